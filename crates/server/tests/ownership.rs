//! API keys, ownership and limits: key B cannot see, grow, release or list key A's
//! sequences and gets no prefix hits from A's prompts; limits per key and in total answer 429
//! with `Retry-After` while freeing can help and 413 `never_fits` naming the limit when it
//! cannot; idle sequences are released; without keys the server refuses a non-loopback
//! address.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Reply, TestServer, MIB2};
use kvvm::sim::SimBackend;
use kvvm_server::{ApiKeys, HttpConfig, KvService, Limits};

const KEY_A: &str = "alice-0123456789abcdef";
const KEY_B: &str = "bob-0123456789abcdef00";

fn keyed(shared_cache: bool) -> TestServer {
    let sim = Arc::new(SimBackend::h200());
    let mut c = common::config(&sim, None);
    c.layout = kvvm::kv::KvLayout::TokenMajor;
    c.shared_prefix_cache = shared_cache;
    let mut keys = ApiKeys::none();
    keys.add(&format!("alice:{KEY_A}")).unwrap();
    keys.add(&format!("bob:{KEY_B}")).unwrap();
    TestServer::start_http(
        sim,
        c,
        HttpConfig {
            api_keys: keys,
            body_limit: 64 << 10,
            ..HttpConfig::default()
        },
    )
}

