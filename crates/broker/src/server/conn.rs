//! One client's connection: reads its requests, validates each against what the client holds,
//! answers, and gives everything it held back to the node when the socket closes.
//!
//! Deadlines (real time, whatever the configured clock): a connection that has not said
//! hello within [`BrokerConfig::hello_timeout`](crate::BrokerConfig::hello_timeout), or a
//! client that sends no complete message for
//! [`idle_timeout`](crate::BrokerConfig::idle_timeout) (clients ping well within it), is
//! dropped. A frame begun and never finished counts as silence. The rate limit drops
//! messages over it, except returns: a return is always applied (the client has already
//! taken the bytes off its books), and counts towards the limit.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Instant;

use super::{lease, lock, prefix, Conn, Shared};
use crate::config::TenantPolicy;
use crate::fdpass::FdReader;
use crate::proto::{read_frame, valid_tenant, ErrorCode, Frame, Reply, Request, PROTOCOL_VERSION};

/// A token bucket: `burst` messages at once, `per_second` in the long run.
struct RateLimit {
    tokens: f64,
    last: Instant,
    dropped_in_a_row: u32,
}

/// What to do after a request.
pub(super) enum Next {
    Continue,
    /// Leave, with a last word sent once the client's slot and grants are given up (so a
    /// client that reads it finds the broker's books already without it).
    Close(Option<Reply>),
}

/// How a connection's reading ended.
enum End {
    /// The peer left, or the stream broke.
    Gone,
    /// The peer let a deadline pass.
    TimedOut,
    /// A last word for the peer.
    Say(Reply),
}

/// Reads the next request and its descriptors.
fn next_request(reader: &mut FdReader) -> Result<(Request, Vec<OwnedFd>), End> {
    let req = match read_frame::<Request>(reader) {
        Ok(Frame::Message(r)) => r,
        Ok(Frame::Closed) => return Err(End::Gone),
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return Err(End::TimedOut),
        Err(_) => return Err(End::Gone),
        Ok(Frame::Malformed(why)) => return Err(End::Say(error(0, ErrorCode::Invalid, &why))),
    };
    let fds = match &req {
        Request::Publish { sizes, .. } => reader.take_fds(sizes.len()),
        _ => Some(Vec::new()),
    };
    match fds.filter(|_| reader.drop_fds() == 0) {
        Some(fds) => Ok((req, fds)),
        None => Err(End::Say(error(
            req.id(),
            ErrorCode::Invalid,
            "descriptors do not match",
        ))),
    }
}

/// Serves connection `id` until the client leaves, breaks the protocol, lets a deadline
/// pass or the broker stops.
pub(super) fn serve(
    shared: &Arc<Shared>,
    id: u64,
    conn: &Arc<Conn>,
    stream: std::os::unix::net::UnixStream,
) {
    let config = &shared.config;
    let mut reader = FdReader::new(stream);
    reader.set_deadline(Some(Instant::now() + config.hello_timeout));
    let mut rate = RateLimit {
        tokens: f64::from(config.burst),
        last: config.clock.now(),
        dropped_in_a_row: 0,
    };
    let last = loop {
        let (req, fds) = match next_request(&mut reader) {
            Ok(r) => r,
            Err(End::Gone) => break None,
            Err(End::Say(reply)) => break Some(reply),
            Err(End::TimedOut) => {
                lock(&shared.books).note_timed_out();
                let why = "no complete message in time (hello, or a sign of life)";
                break Some(error(0, ErrorCode::Invalid, why));
            }
        };
        reader.set_deadline(Some(Instant::now() + config.idle_timeout));
        let is_return = matches!(req, Request::Return { .. });
        if !admit(shared, &mut rate) && !is_return {
            refuse(conn, req.id(), ErrorCode::RateLimited, "message dropped");
            if rate.dropped_in_a_row > config.burst {
                break None;
            }
            continue;
        }
        if let Next::Close(last) = handle(shared, conn, req, fds) {
            break last;
        }
        if rate.dropped_in_a_row > config.burst {
            break None;
        }
    };
    leave(shared, id, conn, last);
}

/// The connection's end: its slot and everything its client held go back, then the last
/// word is said and the socket shut.
fn leave(shared: &Shared, id: u64, conn: &Conn, last: Option<Reply>) {
    lock(&shared.conns).remove(id);
    let client = lock(&conn.client).take();
    if let Some(client) = client {
        let now = shared.config.clock.now();
        let held = shared.books(|b| b.drop_client(client, now));
        tracing::info!(client, ?held, "client left; its grants are back");
    }
    if let Some(last) = last {
        conn.send(&last);
    }
    conn.cut();
}

