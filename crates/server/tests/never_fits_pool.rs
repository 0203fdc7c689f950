//! An append that can never fit the device budget is 413 `never_fits`, also when the handle
//! pool is warm: pooled memory is inside the budget already, so it must not be subtracted
//! from what the request needs (it used to be, and such an append got 429 with a
//! `Retry-After` forever).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use common::{config, Reply, TestServer};
use kvvm::sim::{SimBackend, MIB};

fn assert_never_fits_budget(r: &Reply, needed: u64, limit: u64) {
    assert_eq!(r.status, 413, "{}", r.body);
    let j = r.json();
    assert_eq!(j["kind"], "never_fits", "{j}");
    assert_eq!(j["limit"], "device_budget", "{j}");
    assert_eq!(j["needed_bytes"].as_u64(), Some(needed), "{j}");
    assert_eq!(j["limit_bytes"].as_u64(), Some(limit), "{j}");
    assert!(r.retry_after.is_none(), "no Retry-After on a 413");
}

#[test]
fn an_append_over_the_budget_is_413_with_a_warm_pool_and_exactly_the_budget_fits() {
    // llama-3-8b fp16 seq-major: 64 fragments of 2 KiB a token, a 2 MiB window per fragment
    // holds 1024 tokens; 8192 tokens reserve 8 windows per fragment. A budget of 640 MiB is
    // 5 windows per fragment.
    let sim = Arc::new(SimBackend::h200());
    let mut c = config(&sim, Some(640 * MIB));
    c.model = c.model.with_max_tokens(8192).unwrap();
    let server = TestServer::start_with(sim, c, 16 << 10);
    // Warm the pool with the whole budget: 5 windows per fragment are a 4-window and a
    // 1-window handle each; released, they go to the pool.
    let a = server.post("/v1/sequences", r#"{"prompt_tokens": 5120}"#);
    assert_eq!(a.status, 201, "{}", a.body);
    let a = a.json()["id"].as_u64().unwrap();
    assert_eq!(server.delete(&format!("/v1/sequences/{a}")).status, 200);
    let snap = server
        .service
        .governor()
        .snapshot()
        .device(kvvm::DeviceId(0));
    assert_eq!(snap.pooled, 640 * MIB, "{snap:?}");

    let b = server.post("/v1/sequences", r#"{"prompt_tokens": 0}"#);
    assert_eq!(b.status, 201, "{}", b.body);
    let b = b.json()["id"].as_u64().unwrap();
    let append = format!("/v1/sequences/{b}/append");
    // 6 windows per fragment (768 MiB): a 4-window handle from the pool and a new 2-window
    // one. Over the 640 MiB budget whatever is freed: 413, every time.
    for _ in 0..2 {
        let r = server.post(&append, r#"{"tokens": 6144}"#);
        assert_never_fits_budget(&r, 768 * MIB, 640 * MIB);
    }
    // Exactly the budget fits, from the pool.
    let r = server.post(&append, r#"{"tokens": 5120}"#);
    assert_eq!(r.status, 200, "{}", r.body);
    // Holding the budget, one token more needs a 6th window per fragment: what the sequence
    // holds counts, so this can never fit either.
    let r = server.post(&append, r#"{"tokens": 1}"#);
    assert_never_fits_budget(&r, 640 * MIB + 64 * 2 * MIB, 640 * MIB);
    assert_eq!(server.delete(&format!("/v1/sequences/{b}")).status, 200);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
}
