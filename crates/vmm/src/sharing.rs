//! Shared mappings: committing a reservation's windows as a [`SharedHandles`] set that it owns
//! (read-write), and mapping a set's windows into another reservation at the same offsets
//! (read-only for sharers), each as one transaction. The set itself is `shared.rs`.

use std::sync::Arc;

use kvvm_hal::{Access, AccessDescriptor, PhysicalHandle};

use crate::error::{VmmError, VmmResult};
use crate::mapping::BlockKind;
use crate::range::{runs, window_list, Block, ReservedRange};
use crate::shared::SharedHandles;

impl ReservedRange {
    /// Commits the windows overlapping `ranges` as a new [`SharedHandles`] set that this
    /// reservation owns and maps read-write (the owner of a shared prefix writes it through
    /// this mapping). The bytes are granted and billed once, as shared. Every window must be
    /// unmapped; the transaction and rollback are those of a commit.
    pub(crate) fn commit_shared(&mut self, ranges: &[(u64, u64)]) -> VmmResult<Arc<SharedHandles>> {
        let offsets = self.shared_windows_of(ranges)?;
        let mut windows = Vec::with_capacity(offsets.len());
        self.commit_windows(&offsets, None, Some(&mut windows))?;
        let set = Arc::new(SharedHandles::new(Arc::clone(&self.state), windows));
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
    /// (read-only for sharers), as one transaction. If a map fails, the mappings made by
    /// this call are withdrawn; if the map succeeds and the access cannot be set, the
    /// mappings are withdrawn and counted down while the handles stay with the set. Returns
    /// the bytes mapped; windows already mapped here are refused.
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
        let mut chosen: Vec<(u64, PhysicalHandle)> = Vec::with_capacity(windows.len());
        for &i in windows {
            let (o, h) = set.window(i).ok_or(VmmError::OutOfBounds {
                offset: i as u64,
                requested: 1,
                reserved: set.len() as u64,
            })?;
            self.check_free_window(o)?;
            chosen.push((o, h));
        }
        chosen.sort_unstable_by_key(|(o, _)| *o);
        chosen.dedup_by_key(|(o, _)| *o);
        let offsets: Vec<u64> = chosen.iter().map(|(o, _)| *o).collect();
        if let Some(parked) = &self.parked {
            parked.evict(ctx, &st.pool, &offsets)?;
        }
        let span = tracing::debug_span!(
            "vmm.map_shared",
            device = ctx.device.0,
            base = self.base.0,
            windows = chosen.len()
        );
        let _e = span.enter();
        let mut done: Vec<u64> = Vec::new();
        let mut failure = None;
        for &(o, h) in &chosen {
            let addr = self.at(o);
            match ctx.backend.map(addr, g, h) {
                Ok(()) => {
                    set.note_shared_map();
                    done.push(o);
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
        if let Some(error) = failure {
            // Withdraw this call's mappings, last first. One that cannot be unmapped stays
            // recorded (it is still mapped) and keeps its reference.
            let mut kept = Vec::new();
            for &o in done.iter().rev() {
                let addr = self.at(o);
                match ctx.backend.unmap(addr, g) {
                    Ok(()) => set.note_unmapped(),
                    Err(e) => {
                        tracing::warn!(%addr, error = %e, "withdrawing a shared mapping failed; it stays recorded");
                        if let Some((_, h)) = chosen.iter().find(|(x, _)| *x == o) {
                            kept.push(Block {
                                offset: o,
                                handle: *h,
                                kind: BlockKind::Shared {
                                    writable: access.can_write(),
                                },
                                shared: Some(Arc::clone(set)),
                            });
                        }
                    }
                }
            }
            self.insert_blocks(kept.into_iter());
            return Err(error.into());
        }
        self.insert_blocks(chosen.into_iter().map(|(offset, handle)| Block {
            offset,
            handle,
            kind: BlockKind::Shared {
                writable: access.can_write(),
            },
            shared: Some(Arc::clone(set)),
        }));
        Ok((done.len() as u64).saturating_mul(g))
    }
}
