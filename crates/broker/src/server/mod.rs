//! [`Broker`]: the daemon. One thread accepts connections on the Unix socket, one thread per
//! client reads its requests (at most [`BrokerConfig::max_clients`] at once); the books are
//! one mutex, never held while a socket is written.

mod conn;
mod metrics_file;
mod prefix;

use std::collections::BTreeMap;
use std::io;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::books::NodeBooks;
use crate::config::BrokerConfig;
use crate::error::BrokerError;
use crate::fdpass::send_with_fds;
use crate::metrics::BrokerMetrics;
use crate::peer::{peer_credentials, PeerCredentials};
use crate::prefixes::PrefixRow;
use crate::proto::{encode_frame, write_frame, ErrorCode, Reply};
use metrics_file::MetricsWriter;

/// How long a write to a client may block before the client is dropped (it is not reading).
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);

/// The writing half of one connection.
struct Conn {
    stream: Mutex<UnixStream>,
    client: Mutex<Option<u64>>,
    /// Who connected, as the kernel saw it (`None`: it could not be read; a tenant with a
    /// list of users then refuses the connection).
    peer: Option<PeerCredentials>,
}

impl Conn {
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
}

/// What the broker's threads share.
struct Shared {
    config: BrokerConfig,
    books: Mutex<NodeBooks>,
    conns: Mutex<BTreeMap<u64, Arc<Conn>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    next_conn: AtomicU64,
    stopping: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update under these locks is a single statement or a map insert; a panic elsewhere
    // cannot leave them half-written.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// Sends `reply` to the connection of broker client `client`, if it is connected.
    fn send_to_client(&self, client: u64, reply: &Reply) {
        let conn = lock(&self.conns)
            .values()
            .find(|c| *lock(&c.client) == Some(client))
            .cloned();
        if let Some(c) = conn {
            c.send(reply);
        }
    }
}

/// A running broker. Dropping it stops it ([`stop`](Self::stop)).
pub struct Broker {
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
    metrics: Option<MetricsWriter>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("socket", &self.shared.config.socket)
            .finish()
    }
}

impl Broker {
    /// Validates `config`, binds its socket (a stale socket file no broker answers on is
    /// replaced; a live one is an error), sets the socket's mode and starts serving.
    pub fn start(config: BrokerConfig) -> Result<Broker, BrokerError> {
        config.validate()?;
        let path = &config.socket;
        if UnixStream::connect(path).is_ok() {
            return Err(BrokerError::Io(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("a broker already listens on {}", path.display()),
            )));
        }
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
        let listener = UnixListener::bind(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(config.socket_mode))?;
        let shared = Arc::new(Shared {
            books: Mutex::new(NodeBooks::new(&config)),
            config,
            conns: Mutex::new(BTreeMap::new()),
            threads: Mutex::new(Vec::new()),
            next_conn: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
        });
        let s = Arc::clone(&shared);
        let acceptor = std::thread::Builder::new()
            .name("kvvm-broker-accept".into())
            .spawn(move || accept_loop(&s, &listener))?;
        tracing::info!(socket = %shared.config.socket.display(), "broker started");
        let mut broker = Broker {
            shared,
            acceptor: Some(acceptor),
            metrics: None,
        };
        if let Some(path) = broker.shared.config.metrics_file.clone() {
            let interval = broker.shared.config.metrics_interval;
            broker.metrics = Some(MetricsWriter::start(&broker.shared, path, interval)?);
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

    /// Bytes held on `device` by every client.
    pub fn total_held(&self, device: u32) -> u64 {
        lock(&self.shared.books).total_held(device)
    }

    /// Every published prefix: (tenant, key, device, bytes, users).
    pub fn prefixes(&self) -> Vec<PrefixRow> {
        lock(&self.shared.books).prefixes()
    }

    /// The number of registered clients.
    pub fn clients(&self) -> usize {
        lock(&self.shared.books).clients()
    }

    /// The books now and what they did since the start
    /// ([`BrokerMetrics::to_prometheus`] renders them for a monitoring system).
    pub fn metrics(&self) -> BrokerMetrics {
        lock(&self.shared.books).metrics()
    }

    /// Stops: no new connection is accepted, every client is told ([`Reply::Shutdown`]) and
    /// disconnected, every thread joined and the socket file removed.
    pub fn stop(&mut self) {
        if self.shared.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wake the acceptor with a connection of our own.
        let _ = UnixStream::connect(&self.shared.config.socket);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        let conns: Vec<Arc<Conn>> = lock(&self.shared.conns).values().cloned().collect();
        let bye = Reply::Shutdown {
            reason: "the broker is stopping".into(),
        };
        for c in &conns {
            c.send(&bye);
            let _ = lock(&c.stream).shutdown(std::net::Shutdown::Both);
        }
        let threads = std::mem::take(&mut *lock(&self.shared.threads));
        for t in threads {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.shared.config.socket);
        if let Some(mut m) = self.metrics.take() {
            m.stop(); // the last write sees every client gone
        }
        tracing::info!("broker stopped");
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &UnixListener) {
    for stream in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = stream else { continue };
        if let Err(e) = admit(shared, stream) {
            tracing::warn!(error = %e, "connection not served");
        }
    }
}

/// Serves a new connection on its own thread, or tells it the broker is full.
fn admit(shared: &Arc<Shared>, stream: UnixStream) -> io::Result<()> {
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let writer = stream.try_clone()?;
    let peer = peer_credentials(&stream)
        .inspect_err(|e| tracing::warn!(error = %e, "peer credentials not read"))
        .ok();
    let conn = Arc::new(Conn {
        stream: Mutex::new(writer),
        client: Mutex::new(None),
        peer,
    });
    let id = shared.next_conn.fetch_add(1, Ordering::SeqCst);
    {
        let mut conns = lock(&shared.conns);
        if conns.len() >= shared.config.max_clients {
            drop(conns);
            conn.send(&Reply::Error {
                id: 0,
                code: ErrorCode::TooManyClients,
                message: format!("at most {} clients", shared.config.max_clients),
            });
            return Ok(());
        }
        conns.insert(id, Arc::clone(&conn));
    }
    let s = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name(format!("kvvm-broker-conn-{id}"))
        .spawn(move || conn::serve(&s, id, &conn, stream));
    match spawned {
        Ok(t) => {
            let mut threads = lock(&shared.threads);
            threads.retain(|t| !t.is_finished());
            threads.push(t);
            Ok(())
        }
        Err(e) => {
            lock(&shared.conns).remove(&id);
            Err(e)
        }
    }
}
