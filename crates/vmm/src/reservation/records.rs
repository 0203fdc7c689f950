//! What a reservation records and reads: its blocks (sorted by offset, with those a dropped
//! job handed back), the committed bytes and end, the mappings as reported, the parked
//! windows and the windows of a job in flight.

use std::borrow::Cow;
use std::sync::Weak;

use crate::block::Block;
use crate::mapping::{BlockKind, MappedBlock};
use crate::windows::spans::{self, Span};

use super::Reservation;

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

impl Reservation {
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
    pub(super) fn records(&self) -> Cow<'_, [Block]> {
        let back = self.left_mapped.peek();
        if back.is_empty() {
            return Cow::Borrowed(&self.blocks);
        }
        let mut all = self.blocks.clone();
        all.extend(back);
        all.sort_by_key(|b| b.offset);
        Cow::Owned(all)
    }

    /// Committed windows: the windows of every mapping.
    pub(crate) fn committed_windows(&self) -> u64 {
        self.records()
            .iter()
            .map(|b| b.windows)
            .fold(0u64, u64::saturating_add)
    }

    /// Committed bytes: granule x committed windows (invariant 1). A multi-window handle
    /// that a release or truncate cut through stays mapped and counted until it goes whole.
    pub fn committed_bytes(&self) -> u64 {
        self.committed_windows().saturating_mul(self.granule())
    }

    /// Offset just past the last mapped block: the next commit maps from here. It equals
    /// [`committed_bytes`](Self::committed_bytes) unless a failed rollback or release left a
    /// block mapped above a hole.
    pub fn committed_end(&self) -> u64 {
        let g = self.granule();
        self.records().last().map_or(0, |b| b.end(g))
    }

    /// What is mapped in the granule window starting at `offset`, if anything.
    pub fn window_kind(&self, offset: u64) -> Option<BlockKind> {
        let blocks = self.records();
        let i = blocks.partition_point(|b| b.offset <= offset);
        let b = blocks.get(i.checked_sub(1)?)?;
        (offset < b.end(self.granule())).then_some(b.kind)
    }

    /// Whether the granule window starting at `offset` is mapped.
    pub fn is_mapped(&self, offset: u64) -> bool {
        self.window_kind(offset).is_some()
    }

    /// The mappings as the manager records them, by address: one entry per mapping (one
    /// handle, mapped whole, of one or more granule windows).
    pub fn mappings(&self) -> Vec<MappedBlock> {
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

    /// Windows released but kept mapped for reuse (see
    /// [`VmmConfig::park_released`](crate::VmmConfig::park_released)): pooled memory, not
    /// committed bytes. Empty when the manager does not park.
    pub fn parked(&self) -> Vec<MappedBlock> {
        self.parked
            .as_ref()
            .map(|p| p.list(self.granule()))
            .unwrap_or_default()
    }

    /// Whether a [`CommitJob`](crate::CommitJob) begun here is not finished yet.
    pub fn has_commit_in_flight(&self) -> bool {
        self.in_flight
            .as_ref()
            .is_some_and(|f| f.mark.strong_count() > 0)
    }

    /// Inserts blocks, in any order, and keeps the list sorted by offset.
    pub(crate) fn insert_blocks(&mut self, new: impl Iterator<Item = Block>) {
        self.blocks.extend(new);
        if !self.blocks.is_sorted_by_key(|b| b.offset) {
            self.blocks.sort_by_key(|b| b.offset);
        }
    }
}
