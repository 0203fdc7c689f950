//! The synthetic decode loop on the simulated H200 (2 MiB granule).
//!
//! `cargo run --release -p kvvm-bench --example decode_loop -- [sequences] [prompt] [layout]`
//! (defaults: the reference run, 64 sequences sharing a 4096-token prompt of
//! llama-3-8b fp16, seq-major). On a GPU, call `kvvm_bench::decode::run_decode_loop` with the
//! CUDA backend instead (`kvvm bench kv --backend cuda`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kvvm::kv::{KvDtype, KvGeometry, KvLayout};
use kvvm::sim::{LatencyMode, LatencyModel, SimBackend, SimConfig};
use kvvm_bench::decode::{run_decode_loop, DecodeLoopConfig};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut config = DecodeLoopConfig::reference().unwrap();
    if let Some(s) = args.first() {
        config.sequences = s.parse().expect("sequences");
    }
    if let Some(p) = args.get(1) {
        config.prompt_tokens = p.parse().expect("prompt tokens");
    }
    if let Some(l) = args.get(2) {
        config.layout = l.parse().expect("layout");
    }
    if args.get(3).is_some_and(|v| v == "no-verify") {
        config.verify = false;
    }
    config.geometry = KvGeometry::preset("llama-3-8b", KvDtype::F16, 1).unwrap();
    let _ = KvLayout::ALL;
    // The H200's latency model, spent in the calling thread, so attach and copy times look
    // like the driver's (copies at the modelled PCIe rate).
    let sim = Arc::new(SimBackend::new(
        SimConfig::default().with_latency(LatencyModel::h200(), LatencyMode::Spin),
    ));
    let report = run_decode_loop(sim.clone(), &config).expect("decode loop");
    println!("{}", report.to_markdown());
    assert!(sim.ledger().is_empty());
}
