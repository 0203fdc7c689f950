//! The decode benchmark: `ensure_tokens` latency on the decode path, committing inline
//! against a background [`Precommitter`], side by side in one run (`kvvm bench decode`).

use std::sync::Arc;
use std::time::Instant;

use kvvm::hal::{DeviceId, VirtualMemoryBackend};
use kvvm::kv::precommit::{Ensured, PrecommitConfig, PrecommitStats, Precommitter};
use kvvm::kv::{KvCacheError, SequenceKv};
use kvvm::layout::{KvDtype, KvError, KvGeometry, KvLayout, LayoutPlan};
use kvvm::vmm::VirtualMemory;

/// What [`run_decode_bench`] measures.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DecodeBenchConfig {
    /// KV geometry (model shape and maximum tokens).
    pub geometry: KvGeometry,
    /// Layout.
    pub layout: KvLayout,
    /// The device.
    pub device: DeviceId,
    /// Sequences decoding side by side.
    pub sequences: u32,
    /// Prompt tokens committed before the measured decode (not measured).
    pub prompt_tokens: u64,
    /// Decode steps: each sequence grows by one token per step.
    pub decode_tokens: u64,
    /// Time a decode step spends computing between `ensure_tokens` rounds (a sleep).
    pub step_time: std::time::Duration,
    /// Pre-commit settings of the `precommit` run.
    pub precommit: PrecommitConfig,
    /// Bytes each sequence may hold ahead beyond its headroom in the `precommit` run
    /// ([`Precommitter::set_grow_ahead_bytes`]; 0: none).
    pub grow_ahead_bytes: u64,
}

impl DecodeBenchConfig {
    /// llama-3-8b fp16, token-major (16 tokens a 2 MiB window: a commit every 16 steps),
    /// 16 sequences, 128-token prompts, 512 decode steps of 300 us, 16 tokens of headroom
    /// (the worker commits up to 32 ahead) and at most 3 windows ahead per sequence.
    pub fn standard() -> Result<Self, KvError> {
        let geometry = KvGeometry::preset("llama-3-8b", KvDtype::F16, 4096)?;
        let sequences = 16u32;
        Ok(DecodeBenchConfig {
            geometry,
            layout: KvLayout::TokenMajor,
            device: DeviceId(0),
            sequences,
            prompt_tokens: 128,
            decode_tokens: 512,
            step_time: std::time::Duration::from_micros(300),
            precommit: PrecommitConfig {
                headroom_tokens: 16,
                max_headroom_bytes: u64::from(sequences) * 3 * (2 << 20),
                poll_interval: std::time::Duration::from_micros(200),
            },
            grow_ahead_bytes: 0,
        })
    }
}

/// Latency of the hot-path `ensure_tokens` calls of one run.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LatencySummary {
    /// Calls measured.
    pub calls: u64,
    /// Median in microseconds.
    pub p50_us: f64,
    /// 99th percentile in microseconds.
    pub p99_us: f64,
    /// Maximum in microseconds.
    pub max_us: f64,
    /// Calls that committed inline.
    pub inline_commits: u64,
}

/// The two runs of [`run_decode_bench`], side by side.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeBenchReport {
    /// The backend's name.
    pub backend: String,
    /// Every commit on the decode path (no pre-committer).
    pub inline: LatencySummary,
    /// With the background pre-committer.
    pub precommit: LatencySummary,
    /// The most bytes committed ahead of the live ends at once (precommit run).
    pub extra_committed_bytes: u64,
    /// The configured bound on those bytes.
    pub max_headroom_bytes: u64,
    /// The worker's counters at the end of the precommit run.
    pub stats: PrecommitStats,
    /// The granule used.
    pub granule: u64,
}

fn summarize(mut samples: Vec<std::time::Duration>, inline_commits: u64) -> LatencySummary {
    if samples.is_empty() {
        return LatencySummary::default();
    }
    samples.sort_unstable();
    let n = samples.len();
    let pick = |p: usize| {
        let rank = (p.saturating_mul(n)).div_ceil(100).clamp(1, n);
        samples[rank - 1].as_secs_f64() * 1e6
    };
    LatencySummary {
        calls: n as u64,
        p50_us: pick(50),
        p99_us: pick(99),
        max_us: samples[n - 1].as_secs_f64() * 1e6,
        inline_commits,
    }
}

