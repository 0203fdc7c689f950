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
use kvvm::{DeviceId, VirtualMemoryBackend};
use kvvm_bench::host::measure_host;
use kvvm_bench::vmm::Stats;
use serde_json::{json, Value};

/// Arguments of `kvvm bench host`.
#[derive(Debug, Args)]
pub struct HostBenchArgs {
    /// Bytes committed, touched, attached and copied per sample.
    #[arg(long, default_value_t = 64 << 20)]
    bytes: u64,
    /// Measured samples per case (after one unmeasured warm-up).
    #[arg(long, default_value_t = 20)]
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
pub fn run(args: &HostBenchArgs) -> Result<ExitCode, String> {
    let host = Arc::new(HostBackend::open().map_err(|e| e.to_string())?);
    let granule = host
        .granularity(&kvvm::AllocationProperties::device(DeviceId(0)))
        .map_err(|e| e.to_string())?
        .recommended;
    let bytes = args.bytes.div_ceil(granule).max(1) * granule;
    let s = measure_host(&host, bytes, args.iterations.max(1))?;
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
            "samples": args.iterations.max(1),
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
        println!("{v}");
    } else {
        let mib = bytes as f64 / (1u64 << 20) as f64;
        let granules = bytes / granule;
        println!(
            "### host backend vs plain memory: {mib:.0} MiB, {granules} granules of {} KiB ({device}), p50 / p90 of {} samples\n",
            granule >> 10,
            args.iterations.max(1)
        );
        println!("| case | p50 | p90 |");
        println!("|---|---|---|");
        let line = |name: &str, x: Summary| {
            println!("| {name} | {:.1} us | {:.1} us |", us(x.median), us(x.p90));
        };
        line(
            "commit through the manager (create + map + set access)",
            commit,
        );
        line("first touch of the committed pages", touch);
        line("commit + first touch", commit_touch);
        line("plain mmap + first touch", mmap_touch);
        line("attach the shared prefix read-only (reserve + map)", attach);
        line("memcpy of the prefix (into a touched buffer)", memcpy);
        println!(
            "\ncommit + touch / mmap + touch = {:.2}x; memcpy / attach = {:.1}x; host ledger after the run: {}",
            ratio(commit_touch.median, mmap_touch.median),
            ratio(memcpy.median, attach.median),
            if ledger.is_empty() { "empty" } else { "NOT EMPTY (leak)" }
        );
    }
    Ok(if ledger.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
