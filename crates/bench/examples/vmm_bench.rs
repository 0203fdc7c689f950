//! Runs the manager's side-by-side benchmark ([`kvvm_bench::vmm`]) on a backend.
//!
//! This example runs it on the simulator (with the H200 latency model spent as real time, so
//! the numbers look like the GPU's); the `kvvm` CLI runs the same code on a real backend
//! (`kvvm bench vmm --backend cuda`). Usage:
//!
//! ```text
//! cargo run --release -p kvvm-bench --example vmm_bench [-- --tiny]
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kvvm::hal::VirtualMemoryBackend;
use kvvm::sim::{LatencyMode, LatencyModel, SimBackend, SimConfig, H200_GRANULE, H200_GRANULES};
use kvvm_bench::vmm::{run_all, BenchConfig};

/// Runs the benchmark on `backend` and prints the report: the entry point a real backend is
/// plugged into.
fn bench_backend(backend: Arc<dyn VirtualMemoryBackend>, config: &BenchConfig) {
    match run_all(backend, config) {
        Ok(report) => println!("{}", report.to_markdown()),
        Err(e) => {
            eprintln!("bench failed: {e}");
            std::process::exit(1);
        }
    }
}

fn main() {
    let tiny = std::env::args().any(|a| a == "--tiny");
    let sim = SimBackend::new(
        SimConfig::single(H200_GRANULE, H200_GRANULE * H200_GRANULES)
            .with_latency(LatencyModel::h200(), LatencyMode::Spin),
    );
    let config = if tiny {
        BenchConfig::tiny(H200_GRANULE)
    } else {
        BenchConfig {
            iterations: 5,
            warmup: 1,
            ..BenchConfig::default()
        }
    };
    bench_backend(Arc::new(sim), &config);
}
