//! Shared mappings: committing a reservation's windows as a [`SharedHandles`] set that it owns
//! (read-write), cut into as few handles as each run allows like any commit, and mapping a
//! set's handles into another reservation at the same offsets (read-only for sharers, one
//! mapping per handle), each as one transaction. The set itself is `crate::shared`.

use std::ops::Range;
use std::sync::Arc;

use kvvm_hal::{Access, AccessDescriptor, BackendError};

use crate::block::Block;
use crate::error::{VmmError, VmmResult};
use crate::mapping::BlockKind;
use crate::shared::{SharedHandles, SharedPiece};
use crate::windows::spans::{self, Span};

use super::Reservation;

impl Reservation {
    /// Commits the windows overlapping `ranges` as a new [`SharedHandles`] set that this
    /// reservation owns and maps read-write (the owner of a shared prefix writes it through
    /// this mapping). The bytes are granted and billed once, as shared. Every window must be
    /// unmapped; the transaction and rollback are those of a commit, and so is the cut into
    /// handles, except that no handle crosses the start of one of `ranges`: a sharer may
    /// map the set ([`map_shared`](Self::map_shared), whole handles only) up to any range
    /// boundary.
    pub fn commit_shared(&mut self, ranges: &[(u64, u64)]) -> VmmResult<Arc<SharedHandles>> {
        self.take_back_left_mapped();
        let spans = self.shared_windows_of(ranges)?;
        // Each range is cut on its own: no handle crosses the start of a range, so that a
        // sharer may map a set up to any range boundary.
        let mut cuts: Vec<u64> = ranges
            .iter()
            .filter(|r| r.1 > 0)
            .map(|r| r.0 / self.granule() * self.granule())
            .collect();
        cuts.sort_unstable();
        let mut pieces = Vec::new();
        self.commit_windows(&spans, None, Some(&mut pieces), &cuts)?;
        let set = Arc::new(SharedHandles::new(Arc::clone(&self.state), pieces));
        self.attach_shared(&set);
        Ok(set)
    }

    /// The windows a shared commit of `ranges` names, validated, as sorted spans: zero-length
    /// ranges name no window; ranges may not overlap (in windows) and must name at least one
    /// window; every window must be in bounds and unmapped.
    fn shared_windows_of(&self, ranges: &[(u64, u64)]) -> VmmResult<Vec<Span>> {
        let g = self.granule();
        let mut spans: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
        let mut total = 0u64;
        for &(offset, len) in ranges {
            if len == 0 {
                continue;
            }
            let end = self.checked_end(offset, len, "shared range end")?;
            let (first, last) = (offset / g, end.div_ceil(g));
            total = total.saturating_add(last.saturating_sub(first));
            spans.push((first, last));
        }
        spans.sort_unstable();
        for pair in spans.windows(2) {
            if let [(a0, a1), (b0, _)] = pair {
                if b0 < a1 {
                    return Err(VmmError::InvalidArgument {
                        reason: format!(
                            "shared ranges overlap: windows {a0}..{a1} and {b0}.. (granule {g}); \
                             a window is shared once"
                        ),
                    });
                }
            }
        }
        if spans.is_empty() {
            return Err(VmmError::InvalidArgument {
                reason: "a shared commit must name at least one byte".to_owned(),
            });
        }
        self.check_fits(total)?;
        let spans: Vec<Span> = spans
            .into_iter()
            .map(|(first, last)| Span::new(first.saturating_mul(g), last.saturating_sub(first)))
            .collect();
        self.check_free(&spans)?;
        Ok(spans)
    }

    /// Refuses a set of another manager.
    pub(crate) fn check_set(&self, set: &SharedHandles) -> VmmResult<()> {
        if set.is_from(&self.state) {
            Ok(())
        } else {
            Err(VmmError::GrantMismatch {
                reason: "shared set belongs to another manager".to_owned(),
            })
        }
    }

    /// Attaches the owner's shared set to the blocks just committed for it.
    pub(crate) fn attach_shared(&mut self, set: &Arc<SharedHandles>) {
        for b in &mut self.blocks {
            if matches!(b.kind, BlockKind::Shared { .. }) && b.shared.is_none() {
                b.shared = Some(Arc::clone(set));
                set.note_shared_map();
            }
        }
    }

