//! [`ReservedRange`]: what a reservation records (its range, its mapped blocks sorted by
//! offset, its parked windows) and the bounds checks every operation on it starts with. The
//! operations themselves are in `commit.rs`, `sharing.rs`, `release.rs` and `teardown.rs`;
//! the public face is `reservation.rs`.

use std::sync::{Arc, Weak};

use kvvm_hal::{DeviceAddress, PhysicalHandle};

use crate::error::{VmmError, VmmResult};
use crate::mapping::{BlockKind, MappedBlock};
use crate::parking::ParkedWindows;
use crate::shared::SharedHandles;
use crate::state::DeviceState;
use crate::strided::SharedRange;

/// One mapped granule window of a reservation.
#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub(crate) offset: u64,
    pub(crate) handle: PhysicalHandle,
    pub(crate) kind: BlockKind,
    /// For shared blocks: the set the handle belongs to (keeps it alive while mapped).
    pub(crate) shared: Option<Arc<SharedHandles>>,
}

impl Block {
    /// A block whose handle the reservation owns.
    pub(crate) fn owned(offset: u64, handle: PhysicalHandle) -> Self {
        Block {
            offset,
            handle,
            kind: BlockKind::Owned,
            shared: None,
        }
    }
}

/// A reserved range and its records. Dropping it tears it down (`teardown.rs`).
pub(crate) struct ReservedRange {
    pub(crate) state: Arc<DeviceState>,
    pub(crate) base: DeviceAddress,
    pub(crate) size: u64,
    /// Mapped blocks, sorted by offset, each one granule.
    pub(crate) blocks: Vec<Block>,
    /// Released windows kept mapped for reuse (when the manager parks released windows).
    pub(crate) parked: Option<Arc<ParkedWindows>>,
    /// The driver range this reservation is a slot of, when it was carved out of a larger
    /// one (`VirtualMemory::reserve_strided`): the range is freed when its last slot is gone,
    /// not by this reservation.
    pub(crate) shared_range: Option<Arc<SharedRange>>,
    /// Windows a background commit ([`CommitJob`](crate::CommitJob)) is mapping right now.
    pub(crate) in_flight: Option<InFlight>,
}

/// The windows of a commit job between its begin and its finish. The mark is the job's: once
/// the job is gone (finished or dropped) the windows are free again.
pub(crate) struct InFlight {
    pub(crate) mark: Weak<()>,
    pub(crate) offsets: Vec<u64>,
}

impl InFlight {
    /// Whether the window at `offset` is being committed by a live job.
    pub(crate) fn holds(&self, offset: u64) -> bool {
        self.mark.strong_count() > 0 && self.offsets.binary_search(&offset).is_ok()
    }
}

impl ReservedRange {
    pub(crate) fn new(state: Arc<DeviceState>, base: DeviceAddress, size: u64) -> Self {
        let parked = state.parking.open(base);
        ReservedRange {
            state,
            base,
            size,
            blocks: Vec::new(),
            parked,
            shared_range: None,
            in_flight: None,
        }
    }

    /// The granule.
    pub(crate) fn granule(&self) -> u64 {
        self.state.ctx.granule
    }

    /// The address of `offset`, an offset inside the range (its end was checked at reserve).
    pub(crate) fn at(&self, offset: u64) -> DeviceAddress {
        self.base.offset(offset)
    }

    /// The address of `offset`, refused on overflow.
    pub(crate) fn addr(&self, offset: u64) -> VmmResult<DeviceAddress> {
        self.base.checked_add(offset).ok_or(VmmError::SizeOverflow {
            what: "block address",
        })
    }

    /// Committed bytes: granule x mapped blocks (invariant 1).
    pub(crate) fn committed_bytes(&self) -> u64 {
        self.state.ctx.granules(self.blocks.len())
    }

    /// Offset just past the last mapped block.
    pub(crate) fn committed_end(&self) -> u64 {
        self.blocks
            .last()
            .map_or(0, |b| b.offset.saturating_add(self.granule()))
    }

    /// Whether the granule window starting at `offset` is mapped.
    pub(crate) fn is_mapped(&self, offset: u64) -> bool {
        self.blocks
            .binary_search_by_key(&offset, |b| b.offset)
            .is_ok()
    }

