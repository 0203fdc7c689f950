//! What a leased governor is built on: the [`LeaseSource`] its bytes come from, the
//! [`LeasePolicy`] of its top-ups and trims, and the [`Lease`] it holds (bytes per device).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvvm_hal::DeviceId;

use crate::books::{lock, Books, Ledger};
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

/// The lease a governor holds.
pub(crate) struct Lease {
    pub(crate) source: Arc<dyn LeaseSource>,
    pub(crate) policy: LeasePolicy,
    pub(crate) held: Mutex<BTreeMap<DeviceId, u64>>,
    pub(crate) retry: Mutex<BTreeMap<DeviceId, Duration>>,
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
