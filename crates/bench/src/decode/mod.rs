//! A synthetic generation loop over any backend: it writes each token's K and V bytes at the
//! layout's offsets, grows the sequences step by step, shares one prompt prefix among many
//! sequences through the [`PrefixCache`], and at the end reads everything back and verifies
//! every byte. It also measures the bytes committed with and
//! without sharing and the time to attach a shared prefix against copying it.
//!
//! ```
//! use std::sync::Arc;
//! use kvvm_bench::decode::{run_decode_loop, DecodeLoopConfig};
//! use kvvm::kv::{KvDtype, KvGeometry, KvLayout};
//! use kvvm::sim::{SimBackend, SimConfig};
//!
//! # fn main() -> Result<(), kvvm::kv::KvCacheError> {
//! let sim = Arc::new(SimBackend::new(SimConfig::single(64 << 10, 1 << 30)));
//! let mut config = DecodeLoopConfig::reference()?;
//! config.geometry = KvGeometry::with_dtype(2, 2, 32, KvDtype::F16, 1)?;   // a tiny model
//! config.layout = KvLayout::SeqMajor;
//! config.sequences = 4;
//! config.prompt_tokens = 1000;
//! config.decode_tokens = 40;
//! let report = run_decode_loop(sim.clone(), &config)?;
//! assert!(report.verified);
//! assert!(report.committed_bytes_with_sharing < report.committed_bytes_without_sharing);
//! assert!(sim.ledger().is_empty());
//! # Ok(())
//! # }
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvvm::governor::{Governor, GovernorConfig};
use kvvm::hal::{DeviceId, VirtualMemoryBackend};
use kvvm::kv::synthetic::{decode_token_id, fill_tokens, prompt_token_id};
use kvvm::kv::{KvCacheError, PrefixCache, PrefixCacheConfig, SequenceKv, SharedDevicePrefix};
use kvvm::layout::{KvDtype, KvError, KvGeometry, KvLayout, LayoutPlan};
use kvvm::num::{mul, to_usize};
use kvvm::vmm::{GranularityChoice, VirtualMemory, VmmConfig};

pub use crate::decode_report::DecodeLoopReport;

/// Host bytes per verification / write chunk.
const CHUNK_BYTES: u64 = 64 << 20;

/// What [`run_decode_loop`] runs.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DecodeLoopConfig {
    /// Shape of the KV cache (`max_tokens` is replaced by `prompt_tokens + decode_tokens`).
    pub geometry: KvGeometry,
    /// A label for the report (e.g. the preset name).
    pub model: String,
    /// The layout.
    pub layout: KvLayout,
    /// The device.
    pub device: DeviceId,
    /// Which granularity the manager uses.
    pub granularity: GranularityChoice,
    /// Number of sequences (all share the prompt).
    pub sequences: u32,
    /// Tokens of the shared prompt.
    pub prompt_tokens: u64,
    /// Tokens each sequence generates after the prompt (distinct per sequence).
    pub decode_tokens: u64,
    /// Tokens committed and written per decode step (a step writes them with one copy per
    /// fragment).
    pub step_tokens: u64,
    /// Share the prompt through the prefix cache (`false`: every sequence writes its own).
    pub share_prefix: bool,
    /// Read everything back at the end and compare every byte.
    pub verify: bool,
    /// Samples of the attach-vs-copy measurement, each attach right after a copy of the
    /// prompt (0: skip it).
    pub attach_copy_samples: u32,
    /// Attaches of the shared prompt timed back to back, with no copy between them (what a
    /// server admitting requests on a prefix hit does; 0: skip them).
    pub attach_samples: u32,
    /// The prefix cache's most blocks per handle of a published prompt
    /// ([`PrefixCacheConfig::handle_blocks`](kvvm::kv::PrefixCacheConfig::handle_blocks)).
    pub prefix_handle_blocks: u64,
    /// Governor budget for the device (`None`: unlimited).
    pub budget_bytes: Option<u64>,
}

