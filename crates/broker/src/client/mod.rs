//! [`BrokerClient`]: an engine process's connection to the node's broker, and the
//! [`LeaseSource`] of a governor built on it ([`leased_governor`]).
//!
//! Requests are serialised (one in flight); a reader thread takes the broker's replies,
//! answers its asks to give back ([`Reply::Reclaim`]) through the governor without ever
//! waiting for a request, and pings the broker when the connection is quiet (a broker drops
//! clients that stay silent). Returns are sent without waiting for their answer; the stream
//! keeps them in order with later requests ([`BrokerClient::sync`] waits until all are
//! applied).
//!
//! When the broker goes away (its socket closes: it stopped, crashed or was restarted) the
//! reader thread notices at once and reconnects, retrying with a growing pause until a
//! broker answers; it says hello again and claims what the client holds (its lease per
//! device and its prefix uses) before anything else is sent. A restarted broker keeps what
//! its predecessor lent for those claims. A claim the new broker refuses (it no longer has
//! the bytes: the client came back after the grace) drops that lease to 0, on the client's
//! books and its governor's, so the books stay equal.
//!
//! Where each part lives: `reader.rs` (the reader thread, pings, reconnecting),
//! `prefix.rs` (publishing, opening and closing prefixes, and what the client uses of them).

mod prefix;
mod reader;

use kvvm_hal::sync::{lock, Unpoison};
use std::collections::BTreeMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvvm_governor::{
    Backpressure, Governor, GovernorConfig, LeasePolicy, LeaseSource, Limit, NeverFits, Refusal,
    WeakGovernor,
};
use kvvm_hal::DeviceId;

use crate::error::BrokerError;
use crate::fdpass::send_with_fds;
use crate::proto::{
    encode_frame, read_frame, write_frame, Frame, Reply, Request, WireRefusal, PROTOCOL_VERSION,
};
use prefix::PrefixUse;

/// Ids of requests nobody waits for the answer of (returns, pings) have this bit set.
const UNANSWERED: u64 = 1 << 63;

/// The retry suggested while the broker cannot be reached.
const UNREACHABLE_RETRY: Duration = Duration::from_secs(1);

/// Who the client is and where its broker listens.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// The broker's socket.
    pub socket: PathBuf,
    /// The tenant billed.
    pub tenant: String,
    /// The tenant's token, if the broker wants one.
    pub token: Option<String>,
    /// The longest wait for an answer before the broker is taken for gone (a failure guard).
    pub reply_timeout: Duration,
}

impl ClientOptions {
    /// A client of `tenant` at `socket`, with no token and a 10 s reply timeout.
    pub fn new(socket: impl Into<PathBuf>, tenant: impl Into<String>) -> Self {
        ClientOptions {
            socket: socket.into(),
            tenant: tenant.into(),
            token: None,
            reply_timeout: Duration::from_secs(10),
        }
    }
}

/// What the broker answered to the client's hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Welcome {
    /// The client's number at the broker.
    pub client: u64,
    /// The tenant's floor per device.
    pub floor: u64,
    /// The most the tenant may hold per device.
    pub ceiling: u64,
    /// The node's budget per device.
    pub budget: u64,
}

type Writer = Arc<Mutex<UnixStream>>;

struct Connection {
    writer: Writer,
    replies: Receiver<(Reply, Vec<OwnedFd>)>,
    alive: Arc<AtomicBool>,
}

pub(crate) struct Inner {
    options: ClientOptions,
    conn: Mutex<Option<Connection>>,
    /// The current connection's writer. Its lock orders what is sent outside a request
    /// (returns) with a new connection's claims: a return's bytes are either off the claim
    /// or sent after it, never lost in between.
    writer: Mutex<Option<Writer>>,
    held: Mutex<BTreeMap<u32, u64>>,
    /// Prefixes used, by key (changed only under `conn`'s lock, with the request).
    uses: Mutex<BTreeMap<String, PrefixUse>>,
    welcome: Mutex<Option<Welcome>>,
    governor: Mutex<Option<WeakGovernor>>,
    next_id: AtomicU64,
    /// Whether a connection is up (registered, its claims made), and its changes.
    connected: Mutex<bool>,
    connected_changed: Condvar,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(w) = lock(&self.writer).take() {
            let _ = lock(&w).shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A connection to the node's broker. Cheap to clone; the socket closes (and the broker takes
/// back everything the client held) when the last clone is dropped or the process dies.
#[derive(Clone)]
pub struct BrokerClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for BrokerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerClient")
            .field("options", &self.inner.options)
            .field("held", &*lock(&self.inner.held))
            .finish()
    }
}

