//! `kvvm serve` as a user runs it: starts on an ephemeral loopback port, answers HTTP, and on
//! SIGTERM releases every sequence and exits 0.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One HTTP/1.1 request with `Connection: close`; returns the status and the raw response.
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    http_as(addr, None, method, path, body)
}

/// [`http`] with `Authorization: Bearer <key>`.
fn http_as(addr: &str, key: Option<&str>, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad response {out:?}"));
    (status, out)
}

#[cfg(unix)]
#[test]
fn serve_answers_and_releases_everything_on_sigterm() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args([
            "serve",
            "--backend",
            "sim",
            "--listen",
            "127.0.0.1:0",
            "--budget-bytes",
            "1GiB",
            "--max-tokens",
            "4096",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    assert!(first.contains("listening on http://127.0.0.1:"), "{first}");
    assert!(first.contains("backend sim") && first.contains("budget 1 GiB (1073741824 bytes)"));
    let addr = first
        .split("http://")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap()
        .to_owned();

    let (status, body) = http(&addr, "GET", "/healthz", "");
    assert_eq!(status, 200, "{body}");
    let (status, body) = http(
        &addr,
        "POST",
        "/v1/sequences",
        r#"{"prompt_tokens": 100, "max_tokens": 1000}"#,
    );
    assert_eq!(status, 201, "{body}");
    let (status, body) = http(&addr, "POST", "/v1/sequences", "{not json");
    assert_eq!(status, 400, "{body}");
    let (status, body) = http(&addr, "GET", "/metrics", "");
    assert_eq!(status, 200);
    assert!(
        body.contains("kvvm_live_sequences{device=\"0\"} 1"),
        "{body}"
    );

    // SIGTERM to the child started above, by its id.
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvvm serve did not stop within 20 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    assert!(status.success(), "{status:?}: {rest}");
    assert!(rest.contains("released 1 sequences"), "{rest}");
    assert!(rest.contains("0 bytes still held"), "{rest}");
    let stderr = {
        let mut e = String::new();
        child.stderr.take().unwrap().read_to_string(&mut e).unwrap();
        e
    };
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Starts `kvvm serve` on port 0 with `extra` flags; returns the child, its address and its
/// stdout.
fn start(
    extra: &[&str],
) -> (
    std::process::Child,
    String,
    BufReader<std::process::ChildStdout>,
) {
    start_with(extra, Stdio::piped())
}

/// [`start`] with stderr going to `stderr`, and the access log on (the default `info`).
fn start_with(
    extra: &[&str],
    stderr: Stdio,
) -> (
    std::process::Child,
    String,
    BufReader<std::process::ChildStdout>,
) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(["serve", "--backend", "sim", "--listen", "127.0.0.1:0"])
        .args(["--budget-bytes", "1GiB", "--max-tokens", "4096"])
        .args(extra)
        .env_remove("KVVM_LOG")
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    let addr = first
        .split("http://")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("{first}"))
        .to_owned();
    (child, addr, stdout)
}

