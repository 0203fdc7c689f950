//! Every subcommand whose reader goes away (`kvvm ... | head -1`, `kvvm ... | true`) exits 0
//! quietly, as Unix tools do: no panic, no message.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Quick forms of every subcommand, each printing more than one line.
const COMMANDS: &[&[&str]] = &[
    &["info"],
    &["info", "--json"],
    &["conformance", "--backend", "sim"],
    &["conformance", "--backend", "sim", "--json"],
    &["conformance", "--backend", "cuda"],
    &["behaviour", "--backend", "sim", "--faults", "single"],
    &[
        "behaviour",
        "--backend",
        "sim",
        "--faults",
        "none",
        "--json",
    ],
    &["plan", "--model", "llama-3-8b", "--prefix", "4096"],
    &["plan", "--model", "llama-3-8b", "--json"],
    &["bench", "vmm", "--backend", "sim", "--quick"],
    &["bench", "vmm", "--backend", "sim", "--quick", "--json"],
    &[
        "bench",
        "kv",
        "--backend",
        "sim",
        "--sequences",
        "2",
        "--prompt-tokens",
        "1024",
    ],
    &[
        "bench",
        "decode",
        "--backend",
        "sim",
        "--steps",
        "16",
        "--sequences",
        "2",
    ],
    &["bench", "host", "--iterations", "1", "--bytes", "4MiB"],
    &["bench", "tp", "--backend", "sim", "--iterations", "1"],
    &["simulate", "--backend", "sim", "--requests", "10"],
    &["simulate", "--backend", "sim", "--requests", "10", "--json"],
    &["--help"],
    &["simulate", "--help"],
];

fn wait(child: &mut std::process::Child, what: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `args` with stdout a pipe whose reader reads `lines` lines (0: none) and goes away.
fn run_with_closed_pipe(args: &[&str], lines: usize) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    if lines > 0 {
        let mut r = BufReader::new(stdout);
        for _ in 0..lines {
            let mut l = String::new();
            r.read_line(&mut l).unwrap();
        }
        drop(r);
    } else {
        drop(stdout);
    }
    let mut stderr = child.stderr.take().unwrap();
    let status = wait(&mut child, &args.join(" "));
    let mut err = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut err).unwrap();
    (status.code(), err)
}

#[test]
fn every_subcommand_exits_0_when_its_reader_goes_away() {
    for args in COMMANDS {
        for lines in [0, 1] {
            let (code, stderr) = run_with_closed_pipe(args, lines);
            let what = format!("kvvm {} (reader took {lines} line)", args.join(" "));
            assert!(!stderr.contains("panicked"), "{what}: {stderr}");
            assert!(!stderr.contains("Broken pipe"), "{what}: {stderr}");
            assert_eq!(code, Some(0), "{what}: {stderr}");
        }
    }
}

#[cfg(unix)]
#[test]
fn serve_exits_0_after_its_reader_went_away() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(["serve", "--backend", "sim", "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut r = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    r.read_line(&mut first).unwrap();
    assert!(first.contains("listening on"), "{first}");
    drop(r);
    // SIGTERM to the child started above, by its id: it then prints its last line.
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let status = wait(&mut child, "kvvm serve");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(status.code(), Some(0), "{err}");
}

/// One `Connection: close` request; the status, or `None` for an empty or broken reply.
#[cfg(unix)]
fn status_of(addr: &str, request: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(request.as_bytes()).ok()?;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.split(' ').nth(1)?.parse().ok()
}

/// `kvvm serve 2>&1 | head -1`: stdout and stderr on one pipe whose reader takes the first
/// line and goes away. Every later log line fails to be written: requests are still answered,
/// and SIGTERM stops it with exit 0 (its last line, to the closed stdout, is not an error).
#[cfg(unix)]
#[test]
fn serve_keeps_answering_after_the_reader_of_its_stdout_and_stderr_went_away() {
    let (reader, writer) = std::io::pipe().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(["serve", "--backend", "sim", "--listen", "127.0.0.1:0"])
        .env_remove("KVVM_LOG")
        .env_remove("RUST_LOG")
        .stdout(writer.try_clone().unwrap())
        .stderr(writer)
        .spawn()
        .unwrap();
    // The parent's copies of the write end went to the child: EOF once the child exits.
    let mut r = BufReader::new(reader);
    let mut first = String::new();
    r.read_line(&mut first).unwrap();
    drop(r);
    let addr = first
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .map(str::to_owned);
    let answers: Vec<Option<u16>> = match &addr {
        Some(addr) => [
            "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_owned(),
            "POST /v1/sequences HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: 20\r\nConnection: close\r\n\r\n{\"prompt_tokens\": 1}"
                .to_owned(),
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_owned(),
        ]
        .iter()
        .map(|req| status_of(addr, req))
        .collect(),
        None => Vec::new(),
    };
    // SIGTERM to the child started above, by its id (also when an answer was wrong).
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    let status = wait(&mut child, "kvvm serve");
    assert!(addr.is_some(), "first line: {first:?}");
    assert_eq!(answers, [Some(200), Some(201), Some(200)]);
    assert!(ok);
    assert_eq!(status.code(), Some(0), "{status:?}");
}
