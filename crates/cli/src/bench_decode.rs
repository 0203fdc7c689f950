//! `kvvm bench decode`: `ensure_tokens` latency on the decode path, inline vs pre-committed.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use kvvm::num::format_size;
use kvvm::sim::{LatencyMode, LatencyModel, SimBackend, SimConfig};
use kvvm::VirtualMemoryBackend;
use kvvm_bench::precommit::{
    run_decode_bench, DecodeBenchConfig, DecodeBenchReport, LatencySummary,
};
use kvvm_bench::timing::simulated_timing_note;
use serde_json::json;

use crate::backend;
use crate::error::{failed, CliError, CliResult};
use crate::flags::{self, MAX_CONTEXT_TOKENS};
use crate::output::{self, Out};
use crate::progress::Progress;

/// Arguments of `kvvm bench decode`.
#[derive(Debug, Args)]
pub struct DecodeBenchArgs {
    /// Backend: sim, cuda, hip, host or auto.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Latency model of the simulated backend: h200 (driver calls cost what the H200 latency
    /// model charges, spent for real) or none.
    #[arg(long, default_value = "h200")]
    latency_model: String,
    /// Sequences decoding side by side (1 to 4096).
    #[arg(long, default_value_t = 16, value_parser = flags::int_in::<u32>(1, 4096))]
    sequences: u32,
    /// Decode steps (1 to 1000000).
    #[arg(long, default_value_t = 512, value_parser = flags::int_in::<u64>(1, 1_000_000))]
    steps: u64,
    /// Compute time of one decode step, in microseconds (0 to 1000000).
    #[arg(long, default_value_t = 300, value_parser = flags::int_in::<u64>(0, 1_000_000))]
    step_us: u64,
    /// Bytes each sequence may hold ahead beyond its headroom, so that the pre-committer
    /// commits larger buddy-aligned handles (e.g. 10MiB; default 0: none). The bound on the
    /// bytes ahead grows by as much per sequence.
    #[arg(long, default_value = "0", value_parser = flags::size_in(0, u64::MAX))]
    grow_ahead: u64,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

fn sim_with(model: LatencyModel) -> Arc<dyn VirtualMemoryBackend> {
    Arc::new(SimBackend::new(
        SimConfig::default().with_latency(model, LatencyMode::Spin),
    ))
}

/// Runs `kvvm bench decode`.
pub fn run(args: &DecodeBenchArgs, out: Out<'_>) -> CliResult<ExitCode> {
    let model = latency_model(&args.latency_model)?;
    let spent = args.latency_model == "h200";
    let config = bench_config(args)?;
    backend::check_name(&args.backend)?;
    let backend: Arc<dyn VirtualMemoryBackend> = if args.backend == "sim" {
        sim_with(model)
    } else {
        let opened = backend::open("bench decode", &args.backend)?;
        if opened.backend.name() == "sim" {
            sim_with(model)
        } else {
            opened.backend
        }
    };
    let progress = Progress::start("bench decode", None);
    progress.message("decoding inline, then with the pre-committer");
    let r = run_decode_bench(backend, &config);
    drop(progress);
    let r = r.map_err(failed)?;
    let note = simulated_timing_note(&r.backend, spent);
    if args.json {
        print_json(out, &r, note.is_some())?;
    } else {
        print_text(out, args, &config, &r, note.as_deref())?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The simulator's latency model named by `--latency-model`.
fn latency_model(name: &str) -> CliResult<LatencyModel> {
    match name {
        "h200" => Ok(LatencyModel::h200()),
        "none" => Ok(LatencyModel::zero()),
        other => Err(CliError::Failed(format!(
            "--latency-model {other:?}: expected h200 or none"
        ))),
    }
}

/// The standard run with the sequences, steps, step time and bytes ahead of `args`; the
/// prompt and the steps must fit the largest context.
fn bench_config(args: &DecodeBenchArgs) -> CliResult<DecodeBenchConfig> {
    let mut config = DecodeBenchConfig::standard().map_err(failed)?;
    if config.prompt_tokens + args.steps > MAX_CONTEXT_TOKENS {
        return Err(CliError::Failed(format!(
            "--steps {} with the {}-token prompt exceeds the largest context ({MAX_CONTEXT_TOKENS} tokens)",
            args.steps, config.prompt_tokens
        )));
    }
    config.sequences = args.sequences;
    config.decode_tokens = args.steps;
    config.step_time = std::time::Duration::from_micros(args.step_us);
    config.precommit.max_headroom_bytes = u64::from(config.sequences)
        .saturating_mul((3u64 * (2 << 20)).saturating_add(args.grow_ahead));
    config.grow_ahead_bytes = args.grow_ahead;
    Ok(config)
}

/// The report as one JSON line.
fn print_json(out: Out<'_>, r: &DecodeBenchReport, simulated: bool) -> CliResult<()> {
    let lat = |l: &LatencySummary| {
        json!({"p50_us": l.p50_us, "p99_us": l.p99_us, "max_us": l.max_us,
               "calls": l.calls, "inline_commits": l.inline_commits})
    };
    let v = json!({
        "backend": r.backend,
        "simulated_timings": simulated,
        "granule": r.granule,
        "inline": lat(&r.inline),
        "precommit": lat(&r.precommit),
        "extra_committed_bytes": r.extra_committed_bytes,
        "max_headroom_bytes": r.max_headroom_bytes,
        "background_commits": r.stats.background_commits,
        "background_refused": r.stats.background_refused,
        "background_failures": r.stats.background_failures,
    });
    output::json_line(out, &v)?;
    Ok(())
}

/// The report as text: the run, each mode's latencies, their ratio and the worker's
/// counters.
fn print_text(
    out: Out<'_>,
    args: &DecodeBenchArgs,
    config: &DecodeBenchConfig,
    r: &DecodeBenchReport,
    note: Option<&str>,
) -> CliResult<()> {
    writeln!(
        out,
        "decode bench on {}: {} sequences x {} steps of {} us, granule {}",
        r.backend,
        config.sequences,
        config.decode_tokens,
        args.step_us,
        format_size(r.granule)
    )?;
    if let Some(n) = note {
        writeln!(out, "  {n}")?;
    }
    for (name, l) in [("inline", &r.inline), ("precommit", &r.precommit)] {
        writeln!(
            out,
            "  {name:<9} ensure_tokens p50 {:8.2} us  p99 {:8.2} us  max {:8.2} us  ({} calls, {} inline commits)",
            l.p50_us, l.p99_us, l.max_us, l.calls, l.inline_commits
        )?;
    }
    let ratio = if r.precommit.p99_us > 0.0 {
        format!("{:.1}x", r.inline.p99_us / r.precommit.p99_us)
    } else {
        "not defined (precommit p99 is 0)".to_owned()
    };
    writeln!(out, "  inline p99 / precommit p99 = {ratio}")?;
    writeln!(
        out,
        "  extra committed (peak) {} of at most {}; background commits {}, refused {}, failed {}",
        format_size(r.extra_committed_bytes),
        format_size(r.max_headroom_bytes),
        r.stats.background_commits,
        r.stats.background_refused,
        r.stats.background_failures
    )?;
    Ok(())
}