#[cfg(unix)]
#[test]
fn sigterm_with_a_stalled_client_exits_within_the_deadline_and_releases_everything() {
    let (mut child, addr, mut stdout) =
        start(&["--shutdown-timeout", "2s", "--body-timeout", "60s"]);
    let (status, body) = http(
        &addr,
        "POST",
        "/v1/sequences",
        r#"{"prompt_tokens": 100, "max_tokens": 1000}"#,
    );
    assert_eq!(status, 201, "{body}");
    // A client that sends part of its body and stalls.
    let mut stalled = TcpStream::connect(&addr).unwrap();
    write!(
        stalled,
        "POST /v1/sequences HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: 100\r\n\r\n{{\"prompt_tok"
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(12) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvvm serve did not stop within 12 s of SIGTERM (deadline 2 s)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = start.elapsed();
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    assert!(status.success(), "{status:?}: {rest}");
    assert!(
        took >= Duration::from_millis(1500),
        "the deadline was not waited for: {took:?}"
    );
    assert!(rest.contains("released 1 sequences"), "{rest}");
    assert!(rest.contains("0 bytes still held"), "{rest}");
}

/// Kills the server it holds when dropped (a failed assertion leaves no server behind).
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // A child already waited for is not signalled again.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Sends SIGTERM to `child` (started by this test, by its id) and waits for it (bound 20 s).
#[cfg(unix)]
fn terminate(child: &mut std::process::Child) -> std::process::ExitStatus {
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvvm serve did not stop within 20 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// With stderr a closed pipe or `/dev/full`, every access-log line fails to be written: the
/// requests are still answered, the failures counted in /metrics, and SIGTERM still stops it
/// with exit 0 and its last line.
#[cfg(unix)]
#[test]
fn serve_answers_and_stops_when_stderr_cannot_be_written() {
    for stderr in ["closed pipe", "/dev/full"] {
        let (child, addr, mut stdout) = if stderr == "/dev/full" {
            let full = std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/full")
                .unwrap();
            start_with(&[], Stdio::from(full))
        } else {
            let (mut child, addr, stdout) = start_with(&[], Stdio::piped());
            // The reader goes away: every later write to stderr fails (EPIPE).
            drop(child.stderr.take());
            (child, addr, stdout)
        };
        let mut child = KillOnDrop(child);
        for _ in 0..3 {
            let (status, body) = http(&addr, "GET", "/healthz", "");
            assert_eq!(status, 200, "{stderr}: {body}");
        }
        let (status, body) = http(
            &addr,
            "POST",
            "/v1/sequences",
            r#"{"prompt_tokens": 100, "max_tokens": 1000}"#,
        );
        assert_eq!(status, 201, "{stderr}: {body}");
        let (status, body) = http(&addr, "GET", "/metrics", "");
        assert_eq!(status, 200, "{stderr}: {body}");
        let dropped: u64 = body
            .lines()
            .find_map(|l| l.strip_prefix("kvvm_log_write_errors_total "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{stderr}: no kvvm_log_write_errors_total in {body}"));
        // The access log of the four requests before, at least.
        assert!(
            dropped >= 4,
            "{stderr}: {dropped} log lines counted as dropped"
        );
        let status = terminate(&mut child.0);
        let mut rest = String::new();
        stdout.read_to_string(&mut rest).unwrap();
        assert_eq!(status.code(), Some(0), "{stderr}: {status:?}: {rest}");
        assert!(
            rest.contains("stopped; released 1 sequences"),
            "{stderr}: {rest}"
        );
    }
}

/// `--api-key` makes a tenant, `--operator-key` (or `KVVM_OPERATOR_KEYS`) an operator: only
/// the operator reads /metrics, a caller without a key learns only that the server is alive.
#[cfg(unix)]
#[test]
fn serve_keeps_metrics_for_operator_keys() {
    let tenant = "alice-0123456789abcdef";
    let operator = "prometheus-0123456789ab";
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(["serve", "--backend", "sim", "--listen", "127.0.0.1:0"])
        .args(["--api-key", &format!("alice:{tenant}")])
        .env("KVVM_OPERATOR_KEYS", format!("prometheus:{operator}"))
        .env_remove("KVVM_API_KEYS")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut child = KillOnDrop(child);
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    let addr = first
        .split("http://")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("{first}"))
        .to_owned();
    let (status, body) = http(&addr, "GET", "/healthz", "");
    assert_eq!(status, 200);
    assert!(body.ends_with(r#"{"status":"ok"}"#), "{body}");
    assert_eq!(http_as(&addr, Some(tenant), "GET", "/metrics", "").0, 403);
    let (status, body) = http_as(&addr, Some(operator), "GET", "/metrics", "");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("kvvm_live_sequences"), "{body}");
    assert_eq!(terminate(&mut child.0).code(), Some(0));

    let out = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(["serve", "--backend", "sim", "--operator-key", "short"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--operator-key"), "{stderr}");
}

#[test]
fn serve_refuses_a_network_address_without_keys() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(["serve", "--backend", "sim", "--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("without API keys"), "{err}");
    assert!(out.stdout.is_empty(), "nothing listened");
}

#[test]
fn serve_rejects_bad_flags() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(["serve", "--backend", "sim", "--layout", "diagonal"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("diagonal"));
    let out = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(["serve", "--backend", "sim", "--model", "gpt-9"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("gpt-9"), "{stderr}");
    // Flags are checked before the backend is opened: no `auto` notice before the error.
    let out = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(["serve", "--model", "gpt-9"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert!(!stderr.contains("auto:"), "{stderr}");
    for (args, flag) in [
        (vec!["--budget-bytes", "0"], "--budget-bytes"),
        (vec!["--budget-bytes", "99999TiB"], "--budget-bytes"),
        (vec!["--max-tokens", "0"], "--max-tokens"),
        (vec!["--device", "5"], "--device 5"),
        (vec!["--listen", "nowhere"], "--listen"),
        (vec!["--body-limit-bytes", "-1"], "--body-limit-bytes"),
        (vec!["--body-limit-bytes", "2GiB"], "--body-limit-bytes"),
        (vec!["--header-timeout", "0"], "--header-timeout"),
        (vec!["--body-timeout", "3d"], "--body-timeout"),
        (vec!["--keep-alive-timeout", "-1"], "--keep-alive-timeout"),
        (vec!["--shutdown-timeout", "169h"], "--shutdown-timeout"),
        (vec!["--idle-timeout", "soon"], "--idle-timeout"),
        (vec!["--max-connections", "0"], "--max-connections"),
        (vec!["--max-in-flight", "0"], "--max-in-flight"),
        (vec!["--max-sequences", "0"], "--max-sequences"),
        (
            vec!["--max-sequences-per-key", "-2"],
            "--max-sequences-per-key",
        ),
        (vec!["--max-reserved-bytes", "8GB"], "--max-reserved-bytes"),
        (
            vec!["--max-reserved-bytes-per-key", "0"],
            "--max-reserved-bytes-per-key",
        ),
        (
            vec!["--max-committed-bytes-per-key", "x"],
            "--max-committed-bytes-per-key",
        ),
        (vec!["--log-format", "yaml"], "--log-format"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvvm"))
            .args(["serve", "--backend", "sim"])
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
        assert!(
            stderr.contains("allowed")
                || stderr.contains("has 1 device")
                || stderr.contains("not an address"),
            "{args:?}: {stderr}"
        );
    }
}
