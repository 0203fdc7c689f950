//! Release and truncate: unmapping a reservation's blocks while keeping its address range.
//!
//! Runs of adjacent blocks are unmapped with one call where the backend allows it
//! ([`Capabilities::unmap_spans_mappings`](kvvm_hal::Capabilities)), one call per block
//! otherwise. Owned handles go to the pool or the driver; a shared block only drops its
//! reference to its set. Blocks whose unmap fails stay recorded (still mapped), handles whose
//! release fails are quarantined, and the first error is returned after every other block was
//! processed. With parking on, released owned windows are parked first (`crate::device::parking`).

use std::sync::Arc;

use kvvm_governor::Bucket;
use kvvm_hal::BackendError;

use crate::block::Block;
use crate::device::{DeviceState, Source};
use crate::error::VmmResult;
use crate::mapping::BlockKind;
use crate::windows::spans;

use super::Reservation;

impl Reservation {
    /// Unmaps every block, returns the handles to the pool (or releases them) and keeps the
    /// address range for later commits. Returns the bytes unmapped.
    ///
    /// Adjacent blocks are unmapped with one call where the backend allows it
    /// ([`Capabilities::unmap_spans_mappings`](kvvm_hal::Capabilities)), one call per block
    /// otherwise. On error, the blocks whose unmap failed stay recorded (still mapped),
    /// handles whose release failed are quarantined, and the first error is returned after
    /// every other block was processed.
    ///
    /// Unlike dropping the reservation, releasing does **not** synchronize the device: the
    /// caller orders its own device work, and any kernel or copy still reading or writing the
    /// released bytes must be finished first (its stream synchronized, or an event waited on).
    /// The same holds for [`truncate`](Self::truncate) and
    /// [`release_ranges`](Self::release_ranges). A serving engine shrinks between steps, so a
    /// device-wide synchronize on every release would stall the streams it did not need to.
    pub fn release(&mut self) -> VmmResult<u64> {
        self.take_back_left_mapped();
        self.truncate(0)
    }

    /// Releases every mapping that starts at or beyond `len` bytes from the base, like
    /// [`release`](Self::release). A mapping holding a byte below `len` stays whole (a
    /// multi-window handle straddling `len` stays mapped and committed until a later
    /// truncate reaches its start). Returns the bytes unmapped.
    pub fn truncate(&mut self, len: u64) -> VmmResult<u64> {
        self.take_back_left_mapped();
        let st = Arc::clone(&self.state);
        let g = st.ctx.granule;
        let span = tracing::debug_span!(
            "vmm.release",
            device = st.ctx.device.0,
            base = self.base.0,
            len
        );
        let _e = span.enter();
        let keep_end = len.div_ceil(g).saturating_mul(g);
        let first = self.blocks.partition_point(|b| b.offset < keep_end);
        if let Some(parked) = self.parked.clone() {
            let tail = self.blocks.split_off(first.min(self.blocks.len()));
            let keep = parked.park(&st.ctx, &st.pool, tail, |b| {
                (b.shared.is_none() && b.kind == BlockKind::Owned)
                    .then_some((b.offset, b.windows, b.handle))
            });
            self.blocks.extend(keep);
        }
        match self.unmap_from(&st, first) {
            (bytes, None) => Ok(bytes),
            (_, Some(e)) => Err(e.into()),
        }
    }

    /// Releases the mappings lying wholly inside the union of `ranges` (offsets from the
    /// base), like [`release`](Self::release): owned handles go to the pool or the driver,
    /// shared mappings drop their reference; the others stay, a multi-window mapping only
    /// partly inside included (it is unmapped whole or not at all). Returns the bytes
    /// unmapped. This is how windows committed ahead of need are given back.
    pub fn release_ranges(&mut self, ranges: &[(u64, u64)]) -> VmmResult<u64> {
        self.take_back_left_mapped();
        let st = Arc::clone(&self.state);
        let g = st.ctx.granule;
        let span = tracing::debug_span!(
            "vmm.release_ranges",
            device = st.ctx.device.0,
            base = self.base.0,
            ranges = ranges.len()
        );
        let _e = span.enter();
        let union = merged(ranges);
        let (todo, keep): (Vec<Block>, Vec<Block>) = std::mem::take(&mut self.blocks)
            .into_iter()
            .partition(|b| wholly_inside(&union, b, g));
        self.blocks = keep;
        match self.unmap_blocks(&st, todo) {
            (bytes, None) => Ok(bytes),
            (_, Some(e)) => Err(e.into()),
        }
    }

