//! The broker's defences against a client that would lock others out or make it grow: books
//! that forget what comes and goes, slots per user that idle and half-finished connections
//! give back after their deadline, closed connections that give their slot back at once,
//! descriptors checked at publish, a rate limit that never drops a return, devices bounded.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use common::raw::{acquire, closed, code, connect, give_back, hello, next, send, welcomed};
use common::{memfd, socket, wait_until};
use kvvm_broker::fdpass::send_with_fds;
use kvvm_broker::proto::{encode_frame, ErrorCode};
use kvvm_broker::{Broker, BrokerClient, BrokerConfig, ClientOptions, Reply, Request};
use kvvm_governor::ManualClock;

#[test]
fn twenty_thousand_one_shot_hellos_leave_the_books_as_they_were() {
    let broker = Broker::start(BrokerConfig::new(socket("one-shot"), 1000)).unwrap();
    let mut honest = connect(&broker.config().socket);
    welcomed(&hello(&mut honest, "honest"));
    assert!(matches!(acquire(&mut honest, 0, 100), Reply::Held { .. }));
    let before = broker.book_entries();
    for i in 0..20_000u32 {
        let mut s = connect(&broker.config().socket);
        welcomed(&hello(&mut s, &format!("t{i}")));
        if i % 4 == 0 {
            // A grant given back on a device of its own, a return of nothing on another.
            assert!(matches!(acquire(&mut s, i % 64, 1), Reply::Held { .. }));
            assert!(matches!(
                give_back(&mut s, i % 64, 1),
                Reply::Held { held: 0, .. }
            ));
            assert!(matches!(
                give_back(&mut s, 63 - i % 64, 0),
                Reply::Held { .. }
            ));
        }
    }
    wait_until(&broker, "every one-shot client is gone", |b| {
        b.clients() == 1
    });
    let after = broker.book_entries();
    assert_eq!(
        (after.tenants, after.clients, after.prefixes),
        (before.tenants, before.clients, before.prefixes),
        "{before:?} then {after:?}"
    );
    // What may be new: the give-back history of the 64 devices, nothing per tenant or client.
    assert!(
        after.devices <= before.devices + 64,
        "{before:?} then {after:?}"
    );
    assert_eq!(broker.metrics().tenants, 1);
    let r = acquire(&mut honest, 64, 1);
    assert!(
        matches!(&r, Reply::Refused { .. }),
        "a device past those budgeted never fits: {r:?}"
    );
    assert_eq!(
        code(&give_back(&mut honest, u32::MAX, 1)),
        Some(ErrorCode::NotHeld)
    );
    assert_eq!(
        broker.book_entries(),
        after,
        "refusals leave nothing behind"
    );
}

fn small_broker(name: &str) -> Broker {
    let mut config = BrokerConfig::new(socket(name), 1000);
    config.max_clients = 8;
    config.max_clients_per_user = 3;
    config.hello_timeout = Duration::from_millis(300);
    config.idle_timeout = Duration::from_millis(400);
    Broker::start(config).unwrap()
}