    /// Maps windows of a shared set at the same offsets of this reservation with `access`
    /// (read-only for sharers), as one transaction. If a map fails, the mappings made by
    /// this call are withdrawn; if the map succeeds and the access cannot be set, the
    /// mappings are withdrawn and counted down while the handles stay with the set. Returns
    /// the bytes mapped; windows already mapped here are refused.
    pub fn map_shared(
        &mut self,
        set: &Arc<SharedHandles>,
        windows: &[usize],
        access: Access,
    ) -> VmmResult<u64> {
        self.take_back_left_mapped();
        let mut named = windows.to_vec();
        named.sort_unstable();
        named.dedup();
        self.check_set(set)?;
        // The lowest index past the set is refused here: not every index has a range.
        if let Some(&i) = named.iter().find(|&&i| i >= set.len()) {
            return Err(VmmError::OutOfBounds {
                offset: i as u64,
                requested: 1,
                reserved: set.len() as u64,
            });
        }
        self.map_shared_pieces(set, &index_ranges(&named), access)
    }

    /// Like [`map_shared`](Self::map_shared), the windows named as ranges of their indices in
    /// the set (in any order; overlaps count once): what a sharer attaching whole handles
    /// uses, at a cost per range and per handle rather than per window.
    pub fn map_shared_ranges(
        &mut self,
        set: &Arc<SharedHandles>,
        windows: &[Range<usize>],
        access: Access,
    ) -> VmmResult<u64> {
        self.take_back_left_mapped();
        self.map_shared_pieces(set, windows, access)
    }

    /// Maps whole handles of `set` named by index `ranges` (see
    /// [`map_shared_ranges`](Self::map_shared_ranges)): choose the handles, unmap parked
    /// windows in the way, map each handle, set access once per run; on a failure withdraw
    /// this call's mappings. The work besides the driver calls is per range and per handle.
    fn map_shared_pieces(
        &mut self,
        set: &Arc<SharedHandles>,
        ranges: &[Range<usize>],
        access: Access,
    ) -> VmmResult<u64> {
        let st = Arc::clone(&self.state);
        let ctx = &st.ctx;
        let g = ctx.granule;
        self.check_set(set)?;
        if set.is_imported() && access.can_write() {
            return Err(VmmError::InvalidArgument {
                reason: "an imported shared set is mapped read-only (its writer is another \
                         process)"
                    .to_owned(),
            });
        }
        let chosen = self.handles_named(set, ranges)?;
        let mut spans = Vec::with_capacity(chosen.len());
        for p in &chosen {
            spans::push(&mut spans, Span::new(p.offset, p.windows), g);
        }
        if let Some(parked) = &self.parked {
            parked.evict_overlapping(ctx, &st.pool, &spans, false)?;
        }
        let span = tracing::debug_span!(
            "vmm.map_shared",
            device = ctx.device.0,
            base = self.base.0,
            handles = chosen.len()
        );
        let _e = span.enter();
        let (done, failure) = self.map_handles(set, &chosen);
        let failure = failure.or_else(|| self.set_shared_access(&spans, access).err());
        let block = |p: &SharedPiece| Block {
            offset: p.offset,
            windows: p.windows,
            handle: p.handle,
            kind: BlockKind::Shared {
                writable: access.can_write(),
            },
            shared: Some(Arc::clone(set)),
        };
        if let Some(error) = failure {
            let kept = self.withdraw(set, &done);
            self.insert_blocks(kept.iter().map(block));
            return Err(error.into());
        }
        self.insert_blocks(chosen.iter().map(block));
        Ok(spans::window_count(&spans).saturating_mul(g))
    }

    /// The handles of `set` that the index `ranges` name, in order, each named whole and
    /// every one free here; refused before any driver call otherwise.
    fn handles_named(
        &self,
        set: &SharedHandles,
        ranges: &[Range<usize>],
    ) -> VmmResult<Vec<SharedPiece>> {
        let named = union(ranges);
        // The lowest index past the set, if any is named.
        if let Some(r) = named.iter().find(|r| r.end > set.len()) {
            return Err(VmmError::OutOfBounds {
                offset: r.start.max(set.len()) as u64,
                requested: 1,
                reserved: set.len() as u64,
            });
        }
        let mut chosen: Vec<SharedPiece> = Vec::new();
        // Handles below this index were looked at for an earlier range.
        let mut next = 0usize;
        for r in &named {
            let (Some(k0), Some(k1)) =
                (set.piece_of(r.start), set.piece_of(r.end.saturating_sub(1)))
            else {
                continue;
            };
            for k in k0.max(next)..=k1 {
                let Some((first, p)) = set.piece_with_first_window(k) else {
                    continue;
                };
                check_named_whole(&named, first, p)?;
                self.check_free(std::slice::from_ref(&Span::new(p.offset, p.windows)))?;
                chosen.push(p);
            }
            next = next.max(k1.saturating_add(1));
        }
        Ok(chosen)
    }

