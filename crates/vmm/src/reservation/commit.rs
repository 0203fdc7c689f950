//! The commit transaction and its rollback.
//!
//! A commit maps granule windows of a reservation in one transaction: parked mappings of the
//! same reservation lying wholly inside the windows are taken back first (no driver call),
//! each contiguous run of the rest is cut into as few handles as it allows (`cut::pieces`:
//! largest first, power-of-two numbers of windows aligned to their size from the base, up to
//! `VmmConfig::max_handle_bytes`; a shared commit, released only whole, takes `cut::run_pieces`:
//! one handle per range up to that size), the pool supplies handles of exactly those sizes (no
//! create), the governor grants the rest (no grant, no commit), each handle is created and
//! mapped whole, and access is set once over each contiguous run. Any failure unmaps what
//! this commit mapped, last first, returns the handles to the pool and rolls the grant back;
//! a mapping whose unmap fails stays recorded (it is still mapped) and is accounted as
//! committed.
//!
//! The windows are named as sorted spans (`spans.rs`), so that everything a commit does
//! besides its driver calls costs per span, per parked mapping and per handle, not per
//! window: a run of 2048 windows mapped as one handle is checked, cut and given access once.

use std::sync::Arc;

use kvvm_governor::{Bucket, MappedGrowthGrant, Refusal};
use kvvm_hal::{BackendError, DeviceAddress, PhysicalHandle};

use crate::device::parking::{ParkedWindows, Window};
use crate::device::DeviceState;
use crate::device::Source;
use crate::error::{VmmError, VmmResult};
use crate::mapping::{BlockKind, Commit};
use crate::reservation::records::{Block, ReservedRange};
use crate::shared::SharedPiece;
use crate::windows::cut::{pieces, run_pieces};
use crate::windows::spans::{self, Span};

/// One mapping a commit in progress made.
struct Mapped {
    offset: u64,
    windows: u64,
    handle: PhysicalHandle,
    origin: Origin,
}

/// Where a handle of a commit in progress came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    Pool,
    Created,
}

impl ReservedRange {
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
        }
    }
}

/// What a commit's driver work needs of its reservation: the device state, the base address
/// and the parked windows; not the block list, so that the work can run while the
/// reservation is used elsewhere (a background commit, `job.rs`).
pub(crate) struct Target {
    pub(crate) state: Arc<DeviceState>,
    pub(crate) base: DeviceAddress,
    pub(crate) parked: Option<Arc<ParkedWindows>>,
}

/// The outcome of a commit's driver work: its result, and the blocks to record (the new ones
/// on success; on failure those a failed rollback left mapped).
pub(crate) struct Applied {
    pub(crate) result: VmmResult<Commit>,
    pub(crate) blocks: Vec<Block>,
}

impl Applied {
    fn failed(e: VmmError) -> Self {
        Applied {
            result: Err(e),
            blocks: Vec::new(),
        }
    }
}

impl Target {
    fn at(&self, offset: u64) -> DeviceAddress {
        self.base.offset(offset)
    }

