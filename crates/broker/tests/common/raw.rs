//! A client on a raw socket, speaking the protocol frame by frame (what a hostile client, or a
//! test that steps through the protocol, does), and a test run alone in a child process (for
//! what is process-wide: the umask, the descriptor limit).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use kvvm_broker::proto::{read_frame, write_frame, ErrorCode, Frame, PROTOCOL_VERSION};
use kvvm_broker::{Reply, Request};

/// Set in the child that runs one test alone.
pub const ALONE_ENV: &str = "KVVM_BROKER_ALONE";

/// A raw connection to the broker at `socket`; reads fail after 20 s (a failure guard: a
/// broker that never answers fails the test instead of hanging it).
pub fn connect(socket: &Path) -> UnixStream {
    let s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

/// Sends `r` and reads the answer (asks to give back that came before it are passed over).
pub fn send(s: &mut UnixStream, r: &Request) -> Reply {
    write_frame(s, r).unwrap();
    loop {
        match next(s) {
            Reply::Reclaim { .. } => {}
            answer => return answer,
        }
    }
}

/// The next message.
pub fn next(s: &mut UnixStream) -> Reply {
    match read_frame::<Reply>(s).unwrap() {
        Frame::Message(r) => r,
        other => panic!("{other:?}"),
    }
}

/// Whether the broker closed the connection (reading what it still sends first).
pub fn closed(s: &mut UnixStream) -> bool {
    let mut b = [0u8; 4096];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

/// Says hello as `tenant`.
pub fn hello(s: &mut UnixStream, tenant: &str) -> Reply {
    send(
        s,
        &Request::Hello {
            id: 1,
            tenant: tenant.into(),
            token: None,
            version: PROTOCOL_VERSION,
        },
    )
}

/// The client number of a welcome.
pub fn welcomed(r: &Reply) -> u64 {
    match r {
        Reply::Welcome { client, .. } => *client,
        other => panic!("not welcomed: {other:?}"),
    }
}

/// The error code of an answer.
pub fn code(r: &Reply) -> Option<ErrorCode> {
    match r {
        Reply::Error { code, .. } => Some(*code),
        _ => None,
    }
}

/// Asks for exactly `bytes` on `device`.
pub fn acquire(s: &mut UnixStream, device: u32, bytes: u64) -> Reply {
    send(
        s,
        &Request::Acquire {
            id: 2,
            device,
            need: bytes,
            want: bytes,
        },
    )
}

/// Gives `bytes` on `device` back.
pub fn give_back(s: &mut UnixStream, device: u32, bytes: u64) -> Reply {
    send(
        s,
        &Request::Return {
            id: 3,
            device,
            bytes,
        },
    )
}

/// Runs the test `name` of this binary alone in a child process (`ALONE_ENV` set) and
/// checks that it passed; returns whether this process is that child (then the caller runs
/// the test's body).
pub fn alone(name: &str) -> bool {
    if std::env::var_os(ALONE_ENV).is_some() {
        return true;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(ALONE_ENV, "1")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{name} alone: {text}"
    );
    false
}