/// Whether the rate limit lets one more message through now.
fn admit(shared: &Shared, rate: &mut RateLimit) -> bool {
    let now = shared.config.clock.now();
    let dt = now.saturating_duration_since(rate.last).as_secs_f64();
    rate.last = now;
    let burst = f64::from(shared.config.burst);
    let refill = dt * f64::from(shared.config.messages_per_second);
    rate.tokens = (rate.tokens + refill).min(burst);
    if rate.tokens >= 1.0 {
        rate.tokens -= 1.0;
        rate.dropped_in_a_row = 0;
        true
    } else {
        rate.dropped_in_a_row = rate.dropped_in_a_row.saturating_add(1);
        false
    }
}

pub(super) fn error(id: u64, code: ErrorCode, message: &str) -> Reply {
    Reply::Error {
        id,
        code,
        message: message.to_owned(),
    }
}

pub(super) fn refuse(conn: &Conn, id: u64, code: ErrorCode, message: &str) {
    conn.send(&error(id, code, message));
}

fn handle(shared: &Arc<Shared>, conn: &Conn, req: Request, fds: Vec<OwnedFd>) -> Next {
    let client = *lock(&conn.client);
    match (req, client) {
        (
            Request::Hello {
                id,
                tenant,
                token,
                version,
            },
            None,
        ) => hello(shared, conn, id, &tenant, token.as_deref(), version),
        (Request::Hello { id, .. }, Some(_)) => {
            Next::Close(Some(error(id, ErrorCode::Invalid, "hello twice")))
        }
        (req, None) => Next::Close(Some(error(req.id(), ErrorCode::Invalid, "hello first"))),
        (Request::Ping { id }, Some(_)) => {
            conn.send(&Reply::Pong { id });
            Next::Continue
        }
        (
            req @ (Request::Publish { .. }
            | Request::Open { .. }
            | Request::Close { .. }
            | Request::ClaimPrefix { .. }),
            Some(client),
        ) => prefix::request(shared, conn, client, req, fds),
        (req, Some(client)) => lease::request(shared, conn, client, req),
    }
}

/// Compares in time independent of where the strings differ.
fn same_token(given: Option<&str>, wanted: &str) -> bool {
    let Some(given) = given else { return false };
    given.len() == wanted.len()
        && given
            .bytes()
            .zip(wanted.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// Whether the connection's user may be a tenant of `policy` (a tenant without a list of
/// users admits anyone who could open the socket; one with a list, only a peer whose
/// credentials were read and whose user id is in it).
fn user_allowed(policy: &TenantPolicy, conn: &Conn) -> bool {
    policy
        .users
        .as_ref()
        .is_none_or(|users| conn.peer.is_some_and(|p| users.contains(&p.uid)))
}

fn hello(
    shared: &Shared,
    conn: &Conn,
    id: u64,
    tenant: &str,
    token: Option<&str>,
    version: u32,
) -> Next {
    if version != PROTOCOL_VERSION || !valid_tenant(tenant) {
        return Next::Close(Some(error(
            id,
            ErrorCode::Invalid,
            "bad version or tenant name",
        )));
    }
    let policy: Option<TenantPolicy> = shared.config.policy(tenant).cloned();
    let allowed = policy.as_ref().is_some_and(|p| {
        p.token.as_deref().is_none_or(|t| same_token(token, t)) && user_allowed(p, conn)
    });
    let Some(policy) = policy.filter(|_| allowed) else {
        // One answer for every reason: a client cannot probe which tenants exist or whom
        // they admit.
        let why = "unknown tenant, wrong token or user not allowed";
        return Next::Close(Some(error(id, ErrorCode::Unauthorized, why)));
    };
    let bounds = shared.config.bounds(&policy);
    let client = lock(&shared.books).register(tenant, &policy, bounds.ceiling);
    *lock(&conn.client) = Some(client);
    let (pid, uid) = conn
        .peer
        .map_or((None, None), |p| (Some(p.pid), Some(p.uid)));
    tracing::info!(client, tenant, ?pid, ?uid, "client registered");
    let idle_ms = u64::try_from(shared.config.idle_timeout.as_millis()).unwrap_or(u64::MAX);
    conn.send(&Reply::Welcome {
        id,
        client,
        floor: bounds.floor,
        ceiling: bounds.ceiling,
        budget: shared.config.budget,
        idle_ms,
    });
    Next::Continue
}
