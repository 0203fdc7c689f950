//! A [`SharedDevicePrefix`]'s home view: the prefix's own read-only mapping of its handles,
//! in a reservation of its own, what copies of its bytes read from (a sharer never needs the
//! owner's memory, which may be gone, or in another process); and its tail, captured there
//! from the owner when the prefix is sealed.
//!
//! The view maps the tail's handles, and the read-only windows' once a copy needs bytes inside
//! them, at the plan's offsets (the same offsets as in every sequence), so a byte of the
//! prefix lies at the same offset from the view's base as from a sequence's. It costs address
//! space and one mapping per handle, no physical byte of its own. It is made at the first need
//! and dropped with the prefix.
//!
//! A tail made for a prefix cache's entry is memory the cache may give back under pressure
//! ([`SharedDevicePrefix::release_tail`]): the entry then hands on only the tokens of its
//! read-only windows. Copies read the view with its lock held, and an admission pins the tails
//! it copies from ([`TailPins`]), so a tail is never given back under a copy.
//!
//! Lock order: a prefix cache's lock, then a prefix's home lock. The one call made with a home
//! lock held that may reach a cache's lock is the tail's commit when the owner seals
//! ([`SharedDevicePrefix::capture_tail`]: a grant may ask the governor's reclaimers); a prefix
//! being sealed is in no cache yet (a cache takes only sealed prefixes), so no thread holding
//! a cache's lock waits for its home lock.

use std::sync::{Arc, MutexGuard};

use kvvm_hal::{Access, DeviceAddress, RowCopy};
use kvvm_num::{add, mul};
use kvvm_vmm::{Reservation, SharedHandles, VirtualMemory};

use crate::device_copy::copy_rows;
use crate::error::KvCacheError;
use crate::sequence::prefix::SharedDevicePrefix;
use crate::sequence::SequenceKv;

/// The home view of a prefix and its tail's handles (see the module's doc).
#[derive(Default)]
pub(crate) struct Home {
    /// The view, once made.
    view: Option<Reservation>,
    /// Handles of the read-only set mapped in the view (each mapping holds one reference).
    pub(crate) set_mappings: u64,
    /// The tail's handles: windows `[end_window, tail_end_window)` of every fragment, holding
    /// the prefix's bytes up to its last token; `None` until captured (or imported), and
    /// after it was given back.
    pub(crate) tail: Option<Arc<SharedHandles>>,
    /// The tail belongs to a prefix cache's entry, which may give it back under pressure.
    cache_tail: bool,
    /// Admissions copying from the tail now: it is not given back meanwhile.
    pins: u64,
}

/// The tails of a chain of segments pinned while an admission copies from them: none is given
/// back under pressure until the pins are dropped.
pub(crate) struct TailPins(Vec<Arc<SharedDevicePrefix>>);

impl TailPins {
    /// Pins every tail of `prefixes`.
    pub(crate) fn new<'a>(prefixes: impl Iterator<Item = &'a Arc<SharedDevicePrefix>>) -> Self {
        let held: Vec<Arc<SharedDevicePrefix>> = prefixes.cloned().collect();
        for p in &held {
            p.lock_home().pins += 1;
        }
        TailPins(held)
    }
}

impl Drop for TailPins {
    fn drop(&mut self) {
        for p in &self.0 {
            let mut home = p.lock_home();
            home.pins = home.pins.saturating_sub(1);
        }
    }
}