/// Runs the decode loop twice on `backend`, each on a fresh manager with the same budget and
/// pool: once committing on the decode path (`inline`), once with a [`Precommitter`]
/// (`precommit`); measures every hot-path `ensure_tokens` call. Everything is released at the
/// end of each run.
pub fn run_decode_bench(
    backend: Arc<dyn VirtualMemoryBackend>,
    config: &DecodeBenchConfig,
) -> Result<DecodeBenchReport, KvCacheError> {
    let total = config.prompt_tokens.saturating_add(config.decode_tokens);
    let geometry = config.geometry.with_max_tokens(total.max(1))?;
    let vm = fresh_vm(&backend, config)?;
    let plan = LayoutPlan::new(geometry, config.layout, vm.granule())?;
    let granule = vm.granule();
    let inline = decode_inline(&vm, &plan, config, total)?;
    drop(vm);
    let vm = fresh_vm(&backend, config)?;
    let (precommit, stats) = decode_precommitted(&vm, &plan, config, total)?;
    Ok(DecodeBenchReport {
        backend: backend.name().to_owned(),
        inline,
        precommit,
        extra_committed_bytes: stats.peak_headroom_bytes,
        max_headroom_bytes: config.precommit.max_headroom_bytes,
        stats,
        granule,
    })
}

/// A fresh manager on `backend` for one run: no budget, the minimum granularity.
fn fresh_vm(
    backend: &Arc<dyn VirtualMemoryBackend>,
    config: &DecodeBenchConfig,
) -> Result<VirtualMemory, KvCacheError> {
    Ok(VirtualMemory::new(
        Arc::clone(backend),
        config.device,
        kvvm::governor::Governor::unlimited(),
        kvvm::vmm::VmmConfig::default().granularity(kvvm::vmm::GranularityChoice::Minimum),
    )?)
}

/// The inline run: plain sequences commit on the decode path; every `ensure_tokens` timed.
fn decode_inline(
    vm: &VirtualMemory,
    plan: &LayoutPlan,
    config: &DecodeBenchConfig,
    total: u64,
) -> Result<LatencySummary, KvCacheError> {
    let mut seqs = Vec::new();
    for _ in 0..config.sequences {
        let mut s = SequenceKv::new(vm, plan, total)?;
        s.ensure_tokens(config.prompt_tokens)?;
        seqs.push(s);
    }
    let mut samples = Vec::new();
    let mut inline_commits = 0u64;
    for step in 1..=config.decode_tokens {
        let n = config.prompt_tokens.saturating_add(step);
        for s in &mut seqs {
            let t = Instant::now();
            let bytes = s.ensure_tokens(n)?;
            samples.push(t.elapsed());
            if bytes > 0 {
                inline_commits += 1;
            }
        }
        std::thread::sleep(config.step_time);
    }
    let inline = summarize(samples, inline_commits);
    drop(seqs);
    Ok(inline)
}

/// The pre-commit run: the same loop through a [`Precommitter`]'s sequences; every
/// `ensure_tokens` timed. Returns the latencies and the worker's counters.
fn decode_precommitted(
    vm: &VirtualMemory,
    plan: &LayoutPlan,
    config: &DecodeBenchConfig,
    total: u64,
) -> Result<(LatencySummary, PrecommitStats), KvCacheError> {
    let pre = Precommitter::start(vm, config.precommit)?;
    pre.set_grow_ahead_bytes(config.grow_ahead_bytes);
    let mut seqs = Vec::new();
    for _ in 0..config.sequences {
        let mut s = SequenceKv::new(vm, plan, total)?;
        s.ensure_tokens(config.prompt_tokens)?;
        let p = pre.attach(s);
        p.ensure_tokens(config.prompt_tokens)?;
        seqs.push(p);
    }
    pre.wait_idle();
    let mut samples = Vec::new();
    let mut inline_commits = 0u64;
    for step in 1..=config.decode_tokens {
        let n = config.prompt_tokens.saturating_add(step);
        for s in &seqs {
            let t = Instant::now();
            let got = s.ensure_tokens(n)?;
            samples.push(t.elapsed());
            if matches!(got, Ensured::Inline(_)) {
                inline_commits += 1;
            }
        }
        std::thread::sleep(config.step_time);
    }
    let stats = pre.stats();
    pre.shutdown();
    drop(seqs);
    Ok((summarize(samples, inline_commits), stats))
}
