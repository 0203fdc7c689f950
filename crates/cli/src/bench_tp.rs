//! `kvvm bench tp`: the tensor-parallel commit, side by side in one run (the measurement is
//! `kvvm_bench::tp`; this is its command line and its table). It runs on every device of the
//! backend: N = 1 on one GPU.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use kvvm::num::format_size;
use kvvm_bench::realloc::BenchBackend;
use kvvm_bench::tp::{measure_tp, TpSamples};
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
    let cases = TpCases::of(&s);
    if args.json {
        print_json(out, backend.name(), &s, args.iterations, &cases)?;
    } else {
        print_table(out, backend.name(), &s, args.iterations, &cases)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The summary of each case (`None` when not measured).
struct TpCases {
    /// One transaction over every rank.
    tx: Option<Stats>,
    /// The ranks' commits one after the other.
    ind: Option<Stats>,
    /// The raw driver sequence.
    raw: Option<Stats>,
    /// Set access, owner only.
    own: Option<Stats>,
    /// Set access, owner and a peer.
    peer: Option<Stats>,
}

impl TpCases {
    fn of(s: &TpSamples) -> Self {
        TpCases {
            tx: p50(&s.transaction),
            ind: p50(&s.independent),
            raw: p50(&s.raw),
            own: p50(&s.own_set_access),
            peer: p50(&s.peer_set_access),
        }
    }
}

/// The run on backend `name` as one JSON line.
fn print_json(
    out: Out<'_>,
    name: &str,
    s: &TpSamples,
    iterations: usize,
    c: &TpCases,
) -> CliResult<()> {
    let v = json!({
        "backend": name,
        "simulated_timings": name == "sim",
        "ranks": s.ranks,
        "granule": s.granule,
        "windows_per_rank": s.windows,
        "bytes_per_rank": s.granule.saturating_mul(s.windows),
        "samples": iterations,
        "transaction": us(c.tx),
        "independent": us(c.ind),
        "raw": us(c.raw),
        "independent_over_transaction": ratio(c.ind, c.tx),
        "transaction_over_raw": ratio(c.tx, c.raw),
        "own_set_access": us(c.own),
        "peer_set_access": us(c.peer),
        "peer_over_own_set_access": ratio(c.peer, c.own),
    });
    output::json_line(out, &v)?;
    Ok(())
}

/// The run on backend `name` as a Markdown table, then the ratios.
fn print_table(
    out: Out<'_>,
    name: &str,
    s: &TpSamples,
    iterations: usize,
    c: &TpCases,
) -> CliResult<()> {
    writeln!(
        out,
        "### tensor-parallel commit on `{}`: {} rank(s), {} per rank ({} windows of {}), p50 | p90 of {} samples{}\n",
        name,
        s.ranks,
        format_size(s.granule.saturating_mul(s.windows)),
        s.windows,
        format_size(s.granule),
        iterations,
        if name == "sim" { " (simulated timings)" } else { "" }
    )?;
    writeln!(out, "| case | p50 | p90 |")?;
    writeln!(out, "|---|---|---|")?;
    writeln!(out, "| one transaction over every rank | {} |", cell(c.tx))?;
    writeln!(
        out,
        "| the ranks' commits one after the other | {} |",
        cell(c.ind)
    )?;
    writeln!(
        out,
        "| raw driver sequence (create, map, set access) | {} |",
        cell(c.raw)
    )?;
    if c.own.is_some() {
        writeln!(
            out,
            "| set access, owner only (1 granule) | {} |",
            cell(c.own)
        )?;
        writeln!(
            out,
            "| set access, owner + peer read (1 granule) | {} |",
            cell(c.peer)
        )?;
    }
    let fmt = |r: Option<f64>| r.map_or("-".to_owned(), |r| format!("{r:.2}x"));
    writeln!(
        out,
        "\nindependent / transaction = {}; transaction / raw = {}{}",
        fmt(ratio(c.ind, c.tx)),
        fmt(ratio(c.tx, c.raw)),
        if c.own.is_some() {
            format!("; peer / own set access = {}", fmt(ratio(c.peer, c.own)))
        } else {
            "; no peer device: the peer set-access rows need two devices".to_owned()
        }
    )?;
    Ok(())
}
