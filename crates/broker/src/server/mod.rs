//! [`Broker`]: the daemon. One thread accepts connections on the Unix socket, one thread per
//! connection reads its requests (at most [`BrokerConfig::max_clients`] at once, fewer per
//! user); the books are one mutex, never held while a socket is written.
//!
//! Where each part lives: `accept.rs` (the acceptor: slots, back-off when `accept` fails),
//! `slots.rs` (connections and their slots), `socket.rs` (the socket file), `conn.rs` (one
//! connection: deadlines, rate limit, hello, leases), `prefix.rs` (its prefix requests),
//! `metrics_file.rs`.

mod accept;
mod conn;
mod lease;
mod metrics_file;
mod prefix;
mod slots;
mod socket;

use kvvm_hal::sync::lock;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::books::{BookEntries, NodeBooks};
use crate::books_file::BooksFile;
use crate::config::BrokerConfig;
use crate::error::BrokerError;
use crate::fdpass::send_with_fds;
use crate::metrics::BrokerMetrics;
use crate::peer::PeerCredentials;
use crate::prefixes::PrefixRow;
use crate::proto::{encode_frame, write_frame, Reply};
use metrics_file::MetricsWriter;
use slots::Conns;

/// The writing half of one connection.
struct Conn {
    stream: Mutex<UnixStream>,
    /// The stream's descriptor, to see whether the peer hung up without taking the lock
    /// (open as long as `stream`).
    raw: RawFd,
    client: Mutex<Option<u64>>,
    /// Who connected, as the kernel saw it (`None`: it could not be read; a tenant with a
    /// list of users then refuses the connection).
    peer: Option<PeerCredentials>,
    /// The user whose slots it takes (`u32::MAX` when the credentials could not be read).
    user: u32,
}

impl Conn {
    fn new(writer: UnixStream, peer: Option<PeerCredentials>) -> Conn {
        Conn {
            raw: writer.as_raw_fd(),
            stream: Mutex::new(writer),
            client: Mutex::new(None),
            user: peer.map_or(u32::MAX, |p| p.uid),
            peer,
        }
    }

