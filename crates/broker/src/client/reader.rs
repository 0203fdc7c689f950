//! A connection's reader thread: takes the broker's messages (answers go to the waiting
//! request, asks to give back are answered through the governor), pings when the connection
//! has been quiet for a while, and when the connection ends reconnects at once, trying again
//! with a growing pause until a broker answers or the client is dropped.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Weak};
use std::time::Duration;

use kvvm_hal::DeviceId;

use super::{lock, BrokerClient, Inner, Writer, UNANSWERED};
use crate::fdpass::{readable_within, FdReader};
use crate::proto::{read_frame, write_frame, ErrorCode, Frame, Reply, Request};

/// The first pause between two tries to reconnect.
const FIRST_PAUSE: Duration = Duration::from_millis(2);

/// The longest pause between two tries to reconnect.
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// Starts the reader thread of a new connection: `stream` is read, `writer` pinged on
/// every `ping` of quiet, `alive` cleared when the connection ends.
pub(super) fn spawn(
    inner: Weak<Inner>,
    stream: UnixStream,
    writer: Writer,
    tx: Sender<(Reply, Vec<OwnedFd>)>,
    alive: Arc<AtomicBool>,
    ping: Option<Duration>,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("kvvm-broker-client".into())
        .spawn(move || {
            read_loop(&inner, stream, &writer, &tx, ping);
            alive.store(false, Ordering::SeqCst);
            drop(tx);
            reconnect(&inner);
        })
        .map(|_| ())
}

/// Waits for the next frame, pinging every `ping` of quiet; `false` when the connection
/// broke.
fn wait_for_frame(reader: &FdReader, writer: &Writer, ping: Option<Duration>) -> bool {
    let Some(every) = ping else { return true };
    loop {
        match readable_within(reader.stream().as_raw_fd(), every) {
            Ok(true) => return true,
            Ok(false) => {
                let msg = Request::Ping { id: UNANSWERED };
                if write_frame(&mut *lock(writer), &msg).is_err() {
                    return false;
                }
            }
            Err(_) => return false,
        }
    }
}

/// Takes the broker's messages until the connection ends.
fn read_loop(
    inner: &Weak<Inner>,
    stream: UnixStream,
    writer: &Writer,
    tx: &Sender<(Reply, Vec<OwnedFd>)>,
    ping: Option<Duration>,
) {
    let mut reader = FdReader::new(stream);
    while wait_for_frame(&reader, writer, ping) {
        let Ok(Frame::Message(reply)) = read_frame::<Reply>(&mut reader) else {
            break;
        };
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
                reclaim(&BrokerClient { inner }, device, bytes);
            }
            Reply::Shutdown { reason } => {
                tracing::info!(%reason, "the broker is stopping");
                break;
            }
            Reply::Held { id, .. } | Reply::Error { id, .. } | Reply::Pong { id }
                if id & UNANSWERED != 0 =>
            {
                if let Reply::Error { message, code, .. } = &reply {
                    tracing::warn!(?code, %message, "a message sent without waiting was refused");
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
}

/// The broker asked for `bytes` on `device`: the governor gives back what it can spare.
fn reclaim(client: &BrokerClient, device: u32, bytes: u64) {
    let Some(g) = client.governor() else { return };
    let taken = g.give_back_unused(DeviceId(device), bytes);
    tracing::debug!(
        device,
        asked = bytes,
        taken,
        "the broker asked for bytes back"
    );
    client.return_bytes(device, taken);
}

/// The connection ended: connects again (hello, claims) until a broker answers, someone
/// else reconnected first, or the client is dropped.
fn reconnect(inner: &Weak<Inner>) {
    let mut pause = FIRST_PAUSE;
    loop {
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let client = BrokerClient { inner: strong };
        {
            let mut conn = lock(&client.inner.conn);
            if conn
                .as_ref()
                .is_some_and(|c| c.alive.load(Ordering::SeqCst))
            {
                return;
            }
            *conn = None;
            client.set_connected(false);
            match client.open() {
                Ok(c) => {
                    *conn = Some(c);
                    client.set_connected(true);
                    return;
                }
                Err(e) => tracing::debug!(error = %e, "the broker cannot be reached yet"),
            }
        }
        drop(client);
        std::thread::sleep(pause);
        pause = (pause * 2).min(MAX_PAUSE);
    }
}
