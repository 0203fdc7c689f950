//! Which windows a commit of a reservation takes: after the committed end, the lowest holes
//! first, or the unmapped windows of some ranges; checked (bounds, free, never fits) before
//! the transaction (`crate::transaction`) runs and its blocks are recorded.

use std::sync::Arc;

use kvvm_governor::MappedGrowthGrant;

use crate::error::{VmmError, VmmResult};
use crate::mapping::Commit;
use crate::shared::SharedPiece;
use crate::transaction::Target;
use crate::windows::spans::{self, Span};

use super::Reservation;

impl Reservation {
    /// Commits `bytes` (rounded up to whole granules) after the committed end, asking the
    /// governor for the bytes the pool cannot supply. A zero-byte commit does nothing. When a
    /// failed rollback or release left holes below the committed end, they are filled first
    /// (lowest first), so that the committed bytes grow from the base again.
    pub fn commit(&mut self, bytes: u64) -> VmmResult<Commit> {
        self.take_back_left_mapped();
        let granules = bytes.div_ceil(self.granule());
        self.commit_granules(granules, None)
    }

    /// Commits the bytes of `grant` (a whole number of granules, from this manager's governor
    /// and device, e.g. from [`VirtualMemory::try_grant`](crate::VirtualMemory::try_grant))
    /// after the committed end. The grant is consumed on success and rolled back on failure.
    pub fn commit_with_grant(&mut self, grant: MappedGrowthGrant) -> VmmResult<Commit> {
        self.take_back_left_mapped();
        if let Some(reason) = self.grant_mismatch(&grant) {
            return Err(VmmError::GrantMismatch { reason });
        }
        let granules = grant.bytes() / self.granule();
        self.commit_granules(granules, Some(grant))
    }

    /// Commits whole granules until every window holding a byte of `[0, len)` is mapped,
    /// holes left by a failed rollback or release included. Returns `None` if nothing was
    /// needed.
    pub fn ensure_committed(&mut self, len: u64) -> VmmResult<Option<Commit>> {
        self.take_back_left_mapped();
        if self.has_holes() {
            return self.commit_range(0, len);
        }
        let end = self.committed_end();
        if len <= end {
            return Ok(None);
        }
        self.commit(len.saturating_sub(end)).map(Some)
    }

    /// Commits every granule window that overlaps `[offset, offset + len)` and is not mapped
    /// yet, as one transaction (all of them or none), wherever they are in the reservation
    /// (the windows holding live bytes of a head-major KV cache are spread over many
    /// fragments). Access is set once over each contiguous run of new windows. Returns `None`
    /// when every window was already mapped.
    pub fn commit_range(&mut self, offset: u64, len: u64) -> VmmResult<Option<Commit>> {
        self.take_back_left_mapped();
        self.commit_ranges(&[(offset, len)])
    }

    /// Like [`commit_range`](Self::commit_range) over several ranges, in one transaction.
    pub fn commit_ranges(&mut self, ranges: &[(u64, u64)]) -> VmmResult<Option<Commit>> {
        self.take_back_left_mapped();
        let spans = self.missing_spans(ranges)?;
        if spans.is_empty() {
            return Ok(None);
        }
        self.commit_windows(&spans, None, None, &[]).map(Some)
    }

    /// Why `grant` cannot pay for a commit here, if it cannot: another device or governor,
    /// or not a whole number of granules.
    pub(crate) fn grant_mismatch(&self, grant: &MappedGrowthGrant) -> Option<String> {
        let ctx = &self.state.ctx;
        let g = ctx.granule;
        if grant.device() != ctx.device {
            Some(format!(
                "grant is for {}, manager for {}",
                grant.device(),
                ctx.device
            ))
        } else if !grant.is_from(&ctx.governor) {
            Some("grant is from another governor".to_owned())
        } else if grant.bytes().checked_rem(g) != Some(0) {
            Some(format!(
                "{} bytes is not a multiple of the granule {g}",
                grant.bytes()
            ))
        } else {
            None
        }
    }

    /// Whether some window below the committed end is unmapped (a failed rollback or release
    /// left a block mapped above a hole).
    pub(crate) fn has_holes(&self) -> bool {
        self.committed_bytes() != self.committed_end()
    }

