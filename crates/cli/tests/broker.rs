//! `kvvm broker` as a daemon: serves a client, and on SIGTERM tells it, removes its socket
//! and exits 0.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Read};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use kvvm::broker::proto::{read_frame, write_frame, Frame, PROTOCOL_VERSION};
use kvvm::broker::{Reply, Request};

#[test]
fn sigterm_tells_every_client_and_exits_cleanly() {
    let socket = std::env::temp_dir().join(format!("kvvm-cli-broker-{}.sock", std::process::id()));
    let metrics = socket.with_extension("prom");
    let mut daemon = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(["broker", "--socket"])
        .arg(&socket)
        .args(["--budget-bytes", "1MiB", "--tenant", "a:256KiB:512KiB"])
        .arg("--metrics-file")
        .arg(&metrics)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(daemon.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert!(line.contains("listening on"), "{line}");

    let mut s = UnixStream::connect(&socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let hello = Request::Hello {
        id: 1,
        tenant: "a".into(),
        token: None,
        version: PROTOCOL_VERSION,
    };
    write_frame(&mut s, &hello).unwrap();
    let welcome = read_frame::<Reply>(&mut s).unwrap();
    assert!(
        matches!(
            welcome,
            Frame::Message(Reply::Welcome {
                floor: 262_144,
                ceiling: 524_288,
                ..
            })
        ),
        "{welcome:?}"
    );

    let kill = Command::new("kill")
        .args(["-TERM", &daemon.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let bye = read_frame::<Reply>(&mut s).unwrap();
    assert!(
        matches!(bye, Frame::Message(Reply::Shutdown { .. })),
        "{bye:?}"
    );
    let status = daemon.wait().unwrap();
    assert!(status.success(), "{status}");
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("stopped by signal 15"), "{rest}");
    assert!(!socket.exists(), "the socket file is removed");
    // The last write of the metrics file saw the client go.
    let text = std::fs::read_to_string(&metrics).unwrap();
    assert!(
        text.contains("kvvm_broker_clients_registered_total 1"),
        "{text}"
    );
    assert!(
        text.contains("kvvm_broker_clients_dropped_total 1"),
        "{text}"
    );
    std::fs::remove_file(&metrics).unwrap();
}

#[test]
fn tenant_users_must_name_a_tenant_and_numeric_user_ids() {
    let socket =
        std::env::temp_dir().join(format!("kvvm-cli-broker-users-{}.sock", std::process::id()));
    for (users, why) in [("a=root", "user id"), ("b=0", "no --tenant b")] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvvm"))
            .args(["broker", "--socket"])
            .arg(&socket)
            .args([
                "--budget-bytes",
                "1MiB",
                "--tenant",
                "a",
                "--tenant-users",
                users,
            ])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{users}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(why), "{users}: {err}");
        assert!(!socket.exists(), "no socket was made");
    }
}
