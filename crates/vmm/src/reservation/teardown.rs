//! Teardown: what dropping a reservation does.
//!
//! Parked windows are treated like committed ones. If any block is left, the device is
//! synchronized first; if that fails, the memory cannot be proven idle and **nothing** is
//! unmapped, released or freed: the blocks and the range go to quarantine. Otherwise the blocks
//! are unmapped (as in release) and the range is freed; an unmap that fails quarantines the
//! remaining blocks and the range, a free that fails quarantines the range. A slot of a
//! strided range does not free it: the range goes with its last slot (`crate::strided`).

use std::sync::Arc;

use kvvm_governor::Bucket;
use kvvm_hal::BackendError;

use crate::block::Block;
use crate::device::quarantine::{QuarantineEntry, QuarantineReason};

use super::Reservation;

impl Reservation {
    /// Moves every block and the range to quarantine: owned bytes from committed to
    /// quarantined; a shared window still mapped here is quarantined in its set (never
    /// released, its bytes moved from shared to quarantined once), while the set itself is
    /// dropped as usual so that nothing else is kept alive.
    fn quarantine_blocks(&mut self, reason: QuarantineReason, error: BackendError) {
        let st = Arc::clone(&self.state);
        let ctx = &st.ctx;
        let mappings = self.mappings();
        let g = ctx.granule;
        let owned_bytes = self
            .blocks
            .iter()
            .filter(|b| b.shared.is_none())
            .map(|b| b.bytes(g))
            .fold(0u64, u64::saturating_add);
        ctx.account(ctx.governor.transfer(
            ctx.device,
            Bucket::Committed,
            Bucket::Quarantined,
            owned_bytes,
        ));
        let mut shared_bytes = 0u64;
        for b in self.blocks.drain(..) {
            let size = b.bytes(g);
            if let Some(set) = b.shared {
                if set.quarantine_window(b.offset) {
                    shared_bytes = shared_bytes.saturating_add(size);
                }
            }
        }
        ctx.account(ctx.governor.transfer(
            ctx.device,
            Bucket::Shared,
            Bucket::Quarantined,
            shared_bytes,
        ));
        let bytes = owned_bytes.saturating_add(shared_bytes);
        ctx.quarantine.add(QuarantineEntry::mapped_range(
            reason, self.base, self.size, mappings, bytes, error,
        ));
    }
}

impl Reservation {
    /// Keeps a shared driver range reserved forever: called when this reservation's memory
    /// is quarantined (still mapped), so that neither it nor its sibling slots free the range.
    fn pin_shared_range(&mut self) {
        if let Some(range) = self.shared_range.take() {
            std::mem::forget(range);
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let st = Arc::clone(&self.state);
        let ctx = &st.ctx;
        let span = tracing::debug_span!(
            "vmm.teardown",
            device = ctx.device.0,
            base = self.base.0,
            blocks = self.blocks.len()
        );
        let _e = span.enter();
        // What a dropped job could not unmap is this reservation's to unmap.
        let back = self.left_mapped.close();
        self.insert_blocks(back.into_iter());
        // Parked windows are torn down like committed ones.
        if let Some(parked) = self.parked.clone() {
            let windows = parked.take_all(ctx, &st.pool);
            self.insert_blocks(windows.into_iter().map(|(o, n, h)| Block::owned(o, n, h)));
        }
        if !self.blocks.is_empty() {
            // Every device given access may still be using the memory.
            if let Err(error) = ctx.synchronize_all() {
                tracing::warn!(
                    base = %self.base,
                    blocks = self.blocks.len(),
                    %error,
                    "reservation teardown synchronization failed; quarantining its blocks \
                     and address range (nothing unmapped, released or freed)"
                );
                self.quarantine_blocks(QuarantineReason::TeardownSyncFailed, error);
                self.pin_shared_range();
                return;
            }
            if let (_, Some(error)) = self.unmap_from(&st, 0) {
                if !self.blocks.is_empty() {
                    self.quarantine_blocks(QuarantineReason::UnmapFailed, error);
                    self.pin_shared_range();
                    return;
                }
            }
        }
        if let Some(range) = self.shared_range.take() {
            // A slot: the shared range is freed with its last slot.
            drop(range);
            return;
        }
        if let Err(error) = ctx.backend.free(self.base, self.size) {
            tracing::warn!(base = %self.base, size = self.size, %error, "address free failed; range quarantined");
            ctx.quarantine
                .add(QuarantineEntry::free_failed(self.base, self.size, error));
        }
    }
}
