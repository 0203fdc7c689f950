//! [`BrokerClient`]: an engine process's connection to the node's broker, and the
//! [`LeaseSource`] of a governor built on it ([`leased_governor`]).
//!
//! Requests are serialised (one in flight); a reader thread takes the broker's replies and
//! answers its asks to give back ([`Reply::Reclaim`]) through the governor without ever
//! waiting for a request. Returns are sent without waiting for their answer; the stream keeps
//! them in order with later requests ([`BrokerClient::sync`] waits until all are applied).
//! When the broker goes away the client keeps what it holds; the next request reconnects,
//! registers again and claims what it holds from the new broker.

use std::collections::BTreeMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use kvvm_governor::{
    Backpressure, Governor, GovernorConfig, LeasePolicy, LeaseSource, Limit, NeverFits, Refusal,
    WeakGovernor,
};
use kvvm_hal::DeviceId;

use crate::error::BrokerError;
use crate::fdpass::{send_with_fds, FdReader};
use crate::prefixes::OpenedPrefix;
use crate::proto::{
    encode_frame, read_frame, write_frame, ErrorCode, Frame, Reply, Request, WireRefusal,
    PROTOCOL_VERSION,
};

/// Ids of requests nobody waits for the answer of (returns) have this bit set.
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

struct Connection {
    writer: Arc<Mutex<UnixStream>>,
    replies: Receiver<(Reply, Vec<OwnedFd>)>,
    alive: Arc<AtomicBool>,
}

