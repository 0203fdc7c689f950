//! The HTTP side under abuse, on 127.0.0.1 with raw sockets: a slowloris head, a stalled
//! body, an oversized `Content-Length` (with and without `Expect: 100-continue`), chunked
//! bodies under, at and over the limit, idle keep-alive connections, the connection cap,
//! strict requests, and JSON bodies for every error the server produces. Every wait is bounded; the bounds are generous for a loaded
//! 2-core machine.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{closed_within, raw, read_reply, TestServer};
use kvvm::sim::SimBackend;
use kvvm_server::HttpConfig;

fn server(http: HttpConfig) -> TestServer {
    let sim = Arc::new(SimBackend::h200());
    let c = common::config(&sim, None);
    TestServer::start_http(sim, c, http)
}

#[test]
fn slowloris_and_stalled_bodies_are_closed_within_their_timeouts() {
    let server = server(HttpConfig {
        header_timeout: Duration::from_secs(1),
        body_timeout: Duration::from_secs(1),
        keep_alive_timeout: Duration::from_secs(30),
        ..HttpConfig::default()
    });
    // A slowloris: a head that never ends, one byte at a time.
    let mut slow = raw(server.addr);
    slow.write_all(b"POST /v1/sequences HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let start = Instant::now();
    let mut closed = false;
    for b in b"X-Slow: abcdefghijklmnopqrstuvwxyz"
        .iter()
        .cycle()
        .take(40)
    {
        std::thread::sleep(Duration::from_millis(200));
        if slow.write_all(&[*b]).is_err() {
            closed = true;
            break;
        }
    }
    let closed = closed || closed_within(&mut slow, Duration::from_secs(5));
    let took = start.elapsed();
    assert!(
        closed,
        "the slowloris connection is still open after {took:?}"
    );
    assert!(took < Duration::from_secs(6), "closed only after {took:?}");

    // A stalled body: Content-Length 100, 12 bytes sent. 408 with a JSON body, then closed.
    let mut stalled = raw(server.addr);
    stalled
        .write_all(
            b"POST /v1/sequences HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n{\"prompt_to",
        )
        .unwrap();
    let start = Instant::now();
    let r = read_reply(&mut stalled).expect("an answer to the stalled body");
    let took = start.elapsed();
    assert_eq!(r.status, 408, "{r:?}");
    assert_eq!(r.json()["kind"], "request_timeout");
    assert!(took < Duration::from_secs(6), "answered after {took:?}");
    assert!(closed_within(&mut stalled, Duration::from_secs(5)));
    // A fresh connection that sends nothing is closed too (by the header timeout).
    let mut silent = raw(server.addr);
    assert!(closed_within(&mut silent, Duration::from_secs(6)));
    assert!(server.metric("kvvm_http_connections_closed_total{reason=\"header_timeout\"}") >= 1);
    assert_eq!(server.service.live_sequences(), 0);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}

#[test]
fn oversized_bodies_get_an_early_413_and_100_continue_is_never_sent() {
    let server = server(HttpConfig::default());
    // Content-Length of 10 GB and no body: answered at once, nothing read.
    let mut s = raw(server.addr);
    s.write_all(
        b"POST /v1/sequences HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 10000000000\r\n\r\n",
    )
    .unwrap();
    let start = Instant::now();
    let r = read_reply(&mut s).expect("an answer");
    assert_eq!(r.status, 413, "{r:?}");
    assert_eq!(r.json()["kind"], "body_too_large");
    // The answer says what the limit is (the default, 1 MiB).
    assert_eq!(r.json()["limit_bytes"], 1 << 20, "{r:?}");
    let message = r.json()["error"].as_str().unwrap_or_default().to_owned();
    assert!(message.contains("limit of 1048576 bytes"), "{message}");
    assert!(start.elapsed() < Duration::from_secs(5));
    // Expect: 100-continue with 5 MB: 413 first, no 100 Continue.
    let mut s = raw(server.addr);
    s.write_all(
        b"POST /v1/sequences HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Expect: 100-continue\r\nContent-Length: 5000000\r\n\r\n",
    )
    .unwrap();
    let r = read_reply(&mut s).expect("an answer");
    assert_eq!(r.status, 413, "{r:?}");
    assert!(!r.head.contains("100 Continue"), "{}", r.head);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}

/// Sends `body` with `Transfer-Encoding: chunked`, cut in `pieces` chunks, and reads the
/// answer.
fn post_chunked(server: &TestServer, body: &[u8], pieces: usize) -> common::RawReply {
    let mut s = raw(server.addr);
    let mut request =
        b"POST /v1/sequences HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                        Transfer-Encoding: chunked\r\n\r\n"
            .to_vec();
    for chunk in body.chunks(body.len().div_ceil(pieces).max(1)) {
        request.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        request.extend_from_slice(chunk);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"0\r\n\r\n");
    // An answer may come (and the connection close) before the last bytes are sent.
    let _ = s.write_all(&request);
    read_reply(&mut s).expect("an answer to the chunked body")
}

/// A JSON body of exactly `len` bytes (`{"prompt_tokens": 1}` and spaces).
fn body_of(len: usize) -> Vec<u8> {
    let mut b = br#"{"prompt_tokens": 1"#.to_vec();
    b.resize(len - 1, b' ');
    b.push(b'}');
    b
}

#[test]
fn chunked_bodies_are_held_to_the_body_limit() {
    let limit = 1024;
    let server = server(HttpConfig {
        body_limit: limit,
        ..HttpConfig::default()
    });
    // Under the limit and exactly at it: read whole and served.
    for len in [100, limit - 1, limit] {
        let r = post_chunked(&server, &body_of(len), 3);
        assert_eq!(r.status, 201, "{len} bytes: {r:?}");
    }
    // One byte over, and far over: 413 body_too_large, as for a Content-Length over it.
    for (len, pieces) in [(limit + 1, 3), (limit + 1, 1), (64 * limit, 16)] {
        let r = post_chunked(&server, &body_of(len), pieces);
        assert_eq!(r.status, 413, "{len} bytes in {pieces}: {r:?}");
        assert_eq!(r.json()["kind"], "body_too_large", "{len} bytes: {r:?}");
        assert_eq!(r.json()["limit_bytes"], limit, "{len} bytes: {r:?}");
    }
    assert_eq!(server.service.live_sequences(), 3);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}

#[test]
fn idle_keep_alive_connections_are_closed() {
    let server = server(HttpConfig {
        keep_alive_timeout: Duration::from_millis(500),
        ..HttpConfig::default()
    });
    let mut s = raw(server.addr);
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    assert_eq!(read_reply(&mut s).unwrap().status, 200);
    let start = Instant::now();
    assert!(closed_within(&mut s, Duration::from_secs(6)));
    assert!(start.elapsed() >= Duration::from_millis(400));
    assert!(server.metric("kvvm_http_connections_closed_total{reason=\"idle_timeout\"}") >= 1);
}

#[test]
fn past_the_connection_cap_a_new_client_gets_503_with_retry_after() {
    let server = server(HttpConfig {
        max_connections: 8,
        keep_alive_timeout: Duration::from_secs(60),
        header_timeout: Duration::from_secs(60),
        ..HttpConfig::default()
    });
    let held: Vec<_> = (0..8).map(|_| raw(server.addr)).collect();
    // Let the server accept them all.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut s = loop {
        let mut s = raw(server.addr);
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let r = read_reply(&mut s).expect("an answer, not a hang");
        if r.status == 503 || Instant::now() > deadline {
            assert_eq!(r.status, 503, "{r:?}");
            assert_eq!(r.json()["kind"], "too_many_connections");
            assert_eq!(r.header("retry-after").as_deref(), Some("1"));
            break s;
        }
    };
    assert!(closed_within(&mut s, Duration::from_secs(5)));
    drop(held);
    // Once they are gone, clients are served again.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut s = raw(server.addr);
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let r = read_reply(&mut s).unwrap();
        if r.status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "still {r:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(server.metric("kvvm_http_connections_refused_total") >= 1);
}

