//! A server on an ephemeral loopback port over a simulated driver, and a small HTTP client.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kvvm::hal::decorate::CallHook;
use kvvm::hal::Operation;
use kvvm::layout::KvDtype;
use kvvm::sim::SimBackend;
use kvvm::VirtualMemoryBackend;
use kvvm_server::{HttpConfig, KvService, ServeError, ServedModel, ServiceConfig, ShutdownReport};

/// 2 MiB, the simulated H200's granule.
pub const MIB2: u64 = 2 << 20;

/// A running server.
pub struct TestServer {
    pub addr: SocketAddr,
    pub sim: Arc<SimBackend>,
    pub service: Arc<KvService>,
    pub agent: ureq::Agent,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<ShutdownReport, ServeError>>>,
}

/// A response: status, `Retry-After`, body.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub retry_after: Option<String>,
    pub content_type: Option<String>,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
}

/// The server's config over `sim` with a budget: llama-3-8b, seq-major, 4096 tokens.
pub fn config(sim: &Arc<SimBackend>, budget: Option<u64>) -> ServiceConfig {
    let backend: Arc<dyn VirtualMemoryBackend> = sim.clone();
    config_over(backend, budget)
}

/// [`config`] over any backend (a decorator around the simulator, say).
pub fn config_over(backend: Arc<dyn VirtualMemoryBackend>, budget: Option<u64>) -> ServiceConfig {
    let model = ServedModel::preset("llama-3-8b", KvDtype::F16, 4096).unwrap();
    let mut c = ServiceConfig::new(backend, model);
    c.budget_bytes = budget;
    c
}

impl TestServer {
    /// Starts a server over a simulated H200 with `budget` bytes.
    pub fn start(budget: Option<u64>) -> TestServer {
        let sim = Arc::new(SimBackend::h200());
        let c = config(&sim, budget);
        TestServer::start_with(sim, c, 16 << 10)
    }

    /// Starts a server with `config` over `sim` and a body limit.
    pub fn start_with(sim: Arc<SimBackend>, config: ServiceConfig, body_limit: usize) -> Self {
        let http = HttpConfig {
            body_limit,
            ..HttpConfig::default()
        };
        TestServer::start_http(sim, config, http)
    }

    /// Starts a server with `config` over `sim` and the HTTP settings `http`.
    pub fn start_http(sim: Arc<SimBackend>, config: ServiceConfig, http: HttpConfig) -> Self {
        let service = Arc::new(KvService::new(config).expect("service"));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let svc = service.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = kvvm_server::bind("127.0.0.1:0").await?;
                let addr = listener.local_addr().expect("local addr");
                addr_tx.send(addr).expect("send addr");
                kvvm_server::serve(listener, svc, http, async move {
                    let _ = stop_rx.await;
                })
                .await
            })
        });
        let addr = addr_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("server did not start");
        assert!(addr.ip().is_loopback());
        TestServer {
            addr,
            sim,
            service,
            agent: agent(),
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Asks the server to stop (the stand-in for SIGTERM) without waiting for it.
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Waits for the server to have stopped (after [`stop`](Self::stop)).
    pub fn join(mut self) -> (ShutdownReport, Arc<SimBackend>, Arc<KvService>) {
        let report = self
            .thread
            .take()
            .expect("thread")
            .join()
            .expect("server thread panicked")
            .expect("serve failed");
        (report, self.sim.clone(), self.service.clone())
    }

    pub fn post(&self, path: &str, body: &str) -> Reply {
        post(&self.agent, &self.url(path), body)
    }

    pub fn get(&self, path: &str) -> Reply {
        reply(self.agent.get(&self.url(path)).call())
    }

    pub fn delete(&self, path: &str) -> Reply {
        reply(self.agent.delete(&self.url(path)).call())
    }

    /// The value of metric `name` in `/metrics`.
    pub fn metric(&self, name: &str) -> u64 {
        let text = self.get("/metrics").body;
        metric(&text, name).unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
    }

    /// Stops the server and waits for it: every sequence and the pool are released.
    pub fn shutdown(mut self) -> (ShutdownReport, Arc<SimBackend>, Arc<KvService>) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let report = self
            .thread
            .take()
            .expect("thread")
            .join()
            .expect("server thread panicked")
            .expect("serve failed");
        (report, self.sim.clone(), self.service.clone())
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A client that reports 4xx and 5xx as responses, with timeouts.
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(20)))
        .build()
        .into()
}

pub fn post(agent: &ureq::Agent, url: &str, body: &str) -> Reply {
    reply(
        agent
            .post(url)
            .header("content-type", "application/json")
            .send(body),
    )
}

