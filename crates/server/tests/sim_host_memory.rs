//! The simulated server's host memory: the simulated device's memory is the host's, so what
//! the server writes into it must not grow with the load, and its default budget is bounded
//! by what the host can hold.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use common::{config, TestServer};
use kvvm::hal::{Operation, VirtualMemoryBackend};
use kvvm::sim::{SimBackend, DATA_CHUNK_BYTES, MIB};
use kvvm::DeviceId;
use kvvm_server::KvService;

/// Token ids of request `r`: 1024 of them, unlike any other request's.
fn prompt(r: u32) -> String {
    let ids: Vec<String> = (0..1024u32)
        .map(|k| (r * 100_000 + k).to_string())
        .collect();
    format!(
        r#"{{"token_ids": [{}], "max_tokens": 4096}}"#,
        ids.join(",")
    )
}

#[test]
fn a_load_of_prompts_stores_next_to_nothing_in_the_host() {
    // llama-3-8b seq-major: 1024 tokens are a prefix-cache block, 128 MiB of placeholder KV
    // written per request into a new shared prefix, which stays cached after its sequence
    // ends (evicted under pressure: the budget holds two).
    let budget = 256 * MIB;
    let sim = Arc::new(SimBackend::h200());
    let c = config(&sim, Some(budget));
    let server = TestServer::start_with(sim, c, 64 << 10);
    // At most one byte of host memory per 64 KiB chunk of the whole budget, whatever the load.
    let bound = budget / DATA_CHUNK_BYTES;
    for r in 0..6u32 {
        let a = server.post("/v1/sequences", &prompt(r));
        assert_eq!(a.status, 201, "{}", a.body);
        assert_eq!(a.json()["prefix_hit_tokens"], 0, "{}", a.body);
        let id = a.json()["id"].as_u64().unwrap();
        let stored = server.sim.stored_bytes();
        assert!(stored <= bound, "request {r}: {stored} bytes stored");
        assert_eq!(server.delete(&format!("/v1/sequences/{id}")).status, 200);
    }
    // The placeholder was written (and is what a hit reads), the memory committed.
    assert!(server.sim.calls(Operation::CopyToDevice) > 0);
    assert!(server.sim.ledger().total_physical_bytes() >= 128 * MIB);
    let hit = server.post("/v1/sequences", &prompt(5));
    assert_eq!(hit.status, 201, "{}", hit.body);
    assert_eq!(hit.json()["prefix_hit_tokens"], 1024, "{}", hit.body);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    assert_eq!(sim.stored_bytes(), 0, "released memory gives its data back");
}

#[test]
fn the_default_budget_on_the_simulator_is_bounded_by_the_host() {
    // A simulated H200 reports 139 GiB free, more than most hosts hold.
    let sim = Arc::new(SimBackend::h200());
    let free = sim.memory_info(DeviceId(0)).unwrap().free;
    let service = KvService::new(config(&sim, None)).unwrap();
    let budget = service.governor().device_budget(DeviceId(0)).unwrap();
    // The host's available memory moves between any two reads: the test holds the budget to
    // what cannot move (half the host's total memory) and to the device's size.
    if let Some(ceiling) = kvvm::sim::host_memory_ceiling() {
        assert!(
            budget <= ceiling,
            "budget {budget} over half the host's memory {ceiling}"
        );
    }
    assert!(budget > 0 && budget <= free);
    // A budget given explicitly is the operator's choice.
    let service = KvService::new(config(&sim, Some(free))).unwrap();
    assert_eq!(service.governor().device_budget(DeviceId(0)), Some(free));
}