impl BrokerClient {
    /// Connects and registers.
    pub fn connect(options: ClientOptions) -> Result<BrokerClient, BrokerError> {
        let client = BrokerClient {
            inner: Arc::new(Inner {
                options,
                conn: Mutex::new(None),
                writer: Mutex::new(None),
                held: Mutex::new(BTreeMap::new()),
                uses: Mutex::new(BTreeMap::new()),
                welcome: Mutex::new(None),
                governor: Mutex::new(None),
                next_id: AtomicU64::new(1),
                connected: Mutex::new(false),
                connected_changed: Condvar::new(),
            }),
        };
        let mut conn = lock(&client.inner.conn);
        *conn = Some(client.open()?);
        client.set_connected(true);
        drop(conn);
        Ok(client)
    }

    /// What the broker answered to the latest hello.
    pub fn welcome(&self) -> Option<Welcome> {
        *lock(&self.inner.welcome)
    }

    /// Bytes the client holds on `device` by its own books.
    pub fn held(&self, device: u32) -> u64 {
        lock(&self.inner.held).get(&device).copied().unwrap_or(0)
    }

    /// Every device the client holds bytes on: (device, bytes).
    pub fn holdings(&self) -> Vec<(u32, u64)> {
        lock(&self.inner.held)
            .iter()
            .map(|(d, b)| (*d, *b))
            .collect()
    }

    /// Lets the broker's asks to give back reach `governor` (held weakly).
    pub fn attach(&self, governor: &Governor) {
        *lock(&self.inner.governor) = Some(governor.downgrade());
    }

    /// Whether the client is registered with a broker now, with what it holds claimed.
    pub fn connected(&self) -> bool {
        *lock(&self.inner.connected)
    }

    /// Waits until the client is registered with a broker, what it holds claimed, or until
    /// `timeout` passes; returns whether it is.
    pub fn wait_connected(&self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        let mut up = lock(&self.inner.connected);
        while !*up {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            up = self
                .inner
                .connected_changed
                .wait_timeout(up, left)
                .unpoisoned()
                .0;
        }
        true
    }

    fn set_connected(&self, up: bool) {
        *lock(&self.inner.connected) = up;
        self.inner.connected_changed.notify_all();
    }

    fn governor(&self) -> Option<Governor> {
        lock(&self.inner.governor)
            .as_ref()
            .and_then(WeakGovernor::upgrade)
    }

    fn id(&self) -> u64 {
        self.inner.next_id.fetch_add(1, Ordering::SeqCst) & !UNANSWERED
    }

    /// Opens a connection, says hello and claims what the client holds.
    fn open(&self) -> Result<Connection, BrokerError> {
        let o = &self.inner.options;
        let mut stream = UnixStream::connect(&o.socket)?;
        stream.set_write_timeout(Some(o.reply_timeout))?;
        stream.set_read_timeout(Some(o.reply_timeout))?;
        let hello = Request::Hello {
            id: self.id(),
            tenant: o.tenant.clone(),
            token: o.token.clone(),
            version: PROTOCOL_VERSION,
        };
        write_frame(&mut stream, &hello)?;
        let (welcome, idle_ms) = match read_frame::<Reply>(&mut stream)? {
            Frame::Message(Reply::Welcome {
                client,
                floor,
                ceiling,
                budget,
                idle_ms,
                ..
            }) => (
                Welcome {
                    client,
                    floor,
                    ceiling,
                    budget,
                },
                idle_ms,
            ),
            Frame::Message(Reply::Error { message, .. }) => {
                return Err(BrokerError::Refused(message))
            }
            other => return Err(BrokerError::Protocol(format!("{other:?}"))),
        };
        stream.set_read_timeout(None)?;
        *lock(&self.inner.welcome) = Some(welcome);
        let writer = Arc::new(Mutex::new(stream.try_clone()?));
        let (tx, replies) = mpsc::channel();
        let alive = Arc::new(AtomicBool::new(true));
        let conn = Connection {
            writer: Arc::clone(&writer),
            replies,
            alive: Arc::clone(&alive),
        };
        let ping = (idle_ms > 0).then(|| Duration::from_millis((idle_ms / 4).max(1)));
        reader::spawn(Arc::downgrade(&self.inner), stream, writer, tx, alive, ping)?;
        self.claim_all(&conn)?;
        self.claim_uses(&conn)?;
        tracing::info!(client = welcome.client, "registered with the broker");
        Ok(conn)
    }

