//! The acceptor: takes each connection, gives it a slot (or tells it there is none) and a
//! thread. When `accept` fails (out of descriptors: the connection stays queued) it waits
//! before trying again, doubling the wait up to [`MAX_PAUSE`], rather than spinning.

use std::io;
use std::os::fd::AsRawFd;
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

/// What `poll` found on the listener and the waker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Woken {
    /// A connection waits.
    Connection,
    /// The broker stops.
    Stop,
    /// The wait passed.
    Timeout,
}

/// Waits for a connection on `listener` (`None`: none looked for) or a byte on `waker`, at
/// most `wait` (`None`: as long as it takes).
fn wait(listener: Option<&UnixListener>, waker: &UnixStream, wait: Option<Duration>) -> Woken {
    let mut fds: Vec<libc::pollfd> = std::iter::once(waker.as_raw_fd())
        .chain(listener.map(AsRawFd::as_raw_fd))
        .map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = wait.map_or(-1, |w| {
        libc::c_int::try_from(w.as_millis().saturating_add(1)).unwrap_or(libc::c_int::MAX)
    });
    // SAFETY: `fds` holds `fds.len()` valid pollfds, alive for the call.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if rc < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
        return Woken::Stop;
    }
    if fds[0].revents != 0 {
        Woken::Stop
    } else if fds.get(1).is_some_and(|l| l.revents != 0) {
        Woken::Connection
    } else {
        Woken::Timeout
    }
}

/// Accepts connections until the broker stops (a byte on `waker`), pausing after each failed
/// `accept`.
pub(super) fn accept_loop(shared: &Arc<Shared>, listener: &UnixListener, waker: &UnixStream) {
    let mut pause = Duration::ZERO;
    loop {
        if shared.stopping.load(Ordering::SeqCst)
            || wait(Some(listener), waker, None) == Woken::Stop
        {
            break;
        }
        match listener.accept() {
            Ok((stream, _)) => {
                pause = Duration::ZERO;
                if let Err(e) = admit(shared, stream) {
                    tracing::warn!(error = %e, "connection not served");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => {
                lock(&shared.books).note_accept_failure();
                if pause.is_zero() {
                    tracing::warn!(error = %e, "accept failed; trying again after a pause");
                }
                pause = (pause * 2).clamp(FIRST_PAUSE, MAX_PAUSE);
                // The connection is still queued: wait without looking at it.
                if wait(None, waker, Some(pause)) == Woken::Stop {
                    break;
                }
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn with_no_deadline_the_wait_lasts_until_something_comes() {
        let (waker, mut wake) = UnixStream::pair().unwrap();
        let dir = std::env::temp_dir().join(format!("kvvm-accept-wait-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let listener = UnixListener::bind(dir.join("s")).unwrap();
        let waiter = std::thread::spawn(move || wait(Some(&listener), &waker, None));
        // Whenever the byte comes, the wait ends with it, never before (a wait that timed out
        // by itself would say so first).
        std::thread::sleep(Duration::from_millis(100));
        wake.write_all(&[1]).unwrap();
        assert_eq!(waiter.join().unwrap(), Woken::Stop);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
