//! A client's requests about prefixes: publish one with its descriptors (each checked to be a
//! driver's exported memory of the size claimed before the broker keeps it), open one of its
//! tenant's (the answer carries the descriptors), close one, claim one it used under a
//! previous broker.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use super::conn::{error, refuse, Next};
use super::{lock, Conn, Shared};
use crate::books::BooksError;
use crate::descriptor::check_exported;
use crate::fdpass::MAX_FDS;
use crate::prefixes::Published;
use crate::proto::{valid_key, valid_meta, ErrorCode, Reply, Request, MAX_META};

/// Serves a `publish`, `open`, `close` or `claim_prefix` of `client`.
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
        } => publish(
            shared,
            conn,
            client,
            (id, &key),
            Published {
                device,
                sizes,
                meta,
                fds,
            },
        ),
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
            let r = shared.books(|b| b.close_prefix(client, &key, now));
            answer(conn, id, r.map(|users| users_reply(id, users)))
        }
        Request::ClaimPrefix {
            id,
            key,
            device,
            bytes,
            uses,
        } => {
            let r = shared.lend(|b| b.claim_prefix(client, &key, (device, bytes), uses, now));
            let Some(r) = r else {
                return super::lease::stopping();
            };
            answer(conn, id, r.map(|users| users_reply(id, users)))
        }
        other => Next::Close(Some(error(
            other.id(),
            ErrorCode::Invalid,
            "not a prefix request",
        ))),
    }
}

fn users_reply(id: u64, users: usize) -> Reply {
    Reply::Users {
        id,
        users: u64::try_from(users).unwrap_or(u64::MAX),
    }
}

/// Publishes `published` as `key`, once its frame and every descriptor are checked.
fn publish(
    shared: &Shared,
    conn: &Conn,
    client: u64,
    (id, key): (u64, &str),
    published: Published,
) -> Next {
    if !valid_key(key)
        || !valid_meta(&published.meta)
        || published.fds.is_empty()
        || published.fds.len() > MAX_FDS
        || published.sizes.contains(&0)
    {
        let why = format!(
            "a prefix needs a valid key, 1 to 64 descriptors of nonzero size and at most \
             {MAX_META} bytes of printable meta"
        );
        return Next::Close(Some(error(id, ErrorCode::Invalid, &why)));
    }
    for (i, (fd, size)) in published.fds.iter().zip(&published.sizes).enumerate() {
        if let Err(why) = check_exported(fd.as_fd(), *size) {
            let why = format!("descriptor {i} is {why}");
            tracing::warn!(client, key, %why, "a publish was refused");
            refuse(conn, id, ErrorCode::BadDescriptor, &why);
            return Next::Continue;
        }
    }
    let device = published.device;
    let r = shared.books(|b| b.publish_prefix(client, key, published));
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