impl SharedDevicePrefix {
    /// The home state, locked (poisoning ignored: every update leaves it consistent).
    pub(crate) fn lock_home(&self) -> MutexGuard<'_, Home> {
        self.home
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `copy` with the base address of the home view, its lock held (nothing is given
    /// back under the copy), the view made in `vm` (the prefix's manager) if it was not yet:
    /// the prefix's byte at offset `o` of a sequence lies at `o` from it. The tail is mapped
    /// there from the start; the read-only windows only once `readonly` asks for them (a copy
    /// of bytes inside them, for a hit that maps fewer windows than the prefix has).
    pub(crate) fn with_home<T>(
        &self,
        vm: &VirtualMemory,
        readonly: bool,
        copy: impl FnOnce(DeviceAddress) -> Result<T, KvCacheError>,
    ) -> Result<T, KvCacheError> {
        let mut home = self.lock_home();
        let base = self.view_in(vm, &mut home)?;
        if readonly && home.set_mappings == 0 && !self.set.is_empty() {
            let view = home.view.as_mut().ok_or_else(no_view)?;
            view.map_shared_ranges(&self.set, &whole(&self.set), Access::Read)?;
            home.set_mappings = self.set.handle_count() as u64;
        }
        copy(base)
    }

    /// Marks the tail, once made, as a prefix cache's entry's: the cache may give it back
    /// under pressure ([`release_tail`](Self::release_tail)).
    pub(crate) fn mark_cache_tail(&self) {
        self.lock_home().cache_tail = true;
    }

    /// Bytes of a tail the cache may give back now (a cache's, not pinned by an admission).
    pub(crate) fn releasable_tail_bytes(&self) -> u64 {
        let home = self.lock_home();
        match &home.tail {
            Some(t) if home.cache_tail && home.pins == 0 => t.bytes(),
            _ => 0,
        }
    }

    /// Gives back the tail of a prefix cache's entry that no admission is copying from: its
    /// windows are unmapped from the home view and its handles released (the pool or the
    /// driver; the governor credited). The prefix then hands on only the tokens of its
    /// read-only windows ([`tokens`](Self::tokens)). Returns the bytes given back (0: none, or
    /// pinned, or not the cache's to give back, or an unmap failed and left it recorded).
    pub(crate) fn release_tail(&self) -> u64 {
        let mut home = self.lock_home();
        if !home.cache_tail || home.pins > 0 {
            return 0;
        }
        let Some(tail) = home.tail.take() else {
            return 0;
        };
        let g = self.plan.granule();
        let ranges: Vec<(u64, u64)> = tail
            .pieces()
            .iter()
            .map(|p| (p.offset, p.windows.saturating_mul(g)))
            .collect();
        if let Some(view) = home.view.as_mut() {
            if let Err(e) = view.release_ranges(&ranges) {
                tracing::warn!(error = %e, "giving a prefix's tail back failed; it stays");
                home.tail = Some(tail);
                return 0;
            }
        }
        let bytes = tail.bytes();
        drop(tail);
        bytes
    }

    /// Whether nothing but this prefix holds its read-only handles: no sequence maps them and
    /// no other holder keeps a reference (the home view's own mappings aside).
    pub(crate) fn held_only_here(&self) -> bool {
        let own = self.lock_home().set_mappings;
        self.mapped_count() == 0
            && u64::try_from(Arc::strong_count(&self.set)) == Ok(own.saturating_add(1))
    }

    /// Makes the tail from the owner's memory and records it: commits, in the home view, one
    /// shared window per fragment beyond the read-only windows (billed once, as shared) and
    /// copies the prefix's bytes `[end_window x granule, prefix_len x bytes per token)` of
    /// every fragment from `owner` into them. Nothing to do when the prefix ends on a window
    /// boundary or the tail was made already.
    ///
    /// Errors: backpressure for the tail's windows; driver failures (the tail's windows are
    /// then given back with the view).
    pub(crate) fn capture_tail(&self, owner: &SequenceKv) -> Result<(), KvCacheError> {
        let width = self.tail_bytes();
        let mut home = self.lock_home();
        if width == 0 || home.tail.is_some() {
            return Ok(());
        }
        let base = self.view_in(owner.vm(), &mut home)?;
        let g = self.plan.granule();
        let start = mul(self.end_window, g, "tail offset")?;
        let stride = self.plan.slice_stride();
        let ranges = (0..self.plan.slice_count())
            .map(|f| {
                Ok((
                    add(mul(f, stride, "fragment")?, start, "tail offset")?,
                    width,
                ))
            })
            .collect::<Result<Vec<(u64, u64)>, KvCacheError>>()?;
        let view = home.view.as_mut().ok_or_else(no_view)?;
        let tail = view.commit_shared(&ranges)?;
        let copy = RowCopy {
            dst: DeviceAddress(add(base.0, start, "tail address")?),
            dst_pitch: stride,
            src: DeviceAddress(add(owner.address().0, start, "tail address")?),
            src_pitch: stride,
            width,
            rows: self.plan.slice_count(),
        };
        // On a failed copy the tail is not recorded: it goes back with the view.
        copy_rows(owner.vm(), &[copy])?;
        home.tail = Some(tail);
        Ok(())
    }

    /// Records the tail handles another process exported (read-only here).
    pub(crate) fn set_imported_tail(&self, tail: Arc<SharedHandles>) {
        self.lock_home().tail = Some(tail);
    }

    /// The tail's handles, once made or imported.
    pub(crate) fn tail_handles(&self) -> Option<Arc<SharedHandles>> {
        self.lock_home().tail.clone()
    }

    /// The view's base, making it when missing: a reservation up to the end of the tail's
    /// windows of the last fragment, an imported tail mapped `Read`.
    fn view_in(&self, vm: &VirtualMemory, home: &mut Home) -> Result<DeviceAddress, KvCacheError> {
        if let Some(view) = &home.view {
            return Ok(view.address());
        }
        let g = self.plan.granule();
        let last = mul(
            self.plan.slice_count().saturating_sub(1),
            self.plan.slice_stride(),
            "home view size",
        )?;
        let windows = self.tail_end_window().max(1);
        let size = add(last, mul(windows, g, "home view size")?, "home view size")?;
        let mut view = vm.reserve(size)?;
        if let Some(tail) = &home.tail {
            view.map_shared_ranges(tail, &whole(tail), Access::Read)?;
        }
        let base = view.address();
        home.view = Some(view);
        home.set_mappings = 0;
        Ok(base)
    }
}

/// Every window of `set`, as the one index range a mapping of the whole set names.
fn whole(set: &SharedHandles) -> [std::ops::Range<usize>; 1] {
    let all = 0..set.len();
    [all]
}

fn no_view() -> KvCacheError {
    KvCacheError::PlanMismatch {
        reason: "the prefix's home view is missing".to_owned(),
    }
}