    /// The transaction over validated window spans (sorted, disjoint, unmapped, in bounds,
    /// not in flight); no handle crosses one of the sorted offsets `cuts`. Its bookkeeping is
    /// per span, per parked mapping and per handle, never per window.
    pub(crate) fn apply(
        &self,
        spans: &[Span],
        grant: Option<MappedGrowthGrant>,
        shared: Option<&mut Vec<SharedPiece>>,
        cuts: &[u64],
    ) -> Applied {
        let st = Arc::clone(&self.state);
        let ctx = &st.ctx;
        let g = ctx.granule;
        let granules = spans::window_count(spans);
        let span = tracing::debug_span!(
            "vmm.commit",
            device = ctx.device.0,
            base = self.base.0,
            granules
        );
        let _e = span.enter();
        let first = spans.first().map_or(0, |s| s.offset);
        let Some(start) = self.base.checked_add(first) else {
            return Applied::failed(VmmError::SizeOverflow {
                what: "block address",
            });
        };
        let Some(bytes) = granules.checked_mul(g) else {
            return Applied::failed(VmmError::SizeOverflow {
                what: "commit size",
            });
        };
        let target = if shared.is_some() {
            Bucket::Shared
        } else {
            Bucket::Committed
        };

        // Parked mappings of this reservation at these windows: those lying wholly inside are
        // reused as they are (no driver call) by a private commit; any other that overlaps
        // (and every one, for a shared commit) is unmapped first.
        let reused: Vec<Window> = match &self.parked {
            None => Vec::new(),
            Some(parked) => {
                let whole = shared.is_none();
                if let Err(e) = parked.evict_overlapping(ctx, &st.pool, spans, whole) {
                    return Applied::failed(e.into());
                }
                if whole {
                    parked.take(&st.pool, g, spans)
                } else {
                    Vec::new()
                }
            }
        };
        if !reused.is_empty() {
            return self.apply_reusing_parked(spans, reused, grant, start, bytes);
        }

        // One handle per piece; a pooled handle of exactly the piece's size needs neither a
        // create nor any new budget.
        let cut = if shared.is_some() { run_pieces } else { pieces };
        let plan: Vec<(u64, u64, Option<PhysicalHandle>)> = cut(spans, g, ctx.max_windows, cuts)
            .into_iter()
            .map(|(o, n)| (o, n, st.pool.take(n.saturating_mul(g))))
            .collect();
        let pooled_bytes = plan
            .iter()
            .filter(|p| p.2.is_some())
            .map(|p| p.1.saturating_mul(g))
            .fold(0u64, u64::saturating_add);
        let from_pool = pooled_bytes / g;
        let new_bytes = bytes.saturating_sub(pooled_bytes);
        let untake_all = |plan: &[(u64, u64, Option<PhysicalHandle>)]| {
            st.pool.untake(
                ctx,
                plan.iter()
                    .filter_map(|p| p.2.map(|h| (h, p.1.saturating_mul(g))))
                    .collect(),
            );
        };
        let mut grant = match grant {
            Some(grant) => grant,
            None => match ctx.governor.try_grant(ctx.device, new_bytes) {
                Ok(grant) => grant,
                Err(refusal) => {
                    untake_all(&plan);
                    return Applied::failed(whole_request(refusal, bytes, pooled_bytes));
                }
            },
        };

        // Create (or take) and map piece by piece, each handle mapped whole.
        let mut mapped: Vec<Mapped> = Vec::new();
        let mut failure: Option<BackendError> = None;
        let mut rest = plan.into_iter();
        for (o, n, pooled) in rest.by_ref() {
            let addr = self.at(o);
            let size = n.saturating_mul(g);
            let (handle, origin) = match pooled {
                Some(h) => (h, Origin::Pool),
                None => match ctx.backend.create(size, &ctx.props) {
                    Ok(h) => (h, Origin::Created),
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                },
            };
            if let Err(e) = ctx.backend.map(addr, size, handle) {
                // A failed release is quarantined inside; the map error is the one reported.
                let _ = match origin {
                    Origin::Pool => st.dispose(handle, size, Source::Bucket(Bucket::Pooled)),
                    Origin::Created => st.dispose(handle, size, Source::Grant(&mut grant)),
                };
                failure = Some(e);
                break;
            }
            mapped.push(Mapped {
                offset: o,
                windows: n,
                handle,
                origin,
            });
        }
        // Handles taken from the pool but not reached go back.
        let left: Vec<_> = rest.collect();
        untake_all(&left);

        // One set access over each contiguous run, retried as the backend asks.
        if failure.is_none() {
            for (run_offset, run_bytes) in spans::runs(spans, g) {
                let addr = self.at(run_offset);
                if let Err(e) = ctx.set_access_retrying(addr, run_bytes, &ctx.access) {
                    failure = Some(e);
                    break;
                }
            }
        }

        if let Some(error) = failure {
            tracing::debug!(%error, mapped = mapped.len(), "commit failed; rolling back");
            let kept = self.rollback(mapped, &mut grant);
            grant.rollback();
            return Applied {
                result: Err(error.into()),
                blocks: kept,
            };
        }

        let created = mapped
            .iter()
            .filter(|m| m.origin == Origin::Created)
            .map(|m| m.windows.saturating_mul(g))
            .fold(0u64, u64::saturating_add);
        ctx.account(grant.settle(created, target));
        ctx.account(
            ctx.governor
                .transfer(ctx.device, Bucket::Pooled, target, pooled_bytes),
        );
        grant.rollback();
        let kind = match shared {
            Some(set) => {
                set.extend(mapped.iter().map(|m| SharedPiece {
                    offset: m.offset,
                    windows: m.windows,
                    handle: m.handle,
                }));
                BlockKind::Shared { writable: true }
            }
            None => BlockKind::Owned,
        };
        let handles = mapped.len() as u64;
        let blocks = mapped
            .into_iter()
            .map(|m| Block {
                offset: m.offset,
                windows: m.windows,
                handle: m.handle,
                kind,
                shared: None,
            })
            .collect();
        Applied {
            result: Ok(Commit {
                address: start,
                bytes,
                granules,
                from_pool,
                mappings: handles,
            }),
            blocks,
        }
    }

