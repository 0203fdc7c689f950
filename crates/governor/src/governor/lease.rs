//! A governor whose budget is leased from somewhere else (a node-wide broker): the bytes the
//! governor may grant on a device are the lease it holds there, topped up in batches when a
//! grant does not fit and trimmed when frees leave too much of it unused. Grants within the
//! lease never leave the process; only a top-up or a trim talks to the [`LeaseSource`].

use kvvm_hal::sync::lock;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kvvm_hal::DeviceId;

use super::grant::MappedGrowthGrant;
use super::{Governor, Inner};
use crate::books::Ledger;
use crate::config::GovernorConfig;
use crate::error::Refusal;
use crate::lease_source::{Lease, LeasePolicy, LeaseSource, LeaseStats};

/// A governor that does not keep it alive (what a broker client holds to answer the broker's
/// asks to give back).
#[derive(Clone)]
pub struct WeakGovernor(Weak<Inner>);

impl WeakGovernor {
    /// The governor, while a clone of it lives.
    pub fn upgrade(&self) -> Option<Governor> {
        self.0.upgrade().map(|inner| Governor { inner })
    }
}

impl Governor {
    /// A governor with `config` whose bytes on each device are leased from `source`, topped
    /// up and trimmed by `policy`. The config's budgets still apply on top of the lease (set
    /// them to the most the source would ever grant, so a request over it is
    /// [`NeverFits`](crate::NeverFits) at once).
    pub fn with_lease(
        config: GovernorConfig,
        source: Arc<dyn LeaseSource>,
        policy: LeasePolicy,
    ) -> Governor {
        let lease = Lease {
            source,
            policy,
            held: Mutex::new(BTreeMap::new()),
            retry: Mutex::new(BTreeMap::new()),
            grants: AtomicU64::new(0),
            local_grants: AtomicU64::new(0),
            top_ups: Mutex::new(LeaseStats::default()),
        };
        Governor {
            inner: Arc::new(Inner {
                config,
                ledger: Arc::new(Ledger::default()),
                reclaimers: Mutex::new(Vec::new()),
                lease: Some(lease),
            }),
        }
    }

    /// A handle that does not keep the governor alive.
    pub fn downgrade(&self) -> WeakGovernor {
        WeakGovernor(Arc::downgrade(&self.inner))
    }

    /// How the lease served grants so far (`None`: the governor is not leased).
    pub fn lease_stats(&self) -> Option<LeaseStats> {
        self.inner.lease.as_ref().map(|l| LeaseStats {
            grants: l.grants.load(Ordering::Relaxed),
            local_grants: l.local_grants.load(Ordering::Relaxed),
            ..*lock(&l.top_ups)
        })
    }