    /// The kind of the block mapped at `offset`, if any.
    pub(crate) fn window_kind(&self, offset: u64) -> Option<BlockKind> {
        self.blocks
            .binary_search_by_key(&offset, |b| b.offset)
            .ok()
            .and_then(|i| self.blocks.get(i))
            .map(|b| b.kind)
    }

    /// The blocks as the manager reports them.
    pub(crate) fn mappings(&self) -> Vec<MappedBlock> {
        self.blocks
            .iter()
            .map(|b| MappedBlock {
                address: self.at(b.offset),
                size: self.granule(),
                handle: b.handle,
                kind: b.kind,
            })
            .collect()
    }

    /// Inserts blocks, in any order, and keeps the list sorted by offset.
    pub(crate) fn insert_blocks(&mut self, new: impl Iterator<Item = Block>) {
        self.blocks.extend(new);
        if !self.blocks.is_sorted_by_key(|b| b.offset) {
            self.blocks.sort_by_key(|b| b.offset);
        }
    }

    /// The end of `[offset, offset + len)`, refused when it overflows or runs past the
    /// reservation (the driver does not check reservation bounds; the manager always does).
    pub(crate) fn checked_end(&self, offset: u64, len: u64, what: &'static str) -> VmmResult<u64> {
        let end = offset
            .checked_add(len)
            .ok_or(VmmError::SizeOverflow { what })?;
        if end > self.size {
            return Err(VmmError::OutOfBounds {
                offset,
                requested: len,
                reserved: self.size,
            });
        }
        Ok(end)
    }

    /// A free window of this reservation: in bounds, granule-aligned, not mapped.
    pub(crate) fn check_free_window(&self, offset: u64) -> VmmResult<()> {
        let g = self.granule();
        self.checked_end(offset, g, "window end")?;
        if !offset.is_multiple_of(g) {
            return Err(VmmError::OutOfBounds {
                offset,
                requested: g,
                reserved: self.size,
            });
        }
        if self.is_mapped(offset) {
            return Err(VmmError::AlreadyMapped { offset });
        }
        if self.in_flight.as_ref().is_some_and(|f| f.holds(offset)) {
            return Err(VmmError::Busy { offset });
        }
        Ok(())
    }

    /// Refuses, in O(1), a commit of `windows` granule windows that could never fit even if
    /// the pool supplied every handle it holds.
    pub(crate) fn price(&self, windows: u64) -> VmmResult<()> {
        let ctx = &self.state.ctx;
        let needed = windows.saturating_mul(ctx.granule);
        let new_bytes = needed.saturating_sub(self.state.pooled_bytes());
        ctx.check_fits(new_bytes)?;
        Ok(())
    }

    /// The sorted, unmapped window offsets overlapping `ranges`, bounds-checked. The windows
    /// are counted and priced ([`price`](Self::price)) before they are listed.
    pub(crate) fn missing_windows(&self, ranges: &[(u64, u64)]) -> VmmResult<Vec<u64>> {
        let g = self.granule();
        let mut spans = Vec::with_capacity(ranges.len());
        let mut total = 0u64;
        for &(offset, len) in ranges {
            if len == 0 {
                continue;
            }
            let end = self.checked_end(offset, len, "range end")?;
            let (first, last) = (offset / g, end.div_ceil(g));
            total = total.saturating_add(last.saturating_sub(first));
            spans.push((first, last));
        }
        let mapped = self.blocks.len() as u64;
        self.price(total.saturating_sub(mapped))?;
        let mut offsets = window_list(total)?;
        for (first, last) in spans {
            for w in first..last {
                let o = w.saturating_mul(g);
                if !self.is_mapped(o) {
                    offsets.push(o);
                }
            }
        }
        offsets.sort_unstable();
        offsets.dedup();
        Ok(offsets)
    }
}

/// An empty list with room for `windows` offsets, refused (not aborted) when that much memory
/// cannot be had.
pub(crate) fn window_list(windows: u64) -> VmmResult<Vec<u64>> {
    let too_many = VmmError::SizeOverflow {
        what: "window list",
    };
    let n = usize::try_from(windows).map_err(|_| too_many.clone())?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| too_many)?;
    Ok(v)
}

/// Contiguous runs `(offset, bytes)` of sorted window offsets.
pub(crate) fn runs(offsets: &[u64], g: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &o in offsets {
        match out.last_mut() {
            Some((start, len)) if start.saturating_add(*len) == o => *len = len.saturating_add(g),
            _ => out.push((o, g)),
        }
    }
    out
}
