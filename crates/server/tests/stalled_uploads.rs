//! 300 connections each send most of a 1 MiB body and stall: the server's resident memory
//! stays under the documented bound (`docs/serve.md`): requests in flight (`--max-in-flight`,
//! default 64) x the body limit (1 MiB), plus a 64 KiB read buffer per connection, plus
//! slack; past the in-flight limit uploads are shed with 503 before their bodies are read.
//! In its own test binary: nothing else runs in this process while RSS is measured.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{raise_open_file_limit, rss_bytes, TestServer};
use kvvm::sim::SimBackend;
use kvvm_server::HttpConfig;

const UPLOADS: usize = 300;
const BODY: usize = 1 << 20;

#[test]
fn three_hundred_stalled_1_mib_uploads_stay_under_the_memory_bound() {
    raise_open_file_limit();
    let sim = Arc::new(SimBackend::h200());
    let c = common::config(&sim, None);
    let http = HttpConfig {
        body_timeout: Duration::from_secs(120),
        header_timeout: Duration::from_secs(120),
        keep_alive_timeout: Duration::from_secs(120),
        ..HttpConfig::default()
    };
    let bound = (http.max_in_flight * http.body_limit + UPLOADS * (64 << 10)) as u64 + (48 << 20);
    let server = TestServer::start_http(sim, c, http);
    assert_eq!(server.get("/healthz").status, 200);
    let before = rss_bytes();
    let payload = vec![b' '; BODY - 1024];
    let start = Instant::now();
    let mut conns = Vec::with_capacity(UPLOADS);
    for _ in 0..UPLOADS {
        let mut s = std::net::TcpStream::connect(server.addr).unwrap();
        // A write that cannot proceed (the server is not reading) gives up quickly.
        s.set_write_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let head = format!(
            "POST /v1/sequences HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {BODY}\r\n\r\n"
        );
        if s.write_all(head.as_bytes()).is_ok() {
            let _ = s.write_all(&payload);
        }
        conns.push(s);
        assert!(start.elapsed() < Duration::from_secs(120), "too slow");
    }
    // Let the server take in what it will.
    std::thread::sleep(Duration::from_secs(2));
    let after = rss_bytes();
    let grew = after.saturating_sub(before);
    println!(
        "{UPLOADS} stalled uploads of {BODY} bytes: RSS {} MiB -> {} MiB (+{} MiB; bound +{} MiB)",
        before >> 20,
        after >> 20,
        grew >> 20,
        bound >> 20
    );
    assert!(before > 0, "no /proc/self/status");
    assert!(
        grew < bound,
        "RSS grew by {grew} bytes, over the bound of {bound}"
    );
    // The server still answers its probe, and sheds new work at once (no queue, no hang).
    assert_eq!(server.get("/healthz").status, 200);
    let r = server.post("/v1/sequences", r#"{"prompt_tokens": 1}"#);
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["kind"], "overloaded");
    assert_eq!(r.retry_after.as_deref(), Some("1"));
    drop(conns);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}
