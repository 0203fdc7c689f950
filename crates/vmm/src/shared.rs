//! Shared physical handles: a shared prefix's windows as few large handles, mapped read-write
//! by its owner and read-only by any number of sharers (one mapping per handle), billed once.

use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use kvvm_governor::Bucket;
use kvvm_hal::PhysicalHandle;

use crate::error::VmmResult;

use crate::device::DeviceState;
use crate::device::Source;

/// One handle of a [`SharedHandles`] set: `windows` granule windows from `offset` (in the
/// owner's reservation), mapped whole wherever the set is mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SharedPiece {
    /// Offset of its first window in the owner's reservation (sharers map it there too).
    pub offset: u64,
    /// Granule windows it spans.
    pub windows: u64,
    /// The physical handle.
    pub handle: PhysicalHandle,
}

/// A set of physical handles that several reservations map at the same offsets: the granule
/// windows of a shared prefix, held as few large handles ([`pieces`](Self::pieces)).
///
/// Created by [`Reservation::commit_shared`](crate::Reservation::commit_shared) (the owner's
/// read-write mapping; the bytes are granted once and accounted as *shared* by the governor)
/// and mapped by sharers with [`Reservation::map_shared`](crate::Reservation::map_shared),
/// one mapping per handle. Every mapping holds a reference to the set, and so may a prefix
/// cache: the handles are released (to the pool or the driver) only when the last reference
/// is gone, which is after the owner and every sharer unmapped them (invariant 4). The owner
/// may finish first.
///
/// [`mapped_count`](Self::mapped_count) is the pool's reference count of live mappings, one
/// per mapped handle (`note_shared_map` / `note_unmapped`).
pub struct SharedHandles {
    vm: Arc<DeviceState>,
    pieces: Vec<SharedPiece>,
    /// Per piece: the index of its first window (a prefix sum, for [`window`](Self::window)).
    first_window: Vec<usize>,
    windows: usize,
    mappings: AtomicU64,
    /// Per piece: a mapping of it could not be proven idle, so it is never released.
    quarantined: Vec<AtomicBool>,
    /// Imported from another process's export: billed there, mapped read-only here, and
    /// released straight to the driver (never pooled) when the set is dropped.
    imported: bool,
}

impl fmt::Debug for SharedHandles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedHandles")
            .field("windows", &self.windows)
            .field("handles", &self.pieces.len())
            .field("mappings", &self.mapped_count())
            .finish()
    }
}

impl SharedHandles {
    /// A set of handles this manager created (billed here, as shared).
    pub(crate) fn new(vm: Arc<DeviceState>, pieces: Vec<SharedPiece>) -> Self {
        Self::with_origin(vm, pieces, false)
    }

    /// A set of handles imported from another process's export (billed there; see
    /// [`VirtualMemory::import_shared`](crate::VirtualMemory::import_shared)).
    pub(crate) fn imported(vm: Arc<DeviceState>, pieces: Vec<SharedPiece>) -> Self {
        Self::with_origin(vm, pieces, true)
    }

    fn with_origin(vm: Arc<DeviceState>, mut pieces: Vec<SharedPiece>, imported: bool) -> Self {
        pieces.sort_unstable_by_key(|p| p.offset);
        let quarantined = pieces.iter().map(|_| AtomicBool::new(false)).collect();
        let mut first_window = Vec::with_capacity(pieces.len());
        let mut windows = 0usize;
        for p in &pieces {
            first_window.push(windows);
            windows = windows.saturating_add(usize::try_from(p.windows).unwrap_or(usize::MAX));
        }
        SharedHandles {
            vm,
            pieces,
            first_window,
            windows,
            mappings: AtomicU64::new(0),
            quarantined,
            imported,
        }
    }

    /// Whether the set was imported from another process (mapped read-only only, billed
    /// where it was created).
    pub fn is_imported(&self) -> bool {
        self.imported
    }

    /// Each handle exported as a file descriptor (the manager must create handles as
    /// `ShareableHandleType::PosixFd`), with its piece: what another process imports with
    /// [`VirtualMemory::import_shared`](crate::VirtualMemory::import_shared) to map the same
    /// memory. The memory lives while any process holds a handle or a descriptor of it.
    pub fn export_fds(&self) -> VmmResult<Vec<(OwnedFd, SharedPiece)>> {
        let backend = &self.vm.ctx.backend;
        self.pieces
            .iter()
            .map(|p| Ok((backend.export_posix_fd(p.handle)?, *p)))
            .collect()
    }

    /// Number of granule windows in the set.
    pub fn len(&self) -> usize {
        self.windows
    }

    /// Whether the set has no window.
    pub fn is_empty(&self) -> bool {
        self.windows == 0
    }