    /// Claims what the client holds on the new connection `conn`: the claims are sent under
    /// the writer's lock with what the books say then, so a return is either off a claim or
    /// sent after it. A device whose claim is refused drops to 0, here and in the governor.
    fn claim_all(&self, conn: &Connection) -> Result<(), BrokerError> {
        let mut sent = Vec::new();
        {
            let mut writer = lock(&self.inner.writer);
            *writer = Some(Arc::clone(&conn.writer));
            let held = self.holdings();
            let mut w = lock(&conn.writer);
            for (device, bytes) in held {
                write_frame(
                    &mut *w,
                    &Request::Claim {
                        id: self.id(),
                        device,
                        bytes,
                    },
                )?;
                sent.push(device);
            }
        }
        for device in sent {
            match self.wait_reply(conn)?.0 {
                Reply::Held { .. } => {}
                Reply::Error { message, .. } => self.lose_lease(device, &message),
                other => return Err(BrokerError::Protocol(format!("claim: {other:?}"))),
            }
        }
        Ok(())
    }

    /// The broker would not take back the lease on `device`: it is gone, here and in the
    /// governor.
    fn lose_lease(&self, device: u32, why: &str) {
        let lost = {
            let _writer = lock(&self.inner.writer);
            lock(&self.inner.held).remove(&device).unwrap_or(0)
        };
        if let Some(g) = self.governor() {
            g.forget_lease(DeviceId(device));
        }
        tracing::warn!(
            device,
            lost,
            why,
            "the broker refused to take back a lease; it is lost"
        );
    }