    /// Commits the first `granules` unmapped windows: the holes below the committed end
    /// first (lowest first), then windows after it.
    pub(crate) fn commit_granules(
        &mut self,
        granules: u64,
        grant: Option<MappedGrowthGrant>,
    ) -> VmmResult<Commit> {
        if granules > 0 && self.has_holes() {
            return self.commit_filling_holes(granules, grant);
        }
        let offset = self.committed_end();
        let bytes = granules
            .checked_mul(self.granule())
            .ok_or(VmmError::SizeOverflow {
                what: "commit size",
            })?;
        if granules == 0 {
            // A grant handed in is rolled back by its drop.
            return Ok(Commit::empty(self.addr(offset)?));
        }
        self.checked_end(offset, bytes, "commit end")?;
        // A request that can never fit is refused before the pool, the governor or the
        // driver is asked, however many granules it names.
        if grant.is_none() {
            self.check_fits(granules)?;
        }
        self.commit_windows(&[Span::new(offset, granules)], grant, None, &[])
    }

    /// [`commit_granules`](Self::commit_granules) when there are holes.
    fn commit_filling_holes(
        &mut self,
        granules: u64,
        grant: Option<MappedGrowthGrant>,
    ) -> VmmResult<Commit> {
        let g = self.granule();
        let bytes = granules.checked_mul(g).ok_or(VmmError::SizeOverflow {
            what: "commit size",
        })?;
        // The windows end at most `granules` windows past the committed end.
        let holes = (self.committed_end() - self.committed_bytes()) / g;
        let end = self
            .committed_end()
            .checked_add(
                granules
                    .saturating_sub(holes.min(granules))
                    .saturating_mul(g),
            )
            .ok_or(VmmError::SizeOverflow { what: "commit end" })?;
        if end > self.size {
            return Err(VmmError::OutOfBounds {
                offset: self.committed_end(),
                requested: bytes,
                reserved: self.size,
            });
        }
        if grant.is_none() {
            self.check_fits(granules)?;
        }
        // The first `granules` unmapped windows below `end`: the gaps between the mappings,
        // then the windows after the last one.
        let mut free = Vec::new();
        let mut need = granules;
        let mut at = 0u64;
        for b in &self.blocks {
            if need == 0 || at >= end {
                break;
            }
            let n = (b.offset.min(end).saturating_sub(at) / g).min(need);
            spans::push(&mut free, Span::new(at, n), g);
            need -= n;
            at = at.max(b.end(g));
        }
        if need > 0 && at < end {
            spans::push(&mut free, Span::new(at, ((end - at) / g).min(need)), g);
        }
        self.commit_windows(&free, grant, None, &[])
    }

    /// The commit transaction over sorted, disjoint window spans, every window unmapped and
    /// in bounds. With `shared`, the new handles form a shared set (accounted once, as
    /// shared) that this reservation maps read-write as its owner. No handle crosses one of
    /// the sorted offsets `cuts`.
    pub(crate) fn commit_windows(
        &mut self,
        spans: &[Span],
        grant: Option<MappedGrowthGrant>,
        shared: Option<&mut Vec<SharedPiece>>,
        cuts: &[u64],
    ) -> VmmResult<Commit> {
        // Every window must be in bounds, unmapped and not in flight: the driver checks none.
        self.check_free(spans)?;
        let applied = self.target().apply(spans, grant, shared, cuts);
        self.insert_blocks(applied.blocks.into_iter());
        applied.result
    }

    /// What a commit needs of this reservation (not its block list).
    pub(crate) fn target(&self) -> Target {
        Target {
            state: Arc::clone(&self.state),
            base: self.base,
            parked: self.parked.clone(),
            max_windows: self.max_windows.unwrap_or(self.state.ctx.max_windows),
        }
    }

    /// Makes every later commit of this reservation map at most `windows` windows per handle
    /// (rounded down to a power of two, at most the manager's largest handle; 0 goes back to
    /// the manager's). A handle is mapped and unmapped whole, so a reservation whose windows
    /// are given back one by one from its start (a sliding window's oldest tokens) wants one
    /// handle per window (`windows = 1`): then every window behind can go on its own.
    pub fn set_max_handle_windows(&mut self, windows: u64) {
        self.max_windows = (windows > 0).then(|| {
            let pow2 = 1u64 << (63 - windows.leading_zeros());
            pow2.min(self.state.ctx.max_windows)
        });
    }

    /// The most windows one handle of this reservation's commits holds.
    pub fn max_handle_windows(&self) -> u64 {
        self.max_windows.unwrap_or(self.state.ctx.max_windows)
    }
}
