//! The commit transaction: what a commit does in the driver and the governor, and how it is
//! undone. A [`Target`] is what the transaction needs of its reservation (the device state,
//! the base address, the parked windows), not the block list, so that a background commit
//! ([`CommitJob`](crate::CommitJob)) runs it while the reservation is used elsewhere.
//!
//! [`Target::apply`] runs over validated window spans (sorted, disjoint, unmapped, in bounds,
//! not in flight), step by step, each step's undo beside it:
//!
//! | step | file | undone by |
//! |---|---|---|
//! | take back parked mappings lying wholly inside the windows (no driver call); unmap any other that overlaps | `parked.rs` | put back in parking |
//! | plan the pieces: cut each run into handles (`crate::windows::cut`), take pooled handles of exactly those sizes | `plan.rs` | [`Plan::untake`](plan::Plan::untake) |
//! | grant the bytes the pool cannot supply (no grant, no commit) | `plan.rs` | the grant's rollback |
//! | create each handle (unless pooled) and map it whole | `map.rs` | `rollback.rs`: unmap last first, dispose |
//! | set access once over each contiguous run | `map.rs` | `rollback.rs` |
//! | settle the grant, account pooled bytes, make the blocks | `settle.rs` | (the last step) |
//!
//! A mapping whose undo (unmap) fails stays recorded as a block of the reservation (it is
//! still mapped) and is accounted as committed. The bookkeeping is per span, per parked
//! mapping and per handle, never per window: a run of 2048 windows mapped as one handle is
//! checked, cut and given access once.

mod map;
mod parked;
mod plan;
mod rollback;
mod settle;

use std::sync::Arc;

use kvvm_governor::MappedGrowthGrant;
use kvvm_hal::{DeviceAddress, PhysicalHandle};

use crate::block::Block;
use crate::device::parking::ParkedWindows;
use crate::device::DeviceState;
use crate::error::{VmmError, VmmResult};
use crate::mapping::Commit;
use crate::shared::SharedPiece;
use crate::windows::spans::{self, Span};

/// What a commit's driver work needs of its reservation: the device state, the base address
/// and the parked windows; not the block list, so that the work can run while the
/// reservation is used elsewhere (a background commit).
pub(crate) struct Target {
    pub(crate) state: Arc<DeviceState>,
    pub(crate) base: DeviceAddress,
    pub(crate) parked: Option<Arc<ParkedWindows>>,
    /// The most windows one handle of the commit holds (a power of two, at most the
    /// manager's largest handle).
    pub(crate) max_windows: u64,
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

/// What a commit asks for, as the result reports it: the address of its first window, its
/// bytes and windows.
#[derive(Debug, Clone, Copy)]
struct Request {
    start: DeviceAddress,
    bytes: u64,
    granules: u64,
}

impl Target {
    fn at(&self, offset: u64) -> DeviceAddress {
        self.base.offset(offset)
    }

    /// The transaction over validated window spans; no handle crosses one of the sorted
    /// offsets `cuts`. With `shared`, the new handles are recorded there (a shared set,
    /// accounted once as shared) and mapped read-write for the owner. See the module docs
    /// for its steps.
    pub(crate) fn apply(
        &self,
        spans: &[Span],
        grant: Option<MappedGrowthGrant>,
        shared: Option<&mut Vec<SharedPiece>>,
        cuts: &[u64],
    ) -> Applied {
        let span = tracing::debug_span!(
            "vmm.commit",
            device = self.state.ctx.device.0,
            base = self.base.0,
            granules = spans::window_count(spans)
        );
        let _e = span.enter();
        let request = match self.request(spans) {
            Ok(request) => request,
            Err(e) => return Applied::failed(e),
        };
        match self.take_parked(spans, shared.is_none()) {
            Err(e) => return Applied::failed(e),
            Ok(reused) if !reused.is_empty() => {
                return self.apply_reusing_parked(spans, reused, grant, request);
            }
            Ok(_) => {}
        }
        let plan = self.plan(spans, shared.is_some(), cuts);
        let mut grant = match self.grant_for(&plan, grant, request.bytes) {
            Ok(grant) => grant,
            Err(e) => return Applied::failed(e),
        };
        let (mapped, failure) = self.create_and_map(plan.pieces, &mut grant);
        let failure = failure.or_else(|| self.set_access(spans).err());
        if let Some(error) = failure {
            return self.roll_back(error, mapped, grant);
        }
        self.settle(mapped, grant, plan.pooled_bytes, shared, request)
    }

    /// The request's address, bytes and windows, refused on overflow.
    fn request(&self, spans: &[Span]) -> VmmResult<Request> {
        let first = spans.first().map_or(0, |s| s.offset);
        let start = self.base.checked_add(first).ok_or(VmmError::SizeOverflow {
            what: "block address",
        })?;
        let granules = spans::window_count(spans);
        let bytes = granules
            .checked_mul(self.state.ctx.granule)
            .ok_or(VmmError::SizeOverflow {
                what: "commit size",
            })?;
        Ok(Request {
            start,
            bytes,
            granules,
        })
    }
}
