//! The prefix cache through the HTTP API over the simulated driver: prompts with a common
//! prefix share it read-only and billed once, the owner may finish first, nothing is shared
//! with the cache off, and idle cached prefixes are evicted before a request is refused.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use common::{config, TestServer, MIB2};
use kvvm::sim::SimBackend;

/// A server over a fresh simulated H200, token-major (llama-3-8b fp16: 128 KiB a token, so a
/// 2 MiB window holds 16 tokens and prefixes are shared in 16-token blocks).
fn token_major(budget: Option<u64>, prefix_cache: bool) -> TestServer {
    let sim = Arc::new(SimBackend::h200());
    let mut c = config(&sim, budget);
    c.layout = kvvm::kv::KvLayout::TokenMajor;
    c.prefix_cache = prefix_cache;
    TestServer::start_with(sim, c, 64 << 10)
}

fn ids(range: std::ops::Range<u32>) -> String {
    let v: Vec<String> = range.map(|i| i.to_string()).collect();
    v.join(",")
}

#[test]
fn prompts_with_a_common_prefix_share_it_through_the_prefix_cache() {
    let server = token_major(None, true);
    assert_eq!(server.get("/healthz").json()["prefix_cache"], true);

    // 100 tokens: 6 full blocks (96 tokens, 6 windows) become a shared prefix, published.
    let a = server.post(
        "/v1/sequences",
        &format!(r#"{{"token_ids": [{}], "max_tokens": 1000}}"#, ids(0..100)),
    );
    assert_eq!(a.status, 201, "{}", a.body);
    let a = a.json();
    assert_eq!(a["prefix_hit_tokens"], 0);
    assert_eq!(a["mapped_bytes"], 7 * MIB2); // ceil(100 x 128 KiB / 2 MiB)
                                             // The 6 prefix windows are shared (counted once, in kvvm_shared_bytes): its committed
                                             // bytes are its one own window, as the governor counts them.
    assert_eq!(a["committed_bytes"], MIB2);
    assert_eq!(a["owned_bytes"], MIB2);
    assert_eq!(a["shared_bytes"], 6 * MIB2);
    assert_eq!(a["added_bytes"], 7 * MIB2);
    assert_eq!(server.metric("kvvm_prefixes_published_total"), 1);
    assert_eq!(server.metric("kvvm_shared_bytes"), 6 * MIB2);
    assert_eq!(server.metric("kvvm_prefix_cache_entries"), 1);

    // Same first 96 tokens, another tail: the prefix is mapped read-only, not committed.
    let b = server.post(
        "/v1/sequences",
        &format!(
            r#"{{"token_ids": [{},{}], "max_tokens": 1000}}"#,
            ids(0..96),
            ids(500..520)
        ),
    );
    assert_eq!(b.status, 201, "{}", b.body);
    let b = b.json();
    assert_eq!(b["prefix_hit_tokens"], 96);
    // 116 tokens: 8 windows mapped. Its own 7th full block (tokens 96..112, window 6)
    // extends the chain as a new shared segment; only window 7 is its own.
    assert_eq!(b["mapped_bytes"], 8 * MIB2);
    assert_eq!(b["shared_bytes"], 7 * MIB2);
    assert_eq!(b["committed_bytes"], MIB2);
    assert_eq!(b["owned_bytes"], MIB2);
    assert_eq!(server.metric("kvvm_prefixes_published_total"), 2);
    assert_eq!(server.metric("kvvm_prefix_hits_total"), 1);
    assert_eq!(server.metric("kvvm_prefix_hit_tokens_total"), 96);
    assert_eq!(server.metric("kvvm_prefix_bytes_saved_total"), 6 * MIB2);
    // Billed once: the 7 shared windows, and each sequence's one own window. One definition
    // of committed: the metric is the sum of the sequences' committed_bytes.
    assert_eq!(server.metric("kvvm_committed_bytes"), 2 * MIB2);
    assert_eq!(
        server.metric("kvvm_committed_bytes"),
        a["committed_bytes"].as_u64().unwrap() + b["committed_bytes"].as_u64().unwrap()
    );
    assert_eq!(server.metric("kvvm_shared_bytes"), 7 * MIB2);

    // The owner finishes first; the prefix stays cached (and mapped by b) and keeps serving
    // hits: its DELETE gives back its own window only, which goes to the handle pool and is
    // available to new requests at once.
    let id_a = a["id"].as_u64().unwrap();
    let available = server.metric("kvvm_available_bytes");
    let r = server.delete(&format!("/v1/sequences/{id_a}"));
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["released_bytes"], MIB2);
    assert_eq!(server.metric("kvvm_available_bytes"), available + MIB2);
    assert_eq!(server.metric("kvvm_shared_bytes"), 7 * MIB2);
    let c = server.post(
        "/v1/sequences",
        &format!(r#"{{"token_ids": [{}], "max_tokens": 64}}"#, ids(0..40)),
    );
    assert_eq!(c.status, 201, "{}", c.body);
    assert_eq!(c.json()["prefix_hit_tokens"], 32);
    // A prompt that differs inside the first block does not hit.
    let d = server.post(
        "/v1/sequences",
        &format!(r#"{{"token_ids": [7,{}], "max_tokens": 64}}"#, ids(1..40)),
    );
    assert_eq!(d.status, 201, "{}", d.body);
    assert_eq!(d.json()["prefix_hit_tokens"], 0);

    let (report, sim, service) = server.shutdown();
    assert_eq!(report.sequences, 3);
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    assert_eq!(service.governor().snapshot().used(), 0);
}

#[test]
fn without_the_prefix_cache_nothing_is_shared() {
    let server = token_major(None, false);
    for _ in 0..2 {
        let r = server.post(
            "/v1/sequences",
            &format!(r#"{{"token_ids": [{}], "max_tokens": 1000}}"#, ids(0..100)),
        );
        assert_eq!(r.status, 201, "{}", r.body);
        assert_eq!(r.json()["prefix_hit_tokens"], 0);
        assert_eq!(r.json()["owned_bytes"], 7 * MIB2);
    }
    assert_eq!(server.metric("kvvm_shared_bytes"), 0);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}

#[test]
fn idle_cached_prefixes_are_evicted_before_a_refusal() {
    // 16 windows. A published 96-token prefix holds 6 once its sequence is gone.
    let server = token_major(Some(16 * MIB2), true);
    let a = server.post(
        "/v1/sequences",
        &format!(r#"{{"token_ids": [{}], "max_tokens": 1000}}"#, ids(0..100)),
    );
    assert_eq!(a.status, 201, "{}", a.body);
    let id = a.json()["id"].as_u64().unwrap();
    assert_eq!(server.delete(&format!("/v1/sequences/{id}")).status, 200);
    assert_eq!(server.metric("kvvm_prefix_cache_idle_bytes"), 6 * MIB2);
    // 16 windows of private tokens: only fits if the idle prefix is evicted.
    let r = server.post(
        "/v1/sequences",
        r#"{"prompt_tokens": 256, "max_tokens": 1000}"#,
    );
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(server.metric("kvvm_prefix_evictions_total"), 1);
    assert_eq!(server.metric("kvvm_shared_bytes"), 0);
    // Now the budget is full: 429.
    let r = server.post("/v1/sequences", r#"{"prompt_tokens": 1, "max_tokens": 16}"#);
    assert_eq!(r.status, 429, "{}", r.body);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}