fn call(server: &TestServer, key: Option<&str>, method: &str, path: &str, body: &str) -> Reply {
    let url = server.url(path);
    let auth = key.map(|k| format!("Bearer {k}"));
    let r = match method {
        "POST" => {
            let mut rb = server
                .agent
                .post(&url)
                .header("content-type", "application/json");
            if let Some(a) = &auth {
                rb = rb.header("authorization", a);
            }
            rb.send(body)
        }
        "GET" | "DELETE" => {
            let mut rb = if method == "GET" {
                server.agent.get(&url)
            } else {
                server.agent.delete(&url)
            };
            if let Some(a) = &auth {
                rb = rb.header("authorization", a);
            }
            rb.call()
        }
        _ => panic!("{method}"),
    };
    let mut r = r.expect("HTTP request failed");
    let header = |n: &str| {
        r.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let (retry_after, content_type) = (header("retry-after"), header("www-authenticate"));
    let status = r.status().as_u16();
    Reply {
        status,
        retry_after,
        content_type,
        body: r.body_mut().read_to_string().unwrap(),
    }
}

fn ids(range: std::ops::Range<u32>) -> String {
    range.map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

#[test]
fn another_key_cannot_see_grow_release_or_hit_a_keys_sequences() {
    let server = keyed(false);
    // No key, a wrong key: 401 with WWW-Authenticate; the probe needs none.
    let r = call(
        &server,
        None,
        "POST",
        "/v1/sequences",
        r#"{"prompt_tokens": 1}"#,
    );
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(r.json()["kind"], "unauthorized");
    assert!(r.content_type.unwrap().starts_with("Bearer"));
    let r = call(
        &server,
        Some("not-a-key-of-this-server"),
        "GET",
        "/v1/sequences",
        "",
    );
    assert_eq!(r.status, 401);
    assert_eq!(call(&server, None, "GET", "/metrics", "").status, 401);
    assert_eq!(server.get("/healthz").status, 200);

    // A publishes a 96-token prefix (6 blocks of 16).
    let prompt = format!(r#"{{"token_ids": [{}], "max_tokens": 1000}}"#, ids(0..100));
    let a = call(&server, Some(KEY_A), "POST", "/v1/sequences", &prompt);
    assert_eq!(a.status, 201, "{}", a.body);
    let id = a.json()["id"].as_u64().unwrap();
    // B: 404 for everything of A's, an empty list.
    for (method, path, body) in [
        ("GET", format!("/v1/sequences/{id}"), ""),
        (
            "POST",
            format!("/v1/sequences/{id}/append"),
            r#"{"tokens": 1}"#,
        ),
        ("DELETE", format!("/v1/sequences/{id}"), ""),
    ] {
        let r = call(&server, Some(KEY_B), method, &path, body);
        assert_eq!(r.status, 404, "{method} {path}: {}", r.body);
        assert_eq!(r.json()["kind"], "unknown_sequence");
    }
    let r = call(&server, Some(KEY_B), "GET", "/v1/sequences", "");
    assert_eq!(r.json()["sequences"], serde_json::json!([]));
    // B sends A's prompt: no hit (B's namespace is empty), however B cuts it.
    for n in [100, 16] {
        let body = format!(r#"{{"token_ids": [{}], "max_tokens": 1000}}"#, ids(0..n));
        let r = call(&server, Some(KEY_B), "POST", "/v1/sequences", &body);
        assert_eq!(r.status, 201, "{}", r.body);
        // The second probe hits only what B's own first request published.
        let own = if n == 100 { 0 } else { 16 };
        assert_eq!(r.json()["prefix_hit_tokens"], own, "{n} tokens: {}", r.body);
        assert!(r.json().get("address").is_none());
    }
    // Another key's 97-token prompt that agrees with A's only on the first block: B's own
    // first block, nothing of A's beyond.
    let body = format!(
        r#"{{"token_ids": [{},{}], "max_tokens": 1000}}"#,
        ids(0..16),
        ids(900..981)
    );
    let r = call(&server, Some(KEY_B), "POST", "/v1/sequences", &body);
    assert_eq!(r.json()["prefix_hit_tokens"], 16, "{}", r.body);
    // A's own prompt hits A's prefix; A's sequence is intact and listed.
    let r = call(&server, Some(KEY_A), "POST", "/v1/sequences", &prompt);
    assert_eq!(r.json()["prefix_hit_tokens"], 96, "{}", r.body);
    let r = call(
        &server,
        Some(KEY_A),
        "GET",
        &format!("/v1/sequences/{id}"),
        "",
    );
    assert_eq!((r.status, r.json()["tokens"].as_u64()), (200, Some(100)));
    let list = call(
        &server,
        Some(KEY_A),
        "GET",
        "/v1/sequences?address=true",
        "",
    )
    .json();
    let listed: Vec<u64> = list["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_u64().unwrap())
        .collect();
    assert_eq!(listed.len(), 2);
    assert!(listed.contains(&id));
    assert!(list["sequences"][0]["address"].is_u64());
    assert_eq!(
        call(
            &server,
            Some(KEY_A),
            "DELETE",
            &format!("/v1/sequences/{id}"),
            ""
        )
        .status,
        200
    );
    let (_, sim, service) = server.shutdown();
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    assert_eq!(service.governor().snapshot().used(), 0);
}

#[test]
fn a_shared_prefix_cache_is_shared_only_when_asked_for() {
    let server = keyed(true);
    let prompt = format!(r#"{{"token_ids": [{}], "max_tokens": 1000}}"#, ids(0..100));
    let a = call(&server, Some(KEY_A), "POST", "/v1/sequences", &prompt);
    assert_eq!(a.status, 201, "{}", a.body);
    let b = call(&server, Some(KEY_B), "POST", "/v1/sequences", &prompt);
    assert_eq!(b.json()["prefix_hit_tokens"], 96, "{}", b.body);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}

fn limited(limits: Limits, budget: Option<u64>, max_tokens: u64) -> TestServer {
    let sim = Arc::new(SimBackend::h200());
    let mut c = common::config(&sim, budget);
    c.limits = limits;
    c.model = c.model.with_max_tokens(max_tokens).unwrap();
    TestServer::start_with(sim, c, 16 << 10)
}

fn assert_never_fits(r: &Reply, limit: &str) {
    assert_eq!(r.status, 413, "{}", r.body);
    let j = r.json();
    assert_eq!(j["kind"], "never_fits", "{j}");
    assert_eq!(j["limit"], limit, "{j}");
    assert!(j["needed_bytes"].as_u64().unwrap() > j["limit_bytes"].as_u64().unwrap());
    assert!(
        r.retry_after.is_none(),
        "a never-fitting request has no Retry-After"
    );
}

#[test]
fn never_fitting_requests_are_4xx_naming_the_limit_never_429() {
    // llama-3-8b fp16 seq-major: 64 fragments of 2048 B a token.
    let per_seq = 64 * 2048 * 4096; // reserved at the model's limit of 4096 tokens
    let server = limited(
        Limits {
            max_committed_bytes_per_key: Some(64 * MIB2),
            ..Limits::default()
        },
        Some(128 * MIB2),
        4096,
    );
    // Over the budget by itself: 1100 tokens need 2 windows per fragment (256 MiB).
    let r = server.post("/v1/sequences", r#"{"prompt_tokens": 1100}"#);
    assert_never_fits(&r, "max_committed_bytes_per_key");
    assert_eq!(server.service.live_sequences(), 0);
    let r = server.post("/v1/sequences", r#"{"prompt_tokens": 1}"#);
    assert_eq!(r.status, 201, "{}", r.body);
    let id = r.json()["id"].as_u64().unwrap();
    // The key's committed bytes are full: 429 while it holds them, with Retry-After.
    let r = server.post("/v1/sequences", r#"{"prompt_tokens": 1}"#);
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.json()["kind"], "limit_reached");
    assert_eq!(r.json()["limit"], "max_committed_bytes_per_key");
    assert_eq!(
        r.retry_after.as_deref(),
        Some("5"),
        "nothing released: the cap"
    );
    assert_eq!(server.delete(&format!("/v1/sequences/{id}")).status, 200);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());

    // A reservation at --max-tokens larger than the address-space limit: never fits.
    let server = limited(
        Limits {
            max_reserved_bytes: (per_seq as u64) - 1,
            ..Limits::default()
        },
        None,
        4096,
    );
    assert!(server.service.never_fits_reason().is_some());
    let r = server.post("/v1/sequences", r#"{"prompt_tokens": 0}"#);
    assert_never_fits(&r, "max_reserved_bytes");
    drop(server);

    // An absurd --max-tokens: the server starts, and says why nothing fits.
    let server = limited(Limits::default(), None, 99_999_999_999);
    let r = server.post("/v1/sequences", r#"{"prompt_tokens": 0}"#);
    assert_never_fits(&r, "max_reserved_bytes");
    drop(server);

    // Over the device budget by itself (the governor's never-fits).
    let server = limited(Limits::default(), Some(64 * MIB2), 4096);
    let r = server.post("/v1/sequences", r#"{"prompt_tokens": 1100}"#);
    assert_never_fits(&r, "device_budget");
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}

#[test]
fn empty_sequences_are_bounded_and_their_429_estimates_what_is_released() {
    let server = limited(
        Limits {
            max_sequences: 8,
            ..Limits::default()
        },
        None,
        4096,
    );
    let mut ids = Vec::new();
    for _ in 0..8 {
        let r = server.post("/v1/sequences", r#"{"prompt_tokens": 0}"#);
        assert_eq!(r.status, 201, "{}", r.body);
        ids.push(r.json()["id"].as_u64().unwrap());
    }
    let r = server.post("/v1/sequences", r#"{"prompt_tokens": 0}"#);
    assert_eq!(r.status, 429, "{}", r.body);
    let j = r.json();
    assert_eq!(
        (j["kind"].as_str(), j["limit"].as_str()),
        (Some("limit_reached"), Some("max_sequences"))
    );
    assert_eq!(
        j["retry_after_ms"], 5000,
        "nothing released yet: the cap, {j}"
    );
    // Two sequences released just now: one more is expected within half the window.
    for id in ids.drain(..2) {
        assert_eq!(server.delete(&format!("/v1/sequences/{id}")).status, 200);
    }
    assert_eq!(
        server
            .post("/v1/sequences", r#"{"prompt_tokens": 0}"#)
            .status,
        201
    );
    assert_eq!(
        server
            .post("/v1/sequences", r#"{"prompt_tokens": 0}"#)
            .status,
        201
    );
    let r = server.post("/v1/sequences", r#"{"prompt_tokens": 0}"#);
    assert_eq!(r.status, 429);
    let ms = r.json()["retry_after_ms"].as_u64().unwrap();
    assert!(ms <= 1000, "{ms} ms");
    assert_eq!(server.metric("kvvm_grants_refused_total"), 2);
    let (report, sim, _) = server.shutdown();
    assert_eq!(report.sequences, 8);
    assert!(sim.ledger().is_empty());
}

#[test]
fn idle_sequences_are_released() {
    let sim = Arc::new(SimBackend::h200());
    let mut c = common::config(&sim, None);
    c.idle_timeout = Some(Duration::from_millis(300));
    let server = TestServer::start_with(sim, c, 16 << 10);
    let r = server.post("/v1/sequences", r#"{"prompt_tokens": 100}"#);
    assert_eq!(r.status, 201, "{}", r.body);
    let deadline = Instant::now() + Duration::from_secs(20);
    while server.service.live_sequences() > 0 {
        assert!(
            Instant::now() < deadline,
            "the idle sequence was never released"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(server.metric("kvvm_sequences_expired_total"), 1);
    assert_eq!(server.metric("kvvm_committed_bytes"), 0);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}

#[test]
fn without_keys_a_non_loopback_address_is_refused() {
    let sim = Arc::new(SimBackend::h200());
    let service = Arc::new(KvService::new(common::config(&sim, None)).unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let refused = rt.block_on(async {
        // Bound, never accepted on: serve refuses before accepting anything.
        let listener = kvvm_server::bind("0.0.0.0:0").await.unwrap();
        kvvm_server::serve(listener, service, HttpConfig::default(), async {}).await
    });
    let e = refused.unwrap_err();
    assert!(e.to_string().contains("without API keys"), "{e}");
}
