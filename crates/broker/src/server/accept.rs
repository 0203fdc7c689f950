//! The acceptor: takes each connection, gives it a slot (or tells it there is none) and a
//! thread. When `accept` fails (out of descriptors: the connection stays queued) it waits
//! before trying again, doubling the wait up to [`MAX_PAUSE`], rather than spinning.

use std::io;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::{conn, lock, Conn, Shared};
use crate::config::BrokerConfig;
use crate::fdpass::MAX_FDS;
use crate::peer::peer_credentials;
use crate::proto::{ErrorCode, Reply};

/// How long a write to a client may block before the client is dropped (it is not reading).
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);

/// The first wait after `accept` failed.
const FIRST_PAUSE: Duration = Duration::from_millis(1);

/// The longest wait between two tries of a failing `accept`.
pub(super) const MAX_PAUSE: Duration = Duration::from_millis(100);

/// Descriptors the broker may need: two per connection and the descriptors one may have
/// sent and not had taken yet, the prefixes' and a few of its own.
fn descriptors_needed(config: &BrokerConfig) -> u64 {
    let per_conn = 2 + MAX_FDS as u64;
    (config.max_clients as u64)
        .saturating_mul(per_conn)
        .saturating_add(config.max_prefix_descriptors as u64)
        .saturating_add(64)
}

/// Raises the process's soft limit of open descriptors to its hard limit (best effort),
/// and warns when even that is below what the configuration may need.
pub(super) fn raise_descriptor_limit(config: &BrokerConfig) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for getrlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: `raised` is a valid rlimit; raising the soft limit to the hard one is
        // always allowed.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim = raised;
        }
    }
    let needed = descriptors_needed(config);
    #[allow(clippy::useless_conversion)]
    let limit = u64::from(lim.rlim_cur);
    if limit < needed {
        tracing::warn!(
            limit,
            needed,
            "the limit of open descriptors (ulimit -n) is below what \
            the configured connections and prefixes may need: accept() may fail under load"
        );
    }
}

/// Accepts connections until the broker stops, pausing after each failed `accept`.
pub(super) fn accept_loop(shared: &Arc<Shared>, listener: &UnixListener) {
    let mut pause = Duration::ZERO;
    loop {
        let accepted = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        match accepted {
            Ok((stream, _)) => {
                pause = Duration::ZERO;
                if let Err(e) = admit(shared, stream) {
                    tracing::warn!(error = %e, "connection not served");
                }
            }
            Err(e) => {
                lock(&shared.books).note_accept_failure();
                if pause.is_zero() {
                    tracing::warn!(error = %e, "accept failed; trying again after a pause");
                }
                pause = (pause * 2).clamp(FIRST_PAUSE, MAX_PAUSE);
                std::thread::sleep(pause);
            }
        }
    }
}

/// Serves a new connection on its own thread, or tells it there is no slot for it.
fn admit(shared: &Arc<Shared>, stream: UnixStream) -> io::Result<()> {
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let writer = stream.try_clone()?;
    let peer = peer_credentials(&stream)
        .inspect_err(|e| tracing::warn!(error = %e, "peer credentials not read"))
        .ok();
    let conn = Arc::new(Conn::new(writer, peer));
    let id = shared.next_conn.fetch_add(1, Ordering::SeqCst);
    let c = &shared.config;
    let admitted = lock(&shared.conns).admit(id, &conn, c.max_clients, c.max_clients_per_user);
    if let Err(no) = admitted {
        lock(&shared.books).note_refused();
        conn.send(&Reply::Error {
            id: 0,
            code: ErrorCode::TooManyClients,
            message: no.to_string(),
        });
        return Ok(());
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
            lock(&shared.conns).remove(id);
            Err(e)
        }
    }
}