    /// Number of physical handles (each mapped whole: one mapping per handle per holder).
    pub fn handle_count(&self) -> usize {
        self.pieces.len()
    }

    /// The handles, sorted by offset.
    pub fn pieces(&self) -> &[SharedPiece] {
        &self.pieces
    }

    /// The index of the piece holding window `i`.
    pub(crate) fn piece_of(&self, i: usize) -> Option<usize> {
        if i >= self.windows {
            return None;
        }
        self.first_window
            .partition_point(|&f| f <= i)
            .checked_sub(1)
    }

    /// Piece `k` with the index of its first window.
    pub(crate) fn piece_with_first_window(&self, k: usize) -> Option<(usize, SharedPiece)> {
        Some((*self.first_window.get(k)?, *self.pieces.get(k)?))
    }

    /// Window `i` (in offset order): its offset in the owner's reservation and the handle
    /// holding it.
    pub fn window(&self, i: usize) -> Option<(u64, PhysicalHandle)> {
        let k = self.piece_of(i)?;
        let p = self.pieces.get(k)?;
        let first = self.first_window.get(k)?;
        let within = (i.saturating_sub(*first)) as u64;
        Some((
            p.offset
                .saturating_add(within.saturating_mul(self.vm.ctx.granule)),
            p.handle,
        ))
    }

    /// Whether window `i` is the first window of its handle (or `i` is one past the last
    /// window): a boundary a partial mapping of the set may end at.
    pub fn starts_handle(&self, i: usize) -> bool {
        i == self.windows
            || self
                .piece_of(i)
                .and_then(|k| self.first_window.get(k))
                .is_some_and(|&f| f == i)
    }

    /// Every window with the handle holding it, sorted by offset (a handle appears once per
    /// window it spans).
    pub fn windows(&self) -> Vec<(u64, PhysicalHandle)> {
        (0..self.windows).filter_map(|i| self.window(i)).collect()
    }

    /// Physical bytes the set holds (billed once, however many map it).
    pub fn bytes(&self) -> u64 {
        (self.windows as u64).saturating_mul(self.vm.ctx.granule)
    }

    /// Live mappings of the set's handles (owner's and sharers'), one per mapped handle.
    pub fn mapped_count(&self) -> u64 {
        self.mappings.load(Ordering::Acquire)
    }

    pub(crate) fn is_from(&self, vm: &Arc<DeviceState>) -> bool {
        Arc::ptr_eq(&self.vm, vm)
    }

    /// A mapping of one handle was made.
    pub(crate) fn note_shared_map(&self) {
        self.mappings.fetch_add(1, Ordering::AcqRel);
    }

    /// A mapping of one handle was unmapped.
    pub(crate) fn note_unmapped(&self) {
        let _ = self
            .mappings
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    /// A mapping of the handle at `offset` could not be proven idle: it is never released.
    /// Returns whether this call quarantined bytes billed here (they then move from shared
    /// to quarantined, once; an imported set's are billed elsewhere).
    pub(crate) fn quarantine_window(&self, offset: u64) -> bool {
        let Ok(i) = self.pieces.binary_search_by_key(&offset, |p| p.offset) else {
            return false;
        };
        let first = self
            .quarantined
            .get(i)
            .is_some_and(|q| !q.swap(true, Ordering::AcqRel));
        first && !self.imported
    }

    /// Bytes of handles quarantined.
    pub fn quarantined_bytes(&self) -> u64 {
        self.pieces
            .iter()
            .zip(&self.quarantined)
            .filter(|(_, q)| q.load(Ordering::Acquire))
            .map(|(p, _)| p.windows.saturating_mul(self.vm.ctx.granule))
            .fold(0u64, u64::saturating_add)
    }
}

impl Drop for SharedHandles {
    fn drop(&mut self) {
        let _span = tracing::debug_span!(
            "vmm.shared_release",
            device = self.vm.ctx.device.0,
            handles = self.pieces.len()
        )
        .entered();
        let g = self.vm.ctx.granule;
        for (i, p) in self.pieces.drain(..).enumerate() {
            if self
                .quarantined
                .get(i)
                .is_some_and(|q| q.load(Ordering::Acquire))
            {
                // Still mapped where it cannot be proven idle: kept, accounted as quarantined.
                continue;
            }
            let bytes = p.windows.saturating_mul(g);
            // A failed release is quarantined inside `dispose` / `release_handle`.
            let _ = if self.imported {
                // Not this process's memory to pool: only its handle goes.
                self.vm
                    .ctx
                    .release_handle(p.handle, bytes, Source::Unbilled)
            } else {
                self.vm
                    .dispose(p.handle, bytes, Source::Bucket(Bucket::Shared))
            };
        }
    }
}
