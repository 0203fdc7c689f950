//! 2,000 idle connections (each opened and silent) do not keep a new client waiting: its
//! `/healthz` is answered within 1 s. The process's soft open-file limit is raised to the
//! hard one first (client and server ends share it here).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{raise_open_file_limit, raw, read_reply, TestServer};
use kvvm::sim::SimBackend;
use kvvm_server::HttpConfig;

const IDLE: usize = 2000;

#[test]
fn a_new_client_is_answered_within_a_second_with_2000_idle_connections_open() {
    let limit = raise_open_file_limit();
    // Both ends of each connection live in this process, plus the test harness's own.
    assert!(
        limit >= 2 * IDLE as u64 + 256,
        "the open-file limit ({limit}) is too low for {IDLE} loopback connections"
    );
    let sim = Arc::new(SimBackend::h200());
    let c = common::config(&sim, None);
    let server = TestServer::start_http(
        sim,
        c,
        HttpConfig {
            keep_alive_timeout: Duration::from_secs(120),
            header_timeout: Duration::from_secs(120),
            ..HttpConfig::default()
        },
    );
    let idle: Vec<_> = (0..IDLE).map(|_| raw(server.addr)).collect();
    // Wait until the server has accepted them all (bounded).
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.metric("kvvm_http_connections_open") < IDLE as u64 {
        assert!(
            Instant::now() < deadline,
            "the server did not accept them all"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // A new client, timed from its connect to the end of the answer: best of three, each
    // under 1 s (one slow scheduling blip on a loaded machine is not the server hanging).
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let start = Instant::now();
        let mut s = raw(server.addr);
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let r = read_reply(&mut s).expect("an answer");
        assert_eq!(r.status, 200, "{r:?}");
        best = best.min(start.elapsed());
    }
    println!("/healthz with {IDLE} idle connections open: {best:?}");
    assert!(best < Duration::from_secs(1), "{best:?}");
    assert!(server.metric("kvvm_http_connections_open") >= IDLE as u64);
    drop(idle);
    let (_, sim, _) = server.shutdown();
    assert!(sim.ledger().is_empty());
}