#[test]
fn idle_and_half_frame_connections_are_dropped_after_their_deadline_and_an_honest_client_gets_in() {
    let broker = small_broker("deadlines");
    let path = broker.config().socket.clone();
    // The attacker takes every slot its user (also the test's and the honest client's) has:
    // a connection that says nothing, one that sends half a frame, one that registers and
    // falls silent.
    let mut idle = connect(&path);
    let mut half = connect(&path);
    half.write_all(&[200, 0]).unwrap();
    let mut silent = connect(&path);
    welcomed(&hello(&mut silent, "attacker"));
    let mut refused = connect(&path);
    let r = next(&mut refused);
    assert_eq!(code(&r), Some(ErrorCode::TooManyClients), "{r:?}");
    assert!(format!("{r:?}").contains("of one user"), "{r:?}");
    for (what, s) in [
        ("idle", &mut idle),
        ("half", &mut half),
        ("silent", &mut silent),
    ] {
        let last = next(s);
        assert!(format!("{last:?}").contains("in time"), "{what}: {last:?}");
        assert!(closed(s), "{what} is dropped after its deadline");
    }
    wait_until(&broker, "the dropped connections' slots are free", |b| {
        b.connections() == 0
    });
    let counters = broker.metrics().counters;
    assert_eq!(
        (counters.connections_timed_out, counters.connections_refused),
        (3, 1)
    );
    let honest = BrokerClient::connect(ClientOptions::new(&path, "honest"))
        .expect("the honest client gets in");
    assert_eq!(honest.acquire_bytes(0, 10, 10), Ok(10));
    // Time passes (several idle timeouts): the honest client pings and stays.
    let id = honest.welcome().unwrap().client;
    std::thread::sleep(Duration::from_millis(1500));
    honest.sync().unwrap();
    assert_eq!(
        honest.welcome().unwrap().client,
        id,
        "never dropped, never re-registered"
    );
    assert_eq!(broker.metrics().counters.connections_timed_out, 3);
    assert!(broker.holdings().contains(&(id, 0, 10)));
}

#[test]
fn a_closed_connection_gives_its_slot_back_at_once() {
    // Alone in a process: a child that another test of this binary spawns holds a copy of
    // every descriptor of the process from its fork to its exec, the client ends dropped
    // below included; those connections are then still open, and rightly counted.
    if !common::raw::alone("a_closed_connection_gives_its_slot_back_at_once") {
        return;
    }
    let broker = small_broker("dead-slots");
    let path = broker.config().socket.clone();
    for round in 0..200 {
        let full: Vec<UnixStream> = (0..3).map(|_| connect(&path)).collect();
        drop(full);
        let mut honest = connect(&path);
        let r = hello(&mut honest, "honest");
        assert!(
            matches!(r, Reply::Welcome { .. }),
            "round {round}: closed connections still counted: {r:?}"
        );
    }
}

#[test]
fn a_publish_carries_only_exported_memory_and_a_client_cannot_keep_itself_alive() {
    let broker = Broker::start(BrokerConfig::new(socket("self-publish"), 1000)).unwrap();
    let mut s = connect(&broker.config().socket);
    welcomed(&hello(&mut s, "t"));
    assert!(matches!(acquire(&mut s, 0, 10), Reply::Held { .. }));
    let publish = |key: &str, size: u64| Request::Publish {
        id: 4,
        device: 0,
        key: key.into(),
        sizes: vec![size],
        meta: String::new(),
    };
    // Its own connection: were the broker to keep it, the socket would never close.
    let own = s.try_clone().unwrap();
    let unsealed_size = memfd(10);
    for (fd, size) in [(own.as_fd(), 10), (unsealed_size.as_fd(), 9)] {
        send_with_fds(&s, &encode_frame(&publish("p", size)).unwrap(), &[fd]).unwrap();
        let r = next(&mut s);
        assert_eq!(code(&r), Some(ErrorCode::BadDescriptor), "{r:?}");
    }
    drop(own);
    assert!(broker.prefixes().is_empty());
    let good = memfd(10);
    send_with_fds(
        &s,
        &encode_frame(&publish("p", 10)).unwrap(),
        &[good.as_fd()],
    )
    .unwrap();
    assert!(
        matches!(next(&mut s), Reply::Held { held: 0, .. }),
        "the connection stayed"
    );
    assert_eq!(broker.prefixes().len(), 1);
    drop(s);
    wait_until(
        &broker,
        "the client, its lease and its prefix are gone",
        |b| b.clients() == 0 && b.total_held(0) == 0 && b.prefixes().is_empty(),
    );
    assert_eq!(broker.connections(), 0, "its slot too");
}