    /// Sends `reply`; a client that cannot be written to is cut off.
    fn send(&self, reply: &Reply) -> bool {
        let mut s = lock(&self.stream);
        let ok = write_frame(&mut *s, reply).is_ok();
        if !ok {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        ok
    }

    /// Sends `reply` with `fds` attached; a client that cannot be written to is cut off.
    fn send_fds(&self, reply: &Reply, fds: &[BorrowedFd<'_>]) -> bool {
        let s = lock(&self.stream);
        let ok = encode_frame(reply)
            .and_then(|b| send_with_fds(&s, &b, fds))
            .is_ok();
        if !ok {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        ok
    }

    /// Cuts the connection (its thread then sees the end of it).
    fn cut(&self) {
        let _ = lock(&self.stream).shutdown(std::net::Shutdown::Both);
    }
}

/// What the broker's threads share.
struct Shared {
    config: BrokerConfig,
    books: Mutex<NodeBooks>,
    /// What is lent, for the next broker; written under the books' lock.
    file: Mutex<BooksFile>,
    conns: Mutex<Conns>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    next_conn: AtomicU64,
    /// Set when the broker stops. From then on what the connections' ends give back is not
    /// written to the books file: their clients keep it, to claim from the next broker.
    stopping: AtomicBool,
}

impl Shared {
    /// Runs `f` on the books; when it changed what is lent, writes the books file before
    /// the books are let go (so before any answer: the file never says less than was
    /// lent). Once the broker stops nothing is written: what the connections' ends give
    /// back, their clients keep, to claim from the next broker.
    fn books<R>(&self, f: impl FnOnce(&mut NodeBooks) -> R) -> R {
        let mut books = lock(&self.books);
        let r = f(&mut books);
        if books.take_changed() && !self.stopping.load(Ordering::SeqCst) {
            lock(&self.file).write_logged(&books.lent());
        }
        r
    }

    /// [`books`](Self::books) for a request that may lend more (an acquire, a claim): `None`
    /// once the broker stops (set under the books' lock, so no grant slips in after it and
    /// into room that a stopping connection's end left).
    fn lend<R>(&self, f: impl FnOnce(&mut NodeBooks) -> R) -> Option<R> {
        self.books(|b| (!self.stopping.load(Ordering::SeqCst)).then(|| f(b)))
    }

    /// Sends `reply` to the connection of broker client `client`, if it is connected.
    fn send_to_client(&self, client: u64, reply: &Reply) {
        let conn = lock(&self.conns).of_client(client);
        if let Some(c) = conn {
            c.send(reply);
        }
    }
}

/// A running broker. Dropping it stops it ([`stop`](Self::stop)).
pub struct Broker {
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
    /// A byte written here stops the acceptor.
    waker: UnixStream,
    metrics: Option<MetricsWriter>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("socket", &self.shared.config.socket)
            .finish()
    }
}

/// Checks that the folder of the metrics file exists (before anything is bound).
fn check_metrics_folder(config: &BrokerConfig) -> Result<(), BrokerError> {
    let Some(path) = &config.metrics_file else {
        return Ok(());
    };
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    if dir.is_dir() {
        return Ok(());
    }
    let why = format!("its folder {} does not exist", dir.display());
    Err(BrokerError::path(
        "the metrics file",
        path,
        std::io::Error::new(std::io::ErrorKind::NotFound, why),
    ))
}

impl Broker {
    /// Validates `config`, checks what is at the socket's path (nothing, or a stale socket
    /// no broker answers on, which is replaced; anything else is an error), reads the books
    /// file a previous broker left (what it had lent is kept for its clients' claims for
    /// [`BrokerConfig::restart_grace`]), binds the socket with its mode from the start and
    /// starts serving.
    pub fn start(config: BrokerConfig) -> Result<Broker, BrokerError> {
        config.validate()?;
        socket::check_path(&config.socket)?;
        check_metrics_folder(&config)?;
        accept::raise_descriptor_limit(&config);
        let (file, lent) = BooksFile::open(&config.books_path())?;
        let mut books = NodeBooks::new(&config);
        if !lent.is_empty() {
            let until = config.clock.now() + config.restart_grace;
            tracing::info!(
                ?lent,
                "keeping what the previous broker lent for its clients' claims"
            );
            books.keep_for_claims(lent, until);
            books.take_changed();
        }
        let listener = socket::bind(&config.socket, config.socket_mode)?;
        listener.set_nonblocking(true)?;
        let (waker, woken) = UnixStream::pair()?;
        let shared = Arc::new(Shared {
            books: Mutex::new(books),
            file: Mutex::new(file),
            config,
            conns: Mutex::new(Conns::default()),
            threads: Mutex::new(Vec::new()),
            next_conn: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
        });
        let s = Arc::clone(&shared);
        let acceptor = std::thread::Builder::new()
            .name("kvvm-broker-accept".into())
            .spawn(move || accept::accept_loop(&s, &listener, &woken))?;
        tracing::info!(socket = %shared.config.socket.display(), "broker started");
        let mut broker = Broker {
            shared,
            acceptor: Some(acceptor),
            waker,
            metrics: None,
        };
        if let Some(path) = broker.shared.config.metrics_file.clone() {
            let interval = broker.shared.config.metrics_interval;
            let writer = MetricsWriter::start(&broker.shared, path.clone(), interval)
                .map_err(|e| BrokerError::path("the metrics file", &path, e))?;
            broker.metrics = Some(writer);
        }
        Ok(broker)
    }

    /// The configuration served.
    pub fn config(&self) -> &BrokerConfig {
        &self.shared.config
    }

    /// Every client's holdings: (client, device, bytes).
    pub fn holdings(&self) -> Vec<(u64, u32, u64)> {
        lock(&self.shared.books).holdings()
    }

    /// Bytes held on `device`: every client's, every prefix's, and what is kept for claims
    /// after a restart.
    pub fn total_held(&self, device: u32) -> u64 {
        lock(&self.shared.books).total_held(device)
    }

    /// Every published prefix: (tenant, key, device, bytes, users).
    pub fn prefixes(&self) -> Vec<PrefixRow> {
        lock(&self.shared.books).prefixes()
    }

    /// Every prefix use: (client, key, times opened or published and not closed).
    pub fn prefix_uses(&self) -> Vec<(u64, String, u32)> {
        lock(&self.shared.books).prefix_uses()
    }

    /// Bytes kept for claims after a restart, per (tenant, device).
    pub fn unclaimed(&self) -> std::collections::BTreeMap<(String, u32), u64> {
        lock(&self.shared.books).unclaimed()
    }

    /// The number of registered clients.
    pub fn clients(&self) -> usize {
        lock(&self.shared.books).clients()
    }

    /// The number of connections served (registered or not yet).
    pub fn connections(&self) -> usize {
        lock(&self.shared.conns).len()
    }

    /// How many entries the books keep.
    pub fn book_entries(&self) -> BookEntries {
        lock(&self.shared.books).entries()
    }

    /// The books now and what they did since the start
    /// ([`BrokerMetrics::to_prometheus`] renders them for a monitoring system).
    pub fn metrics(&self) -> BrokerMetrics {
        lock(&self.shared.books).metrics()
    }

    /// Stops: no new connection is accepted, every client is told ([`Reply::Shutdown`]) and
    /// disconnected, every thread joined and the socket file removed. The books file keeps
    /// what the clients hold, for the next broker.
    pub fn stop(&mut self) {
        self.halt(true);
        tracing::info!("broker stopped");
    }

    /// Stops at once as a crash would: no client is told (their connections are cut), the
    /// socket file is left behind (a stale socket the next broker replaces) and the books
    /// file keeps what was lent. What clients do when their broker dies is tested with it.
    pub fn abandon(mut self) {
        self.halt(false);
    }

    fn halt(&mut self, clean: bool) {
        {
            // Under the books' lock: a request that lends sees it before or after, whole.
            let _books = lock(&self.shared.books);
            if self.shared.stopping.swap(true, Ordering::SeqCst) {
                return;
            }
        }
        let _ = std::io::Write::write_all(&mut self.waker, &[1]);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        let conns = lock(&self.shared.conns).all();
        let bye = Reply::Shutdown {
            reason: "the broker is stopping".into(),
        };
        for c in &conns {
            if clean {
                c.send(&bye);
            }
            c.cut();
        }
        let threads = std::mem::take(&mut *lock(&self.shared.threads));
        for t in threads {
            let _ = t.join();
        }
        if clean {
            let _ = std::fs::remove_file(&self.shared.config.socket);
            lock(&self.shared.file).close();
        }
        if let Some(mut m) = self.metrics.take() {
            m.stop(); // the last write sees every client gone
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.stop();
    }
}
