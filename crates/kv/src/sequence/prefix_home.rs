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
    /// the prefix's bytes up to its last token; `None` until captured (or imported).
    pub(crate) tail: Option<Arc<SharedHandles>>,
}

impl SharedDevicePrefix {
    /// The home state, locked (poisoning ignored: every update leaves it consistent).
    pub(crate) fn lock_home(&self) -> MutexGuard<'_, Home> {
        self.home
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Base address of the home view, made in `vm` (the prefix's manager) if it was not yet:
    /// the prefix's byte at offset `o` of a sequence lies at `o` from it. The tail is mapped
    /// there from the start; the read-only windows only once `readonly` asks for them (a copy
    /// of bytes inside them, for a hit that maps fewer windows than the prefix has).
    pub(crate) fn home_address(
        &self,
        vm: &VirtualMemory,
        readonly: bool,
    ) -> Result<DeviceAddress, KvCacheError> {
        let mut home = self.lock_home();
        let base = self.view_in(vm, &mut home)?;
        if readonly && home.set_mappings == 0 && !self.set.is_empty() {
            let view = home.view.as_mut().ok_or_else(no_view)?;
            view.map_shared_ranges(&self.set, &whole(&self.set), Access::Read)?;
            home.set_mappings = self.set.handle_count() as u64;
        }
        Ok(base)
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
