//! The numbers the server reports add up: a 429 names the request's bytes against what is
//! available to it (free budget and the handle pool), `/metrics` shows memory available to
//! new requests beside the budget nothing holds, and a DELETE reports what it gave back.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{TestServer, MIB2};

/// llama-3-8b fp16 seq-major: 64 fragments of 2 KiB a token, so a 2 MiB window of every
/// fragment (128 MiB) holds 1024 tokens.
const WINDOW_ROW: u64 = 64 * MIB2;

fn create(server: &TestServer, tokens: u64) -> serde_json::Value {
    let r = server.post(
        "/v1/sequences",
        &format!(r#"{{"prompt_tokens": {tokens}, "max_tokens": 4096}}"#),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    r.json()
}

#[test]
fn a_429_names_the_request_against_what_it_could_have_and_metrics_agree() {
    let budget = 4 * WINDOW_ROW; // 512 MiB
    let server = TestServer::start(Some(budget));
    let a = create(&server, 512);
    create(&server, 512);
    create(&server, 512);
    assert_eq!(server.metric("kvvm_free_bytes"), WINDOW_ROW);
    // The first one ends: its 128 MiB go to the handle pool. Nothing is free beyond the
    // 128 MiB that were free already, but twice that is available to a new request.
    let id = a["id"].as_u64().unwrap();
    let r = server.delete(&format!("/v1/sequences/{id}"));
    assert_eq!(r.json()["released_bytes"], WINDOW_ROW);
    assert_eq!(server.metric("kvvm_pooled_bytes"), WINDOW_ROW);
    assert_eq!(server.metric("kvvm_free_bytes"), WINDOW_ROW);
    assert_eq!(server.metric("kvvm_available_bytes"), 2 * WINDOW_ROW);

    // 2600 tokens are 3 windows per fragment: 384 MiB. The pool supplies 128 MiB of it and
    // the budget 128 MiB: refused, and the answer says so in the request's terms.
    let r = server.post(
        "/v1/sequences",
        r#"{"prompt_tokens": 2600, "max_tokens": 4096}"#,
    );
    assert_eq!(r.status, 429, "{}", r.body);
    let j = r.json();
    assert_eq!(j["needed_bytes"], 3 * WINDOW_ROW, "{j}");
    assert_eq!(j["available_bytes"], 2 * WINDOW_ROW, "{j}");
    assert!(
        j["error"]
            .as_str()
            .unwrap()
            .contains("402653184 bytes needed, 268435456 available"),
        "{j}"
    );
    assert_eq!(server.metric("kvvm_available_bytes"), 2 * WINDOW_ROW);
    // What was reported available is granted.
    create(&server, 2000);
    assert_eq!(server.metric("kvvm_available_bytes"), 0);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}

#[test]
fn with_the_budget_in_the_pool_nothing_is_free_and_all_of_it_is_available() {
    let budget = 3 * WINDOW_ROW;
    let server = TestServer::start(Some(budget));
    let ids: Vec<u64> = (0..3)
        .map(|_| create(&server, 512)["id"].as_u64().unwrap())
        .collect();
    assert_eq!(
        server.delete(&format!("/v1/sequences/{}", ids[0])).status,
        200
    );
    // Two live sequences, the third's memory in the pool.
    assert_eq!(server.metric("kvvm_live_sequences"), 2);
    assert_eq!(server.metric("kvvm_free_bytes"), 0);
    assert_eq!(server.metric("kvvm_available_bytes"), WINDOW_ROW);
    // One definition of committed: the metric is the sum of the sequences' figures, and a
    // sequence maps what it commits (no sharing here).
    let mut sum = 0;
    for id in &ids[1..] {
        let s = server.get(&format!("/v1/sequences/{id}")).json();
        assert_eq!(s["committed_bytes"], s["mapped_bytes"]);
        sum += s["committed_bytes"].as_u64().unwrap();
    }
    assert_eq!(server.metric("kvvm_committed_bytes"), sum);
    create(&server, 512);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}

#[test]
fn a_sequence_may_open_with_no_prompt_and_commits_nothing_until_it_grows() {
    // A trace request needs a prompt to prefill; a server's sequence may be opened before
    // its prompt is known: its address space is reserved, nothing is committed.
    let server = TestServer::start(Some(WINDOW_ROW));
    let s = create(&server, 0);
    assert_eq!(
        (s["tokens"].as_u64(), s["committed_bytes"].as_u64()),
        (Some(0), Some(0))
    );
    assert!(s["reserved_bytes"].as_u64().unwrap() > 0);
    assert_eq!(server.metric("kvvm_committed_bytes"), 0);
    let id = s["id"].as_u64().unwrap();
    let r = server.post(&format!("/v1/sequences/{id}/append"), r#"{"tokens": 10}"#);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["committed_bytes"], WINDOW_ROW);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}