#[test]
fn a_return_over_the_rate_limit_is_applied_and_the_books_agree() {
    let clock = Arc::new(ManualClock::new());
    let mut config = BrokerConfig::new(socket("rate-return"), 1000);
    config.burst = 2;
    config.messages_per_second = 1;
    config.clock = clock.clone();
    let broker = Broker::start(config).unwrap();
    let client = BrokerClient::connect(ClientOptions::new(&broker.config().socket, "t")).unwrap();
    // The hello and the acquire take both tokens.
    assert_eq!(client.acquire_bytes(0, 100, 100), Ok(100));
    client.return_bytes(0, 10);
    assert_eq!(client.held(0), 90, "off the client's books at once");
    // A barrier, itself over the rate: its answer comes once the return was read.
    assert!(client.sync().is_err(), "the ping is dropped");
    clock.advance(Duration::from_secs(10));
    client.sync().unwrap();
    let id = client.welcome().unwrap().client;
    assert_eq!(broker.holdings(), vec![(id, 0, 90)], "and off the broker's");
    let mut s = connect(&broker.config().socket);
    welcomed(&hello(&mut s, "u"));
    let r = acquire(&mut s, 0, 1);
    assert!(matches!(r, Reply::Held { .. }), "{r:?}");
    assert_eq!(
        code(&send(&mut s, &Request::Ping { id: 9 })),
        Some(ErrorCode::RateLimited)
    );
}

/// The events inotify reported on a folder: (mask, name).
fn folder_events(fd: i32) -> Vec<(u32, String)> {
    let mut events = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        // SAFETY: `buf` is writable for its length; the descriptor is inotify's.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        let Ok(n) = usize::try_from(n) else { break };
        if n == 0 {
            break;
        }
        let mut at = 0;
        while at + 16 <= n {
            let word = |i: usize| u32::from_ne_bytes(buf[at + i..at + i + 4].try_into().unwrap());
            let (mask, len) = (word(4), word(12) as usize);
            let name = &buf[at + 16..at + 16 + len];
            let name = String::from_utf8_lossy(name)
                .trim_end_matches('\0')
                .to_owned();
            events.push((mask, name));
            at += 16 + len;
        }
    }
    events
}

