//! Shared mappings: committing a reservation's windows as a [`SharedHandles`] set that it owns
//! (read-write), cut into as few handles as each run allows like any commit, and mapping a
//! set's handles into another reservation at the same offsets (read-only for sharers, one
//! mapping per handle), each as one transaction. The set itself is `shared.rs`.

use std::ops::Range;
use std::sync::Arc;

use kvvm_hal::{Access, AccessDescriptor};

use crate::error::{VmmError, VmmResult};
use crate::mapping::BlockKind;
use crate::reservation::records::{Block, ReservedRange};
use crate::shared::{SharedHandles, SharedPiece};
use crate::windows::spans::{self, Span};

impl ReservedRange {
    /// Commits the windows overlapping `ranges` as a new [`SharedHandles`] set that this
    /// reservation owns and maps read-write (the owner of a shared prefix writes it through
    /// this mapping). The bytes are granted and billed once, as shared. Every window must be
    /// unmapped; the transaction and rollback are those of a commit.
    pub(crate) fn commit_shared(&mut self, ranges: &[(u64, u64)]) -> VmmResult<Arc<SharedHandles>> {
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
    /// (read-only for sharers), as one transaction: one mapping per handle of the set, one
    /// set access per contiguous run. The windows are named by their indices in the set, as
    /// index ranges in any order (overlaps count once). A handle is mapped whole, so the
    /// windows named must cover every handle they touch: a request naming part of a handle
    /// is refused with [`VmmError::InvalidArgument`] before any driver call
    /// ([`SharedHandles::starts_handle`] tells where a partial mapping may end). If a map
    /// fails, the mappings made by this call are withdrawn; if the maps succeed and the access
    /// cannot be set, the mappings are withdrawn and counted down while the handles stay with
    /// the set. Returns the bytes mapped; windows already mapped here are refused. The work
    /// besides the driver calls is per range and per handle, not per window.
    pub(crate) fn map_shared(
        &mut self,
        set: &Arc<SharedHandles>,
        ranges: &[Range<usize>],
        access: Access,
    ) -> VmmResult<u64> {
        let st = Arc::clone(&self.state);
        let ctx = &st.ctx;
        let g = ctx.granule;
        self.check_set(set)?;
        let named = union(ranges);
        // The lowest index past the set, if any is named.
        if let Some(r) = named.iter().find(|r| r.end > set.len()) {
            return Err(VmmError::OutOfBounds {
                offset: r.start.max(set.len()) as u64,
                requested: 1,
                reserved: set.len() as u64,
            });
        }
        // The handles the windows name, each wholly named, in order.
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
                            "{n} of the {} windows of the shared handle at offset {} named: a \
                             handle is mapped whole",
                            p.windows, p.offset
                        ),
                    });
                }
                let here = Span::new(p.offset, p.windows);
                self.check_free(std::slice::from_ref(&here))?;
                chosen.push(p);
            }
            next = next.max(k1.saturating_add(1));
        }
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
        let mut done: Vec<SharedPiece> = Vec::new();
        let mut failure = None;
        for p in &chosen {
            let addr = self.at(p.offset);
            match ctx.backend.map(addr, p.windows.saturating_mul(g), p.handle) {
                Ok(()) => {
                    set.note_shared_map();
                    done.push(*p);
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if failure.is_none() {
            let desc = [AccessDescriptor {
                device: ctx.device,
                access,
            }];
            for (run_offset, run_bytes) in spans::runs(&spans, g) {
                let addr = self.at(run_offset);
                if let Err(e) = ctx.set_access_retrying(addr, run_bytes, &desc) {
                    failure = Some(e);
                    break;
                }
            }
        }
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
            // Withdraw this call's mappings, last first. One that cannot be unmapped stays
            // recorded (it is still mapped) and keeps its reference.
            let mut kept = Vec::new();
            for p in done.iter().rev() {
                let addr = self.at(p.offset);
                match ctx.backend.unmap(addr, p.windows.saturating_mul(g)) {
                    Ok(()) => set.note_unmapped(),
                    Err(e) => {
                        tracing::warn!(%addr, error = %e, "withdrawing a shared mapping failed; it stays recorded");
                        kept.push(block(p));
                    }
                }
            }
            self.insert_blocks(kept.into_iter());
            return Err(error.into());
        }
        self.insert_blocks(chosen.iter().map(block));
        Ok(spans::window_count(&spans).saturating_mul(g))
    }
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
