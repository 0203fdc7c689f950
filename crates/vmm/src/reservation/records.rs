//! [`ReservedRange`]: what a reservation records (its range, its mapped blocks sorted by
//! offset, its parked windows) and the bounds checks every operation on it starts with. The
//! operations themselves are in `commit.rs`, `sharing.rs`, `release.rs` and `teardown.rs`;
//! the public face is `reservation.rs`.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use kvvm_hal::{DeviceAddress, PhysicalHandle};

use crate::device::parking::ParkedWindows;
use crate::device::DeviceState;
use crate::error::{VmmError, VmmResult};
use crate::mapping::{BlockKind, MappedBlock};
use crate::shared::SharedHandles;
use crate::strided::SharedRange;
use crate::sync::lock;
use crate::windows::spans::{self, Span};

/// One mapping of a reservation: `windows` granule windows from `offset`, one handle mapped
/// whole.
#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub(crate) offset: u64,
    /// Granule windows the mapping spans (its handle is `windows x granule` bytes).
    pub(crate) windows: u64,
    pub(crate) handle: PhysicalHandle,
    pub(crate) kind: BlockKind,
    /// For shared blocks: the set the handle belongs to (keeps it alive while mapped).
    pub(crate) shared: Option<Arc<SharedHandles>>,
}

impl Block {
    /// A block whose handle the reservation owns.
    pub(crate) fn owned(offset: u64, windows: u64, handle: PhysicalHandle) -> Self {
        Block {
            offset,
            windows,
            handle,
            kind: BlockKind::Owned,
            shared: None,
        }
    }

    /// Its size in bytes (the handle's).
    pub(crate) fn bytes(&self, g: u64) -> u64 {
        self.windows.saturating_mul(g)
    }

    /// The offset just past it.
    pub(crate) fn end(&self, g: u64) -> u64 {
        self.offset.saturating_add(self.bytes(g))
    }
}

/// A reserved range and its records. Dropping it tears it down (`teardown.rs`).
pub(crate) struct ReservedRange {
    pub(crate) state: Arc<DeviceState>,
    pub(crate) base: DeviceAddress,
    pub(crate) size: u64,
    /// Mappings, sorted by offset, each of one or more windows (one handle each).
    pub(crate) blocks: Vec<Block>,
    /// Released windows kept mapped for reuse (when the manager parks released windows).
    pub(crate) parked: Option<Arc<ParkedWindows>>,
    /// The driver range this reservation is a slot of, when it was carved out of a larger
    /// one (`VirtualMemory::reserve_strided`): the range is freed when its last slot is gone,
    /// not by this reservation.
    pub(crate) shared_range: Option<Arc<SharedRange>>,
    /// Windows a background commit ([`CommitJob`](crate::CommitJob)) is mapping right now.
    pub(crate) in_flight: Option<InFlight>,
    /// Blocks a job begun here was dropped with and could not unmap: still mapped, so still
    /// this reservation's (taken back into `blocks` at its next change, read with them
    /// until then).
    pub(crate) left_mapped: Arc<LeftMapped>,
}

/// Blocks a commit job dropped unfinished could not unmap, handed back to the reservation
/// that began it: the driver still maps them, so they stay out of use and in its books (and
/// their bytes committed) until a release or the teardown unmaps them. Closed when the
/// reservation goes; a job dropped after that quarantines what it cannot unmap.
pub(crate) struct LeftMapped {
    /// `None` once the reservation is gone.
    blocks: Mutex<Option<Vec<Block>>>,
    /// Whether `blocks` holds any (read without the lock on every call of the reservation).
    pending: AtomicBool,
}

impl LeftMapped {
    fn open() -> Self {
        LeftMapped {
            blocks: Mutex::new(Some(Vec::new())),
            pending: AtomicBool::new(false),
        }
    }

    /// Hands `block` back to its reservation; returns it when the reservation is gone.
    pub(crate) fn hand_back(&self, block: Block) -> Result<(), Block> {
        let mut blocks = lock(&self.blocks);
        match blocks.as_mut() {
            Some(list) => {
                list.push(block);
                self.pending.store(true, Ordering::Release);
                Ok(())
            }
            None => Err(block),
        }
    }