fn reply(r: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Reply {
    let mut r = r.expect("HTTP request failed");
    let header = |name: &str| {
        r.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let retry_after = header("retry-after");
    let content_type = header("content-type");
    let status = r.status().as_u16();
    let body = r.body_mut().read_to_string().expect("body");
    Reply {
        status,
        retry_after,
        content_type,
        body,
    }
}

/// The value of `name` (with any labels) in a Prometheus text.
pub fn metric(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// A raw connection to the server (for what an HTTP client library will not send).
pub fn raw(addr: SocketAddr) -> std::net::TcpStream {
    let s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    s.set_write_timeout(Some(Duration::from_secs(30)))
        .expect("write timeout");
    s
}

/// A raw response: status, the head, the body (as far as `Content-Length` says).
#[derive(Debug)]
pub struct RawReply {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl RawReply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?} after {}", self.body, self.head))
    }

    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_owned())
        })
    }
}

/// Reads one response from `s` (`None`: the connection closed first).
pub fn read_reply(s: &mut std::net::TcpStream) -> Option<RawReply> {
    use std::io::Read;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let status = head.split(' ').nth(1)?.parse().ok()?;
    let mut reply = RawReply {
        status,
        head,
        body: String::new(),
    };
    let len: usize = reply
        .header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + len {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let end = buf.len().min(head_end + len);
    reply.body = String::from_utf8_lossy(&buf[head_end..end]).into_owned();
    Some(reply)
}

/// Whether the server closed `s` within `within` (EOF or a reset), reading and dropping
/// whatever it sends first.
pub fn closed_within(s: &mut std::net::TcpStream, within: Duration) -> bool {
    use std::io::Read;
    let deadline = std::time::Instant::now() + within;
    let mut chunk = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        s.set_read_timeout(Some(left)).expect("read timeout");
        match s.read(&mut chunk) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false
            }
            Err(_) => return true,
        }
    }
}

/// Raises this process's soft open-file limit to its hard limit; returns the soft limit.
pub fn raise_open_file_limit() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        limit.current = limit.maximum;
        let _ = setrlimit(Resource::Nofile, limit);
    }
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// This process's resident set size in bytes (Linux: /proc/self/status).
pub fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Holds every call of one driver operation in flight while armed (a hook of
/// `FaultInjecting`), and says when one arrived: a request held inside its handler for as long
/// as a test needs, without a sleep.
pub struct Gate {
    /// (armed, a call is waiting)
    state: Mutex<(bool, bool)>,
    changed: Condvar,
}

impl Gate {
    pub fn new() -> Arc<Gate> {
        Arc::new(Gate {
            state: Mutex::new((false, false)),
            changed: Condvar::new(),
        })
    }

    /// The hook that holds calls of `op` while the gate is armed.
    pub fn hook(self: &Arc<Self>, op: Operation) -> CallHook {
        let gate = Arc::clone(self);
        Arc::new(move |o| {
            if o != op {
                return;
            }
            let mut s = gate.state.lock().unwrap();
            if !s.0 {
                return;
            }
            s.1 = true;
            gate.changed.notify_all();
            while s.0 {
                s = gate.changed.wait(s).unwrap();
            }
        })
    }

    pub fn arm(&self) {
        self.state.lock().unwrap().0 = true;
    }

    /// Waits until a call is held (panics after `limit`: the request never got there).
    pub fn wait_for_call(&self, limit: Duration) {
        let deadline = std::time::Instant::now() + limit;
        let mut s = self.state.lock().unwrap();
        while !s.1 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            assert!(!left.is_zero(), "no call reached the gate within {limit:?}");
            s = self.changed.wait_timeout(s, left).unwrap().0;
        }
    }

    /// Lets every held call (and every later one) through.
    pub fn open(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.0 = false;
        self.changed.notify_all();
    }

    /// Opens the gate when dropped: declared after the server, it lets a held call go before
    /// the server is stopped, also when an assertion fails (else the held call would keep the
    /// runtime, and the test, from ending).
    pub fn opens_on_drop(self: &Arc<Self>) -> OpenOnDrop {
        OpenOnDrop(Arc::clone(self))
    }
}

/// See [`Gate::opens_on_drop`].
pub struct OpenOnDrop(Arc<Gate>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// Closes `s` with a reset (RST) instead of an orderly close: `SO_LINGER` 0, then drop.
pub fn reset(s: std::net::TcpStream) {
    rustix::net::sockopt::set_socket_linger(&s, Some(Duration::ZERO)).expect("SO_LINGER");
    drop(s);
}

/// Waits until `cond` holds, checking every 10 ms; panics with `what` after `limit`. For a
/// state the server reaches by itself (a reset noticed, say): the bound only decides how long
/// a failure takes to report.
pub fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + limit;
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
