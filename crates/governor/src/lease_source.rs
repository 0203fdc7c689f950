//! What a leased governor is built on: the [`LeaseSource`] its bytes come from, the
//! [`LeasePolicy`] of its top-ups and trims, and the [`Lease`] it holds (bytes per device).

use kvvm_hal::sync::lock;
use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvvm_hal::DeviceId;

use crate::books::{Books, Ledger};
use crate::error::Refusal;

/// Where a leased governor's bytes come from (a broker client).
pub trait LeaseSource: Send + Sync {
    /// Asks for at least `need` and at most `want` more bytes on `device`; returns the bytes
    /// granted (at least `need`). Called without any governor lock held.
    fn acquire(&self, device: DeviceId, need: u64, want: u64) -> Result<u64, Refusal>;

    /// Gives `bytes` on `device` back; the governor has already stopped counting them.
    fn give_back(&self, device: DeviceId, bytes: u64);
}

/// How a leased governor tops up and trims its lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeasePolicy {
    /// A top-up asks for at least this many bytes (more when a grant needs more).
    pub batch: u64,
    /// After a free, unused lease above this is given back.
    pub keep: u64,
}

impl LeasePolicy {
    /// Top-ups of `batch` bytes; up to two batches kept unused.
    pub fn batches_of(batch: u64) -> Self {
        LeasePolicy {
            batch,
            keep: batch.saturating_mul(2),
        }
    }
}

/// How a leased governor's grants went since it was made: how many the lease covered without
/// asking its source, and the source's round trips (top-ups) with their time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseStats {
    /// Grants asked for (granted or refused).
    pub grants: u64,
    /// Grants the lease held room for: no round trip to the source.
    pub local_grants: u64,
    /// Top-ups asked of the source (one round trip each).
    pub top_ups: u64,
    /// Top-ups the source refused (backpressure or never fits).
    pub top_up_refusals: u64,
    /// Time spent in top-ups, in all.
    pub top_up_time: Duration,
    /// The longest top-up.
    pub top_up_max: Duration,
}

impl LeaseStats {
    /// The share of grants served from the lease without a round trip (`None` before the
    /// first grant).
    pub fn hit_rate(&self) -> Option<f64> {
        (self.grants > 0).then(|| self.local_grants as f64 / self.grants as f64)
    }

    /// The mean top-up round trip (`None` before the first).
    pub fn mean_top_up(&self) -> Option<Duration> {
        u32::try_from(self.top_ups)
            .ok()
            .filter(|&n| n > 0)
            .map(|n| self.top_up_time / n)
    }

    /// Records a top-up of `took`, refused or not.
    pub(crate) fn note_top_up(&mut self, took: Duration, refused: bool) {
        self.top_ups = self.top_ups.saturating_add(1);
        self.top_up_refusals = self.top_up_refusals.saturating_add(u64::from(refused));
        self.top_up_time = self.top_up_time.saturating_add(took);
        self.top_up_max = self.top_up_max.max(took);
    }
}

/// The lease a governor holds.
pub(crate) struct Lease {
    pub(crate) source: Arc<dyn LeaseSource>,
    pub(crate) policy: LeasePolicy,
    pub(crate) held: Mutex<BTreeMap<DeviceId, u64>>,
    pub(crate) retry: Mutex<BTreeMap<DeviceId, Duration>>,
    /// Grants asked, and those the lease had room for: counted on every grant, so atomics
    /// (statistics only: no decision reads them).
    pub(crate) grants: AtomicU64,
    pub(crate) local_grants: AtomicU64,
    /// The top-ups' figures (a top-up is a round trip; its lock costs nothing beside it).
    pub(crate) top_ups: Mutex<LeaseStats>,
}

impl Lease {
    pub(crate) fn held(&self, device: DeviceId) -> u64 {
        lock(&self.held).get(&device).copied().unwrap_or(0)
    }

    /// Bytes of the lease on `device` not used or pending in `books`.
    pub(crate) fn room(&self, books: &Books, device: DeviceId) -> u64 {
        self.held(device)
            .saturating_sub(Ledger::device_used(books, device))
    }
}
