//! `kvvm bench`: benchmarks that report ratios measured side by side in one run.

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, Subcommand};
use kvvm::VirtualMemoryBackend;
use kvvm_vmm::bench::{run_all_with_baseline, BenchConfig, BenchReport, Stats};
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
}

/// Arguments of `kvvm bench kv`.
#[derive(Debug, Args)]
pub struct KvBenchArgs {
    /// Backend: sim, cuda, hip or auto.
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
    /// Backend: sim, cuda, hip or auto.
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
            "fresh": stats(&Some(p.fresh)),
            "fresh_over_pool": ratio(&Some(p.fresh), &Some(p.from_pool)),
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
    let (backend, cuda): (
        Arc<dyn VirtualMemoryBackend>,
        Option<Arc<kvvm::cuda::CudaBackend>>,
    ) = if args.backend == "cuda"
        || (args.backend == "auto" && kvvm::cuda::CudaBackend::open().is_ok())
    {
        let c = Arc::new(kvvm::cuda::CudaBackend::open().map_err(|e| e.to_string())?);
        (c.clone(), Some(c))
    } else {
        let opened = kvvm::open_backend_verbose(&args.backend).map_err(|e| e.to_string())?;
        if let Some(n) = &opened.notice {
            eprintln!("{n}");
        }
        (opened.backend, None)
    };
    if args.quick {
        let g = backend
            .granularity(&kvvm::AllocationProperties::device(config.device))
            .map_err(|e| e.to_string())?
            .minimum;
        config = BenchConfig::tiny(g);
    }
    let device = config.device;
    let mut baseline =
        cuda.map(|c| move |size: u64, extra: u64| c.time_realloc_copy(device, size, extra));
    let report = run_all_with_baseline(
        backend,
        &config,
        baseline
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
    let opened = kvvm::open_backend_verbose(&args.backend).map_err(|e| e.to_string())?;
    if let Some(n) = &opened.notice {
        eprintln!("{n}");
    }
    let mut config = kvvm_kv::decode::DecodeLoopConfig::acceptance().map_err(|e| e.to_string())?;
    config.layout = args.layout.parse().map_err(|e| format!("{e}"))?;
    config.sequences = args.sequences;
    config.prompt_tokens = args.prompt_tokens;
    config.share_prefix = !args.no_sharing;
    config.verify = !args.no_verify;
    let r = kvvm_kv::decode::run_decode_loop(opened.backend, &config).map_err(|e| e.to_string())?;
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
            })
        );
    } else {
        print!("{}", r.to_markdown());
    }
    Ok(if r.verified || !config.verify {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Runs a benchmark.
pub fn run(args: &BenchArgs) -> Result<ExitCode, String> {
    match &args.which {
        BenchCommand::Vmm(a) => run_vmm(a),
        BenchCommand::Kv(a) => run_kv(a),
    }
}
