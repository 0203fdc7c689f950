//! `kvvm bench vmm`: the manager against the raw driver sequences (one handle per granule, and
//! for runs, one handle per run: the driver's limit).

use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use kvvm::sim::{LatencyMode, LatencyModel, SimBackend, SimConfig};
use kvvm::VirtualMemoryBackend;
use kvvm_bench::call_clock::TIMED_OPS;
use kvvm_bench::realloc::BenchBackend;
use kvvm_bench::vmm::{
    run_all_with_baseline, BenchConfig, BenchReport, GiveCase, GiveRow, RunCase, Stats,
};
use serde_json::{json, Value};

use crate::backend;
use crate::error::{failed, CliError, CliResult};
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
    /// Run sizes for the manager vs one handle per run vs one handle per granule, commit and
    /// teardown (comma-separated; default 128MiB,512MiB,4GiB; e.g. 128MiB,512MiB on a device
    /// without 4 GiB free). Sizes that do not fit the free memory are skipped anyway.
    #[arg(long, value_delimiter = ',', value_parser = flags::size_in(1, u64::MAX))]
    runs: Vec<u64>,
    /// Token counts given to a request, warm against cold against one handle (comma-separated;
    /// default 256,4096,32768).
    #[arg(long, value_delimiter = ',', value_parser = flags::int_in::<u64>(1, 1 << 40))]
    give_tokens: Vec<u64>,
    /// Bytes of KV per token for the gives (default 128KiB: Llama-3.1-8B in bf16).
    #[arg(long, value_parser = flags::size_in(1, 1 << 40))]
    bytes_per_token: Option<u64>,
    /// Pool cap of the manager the gives are measured through (`VmmConfig::pool_cap_bytes`;
    /// default 1GiB, the manager's default).
    #[arg(long, value_parser = flags::size_in(0, u64::MAX))]
    give_pool: Option<u64>,
    /// Precede each give with an untimed query of the device's memory (cuMemGetInfo on CUDA),
    /// so that freeing a driver defers from the last release is done there, not in the give.
    #[arg(long)]
    give_settle: bool,
    /// Largest handle the manager creates (`VmmConfig::max_handle_bytes`; default 512MiB).
    #[arg(long, value_parser = flags::size_in(1, u64::MAX))]
    max_handle: Option<u64>,
    /// Latency model of the simulated backend: h200 (each driver call spends the H200 model's
    /// cost, so the timings follow it) or none (the times are the simulator's bookkeeping).
    #[arg(long, default_value = "h200")]
    latency_model: String,
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

fn run_case(c: &RunCase) -> Value {
    json!({"commit": stats(&Some(c.commit)), "teardown": stats(&Some(c.teardown))})
}

fn run_ratio(a: Stats, b: Stats) -> Value {
    ratio(&Some(a), &Some(b))
}

fn to_json(r: &BenchReport) -> Value {
    json!({
        "backend": r.backend,
        "device": r.device.0,
        "granule": r.granule,
        "iterations": r.iterations,
        "simulated_timings": r.backend == "sim",
        "latency_spent": r.latency_spent,
        "max_handle_bytes": r.max_handle_bytes,
        "commit": r.commit.iter().map(|c| json!({
            "granules": c.granules,
            "bytes": c.bytes,
            "manager": stats(&Some(c.manager)),
            "raw": stats(&Some(c.raw)),
            "manager_over_raw": ratio(&Some(c.manager), &Some(c.raw)),
        })).collect::<Vec<_>>(),
        "runs": r.runs.iter().map(|x| json!({
            "bytes": x.bytes,
            "manager_handles": x.manager_handles,
            "manager": run_case(&x.manager),
            "one_handle": run_case(&x.one_handle),
            "per_granule": run_case(&x.per_granule),
            "commit_manager_over_one_handle": run_ratio(x.manager.commit, x.one_handle.commit),
            "commit_per_granule_over_manager": run_ratio(x.per_granule.commit, x.manager.commit),
            "teardown_manager_over_one_handle": run_ratio(x.manager.teardown, x.one_handle.teardown),
            "teardown_per_granule_over_manager": run_ratio(x.per_granule.teardown, x.manager.teardown),
            "exportable": x.exportable.as_ref().map(run_case),
            "commit_exportable_over_manager": x.exportable.map(|e| run_ratio(e.commit, x.manager.commit)),
            "teardown_exportable_over_manager": x.exportable.map(|e| run_ratio(e.teardown, x.manager.teardown)),
        })).collect::<Vec<_>>(),
        "gives": r.gives.iter().map(give_json).collect::<Vec<_>>(),
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

fn give_case(c: &GiveCase) -> Value {
    let calls: serde_json::Map<String, Value> = TIMED_OPS
        .iter()
        .map(|op| {
            let (n, t) = c.calls.of(*op);
            (
                op.as_str().to_owned(),
                json!({"calls": n, "us": t.as_secs_f64() * 1e6}),
            )
        })
        .collect();
    json!({
        "time": stats(&Some(c.time)),
        "take": stats(&Some(c.take)),
        "mappings": c.mappings,
        "from_pool_bytes": c.from_pool_bytes,
        "pooled_before": c.pooled_before,
        "calls_per_give": calls,
        "first_call": c.calls.first.map(|(op, t)| json!({"op": op.as_str(), "us": t.as_secs_f64() * 1e6})),
    })
}

fn give_json(g: &GiveRow) -> Value {
    json!({
        "tokens": g.tokens,
        "bytes": g.bytes,
        "cold": give_case(&g.cold),
        "warm": give_case(&g.warm),
        "one_handle": stats(&Some(g.one_handle)),
        "warm_over_cold": g.warm_over_cold(),
        "cold_over_one_handle": g.cold_over_one_handle(),
        "pool_cap_bytes": g.pool_and_max_handle.0,
        "max_handle_bytes": g.pool_and_max_handle.1,
        "settled": g.settled,
    })
}

/// The simulator spending `model` for every call (Spin), so that timings follow it.
fn spending_sim(model: LatencyModel) -> Arc<dyn VirtualMemoryBackend> {
    Arc::new(SimBackend::new(
        SimConfig::default().with_latency(model, LatencyMode::Spin),
    ))
}

/// Runs `kvvm bench vmm`.
pub fn run(args: &VmmBenchArgs, out: Out<'_>) -> CliResult<ExitCode> {
    backend::check_name(&args.backend)?;
    let spent = match args.latency_model.as_str() {
        "h200" => true,
        "none" => false,
        other => {
            return Err(CliError::Failed(format!(
                "--latency-model {other:?}: expected h200 or none"
            )))
        }
    };
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
    let backend = if spent && opened.backend.name() == "sim" {
        spending_sim(LatencyModel::h200())
    } else {
        Arc::clone(&opened.backend)
    };
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
    if !args.runs.is_empty() {
        config.run_sizes.clone_from(&args.runs);
    }
    if let Some(m) = args.max_handle {
        config.max_handle_bytes = m;
        config.gives.max_handle_bytes = m;
    }
    if !args.give_tokens.is_empty() {
        config.gives.tokens.clone_from(&args.give_tokens);
    }
    if let Some(b) = args.bytes_per_token {
        config.gives.bytes_per_token = b;
    }
    if let Some(p) = args.give_pool {
        config.gives.pool_bytes = p;
    }
    config.gives.settle = args.give_settle;
    config.latency_spent = spent && backend.name() == "sim";
    let progress = Progress::start("bench vmm", None);
    progress.message("measuring commits, runs, the pool and growth");
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