    /// Takes the blocks handed back so far.
    fn take(&self) -> Vec<Block> {
        if !self.pending.load(Ordering::Acquire) {
            return Vec::new();
        }
        let mut blocks = lock(&self.blocks);
        self.pending.store(false, Ordering::Release);
        blocks.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// A copy of the blocks handed back and not taken yet.
    fn peek(&self) -> Vec<Block> {
        if !self.pending.load(Ordering::Acquire) {
            return Vec::new();
        }
        lock(&self.blocks).clone().unwrap_or_default()
    }

    /// Closes it (the reservation is going) and takes what was handed back.
    pub(crate) fn close(&self) -> Vec<Block> {
        let mut blocks = lock(&self.blocks);
        self.pending.store(false, Ordering::Release);
        blocks.take().unwrap_or_default()
    }
}

/// The windows of a commit job between its begin and its finish. The mark is the job's: once
/// the job is gone (finished or dropped) the windows are free again.
pub(crate) struct InFlight {
    pub(crate) mark: Weak<()>,
    pub(crate) spans: Vec<Span>,
}

impl InFlight {
    /// The first window of `[start, end)` a live job is committing, if any.
    pub(crate) fn first_held(&self, g: u64, start: u64, end: u64) -> Option<u64> {
        if self.mark.strong_count() == 0 {
            return None;
        }
        spans::first_in(&self.spans, g, start, end)
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
            left_mapped: Arc::new(LeftMapped::open()),
        }
    }

    /// Takes back into `blocks` what a dropped job could not unmap, once that job is gone
    /// (every change of the reservation starts here).
    pub(crate) fn take_back_left_mapped(&mut self) {
        if self
            .in_flight
            .as_ref()
            .is_some_and(|f| f.mark.strong_count() > 0)
        {
            return;
        }
        let back = self.left_mapped.take();
        if !back.is_empty() {
            self.insert_blocks(back.into_iter());
        }
    }

    /// The blocks as they stand: those recorded, and those a dropped job handed back and
    /// the reservation has not taken yet.
    fn records(&self) -> Cow<'_, [Block]> {
        let back = self.left_mapped.peek();
        if back.is_empty() {
            return Cow::Borrowed(&self.blocks);
        }
        let mut all = self.blocks.clone();
        all.extend(back);
        all.sort_by_key(|b| b.offset);
        Cow::Owned(all)
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

    /// Committed windows: the windows of every mapping.
    pub(crate) fn committed_windows(&self) -> u64 {
        self.records()
            .iter()
            .map(|b| b.windows)
            .fold(0u64, u64::saturating_add)
    }

    /// Committed bytes: granule x committed windows (invariant 1).
    pub(crate) fn committed_bytes(&self) -> u64 {
        self.committed_windows().saturating_mul(self.granule())
    }

    /// Offset just past the last mapping.
    pub(crate) fn committed_end(&self) -> u64 {
        let g = self.granule();
        self.records().last().map_or(0, |b| b.end(g))
    }

    /// The kind of the mapping holding the byte at `offset`, if any.
    pub(crate) fn window_kind(&self, offset: u64) -> Option<BlockKind> {
        let blocks = self.records();
        let i = blocks.partition_point(|b| b.offset <= offset);
        let b = blocks.get(i.checked_sub(1)?)?;
        (offset < b.end(self.granule())).then_some(b.kind)
    }

    /// Whether the granule window starting at `offset` is mapped.
    pub(crate) fn is_mapped(&self, offset: u64) -> bool {
        self.window_kind(offset).is_some()
    }

