//! Who can read what, with API keys: a caller without a key learns from `/healthz` only that
//! the server is alive; a tenant key sees its own count there and not `/metrics` (whose
//! figures move with every key's activity); an operator key reads both in full and uses no
//! sequence; two `Authorization` headers are a bad request, not the first one's.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Write;
use std::sync::Arc;

use common::{raw, read_reply, RawReply, TestServer};
use kvvm::sim::SimBackend;
use kvvm_server::{ApiKeys, HttpConfig};

const KEY_A: &str = "alice-0123456789abcdef";
const KEY_B: &str = "bob-0123456789abcdef00";
const OPERATOR: &str = "prometheus-0123456789ab";

fn keyed(operator: bool) -> TestServer {
    let sim = Arc::new(SimBackend::h200());
    let mut c = common::config(&sim, None);
    c.layout = kvvm::kv::KvLayout::TokenMajor;
    let mut keys = ApiKeys::none();
    keys.add(&format!("alice:{KEY_A}")).unwrap();
    keys.add(&format!("bob:{KEY_B}")).unwrap();
    if operator {
        keys.add_operator(&format!("prometheus:{OPERATOR}"))
            .unwrap();
    }
    TestServer::start_http(
        sim,
        c,
        HttpConfig {
            api_keys: keys,
            ..HttpConfig::default()
        },
    )
}

/// One request on its own connection, with these `Authorization` keys (one header each).
fn call(server: &TestServer, keys: &[&str], method: &str, path: &str, body: &str) -> RawReply {
    let mut s = raw(server.addr);
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    for k in keys {
        head.push_str(&format!("Authorization: Bearer {k}\r\n"));
    }
    if !body.is_empty() {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    s.write_all(format!("{head}\r\n{body}").as_bytes()).unwrap();
    read_reply(&mut s).unwrap_or_else(|| panic!("{method} {path}: no answer"))
}

fn metric(text: &str, name: &str) -> u64 {
    common::metric(text, name).unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

#[test]
fn tenants_see_their_own_the_operator_sees_everything_a_stranger_sees_liveness() {
    let server = keyed(true);
    let ids = (0..40).map(|i| i.to_string()).collect::<Vec<_>>().join(",");
    let prompt = format!(r#"{{"token_ids": [{ids}]}}"#);
    for key in [KEY_A, KEY_A, KEY_B] {
        let r = call(&server, &[key], "POST", "/v1/sequences", &prompt);
        assert_eq!(r.status, 201, "{r:?}");
    }

    // Without a key: alive, and nothing else (no count that moves with anyone's activity).
    let r = call(&server, &[], "GET", "/healthz", "");
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json(), serde_json::json!({"status": "ok"}));
    // A tenant: its own sequences; the operator: everyone's.
    for (key, live) in [(KEY_A, 2), (KEY_B, 1), (OPERATOR, 3)] {
        let r = call(&server, &[key], "GET", "/healthz", "");
        assert_eq!(r.status, 200, "{r:?}");
        let body = r.json();
        assert_eq!(body["live_sequences"], live, "{key}: {body}");
        assert_eq!(body["layout"], "token-major");
        assert_eq!(body["authentication"], true);
    }
    // A key it is given must be valid.
    let r = call(
        &server,
        &["not-a-key-of-this-server"],
        "GET",
        "/healthz",
        "",
    );
    assert_eq!(r.status, 401, "{r:?}");

    // /metrics: every key's activity, so the operator's only.
    for key in [KEY_A, KEY_B] {
        let r = call(&server, &[key], "GET", "/metrics", "");
        assert_eq!(r.status, 403, "{key}: {r:?}");
        assert_eq!(r.json()["kind"], "forbidden");
        assert!(!r.body.contains("kvvm_live_sequences"));
    }
    assert_eq!(call(&server, &[], "GET", "/metrics", "").status, 401);
    let r = call(&server, &[OPERATOR], "GET", "/metrics", "");
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(metric(&r.body, "kvvm_live_sequences"), 3);
    assert_eq!(metric(&r.body, "kvvm_prefixes_published_total"), 2);
    assert_eq!(metric(&r.body, "kvvm_prefix_hits_total"), 1);

    // The operator key uses no sequence: 403, nothing created, nothing listed.
    for (method, path, body) in [
        ("POST", "/v1/sequences", r#"{"prompt_tokens": 1}"#),
        ("GET", "/v1/sequences", ""),
        ("GET", "/v1/sequences/1", ""),
        ("DELETE", "/v1/sequences/1", ""),
    ] {
        let r = call(&server, &[OPERATOR], method, path, body);
        assert_eq!(r.status, 403, "{method} {path}: {r:?}");
        assert_eq!(r.json()["kind"], "forbidden");
    }
    assert_eq!(server.service.live_sequences(), 3);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
}

#[test]
fn two_authorization_headers_are_a_bad_request_never_the_first_one() {
    let server = keyed(true);
    let r = call(
        &server,
        &[KEY_A],
        "POST",
        "/v1/sequences",
        r#"{"prompt_tokens": 1}"#,
    );
    assert_eq!(r.status, 201, "{r:?}");
    for (keys, method, path, body) in [
        (
            [KEY_A, KEY_B],
            "POST",
            "/v1/sequences",
            r#"{"prompt_tokens": 1}"#,
        ),
        ([KEY_A, KEY_A], "GET", "/v1/sequences", ""),
        ([KEY_B, KEY_A], "DELETE", "/v1/sequences/1", ""),
        ([OPERATOR, KEY_A], "GET", "/metrics", ""),
        ([KEY_A, OPERATOR], "GET", "/healthz", ""),
    ] {
        let r = call(&server, &keys, method, path, body);
        assert_eq!(r.status, 400, "{method} {path}: {r:?}");
        let body = r.json();
        assert_eq!(body["kind"], "bad_request", "{body}");
        assert!(
            body["error"].as_str().unwrap().contains("Authorization"),
            "{body}"
        );
    }
    // Nothing was created, released or shown; each refusal was counted.
    assert_eq!(server.service.live_sequences(), 1);
    let r = call(&server, &[OPERATOR], "GET", "/metrics", "");
    assert_eq!(metric(&r.body, "kvvm_bad_requests_total"), 5);
}

#[test]
fn without_an_operator_key_no_key_reads_metrics() {
    let server = keyed(false);
    for key in [KEY_A, KEY_B] {
        let r = call(&server, &[key], "GET", "/metrics", "");
        assert_eq!(r.status, 403, "{key}: {r:?}");
        assert!(r.json()["error"].as_str().unwrap().contains("operator"));
    }
    // Without keys there is one owner, who sees everything (the loopback default).
    let open = TestServer::start(None);
    assert_eq!(
        open.post("/v1/sequences", r#"{"prompt_tokens": 1}"#).status,
        201
    );
    assert_eq!(open.get("/healthz").json()["live_sequences"], 1);
    assert_eq!(open.metric("kvvm_live_sequences"), 1);
}
