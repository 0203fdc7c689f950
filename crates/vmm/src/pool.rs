//! The handle pool: unmapped handles (one granule each) kept for reuse, and the count of parked
//! windows, which are pooled memory too. Both count against one cap; the pool's bytes are
//! charged to the governor as *pooled*.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use kvvm_governor::Bucket;
use kvvm_hal::{BackendError, PhysicalHandle};

use crate::device::{DeviceContext, Source};
use crate::sync::lock;

#[derive(Debug, Default)]
struct Free {
    handles: Vec<PhysicalHandle>,
    cap_bytes: u64,
}

/// Free handles and the parked-bytes count, under one cap.
#[derive(Debug, Default)]
pub(crate) struct HandlePool {
    free: Mutex<Free>,
    /// Bytes parked in all reservations (part of the pooled bytes).
    parked_bytes: AtomicU64,
}

impl HandlePool {
    pub(crate) fn new(cap_bytes: u64) -> Self {
        HandlePool {
            free: Mutex::new(Free {
                handles: Vec::new(),
                cap_bytes,
            }),
            parked_bytes: AtomicU64::new(0),
        }
    }

    /// Takes up to `n` handles out of the pool. They stay accounted as pooled until the
    /// caller settles them.
    pub(crate) fn take(&self, n: u64) -> Vec<PhysicalHandle> {
        if n == 0 {
            return Vec::new();
        }
        let mut free = lock(&self.free);
        let keep = free
            .handles
            .len()
            .saturating_sub(usize::try_from(n).unwrap_or(usize::MAX));
        free.handles.split_off(keep)
    }

    /// Puts handles taken by [`take`](Self::take) back (accounted as pooled all along);
    /// releases those that no longer fit.
    pub(crate) fn untake(&self, ctx: &DeviceContext, handles: Vec<PhysicalHandle>) {
        for h in handles {
            // A failed release is quarantined and logged inside.
            let _ = self.dispose(ctx, h, Source::Bucket(Bucket::Pooled));
        }
    }

    /// Returns an unmapped handle to the pool if it fits, otherwise releases it; a failed
    /// release quarantines it (and is returned after that). Returns the bytes released to the
    /// driver.
    pub(crate) fn dispose(
        &self,
        ctx: &DeviceContext,
        handle: PhysicalHandle,
        source: Source<'_>,
    ) -> Result<u64, BackendError> {
        let g = ctx.granule;
        {
            let mut free = lock(&self.free);
            if self.held(&free, g).saturating_add(g) <= free.cap_bytes {
                // Account before the handle becomes visible to other threads.
                ctx.account(source.settle(ctx, Bucket::Pooled, g));
                free.handles.push(handle);
                return Ok(0);
            }
        }
        ctx.release_handle(handle, source)
    }

    fn held(&self, free: &Free, g: u64) -> u64 {
        (free.handles.len() as u64)
            .saturating_mul(g)
            .saturating_add(self.parked_bytes())
    }

    /// Bytes held: free handles and parked windows.
    pub(crate) fn held_bytes(&self, g: u64) -> u64 {
        self.held(&lock(&self.free), g)
    }

    /// Releases free handles until at most `keep_bytes` of pooled memory (parked windows
    /// included) stay, or no free handle is left; returns the bytes released.
    pub(crate) fn trim_free(&self, ctx: &DeviceContext, keep_bytes: u64) -> u64 {
        let g = ctx.granule;
        let victims = {
            let mut free = lock(&self.free);
            let keep = keep_bytes.saturating_sub(self.parked_bytes()) / g;
            let keep = usize::try_from(keep).unwrap_or(usize::MAX);
            let keep = free.handles.len().min(keep);
            free.handles.split_off(keep)
        };
        victims
            .into_iter()
            .map(|h| {
                ctx.release_handle(h, Source::Bucket(Bucket::Pooled))
                    .unwrap_or(0)
            })
            .fold(0u64, u64::saturating_add)
    }

    /// The free handles.
    pub(crate) fn handles(&self) -> Vec<PhysicalHandle> {
        lock(&self.free).handles.clone()
    }

    /// The cap in bytes.
    pub(crate) fn cap_bytes(&self) -> u64 {
        lock(&self.free).cap_bytes
    }

    /// Changes the cap (the caller trims).
    pub(crate) fn set_cap_bytes(&self, bytes: u64) {
        lock(&self.free).cap_bytes = bytes;
    }

    /// Bytes of parked windows.
    pub(crate) fn parked_bytes(&self) -> u64 {
        self.parked_bytes.load(Ordering::Acquire)
    }

    /// Counts `g` more parked bytes if the cap allows it; returns whether it did.
    pub(crate) fn try_add_parked(&self, g: u64) -> bool {
        let free = lock(&self.free);
        if self.held(&free, g).saturating_add(g) <= free.cap_bytes {
            self.parked_bytes.fetch_add(g, Ordering::AcqRel);
            true
        } else {
            false
        }
    }

    /// Counts `bytes` back into the parked bytes (windows taken out and put back; the cap was
    /// checked when they were first parked).
    pub(crate) fn add_parked(&self, bytes: u64) {
        self.parked_bytes.fetch_add(bytes, Ordering::AcqRel);
    }

    /// `bytes` of parked windows left the parked state.
    pub(crate) fn remove_parked(&self, bytes: u64) {
        let _ = self
            .parked_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
                Some(p.saturating_sub(bytes))
            });
    }
}
