//! The handle pool: unmapped handles kept for reuse by size (a commit reuses a handle of
//! exactly the size one of its mappings needs, else creates one), and the count of parked
//! windows, which are pooled memory too. Both count against one cap; the pool's bytes are
//! charged to the governor as *pooled*.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use kvvm_governor::Bucket;
use kvvm_hal::{BackendError, PhysicalHandle};

use crate::device::{DeviceContext, Source};
use crate::sync::lock;

#[derive(Debug, Default)]
struct Free {
    /// Free handles by size in bytes (a handle is reused only for a mapping of its size).
    by_size: BTreeMap<u64, Vec<PhysicalHandle>>,
    /// Bytes of the free handles.
    bytes: u64,
    cap_bytes: u64,
}

impl Free {
    /// Takes the last handle of `size` out.
    fn pop(&mut self, size: u64) -> Option<PhysicalHandle> {
        let list = self.by_size.get_mut(&size)?;
        let h = list.pop()?;
        if list.is_empty() {
            self.by_size.remove(&size);
        }
        self.bytes = self.bytes.saturating_sub(size);
        Some(h)
    }
}

/// Free handles (kept by size) and the parked-bytes count, under one cap.
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
                by_size: BTreeMap::new(),
                bytes: 0,
                cap_bytes,
            }),
            parked_bytes: AtomicU64::new(0),
        }
    }

    /// Takes a handle of exactly `size` bytes out of the pool, if one is there. It stays
    /// accounted as pooled until the caller settles it.
    pub(crate) fn take(&self, size: u64) -> Option<PhysicalHandle> {
        lock(&self.free).pop(size)
    }

    /// Puts handles taken by [`take`](Self::take) back (accounted as pooled all along);
    /// releases those that no longer fit.
    pub(crate) fn untake(&self, ctx: &DeviceContext, handles: Vec<(PhysicalHandle, u64)>) {
        for (h, size) in handles {
            // A failed release is quarantined and logged inside.
            let _ = self.dispose(ctx, h, size, Source::Bucket(Bucket::Pooled));
        }
    }

    /// Returns an unmapped handle of `size` bytes to the pool if it fits, otherwise releases
    /// it; a failed release quarantines it (and is returned after that). Returns the bytes
    /// released to the driver.
    pub(crate) fn dispose(
        &self,
        ctx: &DeviceContext,
        handle: PhysicalHandle,
        size: u64,
        source: Source<'_>,
    ) -> Result<u64, BackendError> {
        {
            let mut free = lock(&self.free);
            if self.held(&free).saturating_add(size) <= free.cap_bytes {
                // Account before the handle becomes visible to other threads.
                ctx.account(source.settle(ctx, Bucket::Pooled, size));
                free.by_size.entry(size).or_default().push(handle);
                free.bytes = free.bytes.saturating_add(size);
                return Ok(0);
            }
        }
        ctx.release_handle(handle, size, source)
    }

    fn held(&self, free: &Free) -> u64 {
        free.bytes.saturating_add(self.parked_bytes())
    }

    /// Bytes held: free handles and parked windows.
    pub(crate) fn held_bytes(&self) -> u64 {
        self.held(&lock(&self.free))
    }

    /// Releases free handles until at most `keep_bytes` of pooled memory (parked windows
    /// included) stay, or no free handle is left; returns the bytes released. Each step
    /// releases the smallest handle that covers what is still over, else the largest.
    pub(crate) fn trim_free(&self, ctx: &DeviceContext, keep_bytes: u64) -> u64 {
        let victims = {
            let mut free = lock(&self.free);
            let mut victims = Vec::new();
            loop {
                let over = self.held(&free).saturating_sub(keep_bytes);
                if over == 0 {
                    break;
                }
                let size = free
                    .by_size
                    .range(over..)
                    .next()
                    .or_else(|| free.by_size.iter().next_back())
                    .map(|(s, _)| *s);
                let Some(size) = size else { break };
                let Some(h) = free.pop(size) else { break };
                victims.push((h, size));
            }
            victims
        };
        victims
            .into_iter()
            .map(|(h, size)| {
                ctx.release_handle(h, size, Source::Bucket(Bucket::Pooled))
                    .unwrap_or(0)
            })
            .fold(0u64, u64::saturating_add)
    }

    /// The free handles.
    pub(crate) fn handles(&self) -> Vec<PhysicalHandle> {
        lock(&self.free)
            .by_size
            .values()
            .flat_map(|v| v.iter().copied())
            .collect()
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
        if self.held(&free).saturating_add(g) <= free.cap_bytes {
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
