//! [`Reservation`]: one reserved device address range, its records and every operation on
//! it. The range is reserved once; physical granules are committed behind it, released and
//! parked, and it is torn down when dropped.
//!
//! Invariants a reservation keeps (the tests check them after every injected fault):
//! * its base address never changes while it lives (invariant 5);
//! * `blocks` are its live driver mappings, sorted by offset and disjoint, and nothing else:
//!   a mapping whose unmap failed stays recorded (it *is* still mapped), and so does one a
//!   dropped [`CommitJob`](crate::CommitJob) could not unmap ([`LeftMapped`]);
//! * committed bytes = granule x the windows of its blocks (invariant 1), and those bytes are
//!   what the governor counts for it as committed (owned) or shared;
//! * a window is in at most one place: a block, the parked set, or a job in flight;
//! * every change starts with the checks of `bounds.rs` (the driver checks no bounds).
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | the type, its construction and identity (base, size, granule) |
//! | `records.rs` | the blocks and what is read from them; the windows of a job in flight |
//! | `bounds.rs` | bounds, free-window, never-fits and missing-window checks |
//! | `commit.rs` | `commit`, `commit_with_grant`, `ensure_committed`, `commit_range(s)`: which windows a commit takes; the transaction itself is `crate::transaction` |
//! | `job.rs` | [`CommitJob`](crate::CommitJob): begin, run, finish, abort, undo on drop |
//! | `left_mapped.rs` | [`LeftMapped`]: what a dropped job could not unmap, handed back here |
//! | `sharing.rs` | `commit_shared`, `map_shared`, `map_shared_ranges` |
//! | `release.rs` | `release`, `truncate`, `release_ranges`: unmap runs, park |
//! | `teardown.rs` | drop: synchronize, unmap, free, or quarantine |

mod bounds;
mod commit;
pub(crate) mod job;
mod left_mapped;
mod records;
mod release;
mod sharing;
mod teardown;

use std::fmt;
use std::sync::Arc;

use kvvm_hal::DeviceAddress;

use crate::block::Block;
use crate::device::parking::ParkedWindows;
use crate::device::DeviceState;
use crate::error::{VmmError, VmmResult};
use crate::strided::SharedRange;

use left_mapped::LeftMapped;
use records::InFlight;

/// A reserved device address range whose base never changes, committed granule by granule.
///
/// Dropping it tears it down: synchronize the device, unmap, return or release the handles,
/// free the range. If the device cannot be synchronized, nothing is unmapped, released or
/// freed: the blocks go to quarantine (see the crate docs).
pub struct Reservation {
    state: Arc<DeviceState>,
    base: DeviceAddress,
    size: u64,
    /// Mappings, sorted by offset, each of one or more windows (one handle each).
    blocks: Vec<Block>,
    /// Released windows kept mapped for reuse (when the manager parks released windows).
    parked: Option<Arc<ParkedWindows>>,
    /// The driver range this reservation is a slot of, when it was carved out of a larger
    /// one (`VirtualMemory::reserve_strided`): the range is freed when its last slot is gone,
    /// not by this reservation.
    shared_range: Option<Arc<SharedRange>>,
    /// Windows a background commit ([`CommitJob`](crate::CommitJob)) is mapping right now.
    in_flight: Option<InFlight>,
    /// Blocks a job begun here was dropped with and could not unmap: still mapped, so still
    /// this reservation's (taken back into `blocks` at its next change, read with them
    /// until then).
    left_mapped: Arc<LeftMapped>,
    /// The most windows a handle of this reservation's commits holds, when it is fewer than
    /// the manager's ([`set_max_handle_windows`](Self::set_max_handle_windows)).
    max_windows: Option<u64>,
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation")
            .field("base", &self.base)
            .field("size", &self.size)
            .field("blocks", &self.blocks.len())
            .field("granule", &self.granule())
            .finish()
    }
}

impl Reservation {
    pub(crate) fn new(state: Arc<DeviceState>, base: DeviceAddress, size: u64) -> Self {
        let parked = state.parking.open(base);
        Reservation {
            state,
            base,
            size,
            blocks: Vec::new(),
            parked,
            shared_range: None,
            in_flight: None,
            left_mapped: Arc::new(LeftMapped::open()),
            max_windows: None,
        }
    }

    /// A reservation of `[base, base + size)` inside the shared driver range `shared`.
    pub(crate) fn new_in_range(
        state: Arc<DeviceState>,
        base: DeviceAddress,
        size: u64,
        shared: Arc<SharedRange>,
    ) -> Self {
        let mut r = Reservation::new(state, base, size);
        r.shared_range = Some(shared);
        r
    }

    /// Whether this reservation is a slot of a range shared with other reservations
    /// ([`VirtualMemory::reserve_strided`](crate::VirtualMemory::reserve_strided)).
    pub fn is_strided_slot(&self) -> bool {
        self.shared_range.is_some()
    }

    /// The base address; it never changes while the reservation lives.
    pub fn address(&self) -> DeviceAddress {
        self.base
    }

    /// Reserved bytes (a whole number of granules).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The granule.
    pub fn granule(&self) -> u64 {
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
}