pub(crate) struct Inner {
    options: ClientOptions,
    conn: Mutex<Option<Connection>>,
    writer: Mutex<Option<Arc<Mutex<UnixStream>>>>,
    held: Mutex<BTreeMap<u32, u64>>,
    welcome: Mutex<Option<Welcome>>,
    governor: Mutex<Option<WeakGovernor>>,
    next_id: AtomicU64,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(w) = lock(&self.writer).take() {
            let _ = lock(&w).shutdown(std::net::Shutdown::Both);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The client's state is updated in single statements; recover from a poisoned lock.
    m.lock().unwrap_or_else(|p| p.into_inner())
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
                welcome: Mutex::new(None),
                governor: Mutex::new(None),
                next_id: AtomicU64::new(1),
            }),
        };
        let mut conn = lock(&client.inner.conn);
        *conn = Some(client.open()?);
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

    /// Lets the broker's asks to give back reach `governor` (held weakly).
    pub fn attach(&self, governor: &Governor) {
        *lock(&self.inner.governor) = Some(governor.downgrade());
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
        let id = self.id();
        let hello = Request::Hello {
            id,
            tenant: o.tenant.clone(),
            token: o.token.clone(),
            version: PROTOCOL_VERSION,
        };
        write_frame(&mut stream, &hello)?;
        let welcome = match read_frame::<Reply>(&mut stream)? {
            Frame::Message(Reply::Welcome {
                client,
                floor,
                ceiling,
                budget,
                ..
            }) => Welcome {
                client,
                floor,
                ceiling,
                budget,
            },
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
        let weak = Arc::downgrade(&self.inner);
        let a = Arc::clone(&alive);
        std::thread::Builder::new()
            .name("kvvm-broker-client".into())
            .spawn(move || read_loop(&weak, stream, &tx, &a))?;
        *lock(&self.inner.writer) = Some(Arc::clone(&writer));
        let conn = Connection {
            writer,
            replies,
            alive,
        };
        self.claim_all(&conn)?;
        tracing::info!(client = welcome.client, "registered with the broker");
        Ok(conn)
    }

    fn claim_all(&self, conn: &Connection) -> Result<(), BrokerError> {
        let held: Vec<(u32, u64)> = lock(&self.inner.held)
            .iter()
            .filter(|(_, b)| **b > 0)
            .map(|(d, b)| (*d, *b))
            .collect();
        for (device, bytes) in held {
            let id = self.id();
            match self
                .exchange(conn, &Request::Claim { id, device, bytes }, &[])?
                .0
            {
                Reply::Held { .. } => {}
                other => return Err(BrokerError::Protocol(format!("claim: {other:?}"))),
            }
        }
        Ok(())
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
    fn request(&self, make: impl Fn(u64) -> Request) -> Result<Reply, BrokerError> {
        self.request_fds(make, &[]).map(|(r, _)| r)
    }

    /// [`request`](Self::request) with `fds` attached, answered with descriptors.
    pub(crate) fn request_fds(
        &self,
        make: impl Fn(u64) -> Request,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(Reply, Vec<OwnedFd>), BrokerError> {
        let mut conn = lock(&self.inner.conn);
        let mut tries = 0;
        loop {
            tries += 1;
            let alive = conn
                .as_ref()
                .is_some_and(|c| c.alive.load(Ordering::SeqCst));
            if !alive {
                *conn = None;
                *conn = Some(self.open()?);
            }
            let c = conn.as_ref().ok_or(BrokerError::Disconnected)?;
            match self.exchange(c, &make(self.id()), fds) {
                Ok(r) => return Ok(r),
                Err(e) => {
                    *conn = None;
                    if tries >= 2 {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Reconnects now if the broker went away (otherwise the next request does).
    pub fn sync(&self) -> Result<(), BrokerError> {
        let r = self.request(|id| Request::Acquire {
            id,
            device: 0,
            need: 0,
            want: 0,
        })?;
        match r {
            Reply::Held { .. } => Ok(()),
            other => Err(BrokerError::Protocol(format!("sync: {other:?}"))),
        }
    }

    /// Asks for at least `need` and at most `want` more bytes on `device`.
    pub fn acquire_bytes(&self, device: u32, need: u64, want: u64) -> Result<u64, Refusal> {
        let d = DeviceId(device);
        let reply = self.request(|id| Request::Acquire {
            id,
            device,
            need,
            want,
        });
        match reply {
            Ok(Reply::Held { granted, .. }) => {
                let mut held = lock(&self.inner.held);
                let h = held.entry(device).or_default();
                *h = h.saturating_add(granted);
                Ok(granted)
            }
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
    /// drop them at once; the broker's when it reads the message.
    pub fn return_bytes(&self, device: u32, bytes: u64) {
        let bytes = {
            let mut held = lock(&self.inner.held);
            let h = held.entry(device).or_default();
            let b = bytes.min(*h);
            *h -= b;
            b
        };
        if bytes == 0 {
            return;
        }
        let writer = lock(&self.inner.writer).clone();
        if let Some(w) = writer {
            let id = self.id() | UNANSWERED;
            let msg = Request::Return { id, device, bytes };
            // A broker that is gone forgets the bytes anyway; the next one is told by a claim.
            let _ = write_frame(&mut *lock(&w), &msg);
        }
    }
}

impl BrokerClient {
    /// Publishes a prefix on `device` under `key` with its exported handles (a descriptor and
    /// its size each): the bytes leave this client's lease (and its governor's) for the prefix, billed once to
    /// the tenant for as long as any client uses it. The publisher is its first user; it
    /// lets go with [`close_prefix`](Self::close_prefix) or by disconnecting. `meta` rides
    /// with the descriptors to every reader (what they need to map them: the KV layer's
    /// `PrefixDescriptor::encode`; at most 2048 bytes of printable ASCII).
    pub fn publish_prefix(
        &self,
        device: u32,
        key: &str,
        handles: &[(BorrowedFd<'_>, u64)],
        meta: &str,
    ) -> Result<(), BrokerError> {
        let fds: Vec<BorrowedFd<'_>> = handles.iter().map(|(fd, _)| *fd).collect();
        let sizes: Vec<u64> = handles.iter().map(|(_, s)| *s).collect();
        let bytes = sizes.iter().fold(0u64, |a, s| a.saturating_add(*s));
        let make = |id| Request::Publish {
            id,
            device,
            key: key.to_owned(),
            sizes: sizes.clone(),
            meta: meta.to_owned(),
        };
        match self.request_fds(make, &fds)?.0 {
            Reply::Held { .. } => {
                {
                    let mut held = lock(&self.inner.held);
                    let h = held.entry(device).or_default();
                    *h = h.saturating_sub(bytes);
                }
                let governor = lock(&self.inner.governor)
                    .as_ref()
                    .and_then(WeakGovernor::upgrade);
                if let Some(g) = governor {
                    g.hand_over_lease(DeviceId(device), bytes);
                }
                Ok(())
            }
            Reply::Error { message, .. } => Err(BrokerError::Refused(message)),
            other => Err(BrokerError::Protocol(format!("publish: {other:?}"))),
        }
    }

    /// Opens the tenant's prefix `key`: its device, bytes, handles (import them read-only) and
    /// the publisher's `meta`.
    /// Not billed again; the client is a user until it closes it or disconnects.
    pub fn open_prefix(&self, key: &str) -> Result<OpenedPrefix, BrokerError> {
        let make = |id| Request::Open {
            id,
            key: key.to_owned(),
        };
        match self.request_fds(make, &[])? {
            (
                Reply::Prefix {
                    device,
                    sizes,
                    meta,
                    ..
                },
                fds,
            ) if fds.len() == sizes.len() => Ok(OpenedPrefix {
                device,
                sizes,
                fds,
                meta,
            }),
            (Reply::Error { message, .. }, _) => Err(BrokerError::Refused(message)),
            (other, _) => Err(BrokerError::Protocol(format!("open: {other:?}"))),
        }
    }

    /// Lets go of the prefix `key` once; returns the users left (0: it was freed).
    pub fn close_prefix(&self, key: &str) -> Result<u64, BrokerError> {
        let make = |id| Request::Close {
            id,
            key: key.to_owned(),
        };
        match self.request(make)? {
            Reply::Users { users, .. } => Ok(users),
            Reply::Error { message, .. } => Err(BrokerError::Refused(message)),
            other => Err(BrokerError::Protocol(format!("close: {other:?}"))),
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

/// Takes the broker's messages: answers go to the waiting request, asks to give back are
/// answered through the governor.
fn read_loop(
    inner: &Weak<Inner>,
    stream: UnixStream,
    tx: &Sender<(Reply, Vec<OwnedFd>)>,
    alive: &AtomicBool,
) {
    let mut reader = FdReader::new(stream);
    while let Ok(Frame::Message(reply)) = read_frame::<Reply>(&mut reader) {
        let fds = match &reply {
            Reply::Prefix { sizes, .. } => reader.take_fds(sizes.len()),
            _ => Some(Vec::new()),
        };
        let Some(fds) = fds.filter(|_| reader.drop_fds() == 0) else {
            break;
        };
        match reply {
            Reply::Reclaim { device, bytes } => {
                let Some(inner) = inner.upgrade() else { break };
                reclaim(BrokerClient { inner }, device, bytes);
            }
            Reply::Shutdown { reason } => {
                tracing::info!(%reason, "the broker is stopping");
                break;
            }
            Reply::Held { id, .. } | Reply::Error { id, .. } if id & UNANSWERED != 0 => {
                if let Reply::Error { message, code, .. } = &reply {
                    tracing::warn!(?code, %message, "a return was refused");
                }
            }
            Reply::Error {
                code: ErrorCode::TooManyClients,
                ..
            } => break,
            other => {
                if tx.send((other, fds)).is_err() {
                    break;
                }
            }
        }
    }
    alive.store(false, Ordering::SeqCst);
}

fn reclaim(client: BrokerClient, device: u32, bytes: u64) {
    let governor = lock(&client.inner.governor)
        .as_ref()
        .and_then(WeakGovernor::upgrade);
    let Some(g) = governor else { return };
    let taken = g.give_back_unused(DeviceId(device), bytes);
    tracing::debug!(
        device,
        asked = bytes,
        taken,
        "the broker asked for bytes back"
    );
    client.return_bytes(device, taken);
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
