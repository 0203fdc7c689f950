//! Prefixes in the books: a published prefix's bytes move from its publisher's lease to the
//! prefix, billed once to the tenant until its last user lets go; after a restart its users
//! claim it again.

use std::time::Instant;

use kvvm_governor::TenantId;

use super::{BooksError, NodeBooks};
use crate::prefixes::{Freed, OpenedPrefix, PrefixClaim, Published, MAX_PREFIXES};

impl NodeBooks {
    /// `client` publishes `key` (its handles, their sizes, the device and the `meta` its
    /// readers get with them): the bytes move from its holding to the prefix (billed once, to
    /// its tenant) and it is the first user. Refused when the tenant has that key or
    /// 256 prefixes, or the broker would hold more descriptors than it may.
    /// Returns what the client holds now.
    pub fn publish_prefix(
        &mut self,
        client: u64,
        key: &str,
        published: Published,
    ) -> Result<u64, BooksError> {
        let device = published.device;
        let bytes = published
            .sizes
            .iter()
            .try_fold(0u64, |a, s| a.checked_add(*s))
            .unwrap_or(u64::MAX);
        let tenant = self.tenant_of(client)?;
        self.check_device(device)?;
        let descriptors = self
            .prefixes
            .descriptors()
            .saturating_add(published.fds.len());
        if self.prefixes.contains(tenant, key)
            || self.prefixes.count(tenant) >= MAX_PREFIXES
            || descriptors > self.max_descriptors
        {
            return Err(BooksError::PrefixExists(key.to_owned()));
        }
        let rest = self.held_after(client, device, bytes)?;
        // The bytes stay the tenant's and the node's: only the client stops holding them.
        if let Some(c) = self.clients.get_mut(&client) {
            c.held.sub(device, bytes);
        }
        self.prefixes.publish(tenant, key, client, published);
        Ok(rest)
    }

    /// Opens the tenant's prefix `key` for `client` (not billed again).
    pub fn open_prefix(&mut self, client: u64, key: &str) -> Result<OpenedPrefix, BooksError> {
        let tenant = self.tenant_of(client)?;
        self.prefixes
            .open(tenant, key, client)
            .ok_or_else(|| BooksError::NoPrefix(key.to_owned()))
    }

    /// `client` lets go of `key` once; the last user's close frees it. Returns the users left.
    pub fn close_prefix(
        &mut self,
        client: u64,
        key: &str,
        now: Instant,
    ) -> Result<usize, BooksError> {
        let tenant = self.tenant_of(client)?;
        let (left, freed) = self
            .prefixes
            .close(tenant, key, client)
            .ok_or_else(|| BooksError::NoPrefix(key.to_owned()))?;
        if let Some(f) = freed {
            self.free_prefix(tenant, f, now);
        }
        Ok(left)
    }

    /// A prefix of `tenant` freed with its last user: its bytes go back to the node, or,
    /// when it was claimed after a restart and the grace runs, back to what is kept for the
    /// tenant's claims (its other users of the previous broker may not have claimed it yet).
    pub(super) fn free_prefix(&mut self, tenant: TenantId, freed: Freed, now: Instant) {
        let Freed {
            device,
            bytes,
            claimed,
        } = freed;
        if claimed && self.grace.until.is_some() {
            let kept = self.grace.unclaimed.entry((tenant, device)).or_default();
            *kept = kept.saturating_add(bytes);
            return;
        }
        self.take_back(tenant, None, device, bytes);
        self.note_given_back(device, bytes, now);
    }

    /// `client` used its tenant's prefix `key` (`bytes` on `device`) `uses` times under a
    /// previous broker: it is a user again. A prefix nobody claimed yet is billed to the
    /// tenant like a claim (out of what is kept for its claims, the rest if it fits) and has
    /// no descriptors until published again. Returns the prefix's users.
    pub fn claim_prefix(
        &mut self,
        client: u64,
        key: &str,
        (device, bytes): (u32, u64),
        uses: u32,
        now: Instant,
    ) -> Result<usize, BooksError> {
        let tenant = self.claimant(client, device, now)?;
        let missing = || BooksError::NoPrefix(key.to_owned());
        if uses == 0 || bytes == 0 {
            return Err(missing());
        }
        match self
            .prefixes
            .claim(tenant, key, client, (device, bytes), uses)
        {
            PrefixClaim::Joined(users) => Ok(users),
            PrefixClaim::Mismatch => Err(missing()),
            PrefixClaim::Absent => {
                if self.prefixes.count(tenant) >= MAX_PREFIXES {
                    return Err(BooksError::PrefixExists(key.to_owned()));
                }
                self.bill_claim(tenant, None, device, bytes)?;
                self.prefixes
                    .insert_claimed(tenant, key, client, (device, bytes), uses);
                Ok(1)
            }
        }
    }
}
