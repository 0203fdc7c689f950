//! A client's requests about prefixes: publish one with its descriptors, open one of its
//! tenant's (the answer carries the descriptors), close one.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use super::conn::{error, refuse, Next};
use super::{lock, Conn, Shared};
use crate::books::BooksError;
use crate::fdpass::MAX_FDS;
use crate::prefixes::Published;
use crate::proto::{valid_key, valid_meta, ErrorCode, Reply, Request};

/// Serves a `publish`, `open` or `close` of `client`.
pub(super) fn request(
    shared: &Arc<Shared>,
    conn: &Conn,
    client: u64,
    req: Request,
    fds: Vec<OwnedFd>,
) -> Next {
    let now = shared.config.clock.now();
    match req {
        Request::Publish {
            id,
            device,
            key,
            sizes,
            meta,
        } => {
            if !valid_key(&key)
                || !valid_meta(&meta)
                || fds.is_empty()
                || fds.len() > MAX_FDS
                || sizes.contains(&0)
            {
                let why = "a prefix needs a valid key, 1 to 64 descriptors of nonzero size and \
                           at most 2048 bytes of printable meta";
                return Next::Close(Some(error(id, ErrorCode::Invalid, why)));
            }
            let published = Published {
                device,
                sizes,
                meta,
                fds,
            };
            let r = lock(&shared.books).publish_prefix(client, &key, published);
            answer(
                conn,
                id,
                r.map(|held| Reply::Held {
                    id,
                    device,
                    granted: 0,
                    held,
                }),
            )
        }
        Request::Open { id, key } => {
            let r = lock(&shared.books).open_prefix(client, &key);
            match r {
                Ok(p) => {
                    let reply = Reply::Prefix {
                        id,
                        device: p.device,
                        sizes: p.sizes,
                        meta: p.meta,
                    };
                    let borrowed: Vec<_> = p.fds.iter().map(AsFd::as_fd).collect();
                    conn.send_fds(&reply, &borrowed);
                    Next::Continue
                }
                Err(e) => answer(conn, id, Err(e)),
            }
        }
        Request::Close { id, key } => {
            let r = lock(&shared.books).close_prefix(client, &key, now);
            answer(
                conn,
                id,
                r.map(|users| Reply::Users {
                    id,
                    users: u64::try_from(users).unwrap_or(u64::MAX),
                }),
            )
        }
        other => Next::Close(Some(error(
            other.id(),
            ErrorCode::Invalid,
            "not a prefix request",
        ))),
    }
}

fn answer(conn: &Conn, id: u64, r: Result<Reply, BooksError>) -> Next {
    match r {
        Ok(reply) => {
            conn.send(&reply);
            Next::Continue
        }
        Err(BooksError::UnknownClient(c)) => Next::Close(Some(error(
            id,
            ErrorCode::Invalid,
            &format!("unknown client {c}"),
        ))),
        Err(e) => {
            refuse(conn, id, ErrorCode::NotHeld, &e.to_string());
            Next::Continue
        }
    }
}
