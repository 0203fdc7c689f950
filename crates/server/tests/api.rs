//! The API through a real HTTP client against a server on 127.0.0.1 (ephemeral port) over
//! the simulated driver: the happy path, every kind of bad input (4xx, nothing changed),
//! governor refusals and driver out-of-memory (429 + Retry-After, nothing changed), racing
//! requests on one sequence, and a shutdown that leaves the driver's ledger empty. The prefix
//! cache through the API is in `prefix_cache.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use common::{config, TestServer, MIB2};
use kvvm::sim::{SimBackend, SimConfig};
use kvvm_server::Owner;

/// llama-3-8b fp16 seq-major: 64 fragments of 2048 bytes per token.
const FRAGMENTS: u64 = 64;

#[test]
fn sequence_lifecycle_metrics_and_clean_shutdown() {
    let server = TestServer::start(None);

    let health = server.get("/healthz");
    assert_eq!(health.status, 200, "{}", health.body);
    let h = health.json();
    assert_eq!(h["status"], "ok");
    assert_eq!(h["backend"], "sim");
    assert_eq!(h["model"], "llama-3-8b");
    assert_eq!(h["layout"], "seq-major");

    // 100 tokens x 2048 B = 200 KB per fragment: one window each. The device address is
    // shown only when asked for.
    let r = server.post(
        "/v1/sequences?address=true",
        r#"{"prompt_tokens": 100, "max_tokens": 2048}"#,
    );
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.content_type.as_deref(), Some("application/json"));
    let created = r.json();
    let id = created["id"].as_u64().unwrap();
    assert_eq!(created["tokens"], 100);
    assert_eq!(created["max_tokens"], 2048);
    assert_eq!(created["committed_bytes"], FRAGMENTS * MIB2);
    assert_eq!(created["added_bytes"], FRAGMENTS * MIB2);
    // Every sequence is reserved at the model's limit (4096 tokens x 2048 B = 8 MiB per
    // fragment, so that shared prefixes map at the same offsets of each), not committed.
    assert_eq!(created["reserved_bytes"], FRAGMENTS * 4 * MIB2);
    assert_eq!(created["owned_bytes"], FRAGMENTS * MIB2);
    assert_eq!(created["shared_bytes"], 0);
    assert_eq!(created["prefix_hit_tokens"], 0);
    let address = created["address"].as_u64().unwrap();

    // Within the first window: nothing new to commit.
    let r = server.post(&format!("/v1/sequences/{id}/append"), r#"{"tokens": 900}"#);
    assert_eq!(r.status, 200, "{}", r.body);
    let a = r.json();
    assert!(a.get("address").is_none(), "{a}");
    assert_eq!(a["tokens"], 1000);
    assert_eq!(a["added_bytes"], 0);
    assert_eq!(a["committed_bytes"], FRAGMENTS * MIB2);

    // 1100 tokens x 2048 B > 2 MiB: a second window per fragment, same address.
    let r = server.post(
        &format!("/v1/sequences/{id}/append?address=true"),
        r#"{"tokens": 100}"#,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let a = r.json();
    assert_eq!(a["tokens"], 1100);
    assert_eq!(a["added_bytes"], FRAGMENTS * MIB2);
    assert_eq!(a["committed_bytes"], 2 * FRAGMENTS * MIB2);
    assert_eq!(a["address"], address);

    let r = server.get(&format!("/v1/sequences/{id}"));
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["tokens"], 1100);

    // token_ids alone give the prompt length.
    let r = server.post(
        "/v1/sequences",
        r#"{"token_ids": [1, 2, 3, 4, 5], "max_tokens": 16}"#,
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let second = r.json()["id"].as_u64().unwrap();
    assert_ne!(second, id);
    assert_eq!(r.json()["tokens"], 5);

    let text = server.get("/metrics");
    assert_eq!(text.status, 200);
    assert!(text
        .content_type
        .as_deref()
        .is_some_and(|c| c.starts_with("text/plain")));
    assert_eq!(server.metric("kvvm_live_sequences"), 2);
    assert_eq!(server.metric("kvvm_live_tokens"), 1105);
    assert_eq!(server.metric("kvvm_committed_bytes"), 3 * FRAGMENTS * MIB2);
    assert_eq!(server.metric("kvvm_sequences_created_total"), 2);
    assert_eq!(server.metric("kvvm_appends_total"), 2);
    assert_eq!(server.metric("kvvm_grants_refused_total"), 0);
    for name in [
        "kvvm_used_bytes",
        "kvvm_pooled_bytes",
        "kvvm_shared_bytes",
        "kvvm_quarantined_bytes",
        "kvvm_prefix_hits_total",
        "kvvm_budget_bytes",
    ] {
        let _ = server.metric(name);
    }

    let r = server.delete(&format!("/v1/sequences/{id}"));
    assert_eq!(r.status, 200, "{}", r.body);
    let d = r.json();
    assert_eq!(d["id"], id);
    assert_eq!(d["released_bytes"], 2 * FRAGMENTS * MIB2);
    assert_eq!(server.delete(&format!("/v1/sequences/{id}")).status, 404);
    assert_eq!(server.metric("kvvm_live_sequences"), 1);
    // Released handles go to the pool; used = committed + pooled.
    assert_eq!(
        server.metric("kvvm_used_bytes"),
        server.metric("kvvm_committed_bytes") + server.metric("kvvm_pooled_bytes")
    );

    // The second sequence is still live: shutdown releases it.
    let (report, sim, service) = server.shutdown();
    assert_eq!(report.sequences, 1);
    assert_eq!(report.failures, 0);
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    assert_eq!(service.governor().snapshot().used(), 0);
    assert_eq!(service.live_sequences(), 0);
}

/// The state a bad request must not change.
fn state(server: &TestServer, id: u64) -> impl PartialEq + std::fmt::Debug {
    (
        server.sim.ledger(),
        server.service.governor().snapshot(),
        server.service.live_sequences(),
        server.service.get(Owner::ANONYMOUS, id).unwrap(),
    )
}

#[test]
fn bad_input_gets_a_clear_4xx_and_changes_nothing() {
    let server = TestServer::start(None);
    let r = server.post(
        "/v1/sequences",
        r#"{"prompt_tokens": 10, "max_tokens": 100}"#,
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let id = r.json()["id"].as_u64().unwrap();
    let append = format!("/v1/sequences/{id}/append");
    let oversize = format!(
        r#"{{"token_ids": [{}], "max_tokens": 4096}}"#,
        vec!["1"; 12 << 10].join(",")
    );
    assert!(oversize.len() > 16 << 10);

    let cases: Vec<(&str, &str, String, u16, &str)> = vec![
        // (what, path, body, status, kind)
        (
            "truncated JSON",
            "/v1/sequences",
            r#"{"prompt_tokens": "#.into(),
            400,
            "malformed_body",
        ),
        (
            "not JSON",
            "/v1/sequences",
            "prompt_tokens=3".into(),
            400,
            "malformed_body",
        ),
        (
            "empty body",
            "/v1/sequences",
            String::new(),
            400,
            "malformed_body",
        ),
        (
            "array",
            "/v1/sequences",
            "[1, 2]".into(),
            400,
            "malformed_body",
        ),
        (
            "negative",
            "/v1/sequences",
            r#"{"prompt_tokens": -1, "max_tokens": 10}"#.into(),
            400,
            "malformed_body",
        ),
        (
            "fraction",
            "/v1/sequences",
            r#"{"prompt_tokens": 1.5, "max_tokens": 10}"#.into(),
            400,
            "malformed_body",
        ),
        (
            "string number",
            "/v1/sequences",
            r#"{"prompt_tokens": "5", "max_tokens": 10}"#.into(),
            400,
            "malformed_body",
        ),
        (
            "huge number",
            "/v1/sequences",
            r#"{"prompt_tokens": 1e30, "max_tokens": 10}"#.into(),
            400,
            "malformed_body",
        ),
        (
            "unknown field",
            "/v1/sequences",
            r#"{"prompt_tokens": 5, "max_token": 10}"#.into(),
            400,
            "malformed_body",
        ),
        (
            "oversize body",
            "/v1/sequences",
            oversize,
            413,
            "body_too_large",
        ),
        (
            "max_tokens over the model limit",
            "/v1/sequences",
            r#"{"prompt_tokens": 5, "max_tokens": 4097}"#.into(),
            422,
            "invalid_request",
        ),
        (
            "prompt over max_tokens",
            "/v1/sequences",
            r#"{"prompt_tokens": 11, "max_tokens": 10}"#.into(),
            422,
            "invalid_request",
        ),
        (
            "zero max_tokens",
            "/v1/sequences",
            r#"{"prompt_tokens": 0, "max_tokens": 0}"#.into(),
            422,
            "invalid_request",
        ),
        (
            "no prompt",
            "/v1/sequences",
            r#"{"max_tokens": 10}"#.into(),
            422,
            "invalid_request",
        ),
        (
            "ids disagree",
            "/v1/sequences",
            r#"{"prompt_tokens": 3, "token_ids": [1, 2]}"#.into(),
            422,
            "invalid_request",
        ),
        (
            "append zero",
            &append,
            r#"{"tokens": 0}"#.into(),
            422,
            "invalid_request",
        ),
        (
            "append past max_tokens",
            &append,
            r#"{"tokens": 91}"#.into(),
            422,
            "invalid_request",
        ),
        (
            "append overflow",
            &append,
            format!(r#"{{"tokens": {}}}"#, u64::MAX),
            422,
            "invalid_request",
        ),
        (
            "append malformed",
            &append,
            r#"{"tokens": }"#.into(),
            400,
            "malformed_body",
        ),
        (
            "append to unknown id",
            "/v1/sequences/999/append",
            r#"{"tokens": 1}"#.into(),
            404,
            "unknown_sequence",
        ),
        (
            "append to non-numeric id",
            "/v1/sequences/abc/append",
            r#"{"tokens": 1}"#.into(),
            400,
            "invalid_id",
        ),
        (
            "append to an id over u64",
            "/v1/sequences/18446744073709551616/append",
            r#"{"tokens": 1}"#.into(),
            400,
            "invalid_id",
        ),
        (
            "unknown route",
            "/v1/nothing",
            "{}".into(),
            404,
            "not_found",
        ),
    ];
    let before = state(&server, id);
    for (what, path, body, status, kind) in &cases {
        let r = server.post(path, body);
        assert_eq!(r.status, *status, "{what}: {}", r.body);
        if *kind == "invalid_id" {
            // Says what an id is, with its range: a number past u64 is not "negative".
            let m = r.json()["error"].as_str().unwrap_or_default().to_owned();
            assert!(m.contains("0..=18446744073709551615"), "{what}: {m}");
        }
        if *kind == "body_too_large" {
            assert!(
                r.json()["limit_bytes"].as_u64().is_some(),
                "{what}: {}",
                r.body
            );
        }
        let j = r.json();
        assert_eq!(j["kind"], *kind, "{what}: {}", r.body);
        assert!(
            j["error"].as_str().is_some_and(|e| e.len() > 5),
            "{what}: {}",
            r.body
        );
        assert!(r.retry_after.is_none(), "{what}");
        assert_eq!(state(&server, id), before, "{what} changed the state");
    }
    for (path, status) in [
        ("/v1/sequences/999", 404),
        ("/v1/sequences/-1", 400),
        ("/v1/sequences/18446744073709551616", 400),
    ] {
        let r = server.delete(path);
        assert_eq!(r.status, status, "DELETE {path}: {}", r.body);
        assert!(r.json()["error"].is_string());
        let r = server.get(path);
        assert_eq!(r.status, status, "GET {path}: {}", r.body);
        assert_eq!(state(&server, id), before, "{path} changed the state");
    }
    let r = server
        .agent
        .put(&server.url("/healthz"))
        .send("{}")
        .unwrap();
    assert_eq!(r.status().as_u16(), 405);
    assert_eq!(state(&server, id), before);
    let expected_4xx = cases.len() as u64 + 7;
    assert_eq!(server.metric("kvvm_bad_requests_total"), expected_4xx);
    assert_eq!(server.metric("kvvm_grants_refused_total"), 0);

    // The sequence still works after all that.
    let r = server.post(&append, r#"{"tokens": 90}"#);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["tokens"], 100);

    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}

#[test]
fn governor_refusal_is_429_with_retry_after_and_changes_nothing() {
    // Room for exactly two windows per fragment: one 1-window sequence grown to 2 windows,
    // or two 1-window sequences.
    let budget = 2 * FRAGMENTS * MIB2;
    let server = TestServer::start(Some(budget));
    let r = server.post(
        "/v1/sequences",
        r#"{"prompt_tokens": 100, "max_tokens": 4096}"#,
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let id = r.json()["id"].as_u64().unwrap();
    let r = server.post(&format!("/v1/sequences/{id}/append"), r#"{"tokens": 1100}"#);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["committed_bytes"], budget);

    let before = state(&server, id);
    // A new sequence does not fit.
    let r = server.post("/v1/sequences", r#"{"prompt_tokens": 1, "max_tokens": 16}"#);
    assert_eq!(r.status, 429, "{}", r.body);
    let secs: u64 = r.retry_after.as_deref().unwrap().parse().unwrap();
    assert!((1..=5).contains(&secs), "Retry-After {secs}");
    let j = r.json();
    assert_eq!(j["kind"], "backpressure");
    assert_eq!(j["needed_bytes"], FRAGMENTS * MIB2);
    assert_eq!(j["available_bytes"], 0);
    let ms = j["retry_after_ms"].as_u64().unwrap();
    assert_eq!(secs, ms.div_ceil(1000).max(1));
    assert_eq!(state(&server, id), before);

    // Growing the sequence, which holds the whole budget, can never fit: 413 with no
    // Retry-After (a 429 would be retried forever); its tokens stay as they were.
    let r = server.post(&format!("/v1/sequences/{id}/append"), r#"{"tokens": 2000}"#);
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(r.json()["kind"], "never_fits");
    assert!(r.retry_after.is_none());
    assert_eq!(state(&server, id), before);
    assert_eq!(
        server.service.get(Owner::ANONYMOUS, id).unwrap().tokens,
        1200
    );
    assert_eq!(server.metric("kvvm_grants_refused_total"), 1);

    // Once it is released, a new sequence fits (its handles come from the pool).
    assert_eq!(server.delete(&format!("/v1/sequences/{id}")).status, 200);
    let r = server.post("/v1/sequences", r#"{"prompt_tokens": 1, "max_tokens": 16}"#);
    assert_eq!(r.status, 201, "{}", r.body);

    // 256 MiB were just released: a shortfall of 128 MiB is estimated at about half of the
    // 1 s window, not at the 5 s cap (the released handles went to the pool, which the
    // governor's own estimate does not see).
    let r = server.post(
        "/v1/sequences",
        r#"{"prompt_tokens": 1100, "max_tokens": 2048}"#,
    );
    assert_eq!(r.status, 429, "{}", r.body);
    let j = r.json();
    // (The pool supplies what it holds; the grant asks the governor for the rest.)
    assert!(j["needed_bytes"].as_u64().unwrap() > j["available_bytes"].as_u64().unwrap());
    assert!(j["retry_after_ms"].as_u64().unwrap() <= 1000, "{j}");
    assert_eq!(r.retry_after.as_deref(), Some("1"));

    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}

#[test]
fn driver_out_of_memory_is_429_not_5xx() {
    // The driver holds 100 granules; the governor is told it may grant far more.
    let sim = Arc::new(SimBackend::new(SimConfig::single(MIB2, 100 * MIB2)));
    let c = config(&sim, Some(1 << 40));
    let server = TestServer::start_with(sim, c, 16 << 10);
    let r = server.post(
        "/v1/sequences",
        r#"{"prompt_tokens": 10, "max_tokens": 100}"#,
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let id = r.json()["id"].as_u64().unwrap();
    let before = server.service.get(Owner::ANONYMOUS, id).unwrap();
    let r = server.post(
        "/v1/sequences",
        r#"{"prompt_tokens": 10, "max_tokens": 100}"#,
    );
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(r.retry_after.is_some());
    let j = r.json();
    assert_eq!(j["kind"], "backpressure");
    assert!(j["needed_bytes"].as_u64().unwrap() > 0);
    // The sequences are as they were (the failed commit's handles went back to the pool,
    // which is the manager's business and shows in kvvm_pooled_bytes).
    assert_eq!(server.service.get(Owner::ANONYMOUS, id).unwrap(), before);
    assert_eq!(server.service.live_sequences(), 1);
    assert_eq!(
        server.service.governor().snapshot().committed(),
        before.committed_bytes
    );
    assert_eq!(server.metric("kvvm_grants_refused_total"), 1);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}

#[test]
fn racing_appends_and_a_delete_on_one_sequence_leave_nothing_behind() {
    let server = TestServer::start(None);
    for round in 0..3 {
        let r = server.post(
            "/v1/sequences",
            r#"{"prompt_tokens": 1, "max_tokens": 4096}"#,
        );
        assert_eq!(r.status, 201, "{}", r.body);
        let id = r.json()["id"].as_u64().unwrap();
        let statuses: Vec<u16> = std::thread::scope(|scope| {
            let appenders: Vec<_> = (0..4)
                .map(|_| {
                    scope.spawn(|| {
                        let agent = common::agent();
                        let url = server.url(&format!("/v1/sequences/{id}/append"));
                        (0..20)
                            .map(|_| common::post(&agent, &url, r#"{"tokens": 40}"#).status)
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            std::thread::sleep(std::time::Duration::from_millis(5 * round));
            let d = server.delete(&format!("/v1/sequences/{id}"));
            assert_eq!(d.status, 200, "{}", d.body);
            appenders
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        });
        // Each append either happened before the delete or found the sequence gone.
        assert!(
            statuses.iter().all(|s| *s == 200 || *s == 404),
            "{statuses:?}"
        );
        assert_eq!(server.service.live_sequences(), 0);
        assert_eq!(server.metric("kvvm_live_tokens"), 0);
        assert_eq!(server.metric("kvvm_committed_bytes"), 0);
    }
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}
