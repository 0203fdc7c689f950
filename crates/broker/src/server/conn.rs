//! One client's connection: reads its requests, validates each against what the client holds,
//! answers, and gives everything it held back to the node when the socket closes.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Instant;

use super::{lock, prefix, Conn, Shared};
use crate::books::BooksError;
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

/// Serves connection `id` until the client leaves, breaks the protocol or the broker stops.
pub(super) fn serve(shared: &Arc<Shared>, id: u64, conn: &Arc<Conn>, stream: UnixStream) {
    let mut reader = FdReader::new(stream);
    let now = shared.config.clock.now();
    let mut rate = RateLimit {
        tokens: f64::from(shared.config.burst),
        last: now,
        dropped_in_a_row: 0,
    };
    let last = loop {
        let req = match read_frame::<Request>(&mut reader) {
            Ok(Frame::Message(r)) => r,
            Ok(Frame::Closed) | Err(_) => break None,
            Ok(Frame::Malformed(why)) => break Some(error(0, ErrorCode::Invalid, &why)),
        };
        let fds = match &req {
            Request::Publish { sizes, .. } => reader.take_fds(sizes.len()),
            _ => Some(Vec::new()),
        };
        let Some(fds) = fds.filter(|_| reader.drop_fds() == 0) else {
            break Some(error(
                req.id(),
                ErrorCode::Invalid,
                "descriptors do not match",
            ));
        };
        if !admit(shared, &mut rate) {
            refuse(conn, req.id(), ErrorCode::RateLimited, "message dropped");
            if rate.dropped_in_a_row > shared.config.burst {
                break None;
            }
            continue;
        }
        if let Next::Close(last) = handle(shared, conn, req, fds) {
            break last;
        }
    };
    lock(&shared.conns).remove(&id);
    let client = lock(&conn.client).take();
    if let Some(client) = client {
        let now = shared.config.clock.now();
        let held = lock(&shared.books).drop_client(client, now);
        tracing::info!(client, ?held, "client left; its grants are back");
    }
    if let Some(last) = last {
        conn.send(&last);
    }
    let _ = lock(&conn.stream).shutdown(std::net::Shutdown::Both);
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
        (
            req @ (Request::Publish { .. } | Request::Open { .. } | Request::Close { .. }),
            Some(client),
        ) => prefix::request(shared, conn, client, req, fds),
        (req, Some(client)) => books_request(shared, conn, client, req),
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
    let ceiling = shared.config.ceiling(&policy);
    let client = lock(&shared.books).register(tenant, &policy, ceiling);
    *lock(&conn.client) = Some(client);
    let (pid, uid) = conn
        .peer
        .map_or((None, None), |p| (Some(p.pid), Some(p.uid)));
    tracing::info!(client, tenant, ?pid, ?uid, "client registered");
    conn.send(&Reply::Welcome {
        id,
        client,
        floor: policy.floor.min(ceiling),
        ceiling,
        budget: shared.config.budget,
    });
    Next::Continue
}

fn books_request(shared: &Arc<Shared>, conn: &Conn, client: u64, req: Request) -> Next {
    let now = shared.config.clock.now();
    let (id, device, result) = match req {
        Request::Hello { .. }
        | Request::Publish { .. }
        | Request::Open { .. }
        | Request::Close { .. } => return Next::Close(None),
        Request::Claim { id, device, bytes } => {
            let r = lock(&shared.books).claim(client, device, bytes);
            (id, device, r.map(|held| (0, held)))
        }
        Request::Return { id, device, bytes } => {
            let r = lock(&shared.books).give_back(client, device, bytes, now);
            (id, device, r.map(|held| (0, held)))
        }
        Request::Acquire {
            id,
            device,
            need,
            want,
        } => {
            let mut books = lock(&shared.books);
            let r = books.acquire(client, device, need, want, &shared.config.retry, now);
            let held = books.client_held(client, device);
            drop(books);
            match r {
                Ok(Ok(granted)) => (id, device, Ok((granted, held))),
                Ok(Err((refusal, asks))) => {
                    for ask in asks {
                        let msg = Reply::Reclaim {
                            device: ask.device,
                            bytes: ask.bytes,
                        };
                        shared.send_to_client(ask.client, &msg);
                    }
                    conn.send(&Reply::Refused {
                        id,
                        device,
                        refusal,
                    });
                    return Next::Continue;
                }
                Err(e) => (id, device, Err(e)),
            }
        }
    };
    match result {
        Ok((granted, held)) => {
            conn.send(&Reply::Held {
                id,
                device,
                granted,
                held,
            });
            Next::Continue
        }
        Err(
            e @ (BooksError::NotHeld { .. }
            | BooksError::Claim(_)
            | BooksError::NoPrefix(_)
            | BooksError::PrefixExists(_)),
        ) => {
            refuse(conn, id, ErrorCode::NotHeld, &e.to_string());
            Next::Continue
        }
        Err(e @ BooksError::UnknownClient(_)) => {
            Next::Close(Some(error(id, ErrorCode::Invalid, &e.to_string())))
        }
    }
}
