//! [`DecodeLoopReport`]: what the decode loop measured, and its Markdown table.

use std::fmt::Write as _;
use std::time::Duration;

use kvvm::kv::PrefixCacheStats;
use kvvm::layout::KvLayout;
use kvvm::num::format_size;

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
    /// The prefix cache's most blocks per handle of a published prompt.
    pub prefix_handle_windows: u64,
    /// Prompt tokens each sharer found in the cache.
    pub hit_tokens: u64,
    /// Whether the whole prompt is shareable under the layout and granule (when not, the
    /// attach figures are zero and `prompt_refusal` says why).
    pub prompt_shareable: bool,
    /// The shareability verdict's refusal reason for the prompt, if any.
    pub prompt_refusal: Option<String>,
    /// Physical bytes of the shared prompt prefix's read-only windows (billed once; what each
    /// sharer maps instead of committing).
    pub shared_prefix_bytes: u64,
    /// Physical bytes of the shared prompt prefix's tail (billed once; what each sharer copies
    /// into windows of its own).
    pub prefix_tail_bytes: u64,
    /// Physical bytes held when every sequence reached its final length, measured (the
    /// governor's used bytes: private windows + the shared prefix once).
    pub committed_bytes_with_sharing: u64,
    /// Physical bytes the same sequences hold without sharing:
    /// `sequences x committed_bytes_for_tokens(prompt + decode)` (measured instead when
    /// `share_prefix` is false).
    pub committed_bytes_without_sharing: u64,
    /// Median time to attach the shared prompt prefix read-only
    /// ([`SharedDevicePrefix::map_shared_prefix_readonly`](kvvm::kv::SharedDevicePrefix::map_shared_prefix_readonly): reserve + map + set access).
    pub attach_median: Duration,
    /// Fastest attach.
    pub attach_min: Duration,
    /// Mappings one attach makes (the attached sequence's mappings: one per handle of the
    /// shared prefix; the driver charges per mapping).
    pub attach_mappings: usize,
    /// Median time of an attach right after a copy of the prompt (the attach-vs-copy
    /// samples).
    pub attach_after_copy_median: Duration,
    /// Fastest attach right after a copy.
    pub attach_after_copy_min: Duration,
    /// Median time of a sharer's [`PrefixCache::admit`](kvvm::kv::PrefixCache::admit) in the loop (lookup, reserve, map,
    /// commit of the rest of the prompt).
    pub admit_hit_median: Duration,
    /// Mappings of a sequence right after an admission with a cache hit (the hit's shared
    /// handles plus what it committed privately).
    pub admit_hit_mappings: usize,
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

    /// What the "prompt shared" row says: whether the prompt was shared and, when not, why.
    fn sharing_text(&self) -> String {
        match (self.share_prefix, &self.prompt_refusal) {
            (false, _) => "no: sharing turned off (every sequence commits and writes its own prompt)"
                .to_owned(),
            (true, Some(reason)) => format!(
                "by copy only: {} tokens per sharer copied from the prefix cache; {reason}",
                self.hit_tokens
            ),
            (true, None) => format!(
                "yes: {} tokens per sharer from the prefix cache, whole windows mapped read-only and the rest copied (blocks of {} tokens, handles of up to {} windows)",
                self.hit_tokens, self.block_tokens, self.prefix_handle_windows
            ),
        }
    }

    /// A Markdown table of the figures: sizes in binary units with the exact bytes, times as
    /// measured (labelled when they come from the simulated driver).
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        self.title_markdown(&mut s);
        let _ = writeln!(s, "| figure | value |\n|---|---|");
        let _ = writeln!(s, "| prompt shared | {} |", self.sharing_text());
        self.memory_rows(&mut s);
        self.attach_and_copy_rows(&mut s);
        self.run_rows(&mut s);
        s
    }

    /// The title (model, layout, shape, backend, granule) and the simulated-timings note.
    fn title_markdown(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "### KV decode loop: {} {}, {} sequences x {}-token prompt + {} decode tokens ({}, granule {})\n",
            self.model,
            self.layout,
            self.sequences,
            self.prompt_tokens,
            self.decode_tokens,
            self.backend,
            format_size(self.granule)
        );
        if let Some(note) = crate::timing::simulated_timing_note(&self.backend, false) {
            let _ = writeln!(s, "{note}\n");
        }
    }

    /// The bytes committed with and without sharing, what sharing saved, and the shared
    /// prefix.
    fn memory_rows(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "| committed with sharing | {} |",
            size(self.committed_bytes_with_sharing)
        );
        let _ = writeln!(
            s,
            "| committed without sharing | {} |",
            size(self.committed_bytes_without_sharing)
        );
        let ratio = if self.committed_bytes_with_sharing > 0 {
            self.committed_bytes_without_sharing as f64 / self.committed_bytes_with_sharing as f64
        } else {
            0.0
        };
        let _ = writeln!(
            s,
            "| saved | {}, {ratio:.1}x less |",
            size(self.bytes_saved())
        );
        let _ = writeln!(
            s,
            "| shared prefix (billed once) | {} read-only, {} tail |",
            size(self.shared_prefix_bytes),
            size(self.prefix_tail_bytes)
        );
    }

    /// The times to attach the shared prefix (when shareable), to admit with a hit and to copy
    /// the prefix instead, and their ratio.
    fn attach_and_copy_rows(&self, s: &mut String) {
        if self.prompt_shareable {
            let _ = writeln!(
                s,
                "| attach shared prefix (map_shared_prefix_readonly), back to back, median / min | {:?} / {:?} ({} mappings) |",
                self.attach_median, self.attach_min, self.attach_mappings
            );
            let _ = writeln!(
                s,
                "| attach right after a copy of the prompt, median / min | {:?} / {:?} |",
                self.attach_after_copy_median, self.attach_after_copy_min
            );
        } else {
            let _ = writeln!(
                s,
                "| attach shared prefix (map_shared_prefix_readonly) | not measured: the prompt is not shareable |"
            );
        }
        let _ = writeln!(
            s,
            "| admit with a cache hit, median | {:?} ({} mappings) |",
            self.admit_hit_median, self.admit_hit_mappings
        );
        let _ = writeln!(
            s,
            "| copy prefix into a private reservation ({}), median / min | {:?} / {:?} |",
            format_size(self.copy_bytes),
            self.copy_median,
            self.copy_min
        );
        if self.attach_after_copy_median.as_nanos() > 0 {
            // Side by side in the same samples: each attach right after a copy.
            let speedup =
                self.copy_median.as_secs_f64() / self.attach_after_copy_median.as_secs_f64();
            let _ = writeln!(s, "| copy / attach (after a copy) | {speedup:.1}x |");
        }
    }

    /// The phases' times, the bytes written and verified, the cache's counters and the bytes
    /// left at the end.
    fn run_rows(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "| prefill / decode / verify | {:?} / {:?} / {:?} |",
            self.prefill_time, self.decode_time, self.verify_time
        );
        let _ = writeln!(s, "| bytes written | {} |", size(self.bytes_written));
        if self.verified {
            let _ = writeln!(
                s,
                "| read back and compared | every byte equal: {} |",
                size(self.bytes_verified)
            );
        } else {
            let _ = writeln!(s, "| read back and compared | skipped (verification off) |");
        }
        let _ = writeln!(
            s,
            "| cache: hits / misses / tokens saved / bytes saved | {} / {} / {} / {} |",
            self.cache.hits,
            self.cache.misses,
            self.cache.tokens_saved,
            size(self.cache.bytes_saved)
        );
        let _ = writeln!(
            s,
            "| used bytes at the end | {} |",
            size(self.used_bytes_at_end)
        );
    }
}