#[test]
fn strict_requests_and_json_errors_everywhere() {
    let server = server(HttpConfig::default());
    let r = server.post(
        "/v1/sequences",
        r#"{"prompt_tokens": 10, "max_tokens": 100}"#,
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let id = r.json()["id"].as_u64().unwrap();
    let cases: Vec<(&str, String, u16, &str)> = vec![
        (
            "no Host on HTTP/1.1",
            "GET /healthz HTTP/1.1\r\n\r\n".into(),
            400,
            "bad_request",
        ),
        (
            "two Host headers",
            "GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n".into(),
            400,
            "bad_request",
        ),
        (
            "two Authorization headers",
            "GET /v1/sequences HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\n\
             Authorization: Bearer b\r\n\r\n"
                .into(),
            400,
            "bad_request",
        ),
        (
            "a text/plain body",
            "POST /v1/sequences HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n\
             Content-Length: 20\r\n\r\n{\"prompt_tokens\": 1}"
                .into(),
            415,
            "unsupported_media_type",
        ),
        (
            "a body without a type",
            "POST /v1/sequences HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n\
             {\"prompt_tokens\": 1}"
                .into(),
            415,
            "unsupported_media_type",
        ),
        (
            "duplicate keys",
            "POST /v1/sequences HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: 38\r\n\r\n{\"prompt_tokens\": 1, \"prompt_tokens\":2}"
                .into(),
            400,
            "malformed_body",
        ),
        (
            "a plus sign in an id",
            format!("GET /v1/sequences/+{id} HTTP/1.1\r\nHost: x\r\n\r\n"),
            400,
            "invalid_id",
        ),
        (
            "leading zeros in an id",
            format!("GET /v1/sequences/000{id} HTTP/1.1\r\nHost: x\r\n\r\n"),
            400,
            "invalid_id",
        ),
        (
            "a percent-encoded id",
            "GET /v1/sequences/%2B1 HTTP/1.1\r\nHost: x\r\n\r\n".into(),
            400,
            "invalid_id",
        ),
        (
            "a percent-encoded digit",
            "GET /v1/sequences/%31 HTTP/1.1\r\nHost: x\r\n\r\n".into(),
            400,
            "invalid_id",
        ),
    ];
    for (what, request, status, kind) in &cases {
        let mut s = raw(server.addr);
        s.write_all(request.as_bytes()).unwrap();
        let r = read_reply(&mut s).unwrap_or_else(|| panic!("{what}: no answer"));
        assert_eq!(r.status, *status, "{what}: {r:?}");
        assert_eq!(r.json()["kind"], *kind, "{what}: {r:?}");
        assert!(r.header("x-request-id").is_some(), "{what}: {}", r.head);
    }
    // Every one was counted, and nothing changed.
    assert_eq!(server.metric("kvvm_bad_requests_total"), cases.len() as u64);
    assert_eq!(server.service.live_sequences(), 1);
    // A head too large for the HTTP layer: answered by it (431) and counted.
    let mut s = raw(server.addr);
    let big = format!(
        "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(100 << 10)
    );
    let _ = s.write_all(big.as_bytes());
    if let Some(r) = read_reply(&mut s) {
        assert_eq!(r.status, 431, "{r:?}");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.metric("kvvm_http_connections_closed_total{reason=\"parse_error\"}") == 0 {
        assert!(Instant::now() < deadline, "the 431 was not counted");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}