    /// Counts a grant asked of a leased governor; `local`: the lease had room for it.
    pub(crate) fn note_lease_grant(&self, local: bool) {
        if let Some(lease) = &self.inner.lease {
            lease.grants.fetch_add(1, Ordering::Relaxed);
            if local {
                lease.local_grants.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The bytes leased on `device` (`None`: the governor is not leased).
    pub fn lease_held(&self, device: DeviceId) -> Option<u64> {
        self.inner.lease.as_ref().map(|l| l.held(device))
    }

    /// Every device's lease: what a client re-claims from a restarted broker.
    pub fn lease_holdings(&self) -> Vec<(DeviceId, u64)> {
        self.inner.lease.as_ref().map_or_else(Vec::new, |l| {
            lock(&l.held).iter().map(|(d, b)| (*d, *b)).collect()
        })
    }

    /// `bytes` of the lease on `device` now belong to someone else (a prefix published to the
    /// broker, billed there from now on): the lease shrinks without giving them back. The
    /// memory stays counted in the books until the manager releases it, so the governor's
    /// room is smaller by `bytes` until then. Returns whether the lease held that much.
    pub fn hand_over_lease(&self, device: DeviceId, bytes: u64) -> bool {
        let Some(lease) = &self.inner.lease else {
            return false;
        };
        let mut held = lock(&lease.held);
        let h = held.entry(device).or_default();
        match h.checked_sub(bytes) {
            Some(rest) => {
                *h = rest;
                true
            }
            None => false,
        }
    }

    /// The lease on `device` is gone (a restarted broker refused to take it back): it drops
    /// to 0 without giving anything back, and the governor grants nothing there until its
    /// frees bring what it uses under a new lease. Returns what the lease held.
    pub fn forget_lease(&self, device: DeviceId) -> u64 {
        let Some(lease) = &self.inner.lease else {
            return 0;
        };
        lock(&lease.held).remove(&device).unwrap_or(0)
    }

    /// After a grant of `bytes` on `device` found only `available`: tops the lease up and
    /// grants if it now fits (`Ok(None)`: still short, or not leased). A source's
    /// [`NeverFits`](crate::NeverFits) is final; its backpressure is remembered for the
    /// refusal's `retry_after`.
    pub(crate) fn top_up_lease(
        &self,
        device: DeviceId,
        bytes: u64,
        available: u64,
    ) -> Result<Option<MappedGrowthGrant>, Refusal> {
        let Some(lease) = &self.inner.lease else {
            return Ok(None);
        };
        // Bytes handed over (a published prefix) are still used here until released, but no
        // longer leased: the lease is short of the books by that much, on top of the grant.
        let deficit = {
            let books = lock(&self.inner.ledger.books);
            Ledger::device_used(&books, device).saturating_sub(lease.held(device))
        };
        let need = bytes.saturating_sub(available).saturating_add(deficit);
        let want = need.max(lease.policy.batch);
        let began = Instant::now();
        let answer = lease.source.acquire(device, need, want);
        lock(&lease.top_ups).note_top_up(began.elapsed(), answer.is_err());
        match answer {
            Ok(granted) => {
                lock(&lease.retry).remove(&device);
                let mut held = lock(&lease.held);
                let h = held.entry(device).or_default();
                *h = h.saturating_add(granted);
            }
            Err(Refusal::NeverFits(n)) => return Err(n.into()),
            Err(Refusal::Backpressure(b)) => {
                lock(&lease.retry).insert(device, b.retry_after);
                return Ok(None);
            }
        }
        Ok(self.try_grant_locked(device, bytes).ok())
    }

    /// The `retry_after` the lease's source suggested when it last refused a top-up on
    /// `device` (`None`: not leased, or the last top-up was granted): the node's release
    /// rate, which the local estimate does not see.
    pub(crate) fn lease_retry_after(&self, device: DeviceId) -> Option<Duration> {
        let lease = self.inner.lease.as_ref()?;
        lock(&lease.retry).get(&device).copied()
    }

    /// Takes up to `bytes` of unused lease on `device` out of the books (`keep` left unused
    /// at least) and returns how many were taken; the caller gives them to the source.
    fn take_unused(&self, device: DeviceId, bytes: u64, keep: u64) -> u64 {
        let Some(lease) = &self.inner.lease else {
            return 0;
        };
        let books = lock(&self.inner.ledger.books);
        let mut held = lock(&lease.held);
        let h = held.entry(device).or_default();
        let unused = h.saturating_sub(Ledger::device_used(&books, device));
        let take = unused.saturating_sub(keep).min(bytes);
        *h -= take;
        take
    }

    /// After a free on `device`: gives unused lease above the policy's `keep` back.
    pub(crate) fn trim_lease(&self, device: DeviceId) {
        let Some(lease) = &self.inner.lease else {
            return;
        };
        let take = self.take_unused(device, u64::MAX, lease.policy.keep);
        if take > 0 {
            lease.source.give_back(device, take);
        }
    }

    /// The broker needs `bytes` on `device`: takes unused lease, first asking the registered
    /// reclaimers (the handle pool, idle prefixes) to free what is short, and returns the
    /// bytes taken out of the lease. The caller gives them back to the source.
    pub fn give_back_unused(&self, device: DeviceId, bytes: u64) -> u64 {
        let mut taken = self.take_unused(device, bytes, 0);
        if taken < bytes {
            let mut short = bytes - taken;
            for r in self.reclaimers() {
                if short == 0 {
                    break;
                }
                short = short.saturating_sub(r.reclaim(device, short));
            }
            taken = taken.saturating_add(self.take_unused(device, bytes - taken, 0));
        }
        taken
    }
}

#[cfg(test)]
#[path = "lease_tests.rs"]
mod tests;
