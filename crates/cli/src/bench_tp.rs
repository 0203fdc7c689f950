//! `kvvm bench tp`: the tensor-parallel commit, side by side in one run (the measurement is
//! `kvvm_bench::tp`; this is its command line and its table). It runs on every device of the
//! backend: N = 1 on one GPU.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use kvvm::num::format_size;
use kvvm_bench::realloc::BenchBackend;
use kvvm_bench::tp::measure_tp;
use kvvm_bench::vmm::Stats;
use serde_json::{json, Value};

use crate::backend;
use crate::error::{CliError, CliResult};
use crate::flags;
use crate::output::{self, Out};
use crate::progress::Progress;

/// Arguments of `kvvm bench tp`.
#[derive(Debug, Args)]
pub struct TpBenchArgs {
    /// Backend: sim, cuda, hip, host or auto.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Granule windows committed per rank per sample (1 to 4096).
    #[arg(long, default_value_t = 8, value_parser = flags::int_in::<u64>(1, 4096))]
    windows: u64,
    /// Measured samples per case, after one unmeasured warm-up (1 to 100000).
    #[arg(long, default_value_t = 20, value_parser = flags::int_in::<usize>(1, 100_000))]
    iterations: usize,
    /// Print JSON instead of Markdown.
    #[arg(long)]
    json: bool,
}

fn p50(samples: &[Duration]) -> Option<Stats> {
    Stats::from_samples(samples.to_vec())
}

fn us(s: Option<Stats>) -> Value {
    s.map_or(
        Value::Null,
        |s| json!({"p50_us": s.median.as_secs_f64() * 1e6, "p90_us": s.p90.as_secs_f64() * 1e6}),
    )
}

fn ratio(a: Option<Stats>, b: Option<Stats>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if !b.median.is_zero() => {
            Some(a.median.as_secs_f64() / b.median.as_secs_f64())
        }
        _ => None,
    }
}

fn cell(s: Option<Stats>) -> String {
    s.map_or("-".to_owned(), |s| {
        format!(
            "{:.1} us | {:.1} us",
            s.median.as_secs_f64() * 1e6,
            s.p90.as_secs_f64() * 1e6
        )
    })
}

/// Runs `kvvm bench tp`.
pub fn run(args: &TpBenchArgs, out: Out<'_>) -> CliResult<ExitCode> {
    backend::check_name(&args.backend)?;
    let opened =
        BenchBackend::open(&args.backend).map_err(|e| backend::open_error(&args.backend, &e))?;
    let backend = std::sync::Arc::clone(&opened.backend);
    let progress = Progress::start("bench tp", None);
    progress.message("transaction, independent and raw commits");
    let s = measure_tp(&backend, args.windows, args.iterations);
    drop(progress);
    let s = s.map_err(CliError::Failed)?;
    let (tx, ind, raw) = (p50(&s.transaction), p50(&s.independent), p50(&s.raw));
    let (own, peer) = (p50(&s.own_set_access), p50(&s.peer_set_access));
    let bytes = s.granule.saturating_mul(s.windows);
    if args.json {
        let v = json!({
            "backend": backend.name(),
            "simulated_timings": backend.name() == "sim",
            "ranks": s.ranks,
            "granule": s.granule,
            "windows_per_rank": s.windows,
            "bytes_per_rank": bytes,
            "samples": args.iterations,
            "transaction": us(tx),
            "independent": us(ind),
            "raw": us(raw),
            "independent_over_transaction": ratio(ind, tx),
            "transaction_over_raw": ratio(tx, raw),
            "own_set_access": us(own),
            "peer_set_access": us(peer),
            "peer_over_own_set_access": ratio(peer, own),
        });
        output::json_line(out, &v)?;
    } else {
        writeln!(
            out,
            "### tensor-parallel commit on `{}`: {} rank(s), {} per rank ({} windows of {}), p50 | p90 of {} samples{}\n",
            backend.name(),
            s.ranks,
            format_size(bytes),
            s.windows,
            format_size(s.granule),
            args.iterations,
            if backend.name() == "sim" { " (simulated timings)" } else { "" }
        )?;
        writeln!(out, "| case | p50 | p90 |")?;
        writeln!(out, "|---|---|---|")?;
        writeln!(out, "| one transaction over every rank | {} |", cell(tx))?;
        writeln!(
            out,
            "| the ranks' commits one after the other | {} |",
            cell(ind)
        )?;
        writeln!(
            out,
            "| raw driver sequence (create, map, set access) | {} |",
            cell(raw)
        )?;
        if own.is_some() {
            writeln!(
                out,
                "| set access, owner only (1 granule) | {} |",
                cell(own)
            )?;
            writeln!(
                out,
                "| set access, owner + peer read (1 granule) | {} |",
                cell(peer)
            )?;
        }
        let fmt = |r: Option<f64>| r.map_or("-".to_owned(), |r| format!("{r:.2}x"));
        writeln!(
            out,
            "\nindependent / transaction = {}; transaction / raw = {}{}",
            fmt(ratio(ind, tx)),
            fmt(ratio(tx, raw)),
            if own.is_some() {
                format!("; peer / own set access = {}", fmt(ratio(peer, own)))
            } else {
                "; no peer device: the peer set-access rows need two devices".to_owned()
            }
        )?;
    }
    Ok(ExitCode::SUCCESS)
}
