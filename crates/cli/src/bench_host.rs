//! `kvvm bench host`: the host backend against plain memory, side by side in one run (the
//! measurement is `kvvm_bench::host`; this is its command line and its table).
//!
//! 1. a commit of `--bytes` (64 MiB) through the manager on `host` (create, map and set access
//!    of each 2 MiB granule; a fresh commit, no pool), then the first touch of its pages,
//!    against a plain anonymous `mmap` of the same bytes and their first touch;
//! 2. attaching a shared prefix of `--bytes` read-only (reserve + map of the owner's handles
//!    into a new reservation: what a sharer of a prompt does) against a `memcpy` of the
//!    prefix into an already touched buffer (the cheapest copy there is).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use kvvm::host::HostBackend;
use kvvm::num::format_size;
use kvvm::{DeviceId, VirtualMemoryBackend};
use kvvm_bench::host::{measure_host, HostSamples};
use kvvm_bench::vmm::Stats;
use serde_json::{json, Value};

use crate::error::{failed, CliError, CliResult};
use crate::flags;
use crate::output::{self, Out};
use crate::progress::Progress;

/// Arguments of `kvvm bench host`.
#[derive(Debug, Args)]
pub struct HostBenchArgs {
    /// Bytes committed, touched, attached and copied per sample (a size, a multiple of the
    /// host granule, 2MiB, up to 64GiB).
    #[arg(long, default_value = "64MiB", value_parser = flags::size_in(1, 64 << 30))]
    bytes: u64,
    /// Measured samples per case, after one unmeasured warm-up (1 to 100000).
    #[arg(long, default_value_t = 20, value_parser = flags::int_in::<usize>(1, 100_000))]
    iterations: usize,
    /// Print JSON instead of Markdown.
    #[arg(long)]
    json: bool,
}

/// Median and 90th percentile (nearest rank) of samples.
#[derive(Debug, Clone, Copy)]
struct Summary {
    median: Duration,
    p90: Duration,
}

fn summary(samples: Vec<Duration>) -> Summary {
    Stats::from_samples(samples).map_or(
        Summary {
            median: Duration::ZERO,
            p90: Duration::ZERO,
        },
        |st| Summary {
            median: st.median,
            p90: st.p90,
        },
    )
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn ratio(a: Duration, b: Duration) -> f64 {
    if b.is_zero() {
        f64::INFINITY
    } else {
        a.as_secs_f64() / b.as_secs_f64()
    }
}

/// Runs `kvvm bench host`.
pub fn run(args: &HostBenchArgs, out: Out<'_>) -> CliResult<ExitCode> {
    let host = Arc::new(
        HostBackend::open()
            .map_err(|e| CliError::Failed(format!("backend host is unavailable: {e}")))?,
    );
    let granule = host_granule(&host, args.bytes)?;
    let bytes = args.bytes;
    let progress = Progress::start("bench host", None);
    progress.message("commit, touch, attach and copy");
    let s = measure_host(&host, bytes, args.iterations);
    drop(progress);
    let s = s.map_err(CliError::Failed)?;
    let ledger = host.ledger();
    let device = host
        .devices()
        .ok()
        .and_then(|d| d.into_iter().next())
        .map(|d| format!("{}, {}", d.name, d.driver_version))
        .unwrap_or_default();
    let run = HostRun {
        device,
        bytes,
        granule,
        samples: args.iterations,
        cases: HostCases::of(s),
        ledger_empty: ledger.is_empty(),
    };
    if args.json {
        print_json(out, &run)?;
    } else {
        print_table(out, &run)?;
    }
    Ok(if ledger.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The host backend's granule; `bytes` must be a whole number of them.
fn host_granule(host: &HostBackend, bytes: u64) -> CliResult<u64> {
    let granule = host
        .granularity(&kvvm::AllocationProperties::device(DeviceId(0)))
        .map_err(failed)?
        .recommended;
    if granule == 0 || !bytes.is_multiple_of(granule) {
        return Err(CliError::Failed(format!(
            "--bytes {} ({} bytes) is not a multiple of the host granule ({}): try {}",
            format_size(bytes),
            bytes,
            format_size(granule),
            format_size(bytes.div_ceil(granule.max(1)).max(1) * granule)
        )));
    }
    Ok(granule)
}

/// The summary of each case.
struct HostCases {
    commit: Summary,
    touch: Summary,
    commit_touch: Summary,
    mmap_touch: Summary,
    attach: Summary,
    memcpy: Summary,
}

impl HostCases {
    fn of(s: HostSamples) -> Self {
        HostCases {
            commit: summary(s.commit),
            touch: summary(s.touch),
            commit_touch: summary(s.commit_touch),
            mmap_touch: summary(s.mmap_touch),
            attach: summary(s.attach),
            memcpy: summary(s.memcpy),
        }
    }
}

/// What one run measured, for its output.
struct HostRun {
    /// The host's name and kernel.
    device: String,
    bytes: u64,
    granule: u64,
    /// Measured samples per case.
    samples: usize,
    cases: HostCases,
    ledger_empty: bool,
}

/// The run as one JSON line.
fn print_json(out: Out<'_>, run: &HostRun) -> CliResult<()> {
    let c = &run.cases;
    let row = |x: Summary| json!({"p50_us": us(x.median), "p90_us": us(x.p90)});
    let v: Value = json!({
        "backend": "host",
        "device": run.device,
        "bytes": run.bytes,
        "granule": run.granule,
        "samples": run.samples,
        "manager_commit": row(c.commit),
        "manager_first_touch": row(c.touch),
        "manager_commit_and_touch": row(c.commit_touch),
        "mmap_and_touch": row(c.mmap_touch),
        "commit_and_touch_over_mmap": ratio(c.commit_touch.median, c.mmap_touch.median),
        "prefix_attach": row(c.attach),
        "prefix_memcpy": row(c.memcpy),
        "memcpy_over_attach": ratio(c.memcpy.median, c.attach.median),
        "ledger_empty_after_run": run.ledger_empty,
    });
    output::json_line(out, &v)?;
    Ok(())
}

/// The run as a Markdown table, then the two ratios and the ledger.
fn print_table(out: Out<'_>, run: &HostRun) -> CliResult<()> {
    let c = &run.cases;
    let granules = run.bytes / run.granule;
    writeln!(
        out,
        "### host backend vs plain memory: {}, {granules} granules of {} ({}), p50 / p90 of {} samples\n",
        format_size(run.bytes),
        format_size(run.granule),
        run.device,
        run.samples
    )?;
    writeln!(out, "| case | p50 | p90 |")?;
    writeln!(out, "|---|---|---|")?;
    let rows = [
        (
            "commit through the manager (create + map + set access)",
            c.commit,
        ),
        ("first touch of the committed pages", c.touch),
        ("commit + first touch", c.commit_touch),
        ("plain mmap + first touch", c.mmap_touch),
        (
            "attach the shared prefix read-only (reserve + map)",
            c.attach,
        ),
        ("memcpy of the prefix (into a touched buffer)", c.memcpy),
    ];
    for (name, x) in rows {
        writeln!(
            out,
            "| {name} | {:.1} us | {:.1} us |",
            us(x.median),
            us(x.p90)
        )?;
    }
    writeln!(
        out,
        "\ncommit + touch / mmap + touch = {:.2}x; memcpy / attach = {:.1}x; host ledger after the run: {}",
        ratio(c.commit_touch.median, c.mmap_touch.median),
        ratio(c.memcpy.median, c.attach.median),
        if run.ledger_empty { "empty" } else { "NOT EMPTY (leak)" }
    )?;
    Ok(())
}
