//! `kvvm bench`: benchmarks that report ratios measured side by side in one run.

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Subcommand};
use kvvm::VirtualMemoryBackend;
use kvvm_bench::realloc::BenchBackend;
use kvvm_bench::vmm::{run_all_with_baseline, BenchConfig, BenchReport, Stats};
use serde_json::{json, Value};

/// Arguments of `kvvm bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    which: BenchCommand,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// The manager against the raw driver: commit of k granules, pooled vs fresh commit,
    /// growth by one granule vs realloc-and-copy (CUDA only).
    Vmm(VmmBenchArgs),
    /// The synthetic decode loop of the KV layer: many sequences sharing one prompt prefix,
    /// every byte written at the layout's offsets and verified; committed bytes with and
    /// without sharing, attach-vs-copy time of the shared prefix.
    Kv(KvBenchArgs),
    /// Latency of `ensure_tokens` on the decode path: commits inline vs a background
    /// pre-committer, side by side in one run.
    Decode(DecodeBenchArgs),
    /// The host backend against plain memory: a 64 MiB commit through the manager (and its
    /// first touch) vs mmap + first touch; attaching a shared prefix vs memcpy of it.
    Host(crate::bench_host::HostBenchArgs),
}

/// Arguments of `kvvm bench decode`.
#[derive(Debug, Args)]
pub struct DecodeBenchArgs {
    /// Backend: sim, cuda, hip, host or auto.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Latency model of the simulated backend: h200 (driver calls cost their H200 medians,
    /// spent for real) or none.
    #[arg(long, default_value = "h200")]
    latency_model: String,
    /// Sequences decoding side by side.
    #[arg(long, default_value_t = 16)]
    sequences: u32,
    /// Decode steps.
    #[arg(long, default_value_t = 512)]
    steps: u64,
    /// Compute time of one decode step, in microseconds.
    #[arg(long, default_value_t = 300)]
    step_us: u64,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Arguments of `kvvm bench kv`.
#[derive(Debug, Args)]
pub struct KvBenchArgs {
    /// Backend: sim, cuda, hip, host or auto.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// KV layout: head-major, seq-major or token-major.
    #[arg(long, default_value = "seq-major")]
    layout: String,
    /// Sequences sharing the prompt.
    #[arg(long, default_value_t = 64)]
    sequences: u32,
    /// Prompt tokens (the shared prefix).
    #[arg(long, default_value_t = 4096)]
    prompt_tokens: u64,
    /// Run without prefix sharing (every sequence commits and writes its own prompt).
    #[arg(long)]
    no_sharing: bool,
    /// Skip the read-back verification.
    #[arg(long)]
    no_verify: bool,
    /// Print JSON instead of Markdown.
    #[arg(long)]
    json: bool,
}

/// Arguments of `kvvm bench vmm`.
#[derive(Debug, Args)]
pub struct VmmBenchArgs {
    /// Backend: sim, cuda, hip, host or auto.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Measured iterations per case.
    #[arg(long, default_value_t = 20)]
    iterations: usize,
    /// Tiny sizes (a smoke run).
    #[arg(long)]
    quick: bool,
    /// Print JSON instead of Markdown.
    #[arg(long)]
    json: bool,
}

fn stats(s: &Option<Stats>) -> Value {
    match s {
        Some(s) => json!({
            "samples": s.samples,
            "min_us": s.min.as_secs_f64() * 1e6,
            "p50_us": s.median.as_secs_f64() * 1e6,
            "p90_us": s.p90.as_secs_f64() * 1e6,
        }),
        None => Value::Null,
    }
}

fn ratio(a: &Option<Stats>, b: &Option<Stats>) -> Value {
    match (a, b) {
        (Some(a), Some(b)) if !b.median.is_zero() => {
            json!(a.median.as_secs_f64() / b.median.as_secs_f64())
        }
        _ => Value::Null,
    }
}

fn to_json(r: &BenchReport) -> Value {
    json!({
        "backend": r.backend,
        "device": r.device.0,
        "granule": r.granule,
        "iterations": r.iterations,
        "commit": r.commit.iter().map(|c| json!({
            "granules": c.granules,
            "bytes": c.bytes,
            "manager": stats(&Some(c.manager)),
            "raw": stats(&Some(c.raw)),
            "manager_over_raw": ratio(&Some(c.manager), &Some(c.raw)),
        })).collect::<Vec<_>>(),
        "pool": r.pool.as_ref().map(|p| json!({
            "granules": p.granules,
            "from_pool": stats(&Some(p.from_pool)),
            "from_parked": stats(&Some(p.from_parked)),
            "fresh": stats(&Some(p.fresh)),
            "fresh_over_pool": ratio(&Some(p.fresh), &Some(p.from_pool)),
            "fresh_over_parked": ratio(&Some(p.fresh), &Some(p.from_parked)),
        })),
        "growth": r.growth.iter().map(|g| json!({
            "size": g.size,
            "manager": stats(&g.manager),
            "raw": stats(&g.raw),
            "realloc_copy": stats(&g.realloc_copy),
            "realloc_over_manager": ratio(&g.realloc_copy, &g.manager),
            "skipped": g.skipped,
        })).collect::<Vec<_>>(),
        "notes": r.notes,
    })
}

fn run_vmm(args: &VmmBenchArgs) -> Result<ExitCode, String> {
    let mut config = BenchConfig {
        iterations: args.iterations.max(1),
        ..BenchConfig::default()
    };
    // CUDA gets the realloc-and-copy baseline, which needs driver calls outside the trait.
    let opened = BenchBackend::open(&args.backend)?;
    if let Some(n) = &opened.notice {
        eprintln!("{n}");
    }
    let backend = Arc::clone(&opened.backend);
    if args.quick {
        let g = backend
            .granularity(&kvvm::AllocationProperties::device(config.device))
            .map_err(|e| e.to_string())?
            .minimum;
        config = BenchConfig::tiny(g);
    }
    let mut baseline = opened.realloc_baseline(config.device);
    let mut realloc = baseline
        .as_mut()
        .map(|b| move |size: u64, extra: u64| b.time(size, extra));
    let report = run_all_with_baseline(
        backend,
        &config,
        realloc
            .as_mut()
            .map(|f| f as &mut dyn FnMut(u64, u64) -> Result<_, _>),
    )
    .map_err(|e| e.to_string())?;
    if args.json {
        println!("{}", to_json(&report));
    } else {
        print!("{}", report.to_markdown());
    }
    Ok(ExitCode::SUCCESS)
}

fn run_kv(args: &KvBenchArgs) -> Result<ExitCode, String> {
    // The host backend is opened directly, for its leak record after the run.
    let (backend, host): (Arc<dyn VirtualMemoryBackend>, _) = if args.backend == "host" {
        let h = Arc::new(kvvm::host::HostBackend::open().map_err(|e| e.to_string())?);
        (h.clone(), Some(h))
    } else {
        let opened = kvvm::open_backend_verbose(&args.backend).map_err(|e| e.to_string())?;
        if let Some(n) = &opened.notice {
            eprintln!("{n}");
        }
        (opened.backend, None)
    };
    let mut config =
        kvvm_bench::decode::DecodeLoopConfig::reference().map_err(|e| e.to_string())?;
    config.layout = args.layout.parse().map_err(|e| format!("{e}"))?;
    config.sequences = args.sequences;
    config.prompt_tokens = args.prompt_tokens;
    config.share_prefix = !args.no_sharing;
    config.verify = !args.no_verify;
    let r = kvvm_bench::decode::run_decode_loop(backend, &config).map_err(|e| e.to_string())?;
    let leak_free = host.as_ref().map(|h| h.ledger().is_empty());
    if args.json {
        let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
        println!(
            "{}",
            json!({
                "backend": r.backend,
                "model": r.model,
                "layout": r.layout.as_str(),
                "granule": r.granule,
                "sequences": r.sequences,
                "prompt_tokens": r.prompt_tokens,
                "decode_tokens": r.decode_tokens,
                "share_prefix": r.share_prefix,
                "prompt_shareable": r.prompt_shareable,
                "prompt_refusal": r.prompt_refusal,
                "shared_prefix_bytes": r.shared_prefix_bytes,
                "committed_bytes_with_sharing": r.committed_bytes_with_sharing,
                "committed_bytes_without_sharing": r.committed_bytes_without_sharing,
                "attach_median_us": us(r.attach_median),
                "copy_median_us": us(r.copy_median),
                "copy_bytes": r.copy_bytes,
                "bytes_written": r.bytes_written,
                "bytes_verified": r.bytes_verified,
                "verified": r.verified,
                "used_bytes_at_end": r.used_bytes_at_end,
                "prefix_hits": r.cache.hits,
                "ledger_empty_after_run": leak_free,
            })
        );
    } else {
        print!("{}", r.to_markdown());
        if let Some(empty) = leak_free {
            println!(
                "host backend ledger after the run: {}",
                if empty { "empty" } else { "NOT EMPTY (leak)" }
            );
        }
    }
    if leak_free == Some(false) {
        return Ok(ExitCode::from(1));
    }
    Ok(if r.verified || !config.verify {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn run_decode(args: &DecodeBenchArgs) -> Result<ExitCode, String> {
    use kvvm::sim::{LatencyMode, LatencyModel, SimBackend, SimConfig};
    let backend: Arc<dyn VirtualMemoryBackend> = if args.backend == "sim" {
        let model = match args.latency_model.as_str() {
            "h200" => LatencyModel::h200(),
            "none" => LatencyModel::zero(),
            other => return Err(format!("unknown latency model {other:?} (h200 or none)")),
        };
        Arc::new(SimBackend::new(
            SimConfig::default().with_latency(model, LatencyMode::Spin),
        ))
    } else {
        let opened = kvvm::open_backend_verbose(&args.backend).map_err(|e| e.to_string())?;
        if let Some(n) = &opened.notice {
            eprintln!("{n}");
        }
        if opened.backend.name() == "sim" {
            Arc::new(SimBackend::new(
                SimConfig::default().with_latency(LatencyModel::h200(), LatencyMode::Spin),
            ))
        } else {
            opened.backend
        }
    };
    let mut config =
        kvvm_bench::precommit::DecodeBenchConfig::standard().map_err(|e| e.to_string())?;
    config.sequences = args.sequences.max(1);
    config.decode_tokens = args.steps.max(1);
    config.step_time = std::time::Duration::from_micros(args.step_us);
    config.precommit.max_headroom_bytes = u64::from(config.sequences) * 3 * (2 << 20);
    let r = kvvm_bench::precommit::run_decode_bench(backend, &config).map_err(|e| e.to_string())?;
    let lat = |l: &kvvm_bench::precommit::LatencySummary| {
        json!({"p50_us": l.p50_us, "p99_us": l.p99_us, "max_us": l.max_us,
               "calls": l.calls, "inline_commits": l.inline_commits})
    };
    if args.json {
        println!(
            "{}",
            json!({
                "backend": r.backend,
                "inline": lat(&r.inline),
                "precommit": lat(&r.precommit),
                "extra_committed_bytes": r.extra_committed_bytes,
                "max_headroom_bytes": r.max_headroom_bytes,
                "background_commits": r.stats.background_commits,
                "background_refused": r.stats.background_refused,
                "background_failures": r.stats.background_failures,
            })
        );
    } else {
        println!(
            "decode bench on {}: {} sequences x {} steps of {} us, granule {} B",
            r.backend, config.sequences, config.decode_tokens, args.step_us, r.granule
        );
        for (name, l) in [("inline", &r.inline), ("precommit", &r.precommit)] {
            println!(
                "  {name:<9} ensure_tokens p50 {:8.2} us  p99 {:8.2} us  max {:8.2} us  ({} calls, {} inline commits)",
                l.p50_us, l.p99_us, l.max_us, l.calls, l.inline_commits
            );
        }
        let ratio = if r.precommit.p99_us > 0.0 {
            r.inline.p99_us / r.precommit.p99_us
        } else {
            f64::INFINITY
        };
        println!("  inline p99 / precommit p99 = {ratio:.1}x");
        println!(
            "  extra committed bytes (peak) {} of at most {}; background commits {}, refused {}, failed {}",
            r.extra_committed_bytes,
            r.max_headroom_bytes,
            r.stats.background_commits,
            r.stats.background_refused,
            r.stats.background_failures
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs a benchmark.
pub fn run(args: &BenchArgs) -> Result<ExitCode, String> {
    match &args.which {
        BenchCommand::Vmm(a) => run_vmm(a),
        BenchCommand::Kv(a) => run_kv(a),
        BenchCommand::Decode(a) => run_decode(a),
        BenchCommand::Host(a) => crate::bench_host::run(a),
    }
}
