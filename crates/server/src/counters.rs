//! The service's counters: atomics bumped by the service and by the HTTP layer's outcome of
//! every request, read as a [`Counters`] snapshot for `/metrics`.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::api::Counters;

#[derive(Debug, Default)]
pub(crate) struct AtomicCounters {
    pub(crate) sequences_created: AtomicU64,
    pub(crate) sequences_released: AtomicU64,
    pub(crate) sequences_expired: AtomicU64,
    pub(crate) appends: AtomicU64,
    pub(crate) grants_refused: AtomicU64,
    pub(crate) bad_requests: AtomicU64,
    pub(crate) internal_errors: AtomicU64,
    pub(crate) unavailable: AtomicU64,
    pub(crate) prefix_hits: AtomicU64,
    pub(crate) prefix_hit_tokens: AtomicU64,
    pub(crate) prefixes_published: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64, by: u64) {
    c.fetch_add(by, Ordering::Relaxed);
}

impl AtomicCounters {
    /// Counts a response by its status: 429, 503, another 4xx, another 5xx.
    pub(crate) fn note_status(&self, status: u16) {
        match status {
            429 => bump(&self.grants_refused, 1),
            503 => bump(&self.unavailable, 1),
            400..=499 => bump(&self.bad_requests, 1),
            500..=599 => bump(&self.internal_errors, 1),
            _ => {}
        }
    }

    pub(crate) fn snapshot(&self) -> Counters {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counters {
            sequences_created: get(&self.sequences_created),
            sequences_released: get(&self.sequences_released),
            sequences_expired: get(&self.sequences_expired),
            appends: get(&self.appends),
            grants_refused: get(&self.grants_refused),
            bad_requests: get(&self.bad_requests),
            internal_errors: get(&self.internal_errors),
            unavailable: get(&self.unavailable),
            prefix_hits: get(&self.prefix_hits),
            prefix_hit_tokens: get(&self.prefix_hit_tokens),
            prefixes_published: get(&self.prefixes_published),
        }
    }
}