    /// The mappings as the manager reports them (one entry per mapping, of its whole size).
    pub(crate) fn mappings(&self) -> Vec<MappedBlock> {
        let g = self.granule();
        self.records()
            .iter()
            .map(|b| MappedBlock {
                address: self.at(b.offset),
                size: b.bytes(g),
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

    /// The first mapped window of `[start, end)` (granule-aligned bounds), if any.
    fn first_mapped(&self, start: u64, end: u64) -> Option<u64> {
        let g = self.granule();
        let blocks = self.records();
        let i = blocks.partition_point(|b| b.end(g) <= start);
        blocks
            .get(i..)?
            .iter()
            .take_while(|b| b.offset < end)
            .find(|b| b.windows > 0)
            .map(|b| b.offset.max(start))
    }

    /// Every window of `spans` is free: in bounds, granule-aligned, not mapped, not in
    /// flight. The first window (in order) that is not is refused, with the checks made in
    /// that order for it; the cost is per span, not per window.
    pub(crate) fn check_free(&self, spans: &[Span]) -> VmmResult<()> {
        let g = self.granule();
        for s in spans {
            if s.windows == 0 {
                continue;
            }
            // Windows of the span that end inside the reservation.
            let in_bounds = s.windows.min(self.size.saturating_sub(s.offset) / g);
            if in_bounds == 0 {
                self.checked_end(s.offset, g, "window end")?;
            }
            if !s.offset.is_multiple_of(g) {
                return Err(VmmError::OutOfBounds {
                    offset: s.offset,
                    requested: g,
                    reserved: self.size,
                });
            }
            let end = s.offset.saturating_add(in_bounds.saturating_mul(g));
            let mapped = self.first_mapped(s.offset, end);
            let busy = self
                .in_flight
                .as_ref()
                .and_then(|f| f.first_held(g, s.offset, end));
            match (mapped, busy) {
                (Some(m), Some(b)) if b < m => return Err(VmmError::Busy { offset: b }),
                (Some(m), _) => return Err(VmmError::AlreadyMapped { offset: m }),
                (None, Some(b)) => return Err(VmmError::Busy { offset: b }),
                (None, None) => {}
            }
            if in_bounds < s.windows {
                self.checked_end(end, g, "window end")?;
            }
        }
        Ok(())
    }

    /// The never-fits decision of every commit into this reservation (a private commit, a
    /// shared commit, a background job; the KV layer's growth and admission and the server's
    /// appends all come here): refuses `new_windows` more granule windows when this
    /// reservation would then hold more physical memory than could ever be granted to it.
    /// Its cost is per mapping of the reservation, never per window.
    ///
    /// What it would hold is every window it maps now (its own, its shared set's, and shared
    /// windows it maps read-only: none of them can be freed while it maps them) plus the new
    /// windows, *wherever their memory comes from*: a handle from the pool or a parked window
    /// is already inside the budget, so it is no discount. What could ever be granted is the
    /// budget less the quarantine, or the device's memory ([`DeviceContext::check_fits`],
    /// which asks [`Governor::check_fits`](kvvm_governor::Governor::check_fits)). Anything
    /// else the budget holds (other reservations, the pool, shared prefixes nobody here maps)
    /// can be freed, so a request under that ceiling is backpressure, never refused for good.
    ///
    /// [`DeviceContext::check_fits`]: crate::device::DeviceContext::check_fits
    pub(crate) fn check_fits(&self, new_windows: u64) -> VmmResult<()> {
        let g = self.granule();
        let holding = self
            .committed_windows()
            .saturating_add(new_windows)
            .saturating_mul(g);
        self.state.ctx.check_fits(holding)?;
        Ok(())
    }

    /// The unmapped windows overlapping `ranges`, bounds-checked, as sorted spans, refused
    /// when they can never fit ([`check_fits`](Self::check_fits)). The work is per range and
    /// per mapping, not per window: a range of any size costs one span.
    pub(crate) fn missing_spans(&self, ranges: &[(u64, u64)]) -> VmmResult<Vec<Span>> {
        let g = self.granule();
        let mut wanted = Vec::with_capacity(ranges.len());
        for &(offset, len) in ranges {
            if len == 0 {
                continue;
            }
            let end = self.checked_end(offset, len, "range end")?;
            wanted.push((offset / g, end.div_ceil(g)));
        }
        // The union of the ranges' windows, less what is mapped.
        let mut out = Vec::new();
        for (first, last) in spans::union(wanted) {
            let (start, end) = (first.saturating_mul(g), last.saturating_mul(g));
            let mut at = start;
            let i = self.blocks.partition_point(|b| b.end(g) <= start);
            for b in self.blocks.iter().skip(i) {
                if b.offset >= end {
                    break;
                }
                if b.offset > at {
                    spans::push(&mut out, Span::new(at, (b.offset - at) / g), g);
                }
                at = at.max(b.end(g));
            }
            if at < end {
                spans::push(&mut out, Span::new(at, (end - at) / g), g);
            }
        }
        self.check_fits(spans::window_count(&out))?;
        Ok(out)
    }
}