/// A size in binary units with the exact bytes (bytes alone under 1 KiB).
fn size(b: u64) -> String {
    if b < 1024 {
        format!("{b} B")
    } else {
        format!("{} ({b} B)", format_size(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report with every figure distinct, shared and verified on the simulator.
    fn shared() -> DecodeLoopReport {
        let mut cache = PrefixCacheStats::default();
        cache.hits = 63;
        cache.misses = 1;
        cache.tokens_saved = 63 * 4096;
        cache.bytes_saved = 63 << 29;
        DecodeLoopReport {
            backend: "sim".to_owned(),
            model: "llama-3-8b fp16".to_owned(),
            layout: KvLayout::SeqMajor,
            granule: 2 << 20,
            sequences: 64,
            prompt_tokens: 4096,
            decode_tokens: 64,
            bytes_per_token: 131_072,
            share_prefix: true,
            block_tokens: 16,
            prefix_handle_windows: 4,
            hit_tokens: 4096,
            prompt_shareable: true,
            prompt_refusal: None,
            shared_prefix_bytes: 1 << 29,
            prefix_tail_bytes: 0,
            committed_bytes_with_sharing: (1 << 29) + (64 << 23),
            committed_bytes_without_sharing: 64 * ((1 << 29) + (1 << 23)),
            attach_median: Duration::from_micros(41),
            attach_min: Duration::from_micros(37),
            attach_mappings: 64,
            attach_after_copy_median: Duration::from_micros(95),
            attach_after_copy_min: Duration::from_micros(88),
            admit_hit_median: Duration::from_micros(120),
            admit_hit_mappings: 66,
            copy_median: Duration::from_millis(3),
            copy_min: Duration::from_micros(2_900),
            copy_bytes: 1 << 29,
            prefill_time: Duration::from_millis(250),
            decode_time: Duration::from_millis(80),
            verify_time: Duration::from_millis(900),
            bytes_written: 3 << 30,
            bytes_verified: 33 << 30,
            verified: true,
            cache,
            used_bytes_at_end: 0,
        }
    }

    /// The same run on another backend with sharing off, not shareable and not verified.
    fn unshared() -> DecodeLoopReport {
        DecodeLoopReport {
            backend: "cuda".to_owned(),
            share_prefix: false,
            prompt_shareable: false,
            prompt_refusal: Some("the prefix ends inside a window".to_owned()),
            committed_bytes_with_sharing: 0,
            committed_bytes_without_sharing: 512,
            shared_prefix_bytes: 0,
            attach_after_copy_median: Duration::ZERO,
            verified: false,
            bytes_verified: 0,
            used_bytes_at_end: 1000,
            ..shared()
        }
    }

    #[test]
    fn the_table_is_pinned() {
        assert_eq!(shared().to_markdown(), SHARED);
        assert_eq!(unshared().to_markdown(), UNSHARED);
        let refused = DecodeLoopReport {
            share_prefix: true,
            ..unshared()
        };
        assert!(refused
            .to_markdown()
            .contains("| prompt shared | by copy only: 4096 tokens per sharer copied from the prefix cache; the prefix ends inside a window |"));
    }

    const SHARED: &str = r#"### KV decode loop: llama-3-8b fp16 seq-major, 64 sequences x 4096-token prompt + 64 decode tokens (sim, granule 2 MiB)

simulated timings: backend sim is an in-process simulated driver; the times are its bookkeeping, not a GPU's (run on a GPU for real figures)

| figure | value |
|---|---|
| prompt shared | yes: 4096 tokens per sharer from the prefix cache, whole windows mapped read-only and the rest copied (blocks of 16 tokens, handles of up to 4 windows) |
| committed with sharing | 1 GiB (1073741824 B) |
| committed without sharing | 32.5 GiB (34896609280 B) |
| saved | 31.5 GiB (33822867456 B), 32.5x less |
| shared prefix (billed once) | 512 MiB (536870912 B) read-only, 0 B tail |
| attach shared prefix (map_shared_prefix_readonly), back to back, median / min | 41µs / 37µs (64 mappings) |
| attach right after a copy of the prompt, median / min | 95µs / 88µs |
| admit with a cache hit, median | 120µs (66 mappings) |
| copy prefix into a private reservation (512 MiB), median / min | 3ms / 2.9ms |
| copy / attach (after a copy) | 31.6x |
| prefill / decode / verify | 250ms / 80ms / 900ms |
| bytes written | 3 GiB (3221225472 B) |
| read back and compared | every byte equal: 33 GiB (35433480192 B) |
| cache: hits / misses / tokens saved / bytes saved | 63 / 1 / 258048 / 31.5 GiB (33822867456 B) |
| used bytes at the end | 0 B |
"#;
    const UNSHARED: &str = r#"### KV decode loop: llama-3-8b fp16 seq-major, 64 sequences x 4096-token prompt + 64 decode tokens (cuda, granule 2 MiB)

| figure | value |
|---|---|
| prompt shared | no: sharing turned off (every sequence commits and writes its own prompt) |
| committed with sharing | 0 B |
| committed without sharing | 512 B |
| saved | 512 B, 0.0x less |
| shared prefix (billed once) | 0 B read-only, 0 B tail |
| attach shared prefix (map_shared_prefix_readonly) | not measured: the prompt is not shareable |
| admit with a cache hit, median | 120µs (66 mappings) |
| copy prefix into a private reservation (512 MiB), median / min | 3ms / 2.9ms |
| prefill / decode / verify | 250ms / 80ms / 900ms |
| bytes written | 3 GiB (3221225472 B) |
| read back and compared | skipped (verification off) |
| cache: hits / misses / tokens saved / bytes saved | 63 / 1 / 258048 / 31.5 GiB (33822867456 B) |
| used bytes at the end | 1000 B |
"#;
}