    /// The bytes of owned handles that [`release_ranges`](Self::release_ranges) would give
    /// back to the budget now for the same `ranges`: the owned mappings lying wholly inside
    /// their union (shared mappings only drop a reference, and a mapping partly outside
    /// stays). Changes nothing.
    pub fn owned_bytes_inside(&self, ranges: &[(u64, u64)]) -> u64 {
        let g = self.state.ctx.granule;
        let union = merged(ranges);
        self.blocks
            .iter()
            .filter(|b| {
                b.kind == BlockKind::Owned && b.shared.is_none() && wholly_inside(&union, b, g)
            })
            .map(|b| b.windows.saturating_mul(g))
            .fold(0, u64::saturating_add)
    }

    /// Unmaps the blocks from index `first` on, last first, in runs of adjacent blocks where
    /// allowed. Returns the bytes unmapped and the first error.
    pub(crate) fn unmap_from(
        &mut self,
        st: &DeviceState,
        first: usize,
    ) -> (u64, Option<BackendError>) {
        let todo = self.blocks.split_off(first.min(self.blocks.len()));
        self.unmap_blocks(st, todo)
    }

    /// Unmaps `todo` (sorted blocks taken out of `self.blocks`), last first, in runs of
    /// adjacent blocks where allowed; blocks whose unmap fails go back into `self.blocks`.
    fn unmap_blocks(
        &mut self,
        st: &DeviceState,
        mut todo: Vec<Block>,
    ) -> (u64, Option<BackendError>) {
        let ctx = &st.ctx;
        let g = ctx.granule;
        let span_runs = ctx.caps.unmap_spans_mappings;
        let mut first_error: Option<BackendError> = None;
        let mut unmapped = 0u64;
        let mut kept_rev: Vec<Block> = Vec::new();
        while let Some(last) = todo.last().cloned() {
            // The run: trailing blocks of `todo` adjacent to each other.
            let mut run_start = todo.len().saturating_sub(1);
            if span_runs {
                while run_start > 0 {
                    let prev = todo[run_start - 1].end(g);
                    if prev == todo[run_start].offset {
                        run_start -= 1;
                    } else {
                        break;
                    }
                }
            }
            let run = todo.split_off(run_start);
            let run_offset = run.first().map_or(last.offset, |b| b.offset);
            let run_bytes = run
                .iter()
                .map(|b| b.bytes(g))
                .fold(0u64, u64::saturating_add);
            let addr = self.at(run_offset);
            match ctx.backend.unmap(addr, run_bytes) {
                Ok(()) => {
                    unmapped = unmapped.saturating_add(run_bytes);
                    for b in run.into_iter().rev() {
                        let size = b.bytes(g);
                        match (b.kind, b.shared) {
                            (BlockKind::Shared { .. }, Some(set)) => {
                                // Only a reference goes; the set releases its handles when
                                // its last holder (mapping, owner, cache) is gone.
                                set.note_unmapped();
                                drop(set);
                            }
                            _ => {
                                if let Err(error) =
                                    st.dispose(b.handle, size, Source::Bucket(Bucket::Committed))
                                {
                                    // The handle is quarantined; report the first error.
                                    first_error.get_or_insert(error);
                                }
                            }
                        }
                    }
                }
                Err(error) => {
                    tracing::warn!(%addr, bytes = run_bytes, %error, "unmap failed; blocks stay recorded");
                    first_error.get_or_insert(error);
                    kept_rev.extend(run.into_iter().rev());
                }
            }
        }
        kept_rev.reverse();
        self.insert_blocks(kept_rev.into_iter());
        (unmapped, first_error)
    }
}

/// The union of `(offset, len)` ranges as sorted, disjoint `(start, end)` spans.
/// Whether block `b` lies wholly inside one span of `union` (sorted, disjoint).
fn wholly_inside(union: &[(u64, u64)], b: &Block, g: u64) -> bool {
    let i = union.partition_point(|&(s, _)| s <= b.offset);
    i.checked_sub(1)
        .and_then(|i| union.get(i))
        .is_some_and(|&(_, end)| b.end(g) <= end)
}

fn merged(ranges: &[(u64, u64)]) -> Vec<(u64, u64)> {
    spans::union(
        ranges
            .iter()
            .map(|&(o, len)| (o, o.saturating_add(len)))
            .collect(),
    )
}
