//! [`DecodeLoopReport`]: what the decode loop measured, and its Markdown table.

use std::fmt::Write as _;
use std::time::Duration;

use kvvm_kv::PrefixCacheStats;
use kvvm_layout::KvLayout;

/// What `run_decode_loop` measured.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct DecodeLoopReport {
    /// Backend name.
    pub backend: String,
    /// Model label.
    pub model: String,
    /// Layout.
    pub layout: KvLayout,
    /// Granule used.
    pub granule: u64,
    /// Sequences.
    pub sequences: u32,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Decode tokens per sequence.
    pub decode_tokens: u64,
    /// Bytes per token (all layers, K and V).
    pub bytes_per_token: u64,
    /// Whether the prompt was shared.
    pub share_prefix: bool,
    /// Prefix-cache block size in tokens.
    pub block_tokens: u64,
    /// Prompt tokens each sharer found in the cache.
    pub hit_tokens: u64,
    /// Whether the whole prompt is shareable under the layout and granule (when not, the
    /// attach figures are zero and `prompt_refusal` says why).
    pub prompt_shareable: bool,
    /// The shareability verdict's refusal reason for the prompt, if any.
    pub prompt_refusal: Option<String>,
    /// Physical bytes of the shared prompt prefix (billed once).
    pub shared_prefix_bytes: u64,
    /// Physical bytes held when every sequence reached its final length, measured (the
    /// governor's used bytes: private windows + the shared prefix once).
    pub committed_bytes_with_sharing: u64,
    /// Physical bytes the same sequences hold without sharing:
    /// `sequences x committed_bytes_for_tokens(prompt + decode)` (measured instead when
    /// `share_prefix` is false).
    pub committed_bytes_without_sharing: u64,
    /// Median time to attach the shared prompt prefix read-only
    /// ([`SharedDevicePrefix::map_shared_prefix_readonly`](kvvm_kv::SharedDevicePrefix::map_shared_prefix_readonly): reserve + map + set access).
    pub attach_median: Duration,
    /// Fastest attach.
    pub attach_min: Duration,
    /// Median time of a sharer's [`PrefixCache::admit`](kvvm_kv::PrefixCache::admit) in the loop (lookup, reserve, map,
    /// commit of the rest of the prompt).
    pub admit_hit_median: Duration,
    /// Median time to copy the prompt prefix into a private reservation instead (reserve +
    /// commit + host-to-device copy of the prefix's bytes, generated beforehand).
    pub copy_median: Duration,
    /// Fastest copy.
    pub copy_min: Duration,
    /// Bytes one copy writes (`prompt x bytes_per_token`).
    pub copy_bytes: u64,
    /// Time of the prefill phase (admissions and prompt writes).
    pub prefill_time: Duration,
    /// Time of the decode phase.
    pub decode_time: Duration,
    /// Time of the verification.
    pub verify_time: Duration,
    /// Host bytes written to the device by the loop.
    pub bytes_written: u64,
    /// Bytes read back and compared (0 when not verifying).
    pub bytes_verified: u64,
    /// Whether every byte was verified equal.
    pub verified: bool,
    /// Prefix-cache counters at the end of the loop.
    pub cache: PrefixCacheStats,
    /// The governor's used bytes after everything was released (0 expected).
    pub used_bytes_at_end: u64,
}

impl DecodeLoopReport {
    /// Bytes saved by sharing.
    pub fn bytes_saved(&self) -> u64 {
        self.committed_bytes_without_sharing
            .saturating_sub(self.committed_bytes_with_sharing)
    }

    /// A Markdown table of the figures.
    pub fn to_markdown(&self) -> String {
        let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
        let mut s = String::new();
        let _ = writeln!(
            s,
            "### KV decode loop: {} {}, {} sequences x {}-token prompt + {} decode tokens ({}, granule {} KiB)\n",
            self.model,
            self.layout,
            self.sequences,
            self.prompt_tokens,
            self.decode_tokens,
            self.backend,
            self.granule >> 10
        );
        let _ = writeln!(s, "| figure | value |\n|---|---|");
        let _ = writeln!(
            s,
            "| prompt shared | {} (block {} tokens, hit {} tokens per sharer) |",
            self.share_prefix, self.block_tokens, self.hit_tokens
        );
        let _ = writeln!(
            s,
            "| committed with sharing | {} B ({:.1} MiB) |",
            self.committed_bytes_with_sharing,
            mib(self.committed_bytes_with_sharing)
        );
        let _ = writeln!(
            s,
            "| committed without sharing | {} B ({:.1} MiB) |",
            self.committed_bytes_without_sharing,
            mib(self.committed_bytes_without_sharing)
        );
        let ratio = if self.committed_bytes_with_sharing > 0 {
            self.committed_bytes_without_sharing as f64 / self.committed_bytes_with_sharing as f64
        } else {
            0.0
        };
        let _ = writeln!(
            s,
            "| saved | {} B ({:.1} MiB, {:.1}x less) |",
            self.bytes_saved(),
            mib(self.bytes_saved()),
            ratio
        );
        let _ = writeln!(
            s,
            "| shared prefix (billed once) | {} B ({:.1} MiB) |",
            self.shared_prefix_bytes,
            mib(self.shared_prefix_bytes)
        );
        if let Some(r) = &self.prompt_refusal {
            let _ = writeln!(s, "| prompt not shareable | {r} |");
        }
        let _ = writeln!(
            s,
            "| attach shared prefix (map_shared_prefix_readonly), median / min | {:?} / {:?} |",
            self.attach_median, self.attach_min
        );
        let _ = writeln!(
            s,
            "| admit with a cache hit, median | {:?} |",
            self.admit_hit_median
        );
        let _ = writeln!(
            s,
            "| copy prefix into a private reservation ({:.1} MiB), median / min | {:?} / {:?} |",
            mib(self.copy_bytes),
            self.copy_median,
            self.copy_min
        );
        let speedup = if self.attach_median.as_nanos() > 0 {
            self.copy_median.as_secs_f64() / self.attach_median.as_secs_f64()
        } else {
            0.0
        };
        let _ = writeln!(s, "| copy / attach | {speedup:.1}x |");
        let _ = writeln!(
            s,
            "| prefill / decode / verify | {:?} / {:?} / {:?} |",
            self.prefill_time, self.decode_time, self.verify_time
        );
        let _ = writeln!(
            s,
            "| bytes written / verified | {} / {} |",
            self.bytes_written, self.bytes_verified
        );
        let _ = writeln!(s, "| every byte verified | {} |", self.verified);
        let _ = writeln!(
            s,
            "| cache: hits / misses / tokens saved / bytes saved | {} / {} / {} / {} |",
            self.cache.hits, self.cache.misses, self.cache.tokens_saved, self.cache.bytes_saved
        );
        let _ = writeln!(s, "| used bytes at the end | {} |", self.used_bytes_at_end);
        s
    }
}
