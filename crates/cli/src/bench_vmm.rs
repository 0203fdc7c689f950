//! `kvvm bench vmm`: the manager against the raw driver sequence.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use kvvm_bench::realloc::BenchBackend;
use kvvm_bench::vmm::{run_all_with_baseline, BenchConfig, BenchReport, Stats};
use serde_json::{json, Value};

use crate::backend;
use crate::error::{failed, CliResult};
use crate::flags;
use crate::output::{self, note, Out};
use crate::progress::Progress;

/// Arguments of `kvvm bench vmm`.
#[derive(Debug, Args)]
pub struct VmmBenchArgs {
    /// Backend: sim, cuda, hip, host or auto.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Measured iterations per case, 1 to 100000 (default 20; 3 with --quick).
    #[arg(long, value_parser = flags::int_in::<usize>(1, 100_000))]
    iterations: Option<usize>,
    /// Tiny sizes and 3 iterations (a smoke run).
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
        "simulated_timings": r.backend == "sim",
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

/// Runs `kvvm bench vmm`.
pub fn run(args: &VmmBenchArgs, out: Out<'_>) -> CliResult<ExitCode> {
    backend::check_name(&args.backend)?;
    let mut config = BenchConfig::default();
    // CUDA gets the realloc-and-copy baseline, which needs driver calls outside the trait.
    let opened =
        BenchBackend::open(&args.backend).map_err(|e| backend::open_error(&args.backend, &e))?;
    if let Some(n) = backend::notice_for(
        "bench vmm",
        opened.backend.name(),
        opened.notice.is_some(),
        &opened.passed_over,
    ) {
        note(n);
    }
    let backend = Arc::clone(&opened.backend);
    if args.quick {
        let g = backend
            .granularity(&kvvm::AllocationProperties::device(config.device))
            .map_err(failed)?
            .minimum;
        config = BenchConfig::tiny(g);
    }
    if let Some(n) = args.iterations {
        config.iterations = n;
    }
    let progress = Progress::start("bench vmm", None);
    progress.message("measuring commits, the pool and growth");
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
    );
    drop(progress);
    let report = report.map_err(failed)?;
    if args.json {
        output::json_line(out, &to_json(&report))?;
    } else {
        output::text(out, &report.to_markdown())?;
    }
    Ok(ExitCode::SUCCESS)
}