    /// Maps each handle of `chosen` whole at its offset, in order, until one fails; counts
    /// each mapping on the set. Returns those mapped and the failure.
    fn map_handles(
        &self,
        set: &SharedHandles,
        chosen: &[SharedPiece],
    ) -> (Vec<SharedPiece>, Option<BackendError>) {
        let ctx = &self.state.ctx;
        let mut done: Vec<SharedPiece> = Vec::new();
        for p in chosen {
            let bytes = p.windows.saturating_mul(ctx.granule);
            if let Err(e) = ctx.backend.map(self.at(p.offset), bytes, p.handle) {
                return (done, Some(e));
            }
            set.note_shared_map();
            done.push(*p);
        }
        (done, None)
    }

    /// Sets `access` for this device once over each contiguous run of `spans`.
    fn set_shared_access(&self, spans: &[Span], access: Access) -> Result<(), BackendError> {
        let ctx = &self.state.ctx;
        let desc = [AccessDescriptor {
            device: ctx.device,
            access,
        }];
        for (run_offset, run_bytes) in spans::runs(spans, ctx.granule) {
            ctx.set_access_retrying(self.at(run_offset), run_bytes, &desc)?;
        }
        Ok(())
    }

    /// Withdraws this call's mappings `done`, last first. One that cannot be unmapped stays
    /// (it is still mapped) and keeps its reference: it is returned, to be recorded.
    fn withdraw(&self, set: &SharedHandles, done: &[SharedPiece]) -> Vec<SharedPiece> {
        let ctx = &self.state.ctx;
        let mut kept = Vec::new();
        for p in done.iter().rev() {
            let addr = self.at(p.offset);
            match ctx
                .backend
                .unmap(addr, p.windows.saturating_mul(ctx.granule))
            {
                Ok(()) => set.note_unmapped(),
                Err(e) => {
                    tracing::warn!(%addr, error = %e, "withdrawing a shared mapping failed; it stays recorded");
                    kept.push(*p);
                }
            }
        }
        kept
    }
}

/// Refuses a handle (`p`, its first window index `first`) that the sorted index ranges
/// `named` cover only in part: a handle is mapped whole.
fn check_named_whole(named: &[Range<usize>], first: usize, p: SharedPiece) -> VmmResult<()> {
    let last = first.saturating_add(usize::try_from(p.windows).unwrap_or(usize::MAX));
    // Named windows of this handle: the ranges from the first one reaching it.
    let from = named.partition_point(|q| q.end <= first);
    let n = named
        .get(from..)
        .unwrap_or_default()
        .iter()
        .take_while(|q| q.start < last)
        .map(|q| q.end.min(last).saturating_sub(q.start.max(first)) as u64)
        .fold(0u64, u64::saturating_add);
    if n != p.windows {
        return Err(VmmError::InvalidArgument {
            reason: format!(
                "{n} of the {} windows of the shared handle at offset {} named: a handle is \
                 mapped whole",
                p.windows, p.offset
            ),
        });
    }
    Ok(())
}

/// The union of index ranges as sorted, disjoint, non-empty ranges.
pub(crate) fn union(ranges: &[Range<usize>]) -> Vec<Range<usize>> {
    spans::union(ranges.iter().map(|r| (r.start, r.end)).collect())
        .into_iter()
        .map(|(start, end)| start..end)
        .collect()
}

/// Sorted, distinct window indices as ranges of consecutive indices (an index of
/// `usize::MAX`, past every set, is left out: the caller refuses it first).
pub(crate) fn index_ranges(sorted: &[usize]) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for &i in sorted {
        match out.last_mut() {
            Some(last) if last.end == i => last.end = i.saturating_add(1),
            _ => out.push(i..i.saturating_add(1)),
        }
    }
    out
}
