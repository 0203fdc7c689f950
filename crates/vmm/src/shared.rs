//! Shared physical handles: one allocation per granule window, mapped read-write by its owner
//! and read-only by any number of sharers, billed once.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use kvvm_governor::Bucket;
use kvvm_hal::PhysicalHandle;

use crate::device::Source;
use crate::state::DeviceState;

/// A set of physical handles that several reservations map at the same offsets: the granule
/// windows of a shared prefix.
///
/// Created by [`Reservation::commit_shared`](crate::Reservation::commit_shared) (the owner's
/// read-write mapping; the bytes are granted once and accounted as *shared* by the governor)
/// and mapped by sharers with [`Reservation::map_shared`](crate::Reservation::map_shared).
/// Every mapping holds a reference to the set, and so may a prefix cache: the handles are
/// released (to the pool or the driver) only when the last reference is gone, which is after
/// the owner and every sharer unmapped them (invariant 4). The owner may finish first.
///
/// [`mapped_count`](Self::mapped_count) is the pool's reference count of live mappings
/// (`note_shared_map` / `note_unmapped`).
pub struct SharedHandles {
    vm: Arc<DeviceState>,
    windows: Vec<(u64, PhysicalHandle)>,
    mappings: AtomicU64,
    /// Per window: a mapping of it could not be proven idle, so it is never released.
    quarantined: Vec<AtomicBool>,
}

impl fmt::Debug for SharedHandles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedHandles")
            .field("windows", &self.windows.len())
            .field("mappings", &self.mapped_count())
            .finish()
    }
}

impl SharedHandles {
    pub(crate) fn new(vm: Arc<DeviceState>, windows: Vec<(u64, PhysicalHandle)>) -> Self {
        let quarantined = windows.iter().map(|_| AtomicBool::new(false)).collect();
        SharedHandles {
            vm,
            windows,
            mappings: AtomicU64::new(0),
            quarantined,
        }
    }

    /// Number of granule windows (handles) in the set.
    pub fn len(&self) -> usize {
        self.windows.len()
    }

    /// Whether the set has no window.
    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }

    /// Window `i`: its offset in the owner's reservation and its handle.
    pub fn window(&self, i: usize) -> Option<(u64, PhysicalHandle)> {
        self.windows.get(i).copied()
    }

    /// Every window, sorted by offset.
    pub fn windows(&self) -> &[(u64, PhysicalHandle)] {
        &self.windows
    }

    /// Physical bytes the set holds (billed once, however many map it).
    pub fn bytes(&self) -> u64 {
        (self.windows.len() as u64).saturating_mul(self.vm.ctx.granule)
    }

    /// Live mappings of the set's handles (owner's and sharers'), counted per window.
    pub fn mapped_count(&self) -> u64 {
        self.mappings.load(Ordering::Acquire)
    }

    pub(crate) fn is_from(&self, vm: &Arc<DeviceState>) -> bool {
        Arc::ptr_eq(&self.vm, vm)
    }

    /// A mapping of one window was made.
    pub(crate) fn note_shared_map(&self) {
        self.mappings.fetch_add(1, Ordering::AcqRel);
    }

    /// A mapping of one window was unmapped.
    pub(crate) fn note_unmapped(&self) {
        let _ = self
            .mappings
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    /// A mapping of the window at `offset` could not be proven idle: its handle is never
    /// released. Returns whether this call quarantined it (its bytes then move from shared to
    /// quarantined, once).
    pub(crate) fn quarantine_window(&self, offset: u64) -> bool {
        let Ok(i) = self.windows.binary_search_by_key(&offset, |(o, _)| *o) else {
            return false;
        };
        self.quarantined
            .get(i)
            .is_some_and(|q| !q.swap(true, Ordering::AcqRel))
    }

    /// Bytes of windows quarantined.
    pub fn quarantined_bytes(&self) -> u64 {
        let n = self
            .quarantined
            .iter()
            .filter(|q| q.load(Ordering::Acquire))
            .count();
        self.vm.ctx.granules(n)
    }
}

impl Drop for SharedHandles {
    fn drop(&mut self) {
        let _span = tracing::debug_span!(
            "vmm.shared_release",
            device = self.vm.ctx.device.0,
            windows = self.windows.len()
        )
        .entered();
        for (i, (_, handle)) in self.windows.drain(..).enumerate() {
            if self
                .quarantined
                .get(i)
                .is_some_and(|q| q.load(Ordering::Acquire))
            {
                // Still mapped where it cannot be proven idle: kept, accounted as quarantined.
                continue;
            }
            // A failed release is quarantined inside `dispose`.
            let _ = self.vm.dispose(handle, Source::Bucket(Bucket::Shared));
        }
    }
}