impl DecodeLoopConfig {
    /// The reference run: llama-3-8b fp16, seq-major, 64 sequences sharing a
    /// 4096-token prompt, 64 decode tokens each in steps of 16, verified, 63 attaches back
    /// to back and 5 attach/copy samples.
    pub fn reference() -> Result<Self, KvError> {
        let geometry = KvGeometry::preset("llama-3-8b", KvDtype::F16, 4096 + 64)?;
        Ok(DecodeLoopConfig {
            geometry,
            model: "llama-3-8b fp16".to_owned(),
            layout: KvLayout::SeqMajor,
            device: DeviceId(0),
            granularity: GranularityChoice::Recommended,
            sequences: 64,
            prompt_tokens: 4096,
            decode_tokens: 64,
            step_tokens: 16,
            share_prefix: true,
            verify: true,
            attach_copy_samples: 5,
            attach_samples: 63,
            prefix_handle_blocks: 1,
            budget_bytes: None,
        })
    }
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn compare(
    sequence: u64,
    first: u64,
    bpt: u64,
    expected: &[u8],
    got: &[u8],
) -> Result<(), KvCacheError> {
    if expected == got {
        return Ok(());
    }
    let i = expected
        .iter()
        .zip(got)
        .position(|(a, b)| a != b)
        .unwrap_or(0);
    let i = i as u64;
    Err(KvCacheError::Verification {
        sequence,
        token: first + i / bpt.max(1),
        byte: i % bpt.max(1),
        expected: expected.get(i as usize).copied().unwrap_or(0),
        got: got.get(i as usize).copied().unwrap_or(0),
    })
}

/// Runs the synthetic decode loop on `backend` (the simulator in CI, CUDA on the H200).
///
/// 1. A manager over `backend` (no handle pool, so the governor's used bytes are exactly the
///    physical bytes held) and a [`PrefixCache`] for the layout.
/// 2. Prefill: sequence 0 is admitted (a miss), writes the prompt and publishes it; every
///    other sequence is admitted (a hit of the prompt's full blocks), writes only the rest of
///    the prompt. Without sharing, every sequence writes its whole prompt privately.
/// 3. Decode: in steps of `step_tokens`, each sequence commits (`ensure_tokens`) and writes
///    its own tokens.
/// 4. The governor's used bytes are measured (with sharing), then every byte of every
///    sequence is read back and compared (prompt chunks are generated once and compared for
///    every sequence).
/// 5. Attach: the time of `map_shared_prefix_readonly` for the prompt, back to back; then
///    attach vs copy: an attach right after each copy of the prompt's bytes into a private
///    sequence (reserve, commit, copy). The driver's set access is slower right after a
///    large host-to-device copy (measured on the H200: `docs/driver-semantics.md`), so the
///    two attach figures differ.
/// 6. Everything is released; the governor's used bytes must be 0.
pub fn run_decode_loop(
    backend: Arc<dyn VirtualMemoryBackend>,
    config: &DecodeLoopConfig,
) -> Result<DecodeLoopReport, KvCacheError> {
    run_decode_loop_with_progress(backend, config, &mut |_| {})
}

/// Where a decode loop is: its phase and the units of work done out of the whole run's
/// (a unit is one sequence's prefill, decode step, verification, or one attach/copy sample).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopProgress {
    /// `prefill`, `decode`, `verify` or `attach vs copy`.
    pub phase: &'static str,
    /// Units done.
    pub done: u64,
    /// Units in the whole run.
    pub total: u64,
}

