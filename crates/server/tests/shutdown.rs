//! The shutdown deadline: with a stalled upload in flight, a half-sent request head and an
//! idle keep-alive connection, stopping the server answers 503 `shutting_down` to a new
//! request on the open connection, closes what remains at the deadline, releases every
//! sequence, and leaves the simulated driver's ledger empty. A client that reset its
//! connection while its request was handled leaves nothing in flight: the next shutdown does
//! not wait for it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{closed_within, raw, read_reply, reset, wait_until, Gate, TestServer};
use kvvm::hal::decorate::FaultInjecting;
use kvvm::hal::Operation;
use kvvm::sim::SimBackend;
use kvvm::VirtualMemoryBackend;
use kvvm_server::HttpConfig;

#[test]
fn a_stalled_client_cannot_hold_the_shutdown_past_its_deadline() {
    let deadline = Duration::from_secs(2);
    let sim = Arc::new(SimBackend::h200());
    let mut c = common::config(&sim, None);
    c.layout = kvvm::kv::KvLayout::TokenMajor;
    let mut server = TestServer::start_http(
        sim,
        c,
        HttpConfig {
            shutdown_timeout: deadline,
            body_timeout: Duration::from_secs(120),
            header_timeout: Duration::from_secs(120),
            keep_alive_timeout: Duration::from_secs(120),
            ..HttpConfig::default()
        },
    );
    // Two sequences sharing a prefix, live at shutdown.
    let ids: Vec<String> = (0..40).map(|i| i.to_string()).collect();
    let body = format!(r#"{{"token_ids": [{}]}}"#, ids.join(","));
    assert_eq!(server.post("/v1/sequences", &body).status, 201);
    assert_eq!(server.post("/v1/sequences", &body).status, 201);
    // An upload stalled in flight, a head never finished, a keep-alive connection.
    let mut upload = raw(server.addr);
    upload
        .write_all(
            b"POST /v1/sequences HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 1000\r\n\r\n{\"prompt",
        )
        .unwrap();
    let mut partial = raw(server.addr);
    partial.write_all(b"GET /healthz HTTP/1.1\r\nHo").unwrap();
    let mut idle = raw(server.addr);
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    assert_eq!(read_reply(&mut idle).unwrap().status, 200);
    let wait = Instant::now() + Duration::from_secs(20);
    while server.metric("kvvm_http_requests_in_flight") < 2 {
        // The upload, and this very /metrics request.
        assert!(
            Instant::now() < wait,
            "the upload never reached its handler"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    let start = Instant::now();
    server.stop();
    // While the upload holds the drain, a new request on the open connection: 503.
    let mut seen = None;
    while start.elapsed() < deadline {
        if idle
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .is_err()
        {
            break;
        }
        match read_reply(&mut idle) {
            Some(r) if r.status == 503 => {
                seen = Some(r);
                break;
            }
            Some(_) => std::thread::sleep(Duration::from_millis(20)),
            None => break,
        }
    }
    let r = seen.expect("no 503 seen on the open connection while draining");
    assert_eq!(r.json()["kind"], "shutting_down");
    assert_eq!(r.header("connection").as_deref(), Some("close"));
    assert!(closed_within(&mut partial, Duration::from_secs(10)));
    let (report, sim, service) = server.join();
    let took = start.elapsed();
    println!("stopped in {took:?}: {report:?}");
    assert!(took < deadline + Duration::from_secs(8), "{took:?}");
    assert!(closed_within(&mut upload, Duration::from_secs(5)));
    assert_eq!(report.sequences, 2);
    assert!(report.abandoned_connections >= 1, "{report:?}");
    assert_eq!(report.held_bytes, 0);
    // 40 tokens, 16 a window: two shared windows (the 32-token prefix) counted once, and
    // each sequence's own third window.
    assert_eq!(report.released_bytes, 4 * common::MIB2, "{report:?}");
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    assert_eq!(service.governor().snapshot().used(), 0);
    assert_eq!(service.manager().accounting_errors(), 0);
}

/// A create held inside its driver call (deterministically, by a gate on `reserve`) whose
/// client resets the connection: hyper drops the request's future before it completes. The
/// in-flight gauge must still come back down, and a shutdown with nothing in flight must not
/// wait for its deadline.
#[test]
fn a_client_reset_mid_request_leaves_nothing_in_flight_and_shutdown_does_not_wait() {
    let deadline = Duration::from_secs(30);
    let sim = Arc::new(SimBackend::h200());
    let injector = Arc::new(FaultInjecting::new(sim.clone()));
    let gate = Gate::new();
    injector.set_hook(Some(gate.hook(Operation::Reserve)));
    let backend: Arc<dyn VirtualMemoryBackend> = injector;
    let mut server = TestServer::start_http(
        sim,
        common::config_over(backend, None),
        HttpConfig {
            shutdown_timeout: deadline,
            ..HttpConfig::default()
        },
    );
    let _open = gate.opens_on_drop();
    gate.arm();
    let mut client = raw(server.addr);
    let body = r#"{"prompt_tokens": 16}"#;
    write!(
        client,
        "POST /v1/sequences HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // The create is now inside the driver's reserve, and stays there until the gate opens.
    gate.wait_for_call(Duration::from_secs(30));
    // The held create, and this /metrics request itself.
    assert_eq!(server.metric("kvvm_http_requests_in_flight"), 2);
    reset(client);
    wait_until(
        Duration::from_secs(20),
        "the reset request still counted in flight",
        || server.metric("kvvm_http_requests_in_flight") == 1,
    );
    // The blocking operation itself runs to its end: the sequence exists, nobody knows its id
    // (released at shutdown here, or by the idle timeout).
    gate.open();
    wait_until(
        Duration::from_secs(20),
        "the held create never ended",
        || server.service.live_sequences() == 1,
    );

    let start = Instant::now();
    server.stop();
    let (report, sim, service) = server.join();
    let took = start.elapsed();
    println!("stopped in {took:?}: {report:?}");
    // Nothing is in flight: the drain has nothing to wait for (milliseconds; the bound is a
    // third of the deadline it used to wait out).
    assert!(took < deadline / 3, "the shutdown waited {took:?}");
    assert_eq!(report.sequences, 1);
    assert_eq!(report.abandoned_connections, 0);
    assert_eq!(report.held_bytes, 0);
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    assert_eq!(service.manager().accounting_errors(), 0);
}
