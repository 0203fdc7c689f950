//! A client's requests about its lease: claim (after a reconnect), acquire, return.

use std::sync::Arc;

use super::conn::{error, refuse, Next};
use super::{Conn, Shared};
use crate::books::BooksError;
use crate::proto::{ErrorCode, Reply, Request};

/// The answer to a request that would lend while the broker stops: the connection ends
/// (its client reconnects to the next broker).
pub(super) fn stopping() -> Next {
    Next::Close(Some(Reply::Shutdown {
        reason: "the broker is stopping".into(),
    }))
}

/// Serves a `claim`, `acquire` or `return` of `client`.
pub(super) fn request(shared: &Arc<Shared>, conn: &Conn, client: u64, req: Request) -> Next {
    let now = shared.config.clock.now();
    let (id, device, result) = match req {
        Request::Claim { id, device, bytes } => {
            let Some(r) = shared.lend(|b| b.claim(client, device, bytes, now)) else {
                return stopping();
            };
            (id, device, r.map(|held| (0, held)))
        }
        Request::Return { id, device, bytes } => {
            let r = shared.books(|b| b.give_back(client, device, bytes, now));
            (id, device, r.map(|held| (0, held)))
        }
        Request::Acquire {
            id,
            device,
            need,
            want,
        } => {
            let retry = &shared.config.retry;
            let r = shared.lend(|b| {
                let r = b.acquire(client, device, need, want, retry, now);
                (r, b.client_held(client, device))
            });
            let Some(r) = r else { return stopping() };
            match r {
                (Ok(Ok(granted)), held) => (id, device, Ok((granted, held))),
                (Ok(Err((refusal, asks))), _) => {
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
                (Err(e), _) => (id, device, Err(e)),
            }
        }
        other => {
            let why = "not a lease request";
            return Next::Close(Some(error(other.id(), ErrorCode::Invalid, why)));
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
        Err(e @ BooksError::UnknownClient(_)) => {
            Next::Close(Some(error(id, ErrorCode::Invalid, &e.to_string())))
        }
        Err(e) => {
            refuse(conn, id, ErrorCode::NotHeld, &e.to_string());
            Next::Continue
        }
    }
}