/// Like [`run_decode_loop`], calling `progress` as the work advances.
pub fn run_decode_loop_with_progress(
    backend: Arc<dyn VirtualMemoryBackend>,
    config: &DecodeLoopConfig,
    progress: &mut dyn FnMut(LoopProgress),
) -> Result<DecodeLoopReport, KvCacheError> {
    let seqs_n = u64::from(config.sequences);
    let steps = config.decode_tokens.div_ceil(config.step_tokens.max(1));
    let verify_units = if config.verify { seqs_n } else { 0 };
    let total_units = seqs_n
        .saturating_mul(steps.saturating_add(1))
        .saturating_add(verify_units)
        .saturating_add(u64::from(config.attach_copy_samples))
        .saturating_add(u64::from(config.attach_samples));
    let mut units = 0u64;
    let mut tick = |phase: &'static str, n: u64| {
        units = units.saturating_add(n);
        progress(LoopProgress {
            phase,
            done: units.min(total_units),
            total: total_units,
        });
    };
    let span = tracing::info_span!(
        "kv.decode_loop",
        layout = config.layout.as_str(),
        sequences = config.sequences,
        prompt = config.prompt_tokens
    );
    let _e = span.enter();
    let total_tokens = config
        .prompt_tokens
        .checked_add(config.decode_tokens)
        .ok_or(KvError::Overflow { what: "tokens" })?;
    let geometry = config.geometry.with_max_tokens(total_tokens.max(1))?;
    let governor = match config.budget_bytes {
        Some(b) => Governor::new(GovernorConfig::default().device_budget(config.device, b)),
        None => Governor::unlimited(),
    };
    let vm = VirtualMemory::new(
        Arc::clone(&backend),
        config.device,
        governor.clone(),
        VmmConfig::default()
            .pool_cap_bytes(0)
            .granularity(config.granularity),
    )?;
    let plan = LayoutPlan::new(geometry, config.layout, vm.granule())?;
    let bpt = geometry.bytes_per_token();
    let chunk_tokens = (CHUNK_BYTES / bpt.max(1)).max(1);
    let prompt_ids: Vec<u32> = (0..config.prompt_tokens).map(prompt_token_id).collect();
    let prompt_id = |p: u64| prompt_token_id(p);
    let cache = PrefixCache::with_config(
        vm.clone(),
        plan,
        PrefixCacheConfig::default().handle_blocks(config.prefix_handle_blocks),
    )?;
    let mut bytes_written = 0u64;
    let mut buf: Vec<u8> = Vec::new();

    // ---- prefill ----
    let t0 = Instant::now();
    let mut seqs: Vec<SequenceKv> = Vec::with_capacity(config.sequences as usize);
    let mut froms: Vec<u64> = Vec::with_capacity(config.sequences as usize);
    let mut admit_hits = Vec::new();
    let mut admit_hit_mappings = 0usize;
    let mut hit_tokens = 0u64;
    for s in 0..config.sequences {
        let (mut seq, from) = if config.share_prefix {
            let t = Instant::now();
            let adm = cache.admit(&prompt_ids, total_tokens)?;
            if adm.hit_tokens > 0 {
                admit_hits.push(t.elapsed());
                hit_tokens = adm.hit_tokens;
                if admit_hits.len() == 1 {
                    admit_hit_mappings = adm.sequence.reservation().mappings().len();
                }
            }
            let from = adm.hit_tokens;
            (adm.sequence, from)
        } else {
            let mut seq = SequenceKv::new(&vm, &plan, total_tokens)?;
            seq.ensure_tokens(config.prompt_tokens)?;
            (seq, 0)
        };
        if s == 0 && config.share_prefix {
            // The first request writes its prompt and publishes it before anyone else is
            // admitted, so that they hit it.
            let mut t = from;
            while t < config.prompt_tokens {
                let n = chunk_tokens.min(config.prompt_tokens - t);
                buf.resize(to_usize(mul(n, bpt, "chunk")?, "usize")?, 0);
                fill_tokens(&geometry, t, &mut buf, &prompt_id);
                seq.write_tokens(t, &buf)?;
                bytes_written = bytes_written.saturating_add(buf.len() as u64);
                t += n;
            }
            cache.publish(&mut seq)?;
            froms.push(config.prompt_tokens);
        } else {
            froms.push(from);
        }
        seqs.push(seq);
        tick("prefill", 1);
    }
    // Everyone else writes the part of the prompt it did not find in the cache; each chunk of
    // the prompt is generated once and written to every sequence that needs it.
    let mut t = 0;
    while t < config.prompt_tokens {
        let n = chunk_tokens.min(config.prompt_tokens - t);
        let end = t + n;
        let mut generated = false;
        for (seq, &from) in seqs.iter_mut().zip(&froms) {
            let lo = from.max(t);
            if lo >= end {
                continue;
            }
            if !generated {
                buf.resize(to_usize(mul(n, bpt, "chunk")?, "usize")?, 0);
                fill_tokens(&geometry, t, &mut buf, &prompt_id);
                generated = true;
            }
            let skip = to_usize(mul(lo - t, bpt, "chunk")?, "usize")?;
            seq.write_tokens(lo, &buf[skip..])?;
            bytes_written = bytes_written.saturating_add((buf.len() - skip) as u64);
        }
        t = end;
    }
    if config.share_prefix {
        for seq in &mut seqs {
            cache.publish(seq)?;
        }
    }
    let prefill_time = t0.elapsed();

    // ---- decode ----
    let t1 = Instant::now();
    let step = config.step_tokens.max(1);
    let mut len = config.prompt_tokens;
    while len < total_tokens {
        let n = step.min(total_tokens - len);
        buf.resize(to_usize(mul(n, bpt, "step")?, "usize")?, 0);
        for (s, seq) in seqs.iter_mut().enumerate() {
            seq.ensure_tokens(len + n)?;
            let s = s as u64;
            fill_tokens(&geometry, len, &mut buf, &|p| decode_token_id(s, p));
            seq.write_tokens(len, &buf)?;
            bytes_written = bytes_written.saturating_add(buf.len() as u64);
        }
        len += n;
        tick("decode", seqs_n);
    }
    let decode_time = t1.elapsed();
    let committed_measured = governor.snapshot().device(config.device).used();
    let shared_prefix_bytes = seqs
        .first()
        .and_then(|s| s.owned_prefix().map(|p| p.bytes()))
        .unwrap_or(0);

    // ---- verify ----
    let t2 = Instant::now();
    let mut bytes_verified = 0u64;
    if config.verify {
        let mut expected = Vec::new();
        let mut got = Vec::new();
        let mut t = 0;
        while t < config.prompt_tokens {
            let n = chunk_tokens.min(config.prompt_tokens - t);
            expected.resize(to_usize(mul(n, bpt, "chunk")?, "usize")?, 0);
            got.resize(expected.len(), 0);
            fill_tokens(&geometry, t, &mut expected, &prompt_id);
            for (s, seq) in seqs.iter().enumerate() {
                seq.read_tokens(t, &mut got)?;
                compare(s as u64, t, bpt, &expected, &got)?;
                bytes_verified = bytes_verified.saturating_add(got.len() as u64);
            }
            t += n;
        }
        for (s, seq) in seqs.iter().enumerate() {
            let s64 = s as u64;
            let mut t = config.prompt_tokens;
            while t < total_tokens {
                let n = chunk_tokens.min(total_tokens - t);
                expected.resize(to_usize(mul(n, bpt, "chunk")?, "usize")?, 0);
                got.resize(expected.len(), 0);
                fill_tokens(&geometry, t, &mut expected, &|p| decode_token_id(s64, p));
                seq.read_tokens(t, &mut got)?;
                compare(s64, t, bpt, &expected, &got)?;
                bytes_verified = bytes_verified.saturating_add(got.len() as u64);
                t += n;
            }
            tick("verify", 1);
        }
    }
    let verify_time = t2.elapsed();
    for mut s in seqs.drain(..) {
        s.release()?;
    }
    let cache_stats = cache.stats();
    cache.clear();

    // ---- attach vs copy ----
    let mut attach = Vec::new();
    let mut copy = Vec::new();
    let mut attach_after_copy = Vec::new();
    let mut attach_mappings = 0usize;
    let verdict = kvvm::layout::evaluate_prefix_shareability(
        &geometry,
        config.layout,
        config.prompt_tokens,
        plan.granule(),
    )?;
    let copy_bytes = mul(config.prompt_tokens, bpt, "copy bytes")?;
    if config.attach_copy_samples > 0 && config.prompt_tokens > 0 {
        let mut host = vec![0u8; to_usize(copy_bytes, "usize")?];
        fill_tokens(&geometry, 0, &mut host, &prompt_id);
        let owner = if verdict.shareable {
            let (prefix, owner) = SharedDevicePrefix::reserve_unwritten(
                &vm,
                &plan,
                config.prompt_tokens,
                total_tokens,
            )?;
            let mut owner = owner;
            owner.write_tokens(0, &host)?;
            prefix.seal();
            Some((prefix, owner))
        } else {
            None
        };
        if let Some((prefix, _)) = &owner {
            for _ in 0..config.attach_samples {
                let t = Instant::now();
                let seq = prefix.map_shared_prefix_readonly(&vm, total_tokens)?;
                attach.push(t.elapsed());
                if attach.len() == 1 {
                    attach_mappings = seq.reservation().mappings().len();
                }
                drop(seq);
                tick("attach", 1);
            }
        }
        for _ in 0..config.attach_copy_samples {
            if let Some((prefix, _)) = &owner {
                let t = Instant::now();
                let seq = prefix.map_shared_prefix_readonly(&vm, total_tokens)?;
                attach_after_copy.push(t.elapsed());
                drop(seq);
            }
            let t = Instant::now();
            let mut seq = SequenceKv::new(&vm, &plan, total_tokens)?;
            seq.ensure_tokens(config.prompt_tokens)?;
            seq.write_tokens(0, &host)?;
            backend.synchronize(config.device)?;
            copy.push(t.elapsed());
            drop(seq);
            tick("attach vs copy", 1);
        }
        drop(owner);
    }
    let without = if config.share_prefix {
        mul(
            u64::from(config.sequences),
            plan.committed_bytes_for_tokens(total_tokens)?,
            "committed without sharing",
        )?
    } else {
        committed_measured
    };
    let attach_min = attach.iter().min().copied().unwrap_or_default();
    let attach_after_copy_min = attach_after_copy.iter().min().copied().unwrap_or_default();
    let copy_min = copy.iter().min().copied().unwrap_or_default();
    let report = DecodeLoopReport {
        backend: backend.name().to_owned(),
        model: config.model.clone(),
        layout: config.layout,
        granule: plan.granule(),
        sequences: config.sequences,
        prompt_tokens: config.prompt_tokens,
        decode_tokens: config.decode_tokens,
        bytes_per_token: bpt,
        share_prefix: config.share_prefix,
        block_tokens: cache.block_tokens(),
        prefix_handle_blocks: config.prefix_handle_blocks.max(1),
        hit_tokens,
        prompt_shareable: verdict.shareable,
        prompt_refusal: verdict.refusal_reason(),
        shared_prefix_bytes,
        committed_bytes_with_sharing: committed_measured,
        committed_bytes_without_sharing: without,
        attach_median: median(&mut attach),
        attach_min,
        attach_mappings,
        attach_after_copy_median: median(&mut attach_after_copy),
        attach_after_copy_min,
        admit_hit_median: median(&mut admit_hits),
        admit_hit_mappings,
        copy_median: median(&mut copy),
        copy_min,
        copy_bytes,
        prefill_time,
        decode_time,
        verify_time,
        bytes_written,
        bytes_verified,
        verified: config.verify,
        cache: cache_stats,
        used_bytes_at_end: 0,
    };
    drop(cache);
    let used_bytes_at_end = governor.snapshot().device(config.device).used();
    Ok(DecodeLoopReport {
        used_bytes_at_end,
        ..report
    })
}
