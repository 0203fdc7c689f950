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
use kvvm_bench::host::measure_host;
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
    let granule = host
        .granularity(&kvvm::AllocationProperties::device(DeviceId(0)))
        .map_err(failed)?
        .recommended;
    if granule == 0 || !args.bytes.is_multiple_of(granule) {
        return Err(CliError::Failed(format!(
            "--bytes {} ({} bytes) is not a multiple of the host granule ({}): try {}",
            format_size(args.bytes),
            args.bytes,
            format_size(granule),
            format_size(args.bytes.div_ceil(granule.max(1)).max(1) * granule)
        )));
    }
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
    let commit = summary(s.commit);
    let touch = summary(s.touch);
    let commit_touch = summary(s.commit_touch);
    let mmap_touch = summary(s.mmap_touch);
    let attach = summary(s.attach);
    let memcpy = summary(s.memcpy);
    if args.json {
        let row = |x: Summary| json!({"p50_us": us(x.median), "p90_us": us(x.p90)});
        let v: Value = json!({
            "backend": "host",
            "device": device,
            "bytes": bytes,
            "granule": granule,
            "samples": args.iterations,
            "manager_commit": row(commit),
            "manager_first_touch": row(touch),
            "manager_commit_and_touch": row(commit_touch),
            "mmap_and_touch": row(mmap_touch),
            "commit_and_touch_over_mmap": ratio(commit_touch.median, mmap_touch.median),
            "prefix_attach": row(attach),
            "prefix_memcpy": row(memcpy),
            "memcpy_over_attach": ratio(memcpy.median, attach.median),
            "ledger_empty_after_run": ledger.is_empty(),
        });
        output::json_line(out, &v)?;
    } else {
        let granules = bytes / granule;
        writeln!(
            out,
            "### host backend vs plain memory: {}, {granules} granules of {} ({device}), p50 / p90 of {} samples\n",
            format_size(bytes),
            format_size(granule),
            args.iterations
        )?;
        writeln!(out, "| case | p50 | p90 |")?;
        writeln!(out, "|---|---|---|")?;
        let rows = [
            (
                "commit through the manager (create + map + set access)",
                commit,
            ),
            ("first touch of the committed pages", touch),
            ("commit + first touch", commit_touch),
            ("plain mmap + first touch", mmap_touch),
            ("attach the shared prefix read-only (reserve + map)", attach),
            ("memcpy of the prefix (into a touched buffer)", memcpy),
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
            ratio(commit_touch.median, mmap_touch.median),
            ratio(memcpy.median, attach.median),
            if ledger.is_empty() { "empty" } else { "NOT EMPTY (leak)" }
        )?;
    }
    Ok(if ledger.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
