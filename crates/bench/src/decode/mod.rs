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
use std::time::Instant;

use kvvm::governor::{Governor, GovernorConfig};
use kvvm::hal::{DeviceId, VirtualMemoryBackend};
use kvvm::kv::{KvCacheError, PrefixCache, PrefixCacheConfig};
use kvvm::layout::{KvDtype, KvError, KvGeometry, KvLayout, LayoutPlan};
use kvvm::vmm::{GranularityChoice, VirtualMemory, VmmConfig};

pub use crate::decode_report::DecodeLoopReport;

mod phases;

use phases::{DecodeLoop, Measured, Ticker};

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
    /// The prefix cache's most windows per handle of a published prompt
    /// ([`PrefixCacheConfig::handle_windows`](kvvm::kv::PrefixCacheConfig::handle_windows)).
    pub prefix_handle_windows: u64,
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
            prefix_handle_windows: 1,
            budget_bytes: None,
        })
    }
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
    let ticker = Ticker::new(config, progress);
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
    let cache = PrefixCache::with_config(
        vm.clone(),
        plan,
        PrefixCacheConfig::default().handle_windows(config.prefix_handle_windows),
    )?;
    let mut run = DecodeLoop::new(config, &vm, geometry, plan, total_tokens, ticker);
    let mut m = Measured::default();

    let t0 = Instant::now();
    let mut seqs = run.prefill(&cache, &mut m)?;
    m.prefill_time = t0.elapsed();
    let t1 = Instant::now();
    run.decode(&mut seqs)?;
    m.decode_time = t1.elapsed();
    m.committed_with_sharing = governor.snapshot().device(config.device).used();
    let prefix = seqs.first().and_then(|s| s.owned_prefix());
    m.shared_prefix_bytes = prefix.map_or(0, |p| p.handles().bytes());
    m.prefix_tail_bytes = prefix.map_or(0, |p| p.bytes() - p.handles().bytes());
    let t2 = Instant::now();
    if config.verify {
        run.verify(&seqs)?;
    }
    m.verify_time = t2.elapsed();
    for mut s in seqs.drain(..) {
        s.release()?;
    }
    m.cache = cache.stats();
    cache.clear();
    let timed = run.attach_vs_copy(&*backend)?;
    let report = run.report(backend.name(), cache.block_tokens(), m, timed)?;
    drop(cache);
    let used_bytes_at_end = governor.snapshot().device(config.device).used();
    Ok(DecodeLoopReport {
        used_bytes_at_end,
        ..report
    })
}
