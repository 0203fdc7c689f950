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

/// `kvvm broker` with `args`, expected to fail: its stderr. One still running after 20 s (a
/// failure guard) was accepted: it is killed and the test fails.
fn refused(args: &[&std::ffi::OsStr]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .arg("broker")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(20) {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("{args:?} was accepted: the broker ran");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(!status.success(), "{args:?} was accepted");
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    err
}

fn os(s: &str) -> &std::ffi::OsStr {
    std::ffi::OsStr::new(s)
}

#[test]
fn the_socket_path_must_be_free_or_a_stale_socket_and_is_named_when_it_is_not() {
    let dir = std::env::temp_dir().join(format!("kvvm-cli-broker-paths-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("file");
    std::fs::write(&file, "keep me").unwrap();
    let folder = dir.join("folder");
    std::fs::create_dir_all(&folder).unwrap();
    let budget = [os("--budget-bytes"), os("1MiB")];
    for (path, what) in [(&file, "a regular file"), (&folder, "a directory")] {
        let err = refused(&[&[os("--socket"), path.as_os_str()], &budget[..]].concat());
        assert!(err.contains(&path.display().to_string()), "{err}");
        assert!(err.contains(what), "{err}");
    }
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        "keep me",
        "left alone"
    );
    assert!(folder.is_dir(), "left alone");
    let missing = dir.join("missing").join("b.sock");
    let err = refused(&[&[os("--socket"), missing.as_os_str()], &budget[..]].concat());
    assert!(err.contains(&missing.display().to_string()), "{err}");
    assert!(err.contains("does not exist"), "{err}");
    let socket = dir.join("b.sock");
    let metrics = dir.join("nowhere").join("m.prom");
    let err = refused(
        &[
            &[os("--socket"), socket.as_os_str()],
            &budget[..],
            &[os("--metrics-file"), metrics.as_os_str()],
        ]
        .concat(),
    );
    assert!(err.contains(&metrics.display().to_string()), "{err}");
    assert!(
        err.contains("metrics file") && !err.contains("broker socket"),
        "{err}"
    );
    assert!(!socket.exists(), "nothing bound");

    // A stale socket (its listener gone) is replaced; a live one is refused.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    let mut daemon = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(["broker", "--budget-bytes", "1MiB", "--socket"])
        .arg(&socket)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(daemon.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("listening on"), "{line}");
    let err = refused(&[&[os("--socket"), socket.as_os_str()], &budget[..]].concat());
    assert!(err.contains("already listens"), "{err}");
    let kill = Command::new("kill")
        .args(["-TERM", &daemon.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    assert!(daemon.wait().unwrap().success());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tenants_modes_and_named_only_are_refused_with_the_flag_s_name() {
    let socket =
        std::env::temp_dir().join(format!("kvvm-cli-broker-flags-{}.sock", std::process::id()));
    let base = [
        os("--socket"),
        socket.as_os_str(),
        os("--budget-bytes"),
        os("1MiB"),
    ];
    for (extra, why) in [
        (vec!["--tenant", "a:0:2MiB"], "--tenant a: its ceiling"),
        (
            vec!["--tenant", "a", "--tenant", "a:1KiB"],
            "--tenant a is given twice",
        ),
        (vec!["--mode", "7777"], "--mode"),
        (vec!["--mode", "8"], "--mode"),
        (vec!["--named-only"], "--named-only with no --tenant"),
    ] {
        let args: Vec<&std::ffi::OsStr> = base
            .iter()
            .copied()
            .chain(extra.iter().map(|s| os(s)))
            .collect();
        let err = refused(&args);
        assert!(err.contains(why), "{extra:?}: {err}");
        assert!(!socket.exists(), "{extra:?}: nothing bound");
    }
}
