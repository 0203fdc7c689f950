//! `kvvm bench`: benchmarks that report ratios measured side by side in one run. One module
//! per benchmark (`bench_vmm`, `bench_kv`, `bench_decode`, `bench_host`, `bench_tp`); this one dispatches.

use std::process::ExitCode;

use clap::{Args, Subcommand};

use crate::error::CliResult;
use crate::output::Out;

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
    Vmm(crate::bench_vmm::VmmBenchArgs),
    /// The synthetic decode loop of the KV layer: many sequences sharing one prompt prefix,
    /// every byte written at the layout's offsets and verified; committed bytes with and
    /// without sharing, attach-vs-copy time of the shared prefix.
    Kv(crate::bench_kv::KvBenchArgs),
    /// Latency of `ensure_tokens` on the decode path: commits inline vs a background
    /// pre-committer, side by side in one run.
    Decode(crate::bench_decode::DecodeBenchArgs),
    /// The tensor-parallel commit: the same tokens committed on every device of the backend
    /// as one transaction, against the same commits one after the other and the raw driver
    /// sequence; with a peer device, the cost of granting it access.
    Tp(crate::bench_tp::TpBenchArgs),
    /// The host backend against plain memory: a 64 MiB commit through the manager (and its
    /// first touch) vs mmap + first touch; attaching a shared prefix vs memcpy of it.
    Host(crate::bench_host::HostBenchArgs),
}

/// Runs a benchmark.
pub fn run(args: &BenchArgs, out: Out<'_>) -> CliResult<ExitCode> {
    match &args.which {
        BenchCommand::Vmm(a) => crate::bench_vmm::run(a, out),
        BenchCommand::Kv(a) => crate::bench_kv::run(a, out),
        BenchCommand::Decode(a) => crate::bench_decode::run(a, out),
        BenchCommand::Host(a) => crate::bench_host::run(a, out),
        BenchCommand::Tp(a) => crate::bench_tp::run(a, out),
    }
}
