//! A client's prefixes: publishing, opening and closing them, and the uses it keeps (each
//! publish or open not closed yet), which a new connection claims from a restarted broker.

use std::os::fd::BorrowedFd;

use kvvm_hal::DeviceId;

use super::{lock, BrokerClient, Connection};
use crate::error::BrokerError;
use crate::prefixes::OpenedPrefix;
use crate::proto::{write_frame, Reply, Request};

/// What the client uses of one prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PrefixUse {
    pub(super) device: u32,
    pub(super) bytes: u64,
    /// Publishes and opens not closed yet.
    pub(super) count: u32,
}

impl BrokerClient {
    /// One more use of `key` (on `device`, of `bytes`).
    fn use_prefix(&self, key: &str, device: u32, bytes: u64) {
        let mut uses = lock(&self.inner.uses);
        let u = uses.entry(key.to_owned()).or_insert(PrefixUse {
            device,
            bytes,
            count: 0,
        });
        u.count = u.count.saturating_add(1);
    }

    /// The prefixes the client uses: (key, device, bytes, publishes and opens not closed).
    pub fn prefix_uses(&self) -> Vec<(String, u32, u64, u32)> {
        lock(&self.inner.uses)
            .iter()
            .map(|(k, u)| (k.clone(), u.device, u.bytes, u.count))
            .collect()
    }

    /// Claims every prefix use on the new connection `conn`; one the broker refuses is
    /// forgotten (the memory stays mapped here, billed nowhere).
    pub(super) fn claim_uses(&self, conn: &Connection) -> Result<(), BrokerError> {
        let uses: Vec<(String, PrefixUse)> = lock(&self.inner.uses)
            .iter()
            .map(|(k, u)| (k.clone(), *u))
            .collect();
        for (key, u) in uses {
            let req = Request::ClaimPrefix {
                id: self.id(),
                key: key.clone(),
                device: u.device,
                bytes: u.bytes,
                uses: u.count,
            };
            write_frame(&mut *lock(&conn.writer), &req)?;
            match self.wait_reply(conn)?.0 {
                Reply::Users { .. } => {}
                Reply::Error { message, .. } => {
                    lock(&self.inner.uses).remove(&key);
                    tracing::warn!(key, %message, "the broker refused a prefix use; forgotten");
                }
                other => return Err(BrokerError::Protocol(format!("claim: {other:?}"))),
            }
        }
        Ok(())
    }

    /// Publishes a prefix on `device` under `key` with its exported handles (a descriptor and
    /// its size each): the bytes leave this client's lease (and its governor's) for the
    /// prefix, billed once to the tenant for as long as any client uses it. The publisher is
    /// its first user; it lets go with [`close_prefix`](Self::close_prefix) or by
    /// disconnecting. `meta` rides with the descriptors to every reader (what they need to
    /// map them: the KV layer's `PrefixDescriptor::encode`; at most [`MAX_META`](crate::proto::MAX_META) bytes of printable
    /// ASCII). The broker accepts only a driver's exported memory of the size given (a
    /// sealed memfd, an NVIDIA driver export, a dma-buf).
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
        let reply = self.request(make, &fds, |reply, _| {
            if matches!(reply, Reply::Held { .. }) {
                {
                    let _writer = lock(&self.inner.writer);
                    let mut held = lock(&self.inner.held);
                    let h = held.entry(device).or_default();
                    *h = h.saturating_sub(bytes);
                    if *h == 0 {
                        held.remove(&device);
                    }
                }
                self.use_prefix(key, device, bytes);
                if let Some(g) = self.governor() {
                    g.hand_over_lease(DeviceId(device), bytes);
                }
            }
            reply
        })?;
        match reply {
            Reply::Held { .. } => Ok(()),
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
        let opened = self.request(make, &[], |reply, fds| match reply {
            Reply::Prefix {
                device,
                sizes,
                meta,
                ..
            } if fds.len() == sizes.len() => {
                let bytes = sizes.iter().fold(0u64, |a, s| a.saturating_add(*s));
                self.use_prefix(key, device, bytes);
                Ok(OpenedPrefix {
                    device,
                    sizes,
                    fds,
                    meta,
                })
            }
            Reply::Error { message, .. } => Err(BrokerError::Refused(message)),
            other => Err(BrokerError::Protocol(format!("open: {other:?}"))),
        })?;
        opened
    }

    /// Lets go of the prefix `key` once; returns the users left (0: it was freed).
    pub fn close_prefix(&self, key: &str) -> Result<u64, BrokerError> {
        let make = |id| Request::Close {
            id,
            key: key.to_owned(),
        };
        self.request(make, &[], |reply, _| match reply {
            Reply::Users { users, .. } => {
                let mut uses = lock(&self.inner.uses);
                if let Some(u) = uses.get_mut(key) {
                    u.count = u.count.saturating_sub(1);
                    if u.count == 0 {
                        uses.remove(key);
                    }
                }
                Ok(users)
            }
            Reply::Error { message, .. } => Err(BrokerError::Refused(message)),
            other => Err(BrokerError::Protocol(format!("close: {other:?}"))),
        })?
    }
}
