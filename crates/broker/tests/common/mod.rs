//! The harness of the multi-process tests: a child process is this test binary re-run with
//! `KVVM_BROKER_CHILD` set, running only [`child_main`]. It builds a leased governor on the
//! broker at `KVVM_BROKER_SOCKET` and obeys one command per line on stdin, answering one line
//! on stdout after syncing with the broker, so the parent compares the books at quiescence.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

pub mod raw;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use kvvm_broker::{leased_governor, Broker, ClientOptions};
use kvvm_governor::{Bucket, LeasePolicy};
use kvvm_hal::DeviceId;

pub const CHILD_ENV: &str = "KVVM_BROKER_CHILD";
pub const SOCKET_ENV: &str = "KVVM_BROKER_SOCKET";
pub const TENANT_ENV: &str = "KVVM_BROKER_TENANT";
pub const LINE: &str = "KVVM_BROKER ";
pub const BATCH: u64 = 100;
const D: DeviceId = DeviceId(0);

/// A memfd of `size` bytes with its size sealed: what the host backend exports, the kind of
/// descriptor a broker accepts in a publish.
pub fn memfd(size: u64) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: the name is a valid C string; the flags are memfd_create's.
    let raw = unsafe { libc::memfd_create(c"kvvm-test".as_ptr(), libc::MFD_ALLOW_SEALING) };
    assert!(raw >= 0, "{}", std::io::Error::last_os_error());
    // SAFETY: memfd_create returned a new descriptor we own.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
    // SAFETY: the descriptor is open; ftruncate and fcntl touch no memory of ours.
    unsafe {
        assert_eq!(libc::ftruncate(raw, i64::try_from(size).unwrap()), 0);
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        assert_eq!(libc::fcntl(raw, libc::F_ADD_SEALS, seals), 0);
    }
    fd
}

/// A socket path of its own for one test.
pub fn socket(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvvm-broker-{}-{name}.sock", std::process::id()))
}

/// The child's side: a no-op unless this process was started as a child.
pub fn child_main() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    // SAFETY: alarm only arms a timer; a child that hangs dies and its parent sees EOF.
    unsafe { libc::alarm(60) };
    let socket = std::env::var(SOCKET_ENV).expect("socket");
    let tenant = std::env::var(TENANT_ENV).expect("tenant");
    let (g, client) = leased_governor(
        ClientOptions::new(socket, tenant),
        LeasePolicy::batches_of(BATCH),
    )
    .expect("connect");
    let report = |what: &str| {
        let id = client.welcome().map_or(0, |w| w.client);
        let held = g.lease_held(D).unwrap_or(0);
        assert_eq!(
            held,
            client.held(0),
            "the governor's lease is the client's books"
        );
        println!("{LINE}{what} client={id} held={held}");
    };
    report("ready");
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("stdin");
        let mut words = line.split_whitespace();
        let (cmd, n) = (words.next().unwrap_or(""), words.next().unwrap_or("0"));
        let n: u64 = n.parse().expect("a number");
        let what = match cmd {
            "grant" => match g.try_grant(D, n) {
                Ok(grant) => {
                    grant.commit();
                    "granted".to_owned()
                }
                Err(r) if r.never_fits().is_some() => "never_fits".to_owned(),
                Err(r) => format!("backpressure retry_ms={}", {
                    r.backpressure().map_or(0, |b| b.retry_after.as_millis())
                }),
            },
            "free" => {
                g.free(D, Bucket::Committed, n).expect("free");
                "freed".to_owned()
            }
            "sync" => "synced".to_owned(),
            "exit" => return,
            other => panic!("unknown command {other}"),
        };
        // Best effort: a broker that is gone is reached again by the next command.
        let _ = client.sync();
        report(&what);
    }
}

/// A child process obeying commands.
pub struct Proc {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The client number the child last reported.
    pub client: u64,
    /// The bytes the child last reported holding.
    pub held: u64,
}

impl Proc {
    /// Starts a child of `tenant` on `socket`; `test` is the name of the test that calls
    /// [`child_main`].
    pub fn spawn(test: &str, socket: &Path, tenant: &str) -> Proc {
        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new(exe)
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, "1")
            .env(SOCKET_ENV, socket)
            .env(TENANT_ENV, tenant)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut p = Proc {
            child,
            stdin,
            stdout,
            client: 0,
            held: 0,
        };
        let first = p.answer();
        assert!(first.starts_with("ready"), "{first}");
        p
    }

    fn answer(&mut self) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "the child died");
            // libtest may print "test child ... " on the same line first.
            if let Some((_, rest)) = line.trim_end().split_once(LINE) {
                for word in rest.split_whitespace() {
                    if let Some(v) = word.strip_prefix("client=") {
                        self.client = v.parse().unwrap();
                    }
                    if let Some(v) = word.strip_prefix("held=") {
                        self.held = v.parse().unwrap();
                    }
                }
                return rest.to_owned();
            }
        }
    }

    /// Sends one command and returns the child's answer.
    pub fn cmd(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        self.answer()
    }

    /// SIGKILLs the child and reaps it.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Tells the child to exit and reaps it.
    pub fn exit(mut self) {
        let _ = writeln!(self.stdin, "exit");
        self.child.wait().unwrap();
    }
}

/// Waits (a failure guard of 20 s, never an outcome) until `cond` holds of the broker.
pub fn wait_until(broker: &Broker, what: &str, cond: impl Fn(&Broker) -> bool) {
    let start = Instant::now();
    while !cond(broker) {
        assert!(start.elapsed() < Duration::from_secs(20), "never: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The books check: the broker's holding of every client is what the child reports holding
/// (clients holding nothing aside), and the broker's total is their sum.
pub fn books_agree(broker: &Broker, procs: &[&Proc]) {
    let mut want: Vec<(u64, u64)> = procs
        .iter()
        .map(|p| (p.client, p.held))
        .filter(|(_, b)| *b > 0)
        .collect();
    want.sort_unstable();
    let mut got: Vec<(u64, u64)> = broker
        .holdings()
        .into_iter()
        .filter(|(_, d, b)| *d == 0 && *b > 0)
        .map(|(c, _, b)| (c, b))
        .collect();
    got.sort_unstable();
    assert_eq!(
        got, want,
        "the broker's books are the sum of the clients' books"
    );
    let sum: u64 = procs.iter().map(|p| p.held).sum();
    assert_eq!(broker.total_held(0), sum);
}