    /// Sends `req` (with `fds` attached, if any) and waits for its answer.
    fn exchange(
        &self,
        conn: &Connection,
        req: &Request,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(Reply, Vec<OwnedFd>), BrokerError> {
        if fds.is_empty() {
            write_frame(&mut *lock(&conn.writer), req)?;
        } else {
            send_with_fds(&lock(&conn.writer), &encode_frame(req)?, fds)?;
        }
        self.wait_reply(conn)
    }

    /// Waits for the next answer on `conn` (a failure guard of `reply_timeout`: then the
    /// connection is cut).
    fn wait_reply(&self, conn: &Connection) -> Result<(Reply, Vec<OwnedFd>), BrokerError> {
        match conn.replies.recv_timeout(self.inner.options.reply_timeout) {
            Ok(r) => Ok(r),
            Err(RecvTimeoutError::Timeout) => {
                let _ = lock(&conn.writer).shutdown(std::net::Shutdown::Both);
                Err(BrokerError::Disconnected)
            }
            Err(RecvTimeoutError::Disconnected) => Err(BrokerError::Disconnected),
        }
    }

    /// Sends `req` on the current connection, reconnecting when the broker went away (the
    /// connection found dead, or dying under the request: then once more on a new one; a
    /// broker that lost the connection has forgotten the request with everything else).
    /// `then` sees the answer while no reconnect can happen, so what it changes in the
    /// client's books is in the claims of the next connection.
    fn request<R>(
        &self,
        make: impl Fn(u64) -> Request,
        fds: &[BorrowedFd<'_>],
        then: impl FnOnce(Reply, Vec<OwnedFd>) -> R,
    ) -> Result<R, BrokerError> {
        let mut conn = lock(&self.inner.conn);
        let mut tries = 0;
        loop {
            tries += 1;
            let alive = conn
                .as_ref()
                .is_some_and(|c| c.alive.load(Ordering::SeqCst));
            if !alive {
                *conn = None;
                self.set_connected(false);
                *conn = Some(self.open()?);
                self.set_connected(true);
            }
            let c = conn.as_ref().ok_or(BrokerError::Disconnected)?;
            match self.exchange(c, &make(self.id()), fds) {
                Ok((reply, fds)) => return Ok(then(reply, fds)),
                Err(e) => {
                    *conn = None;
                    self.set_connected(false);
                    if tries >= 2 {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Reconnects now if the broker went away, and waits until everything sent before
    /// (returns included) has been applied by the broker.
    pub fn sync(&self) -> Result<(), BrokerError> {
        match self.request(|id| Request::Ping { id }, &[], |r, _| r)? {
            Reply::Pong { .. } => Ok(()),
            other => Err(BrokerError::Protocol(format!("sync: {other:?}"))),
        }
    }

    /// Asks for at least `need` and at most `want` more bytes on `device`.
    pub fn acquire_bytes(&self, device: u32, need: u64, want: u64) -> Result<u64, Refusal> {
        let d = DeviceId(device);
        let make = |id| Request::Acquire {
            id,
            device,
            need,
            want,
        };
        let reply = self.request(make, &[], |reply, _| {
            if let Reply::Held { granted, .. } = reply {
                if granted > 0 {
                    let mut held = lock(&self.inner.held);
                    let h = held.entry(device).or_default();
                    *h = h.saturating_add(granted);
                }
            }
            reply
        });
        match reply {
            Ok(Reply::Held { granted, .. }) => Ok(granted),
            Ok(Reply::Refused { refusal, .. }) => Err(refusal_of(d, refusal)),
            Ok(_) | Err(_) => Err(Backpressure {
                device: d,
                needed: need,
                available: 0,
                retry_after: UNREACHABLE_RETRY,
            }
            .into()),
        }
    }

    /// Gives `bytes` on `device` back (at most what the client holds): the client's books
    /// drop them at once; the broker's when it reads the message (a return is never
    /// dropped by its rate limit).
    pub fn return_bytes(&self, device: u32, bytes: u64) {
        let writer = lock(&self.inner.writer);
        let bytes = {
            let mut held = lock(&self.inner.held);
            let Some(h) = held.get_mut(&device) else {
                return;
            };
            let b = bytes.min(*h);
            *h -= b;
            if *h == 0 {
                held.remove(&device);
            }
            b
        };
        if bytes == 0 {
            return;
        }
        if let Some(w) = writer.as_ref() {
            let msg = Request::Return {
                id: self.id() | UNANSWERED,
                device,
                bytes,
            };
            // A broker that is gone forgets the bytes anyway; the next one is told by a claim.
            let _ = write_frame(&mut *lock(w), &msg);
        }
    }
}

fn refusal_of(device: DeviceId, r: WireRefusal) -> Refusal {
    match r {
        WireRefusal::Backpressure {
            needed,
            available,
            retry_after_ms,
        } => Backpressure {
            device,
            needed,
            available,
            retry_after: Duration::from_millis(retry_after_ms),
        }
        .into(),
        WireRefusal::NeverFits {
            needed,
            limit_bytes,
            ..
        } => NeverFits {
            device,
            needed,
            limit: Limit::DeviceBudget,
            limit_bytes,
        }
        .into(),
    }
}

impl LeaseSource for BrokerClient {
    fn acquire(&self, device: DeviceId, need: u64, want: u64) -> Result<u64, Refusal> {
        self.acquire_bytes(device.0, need, want)
    }

    fn give_back(&self, device: DeviceId, bytes: u64) {
        self.return_bytes(device.0, bytes);
    }
}

/// Connects to the broker of `options` and builds a governor on a lease from it: the device
/// budget is the tenant's ceiling, top-ups and trims follow `policy`, and the broker's asks
/// to give back reach the governor. Hand the governor to the manager as any other.
pub fn leased_governor(
    options: ClientOptions,
    policy: LeasePolicy,
) -> Result<(Governor, BrokerClient), BrokerError> {
    let client = BrokerClient::connect(options)?;
    let ceiling = client.welcome().map_or(0, |w| w.ceiling);
    let config = GovernorConfig::default().default_device_budget(ceiling);
    let source: Arc<dyn LeaseSource> = Arc::new(client.clone());
    let governor = Governor::with_lease(config, source, policy);
    client.attach(&governor);
    Ok((governor, client))
}