#[test]
fn under_umask_000_the_socket_has_its_final_mode_from_the_moment_it_appears() {
    if !common::raw::alone(
        "under_umask_000_the_socket_has_its_final_mode_from_the_moment_it_appears",
    ) {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("kvvm-broker-umask-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // SAFETY: umask only sets the process's mask (this process runs this test alone).
    unsafe { libc::umask(0) };
    // SAFETY: inotify_init1 makes a descriptor we own; the flags are its own.
    let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
    assert!(fd >= 0);
    let c_dir = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    let mask = libc::IN_CREATE | libc::IN_MOVED_TO | libc::IN_ATTRIB;
    // SAFETY: the path is a valid C string; the descriptor is inotify's.
    assert!(unsafe { libc::inotify_add_watch(fd, c_dir.as_ptr(), mask) } >= 0);
    let path = dir.join("b.sock");
    let broker = Broker::start(BrokerConfig::new(&path, 1000)).unwrap();
    let all = folder_events(fd);
    assert!(
        all.iter().any(|(mask, name)| mask & libc::IN_CREATE != 0
            && mask & libc::IN_ISDIR != 0
            && name.starts_with(".kvvm")),
        "bound in a private folder beside it: {all:?}"
    );
    let events: Vec<(u32, String)> = all
        .into_iter()
        .filter(|(_, name)| name == "b.sock")
        .collect();
    assert_eq!(
        events,
        vec![(libc::IN_MOVED_TO, "b.sock".to_owned())],
        "the socket appears by a rename, already with its mode, and is never changed after"
    );
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o7777, 0o600);
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        left,
        vec![std::ffi::OsString::from("b.sock")],
        "no private folder left behind"
    );
    drop(broker);
    // SAFETY: closes the inotify descriptor we own.
    unsafe { libc::close(fd) };
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn accept_backs_off_while_descriptors_run_out_and_serves_once_they_are_back() {
    if !common::raw::alone(
        "accept_backs_off_while_descriptors_run_out_and_serves_once_they_are_back",
    ) {
        return;
    }
    let broker = Broker::start(BrokerConfig::new(socket("emfile"), 1000)).unwrap();
    let low = libc::rlimit {
        rlim_cur: 256,
        rlim_max: 256,
    };
    // SAFETY: a valid rlimit; lowering the limit is always allowed.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
    let null = std::fs::File::open("/dev/null").unwrap();
    let mut fillers = Vec::new();
    while let Ok(f) = null.try_clone() {
        fillers.push(f);
    }
    fillers.pop(); // one free: for the client's socket, none for the broker's accept
    let mut s = UnixStream::connect(&broker.config().socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    // The connection waits in the queue while accept fails: let that go on for a while.
    std::thread::sleep(Duration::from_millis(400));
    let failures = broker.metrics().counters.accept_failures;
    assert!(
        (1..=40).contains(&failures),
        "{failures} tries in 400 ms: a pause after each, not a spin"
    );
    drop(fillers);
    welcomed(&hello(&mut s, "t"));
}

#[test]
fn a_socket_and_a_metrics_file_named_without_a_folder_live_in_the_working_folder() {
    if !common::raw::alone(
        "a_socket_and_a_metrics_file_named_without_a_folder_live_in_the_working_folder",
    ) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("kvvm-broker-cwd-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // This process runs this test alone: its working folder is its own.
    std::env::set_current_dir(&dir).unwrap();
    let mut config = BrokerConfig::new("b.sock", 1000);
    config.metrics_file = Some("m.prom".into());
    let broker = Broker::start(config).unwrap();
    assert!(dir.join("b.sock").exists() && dir.join("m.prom").exists());
    let mut s = connect(std::path::Path::new("b.sock"));
    welcomed(&hello(&mut s, "t"));
    drop(s);
    drop(broker);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_broker_leaves_a_file_at_its_socket_s_path_alone() {
    let path = socket("a-file");
    std::fs::write(&path, "keep me").unwrap();
    let e = Broker::start(BrokerConfig::new(&path, 1000)).unwrap_err();
    assert!(e.to_string().contains("a regular file"), "{e}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "keep me");
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn starting_raises_the_descriptor_limit_to_the_hard_limit() {
    if !common::raw::alone("starting_raises_the_descriptor_limit_to_the_hard_limit") {
        return;
    }
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit to fill.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    let low = libc::rlimit {
        rlim_cur: 64,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: a valid rlimit; lowering the soft limit is always allowed.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
    let broker = Broker::start(BrokerConfig::new(socket("rlimit"), 1000)).unwrap();
    let mut now = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut now) }, 0);
    assert_eq!(now.rlim_cur, lim.rlim_max);
    drop(broker);
}

#[test]
fn sigterm_is_waited_for_without_a_handler() {
    if !common::raw::alone("sigterm_is_waited_for_without_a_handler") {
        return;
    }
    kvvm_broker::signal::block_termination_signals().unwrap();
    // SAFETY: pthread_kill only sends a signal, to this thread, which has it blocked: it
    // waits (the test harness's other threads do not block it: a signal to the process
    // could be taken by one of them).
    let sent = unsafe { libc::pthread_kill(libc::pthread_self(), libc::SIGTERM) };
    assert_eq!(sent, 0);
    assert_eq!(
        kvvm_broker::signal::wait_for_termination().unwrap(),
        libc::SIGTERM
    );
}

#[test]
fn a_grant_of_nothing_leaves_no_entry_on_the_client_s_books() {
    let broker = Broker::start(BrokerConfig::new(socket("grant-nothing"), 1000)).unwrap();
    let client = BrokerClient::connect(ClientOptions::new(&broker.config().socket, "t")).unwrap();
    assert_eq!(client.acquire_bytes(3, 0, 0), Ok(0));
    assert_eq!(client.holdings(), vec![], "no device at 0");
    assert_eq!(client.acquire_bytes(3, 10, 10), Ok(10));
    assert_eq!(client.holdings(), vec![(3, 10)]);
}
