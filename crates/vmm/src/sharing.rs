//! Shared mappings: committing a reservation's windows as a [`SharedHandles`] set that it owns
//! (read-write), cut into as few handles as each run allows like any commit, and mapping a
//! set's handles into another reservation at the same offsets (read-only for sharers, one
//! mapping per handle), each as one transaction. The set itself is `shared.rs`.

use std::sync::Arc;

use kvvm_hal::{Access, AccessDescriptor};

use crate::cut::runs;
use crate::error::{VmmError, VmmResult};
use crate::mapping::BlockKind;
use crate::range::{window_list, Block, ReservedRange};
use crate::shared::{SharedHandles, SharedPiece};

impl ReservedRange {
    /// Commits the windows overlapping `ranges` as a new [`SharedHandles`] set that this
    /// reservation owns and maps read-write (the owner of a shared prefix writes it through
    /// this mapping). The bytes are granted and billed once, as shared. Every window must be
    /// unmapped; the transaction and rollback are those of a commit.
    pub(crate) fn commit_shared(&mut self, ranges: &[(u64, u64)]) -> VmmResult<Arc<SharedHandles>> {
        let offsets = self.shared_windows_of(ranges)?;
        // Each range is cut on its own: no handle crosses the start of a range, so that a
        // sharer may map a set up to any range boundary.
        let mut cuts: Vec<u64> = ranges
            .iter()
            .filter(|r| r.1 > 0)
            .map(|r| r.0 / self.granule() * self.granule())
            .collect();
        cuts.sort_unstable();
        let mut pieces = Vec::new();
        self.commit_windows(&offsets, None, Some(&mut pieces), &cuts)?;
        let set = Arc::new(SharedHandles::new(Arc::clone(&self.state), pieces));
        self.attach_shared(&set);
        Ok(set)
    }

    /// The windows a shared commit of `ranges` names, validated: zero-length ranges name no
    /// window; ranges may not overlap (in windows) and must name at least one window; every
    /// window must be in bounds and unmapped.
    fn shared_windows_of(&self, ranges: &[(u64, u64)]) -> VmmResult<Vec<u64>> {
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
        self.price(total)?;
        let mut offsets = window_list(total)?;
        for (first, last) in spans {
            for w in first..last {
                let o = w.saturating_mul(g);
                self.check_free_window(o)?;
                offsets.push(o);
            }
        }
        Ok(offsets)
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
    /// set access per contiguous run. A handle is mapped whole, so the windows named must
    /// cover every handle they touch: a request naming part of a handle is refused with
    /// [`VmmError::InvalidArgument`] before any driver call
    /// ([`SharedHandles::starts_handle`] tells where a partial mapping may end). If a map
    /// fails, the mappings made by this call are withdrawn; if the maps succeed and the access
    /// cannot be set, the mappings are withdrawn and counted down while the handles stay with
    /// the set. Returns the bytes mapped; windows already mapped here are refused.
    pub(crate) fn map_shared(
        &mut self,
        set: &Arc<SharedHandles>,
        windows: &[usize],
        access: Access,
    ) -> VmmResult<u64> {
        let st = Arc::clone(&self.state);
        let ctx = &st.ctx;
        let g = ctx.granule;
        if !set.is_from(&st) {
            return Err(VmmError::GrantMismatch {
                reason: "shared set belongs to another manager".to_owned(),
            });
        }
        let mut named: Vec<usize> = windows.to_vec();
        named.sort_unstable();
        named.dedup();
        // The handles the windows name, each wholly named.
        let mut chosen: Vec<SharedPiece> = Vec::new();
        let mut count: Vec<(usize, u64)> = Vec::new();
        for &i in &named {
            let k = set.piece_of(i).ok_or(VmmError::OutOfBounds {
                offset: i as u64,
                requested: 1,
                reserved: set.len() as u64,
            })?;
            match count.last_mut() {
                Some((last, n)) if *last == k => *n = n.saturating_add(1),
                _ => count.push((k, 1)),
            }
        }
        for (k, n) in count {
            let Some(p) = set.pieces().get(k).copied() else {
                continue;
            };
            if n != p.windows {
                return Err(VmmError::InvalidArgument {
                    reason: format!(
                        "{n} of the {} windows of the shared handle at offset {} named: a handle \
                         is mapped whole",
                        p.windows, p.offset
                    ),
                });
            }
            for w in 0..p.windows {
                self.check_free_window(p.offset.saturating_add(w.saturating_mul(g)))?;
            }
            chosen.push(p);
        }
        let offsets: Vec<u64> = chosen
            .iter()
            .flat_map(|p| (0..p.windows).map(move |w| p.offset.saturating_add(w.saturating_mul(g))))
            .collect();
        if let Some(parked) = &self.parked {
            parked.evict_overlapping(ctx, &st.pool, &offsets, false)?;
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
            for (run_offset, run_bytes) in runs(&offsets, g) {
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
        Ok((offsets.len() as u64).saturating_mul(g))
    }
}
