//! Clients that break the protocol, on raw sockets: every message is checked, a client can
//! only return what it holds, and nothing a hostile client sends changes another's books;
//! and what the broker's metrics file says of clients that come and go.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use common::socket;
use kvvm_broker::proto::{read_frame, write_frame, ErrorCode, Frame, PROTOCOL_VERSION};
use kvvm_broker::{Broker, BrokerConfig, Reply, Request, TenantPolicy};
use kvvm_governor::ManualClock;

fn raw(broker: &Broker) -> UnixStream {
    let s = UnixStream::connect(&broker.config().socket).unwrap();
    // A failure guard: a broker that never answers fails the test instead of hanging it.
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

fn send(s: &mut UnixStream, r: &Request) -> Reply {
    write_frame(s, r).unwrap();
    next(s)
}

fn next(s: &mut UnixStream) -> Reply {
    match read_frame::<Reply>(s).unwrap() {
        Frame::Message(r) => r,
        other => panic!("{other:?}"),
    }
}

fn closed(s: &mut UnixStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

fn hello(s: &mut UnixStream, tenant: &str, token: Option<&str>) -> Reply {
    send(
        s,
        &Request::Hello {
            id: 1,
            tenant: tenant.into(),
            token: token.map(Into::into),
            version: PROTOCOL_VERSION,
        },
    )
}

fn code(r: &Reply) -> Option<ErrorCode> {
    match r {
        Reply::Error { code, .. } => Some(*code),
        _ => None,
    }
}

fn acquire(s: &mut UnixStream, bytes: u64) -> Reply {
    send(
        s,
        &Request::Acquire {
            id: 2,
            device: 0,
            need: bytes,
            want: bytes,
        },
    )
}

#[test]
fn requests_before_hello_and_malformed_frames_close_the_connection() {
    let broker = Broker::start(BrokerConfig::new(socket("order"), 1000)).unwrap();
    let mut s = raw(&broker);
    let r = acquire(&mut s, 10);
    assert_eq!(code(&r), Some(ErrorCode::Invalid));
    assert!(closed(&mut s));
    let mut s = raw(&broker);
    s.write_all(&5u32.to_le_bytes()).unwrap();
    s.write_all(b"nope!").unwrap();
    assert_eq!(code(&next(&mut s)), Some(ErrorCode::Invalid));
    assert!(closed(&mut s));
    let mut s = raw(&broker);
    s.write_all(&u32::MAX.to_le_bytes()).unwrap();
    assert!(closed(&mut s), "an oversized frame is never read");
    let mut s = raw(&broker);
    assert!(matches!(hello(&mut s, "a", None), Reply::Welcome { .. }));
    assert_eq!(code(&hello(&mut s, "a", None)), Some(ErrorCode::Invalid));
    assert!(closed(&mut s));
    assert_eq!(
        code(&hello(&mut raw(&broker), "../x", None)),
        Some(ErrorCode::Invalid)
    );
    assert_eq!(broker.total_held(0), 0);
}

#[test]
fn a_client_returns_only_what_it_holds_and_never_another_tenants_bytes() {
    let broker = Broker::start(BrokerConfig::new(socket("steal"), 1000)).unwrap();
    let mut victim = raw(&broker);
    hello(&mut victim, "victim", None);
    assert!(matches!(
        acquire(&mut victim, 600),
        Reply::Held { held: 600, .. }
    ));
    let mut thief = raw(&broker);
    hello(&mut thief, "thief", None);
    for bytes in [1, 600, u64::MAX] {
        let r = send(
            &mut thief,
            &Request::Return {
                id: 3,
                device: 0,
                bytes,
            },
        );
        assert_eq!(code(&r), Some(ErrorCode::NotHeld));
    }
    let r = send(
        &mut thief,
        &Request::Claim {
            id: 4,
            device: 0,
            bytes: u64::MAX,
        },
    );
    assert_eq!(
        code(&r),
        Some(ErrorCode::NotHeld),
        "no claim over the ceiling"
    );
    let r = acquire(&mut thief, u64::MAX);
    assert!(matches!(r, Reply::Refused { .. }), "{r:?}");
    assert!(matches!(
        acquire(&mut thief, 400),
        Reply::Held { held: 400, .. }
    ));
    let r = send(
        &mut thief,
        &Request::Claim {
            id: 5,
            device: 0,
            bytes: 1,
        },
    );
    assert_eq!(
        code(&r),
        Some(ErrorCode::NotHeld),
        "no claim on a device in use"
    );
    let mut holdings = broker.holdings();
    holdings.sort_unstable();
    assert_eq!(holdings, vec![(1, 0, 600), (2, 0, 400)]);
    drop(thief);
    let r = send(
        &mut victim,
        &Request::Return {
            id: 6,
            device: 0,
            bytes: 600,
        },
    );
    assert!(matches!(r, Reply::Held { held: 0, .. }));
}

#[test]
fn tokens_tenants_client_count_and_rate_are_enforced() {
    let clock = Arc::new(ManualClock::new());
    let mut config = BrokerConfig::new(socket("limits"), 1000).tenant(
        "secret",
        TenantPolicy {
            token: Some("s3cret".into()),
            ..TenantPolicy::default()
        },
    );
    config.default_tenant = None;
    config.max_clients = 2;
    config.burst = 3;
    config.messages_per_second = 1;
    config.clock = clock.clone();
    let broker = Broker::start(config).unwrap();
    assert_eq!(
        code(&hello(&mut raw(&broker), "secret", Some("3scret"))),
        Some(ErrorCode::Unauthorized),
        "two bytes swapped: their differences do not cancel"
    );
    assert_eq!(
        code(&hello(&mut raw(&broker), "secret", Some("guess"))),
        Some(ErrorCode::Unauthorized)
    );
    assert_eq!(
        code(&hello(&mut raw(&broker), "secret", None)),
        Some(ErrorCode::Unauthorized)
    );
    assert_eq!(
        code(&hello(&mut raw(&broker), "other", None)),
        Some(ErrorCode::Unauthorized)
    );
    let mut a = raw(&broker);
    assert!(matches!(
        hello(&mut a, "secret", Some("s3cret")),
        Reply::Welcome { .. }
    ));
    let mut b = raw(&broker);
    assert!(matches!(
        hello(&mut b, "secret", Some("s3cret")),
        Reply::Welcome { .. }
    ));
    let mut c = raw(&broker);
    assert_eq!(code(&next(&mut c)), Some(ErrorCode::TooManyClients));
    assert!(closed(&mut c));
    // a's hello took one of its 3 tokens: two more pass, the next is dropped.
    assert!(matches!(acquire(&mut a, 1), Reply::Held { .. }));
    assert!(matches!(acquire(&mut a, 1), Reply::Held { .. }));
    assert_eq!(code(&acquire(&mut a, 1)), Some(ErrorCode::RateLimited));
    assert_eq!(broker.total_held(0), 2, "the dropped message did nothing");
    clock.advance(Duration::from_secs(1));
    assert!(matches!(acquire(&mut a, 1), Reply::Held { held: 3, .. }));
}

#[test]
fn a_tenant_with_a_list_of_users_admits_only_their_processes() {
    // SAFETY: geteuid cannot fail and touches no memory.
    let me = unsafe { libc::geteuid() };
    let mut config = BrokerConfig::new(socket("users"), 1000)
        .tenant(
            "mine",
            TenantPolicy {
                users: Some(vec![me]),
                ..TenantPolicy::default()
            },
        )
        .tenant(
            "theirs",
            TenantPolicy {
                users: Some(vec![me.wrapping_add(1)]),
                ..TenantPolicy::default()
            },
        );
    config.default_tenant = None;
    let broker = Broker::start(config).unwrap();
    let mut theirs = raw(&broker);
    let refused = hello(&mut theirs, "theirs", None);
    assert_eq!(code(&refused), Some(ErrorCode::Unauthorized));
    // The same answer as for a tenant that does not exist: nothing to probe.
    let unknown = hello(&mut raw(&broker), "nobody", None);
    assert_eq!(format!("{refused:?}"), format!("{unknown:?}"));
    assert!(closed(&mut theirs));
    assert!(matches!(
        hello(&mut raw(&broker), "mine", None),
        Reply::Welcome { .. }
    ));
}

#[test]
fn the_metrics_file_is_written_at_start_and_once_more_at_stop() {
    let file =
        std::env::temp_dir().join(format!("kvvm-broker-{}-metrics.prom", std::process::id()));
    let mut config = BrokerConfig::new(socket("metrics"), 1000);
    config.metrics_file = Some(file.clone());
    config.metrics_interval = Duration::from_secs(3600); // no periodic write in this test
    let mut broker = Broker::start(config).unwrap();
    let at_start = std::fs::read_to_string(&file).unwrap();
    assert!(
        at_start.lines().any(|l| l == "kvvm_broker_clients 0"),
        "{at_start}"
    );
    let mut a = raw(&broker);
    assert!(matches!(hello(&mut a, "a", None), Reply::Welcome { .. }));
    assert!(matches!(
        acquire(&mut a, 600),
        Reply::Held { granted: 600, .. }
    ));
    let mut b = raw(&broker);
    assert!(matches!(hello(&mut b, "b", None), Reply::Welcome { .. }));
    assert!(matches!(acquire(&mut b, 500), Reply::Refused { .. }));
    let now = broker.metrics();
    assert_eq!(now.held.get(&("a".to_owned(), 0)), Some(&600));
    assert_eq!((now.counters.grants, now.counters.backpressure), (1, 1));
    broker.stop();
    let at_stop = std::fs::read_to_string(&file).unwrap();
    for line in [
        "kvvm_broker_clients 0",
        "kvvm_broker_clients_dropped_total 2",
        "kvvm_broker_grants_total 1",
        "kvvm_broker_granted_bytes_total 600",
        "kvvm_broker_refusals_total{kind=\"backpressure\"} 1",
        "kvvm_broker_returned_bytes_total 600",
    ] {
        assert!(
            at_stop.lines().any(|l| l == line),
            "{line} missing from\n{at_stop}"
        );
    }
    assert!(
        !at_stop.contains("held_bytes{"),
        "nobody holds anything: {at_stop}"
    );
    let mut tmp = file.as_os_str().to_owned();
    tmp.push(".tmp");
    assert!(
        !std::path::Path::new(&tmp).exists(),
        "written beside, then renamed over"
    );
    std::fs::remove_file(&file).unwrap();
}

#[test]
fn prefix_requests_are_checked_against_the_clients_books() {
    let broker = Broker::start(BrokerConfig::new(socket("prefix-hostile"), 1000)).unwrap();
    let mut s = raw(&broker);
    hello(&mut s, "t", None);
    let r = send(
        &mut s,
        &Request::Open {
            id: 2,
            key: "nothing".into(),
        },
    );
    assert_eq!(code(&r), Some(ErrorCode::NotHeld), "no such prefix");
    let r = send(
        &mut s,
        &Request::Close {
            id: 3,
            key: "nothing".into(),
        },
    );
    assert_eq!(code(&r), Some(ErrorCode::NotHeld), "not a user");
    let publish = Request::Publish {
        id: 4,
        device: 0,
        key: "p".into(),
        sizes: vec![1, 1],
        meta: String::new(),
    };
    let r = send(&mut s, &publish);
    assert_eq!(
        code(&r),
        Some(ErrorCode::Invalid),
        "sizes without descriptors"
    );
    assert!(closed(&mut s));

    let client = kvvm_broker::BrokerClient::connect(kvvm_broker::ClientOptions::new(
        &broker.config().socket,
        "t",
    ))
    .unwrap();
    let file = common::memfd(10);
    let one = common::memfd(1);
    use std::os::fd::AsFd;
    let r = client.publish_prefix(0, "p", &[(file.as_fd(), 10)], "");
    assert!(r.is_err(), "publishing bytes it does not hold");
    assert!(broker.prefixes().is_empty());
    let bad = kvvm_broker::BrokerClient::connect(kvvm_broker::ClientOptions::new(
        &broker.config().socket,
        "t",
    ))
    .unwrap();
    assert_eq!(bad.acquire_bytes(0, 10, 10), Ok(10));
    for meta in [
        "line\nbreak".to_owned(),
        "x".repeat(kvvm_broker::proto::MAX_META + 1),
    ] {
        let r = bad.publish_prefix(0, "q", &[(file.as_fd(), 10)], &meta);
        assert!(r.is_err(), "meta {:?}... refused", &meta[..4]);
    }
    assert!(broker.prefixes().is_empty());
    // The bad meta closed `bad`'s connection: it came back and claimed its 10 bytes.
    bad.sync().unwrap();
    assert_eq!(bad.held(0), 10);
    let bad_id = bad.welcome().unwrap().client;
    assert!(
        broker.holdings().contains(&(bad_id, 0, 10)),
        "{:?}",
        broker.holdings()
    );
    drop(bad);
    common::wait_until(&broker, "bad's socket closed", |b| b.clients() == 1);
    assert_eq!(client.acquire_bytes(0, 10, 10), Ok(10));
    client
        .publish_prefix(
            0,
            "p",
            &[(file.as_fd(), 10)],
            &"m".repeat(kvvm_broker::proto::MAX_META),
        )
        .unwrap();
    assert!(
        client
            .publish_prefix(0, "p", &[(one.as_fd(), 1)], "")
            .is_err(),
        "a second p"
    );
    assert_eq!(client.held(0), 0);
    assert_eq!(broker.total_held(0), 10, "billed once, to the prefix");
    assert_eq!(client.close_prefix("p").unwrap(), 0);
    assert_eq!(broker.total_held(0), 0);
}

#[test]
fn a_client_tries_a_request_once_more_on_a_new_connection_and_then_gives_up() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let path = socket("drops-requests");
    let _ = std::fs::remove_file(&path);
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let requests = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&requests);
    // Not a broker: it welcomes every client and hangs up on its first request.
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { return };
            let seen = Arc::clone(&seen);
            std::thread::spawn(move || {
                let hello = read_frame::<Request>(&mut s);
                if !matches!(hello, Ok(Frame::Message(Request::Hello { .. }))) {
                    return;
                }
                let welcome = Reply::Welcome {
                    id: 1,
                    client: 1,
                    floor: 0,
                    ceiling: 100,
                    budget: 100,
                    idle_ms: 0,
                };
                if write_frame(&mut s, &welcome).is_ok()
                    && matches!(read_frame::<Request>(&mut s), Ok(Frame::Message(_)))
                {
                    seen.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
    });
    let client =
        kvvm_broker::BrokerClient::connect(kvvm_broker::ClientOptions::new(&path, "t")).unwrap();
    assert!(client.acquire_bytes(0, 1, 1).is_err(), "no answer came");
    assert_eq!(
        requests.load(Ordering::SeqCst),
        2,
        "the request, and once more on a new connection"
    );
    drop(client);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_client_whose_broker_turns_it_away_tries_again_less_and_less_often() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let path = socket("turns-away");
    let _ = std::fs::remove_file(&path);
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let tries = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&tries);
    let first = Arc::new(std::sync::Barrier::new(2));
    let welcomed = Arc::clone(&first);
    // Not a broker: it welcomes the first connection and cuts it, then hangs up on every hello.
    std::thread::spawn(move || {
        for (n, s) in listener.incoming().enumerate() {
            let Ok(mut s) = s else { return };
            if n > 0 {
                seen.fetch_add(1, Ordering::SeqCst);
                continue;
            }
            drop(read_frame::<Request>(&mut s));
            let welcome = Reply::Welcome {
                id: 1,
                client: 1,
                floor: 0,
                ceiling: 100,
                budget: 100,
                idle_ms: 0,
            };
            write_frame(&mut s, &welcome).unwrap();
            welcomed.wait();
        }
    });
    let client =
        kvvm_broker::BrokerClient::connect(kvvm_broker::ClientOptions::new(&path, "t")).unwrap();
    first.wait(); // the connection is cut: the client tries again, and again
    std::thread::sleep(Duration::from_millis(500));
    let n = tries.load(Ordering::SeqCst);
    assert!(
        (3..=40).contains(&n),
        "{n} tries in 500 ms: a pause growing from 2 ms between them"
    );
    drop(client);
    let _ = std::fs::remove_file(&path);
}