    /// A private commit some of whose windows are parked here: the others are committed as
    /// usual, then the parked ones become blocks again (pooled to committed). If the fresh
    /// part fails, the parked windows go back to parking.
    fn apply_reusing_parked(
        &self,
        spans: &[Span],
        reused: Vec<Window>,
        grant: Option<MappedGrowthGrant>,
        start: DeviceAddress,
        bytes: u64,
    ) -> Applied {
        let st = Arc::clone(&self.state);
        let ctx = &st.ctx;
        let g = ctx.granule;
        let holes: Vec<Span> = reused.iter().map(|w| Span::new(w.0, w.1)).collect();
        let fresh = spans::subtract(spans, &holes, g);
        let reused_windows = reused.iter().map(|w| w.1).fold(0u64, u64::saturating_add);
        let reused_bytes = reused_windows.saturating_mul(g);
        let mut applied = if fresh.is_empty() {
            if let Some(grant) = grant {
                grant.rollback();
            }
            Applied {
                result: Ok(Commit::empty(start)),
                blocks: Vec::new(),
            }
        } else {
            self.apply(&fresh, grant, None, &[])
        };
        match applied.result {
            Ok(c) => {
                ctx.account(ctx.governor.transfer(
                    ctx.device,
                    Bucket::Pooled,
                    Bucket::Committed,
                    reused_bytes,
                ));
                let n = reused.len() as u64;
                applied
                    .blocks
                    .extend(reused.into_iter().map(|(o, w, h)| Block::owned(o, w, h)));
                applied.blocks.sort_by_key(|b| b.offset);
                Applied {
                    result: Ok(Commit {
                        address: start,
                        bytes,
                        granules: spans::window_count(spans),
                        from_pool: c.from_pool.saturating_add(reused_windows),
                        mappings: c.mappings.saturating_add(n),
                    }),
                    blocks: applied.blocks,
                }
            }
            Err(e) => {
                if let Some(parked) = &self.parked {
                    parked.put_back(&st.pool, g, reused);
                }
                Applied {
                    result: Err(e),
                    blocks: applied.blocks,
                }
            }
        }
    }

    /// Undoes the maps of a failed commit in reverse order, mapping by mapping. A mapping
    /// whose unmap fails stays recorded (it is still mapped) and its bytes are accounted as
    /// committed.
    fn rollback(&self, mapped: Vec<Mapped>, grant: &mut MappedGrowthGrant) -> Vec<Block> {
        let st = &*self.state;
        let ctx = &st.ctx;
        let g = ctx.granule;
        let mut kept = Vec::new();
        for m in mapped.into_iter().rev() {
            let addr = self.at(m.offset);
            let size = m.windows.saturating_mul(g);
            match ctx.backend.unmap(addr, size) {
                Ok(()) => {
                    // A failed release is quarantined inside; the commit's error is reported.
                    let _ = match m.origin {
                        Origin::Pool => st.dispose(m.handle, size, Source::Bucket(Bucket::Pooled)),
                        Origin::Created => st.dispose(m.handle, size, Source::Grant(grant)),
                    };
                }
                Err(error) => {
                    tracing::warn!(%addr, %error, "rollback unmap failed; mapping stays recorded");
                    // Still mapped: it stays as an owned block of this reservation, even when
                    // the commit was for a shared set (the set never saw it).
                    let r = match m.origin {
                        Origin::Pool => ctx.governor.transfer(
                            ctx.device,
                            Bucket::Pooled,
                            Bucket::Committed,
                            size,
                        ),
                        Origin::Created => grant.settle(size, Bucket::Committed),
                    };
                    ctx.account(r);
                    kept.push(Block::owned(m.offset, m.windows, m.handle));
                }
            }
        }
        kept
    }
}

/// A refusal of the grant for what the pool could not supply, restated for the whole commit:
/// `needed` is every byte the commit asked for and `available` includes the pooled handles it
/// had set aside (back in the pool now), so that both count the same bytes.
fn whole_request(refusal: Refusal, bytes: u64, pooled_bytes: u64) -> VmmError {
    match refusal {
        Refusal::Backpressure(mut b) => {
            b.needed = bytes;
            b.available = b.available.saturating_add(pooled_bytes);
            VmmError::Backpressure(b)
        }
        other => other.into(),
    }
}
