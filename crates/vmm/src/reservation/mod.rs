//! [`Reservation`]: the public face of one reserved address range. Each operation is a thin
//! entry point; the work is in `commit.rs` (the transaction and rollback), `sharing.rs`
//! (shared mappings), `release.rs` (unmap runs), `parking.rs` (parked windows) and
//! `teardown.rs` (drop); the records and bounds checks are `range.rs`.

pub(crate) mod commit;
pub(crate) mod job;
pub(crate) mod records;
mod release;
pub(crate) mod sharing;
mod teardown;

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use kvvm_governor::MappedGrowthGrant;
use kvvm_hal::{Access, DeviceAddress};

use crate::device::DeviceState;
use crate::error::{VmmError, VmmResult};
use crate::mapping::{Commit, MappedBlock};
use crate::reservation::records::ReservedRange;
use crate::shared::SharedHandles;
use crate::strided::SharedRange;

/// A reserved device address range whose base never changes, committed granule by granule.
///
/// Dropping it tears it down: synchronize the device, unmap, return or release the handles,
/// free the range. If the device cannot be synchronized, nothing is unmapped, released or
/// freed: the blocks go to quarantine (see the crate docs).
pub struct Reservation {
    range: ReservedRange,
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation")
            .field("base", &self.range.base)
            .field("size", &self.range.size)
            .field("blocks", &self.range.blocks.len())
            .field("granule", &self.range.granule())
            .finish()
    }
}

impl Reservation {
    pub(crate) fn new(state: Arc<DeviceState>, base: DeviceAddress, size: u64) -> Self {
        Reservation {
            range: ReservedRange::new(state, base, size),
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
        r.range.shared_range = Some(shared);
        r
    }

    /// Whether this reservation is a slot of a range shared with other reservations
    /// ([`VirtualMemory::reserve_strided`](crate::VirtualMemory::reserve_strided)).
    pub fn is_strided_slot(&self) -> bool {
        self.range.shared_range.is_some()
    }

    /// The base address; it never changes while the reservation lives.
    pub fn address(&self) -> DeviceAddress {
        self.range.base
    }

    /// Reserved bytes (a whole number of granules).
    pub fn size(&self) -> u64 {
        self.range.size
    }

    /// The granule.
    pub fn granule(&self) -> u64 {
        self.range.granule()
    }

    /// Committed bytes: granule x committed windows (invariant 1). A multi-window handle
    /// that a release or truncate cut through stays mapped and counted until it goes whole.
    pub fn committed_bytes(&self) -> u64 {
        self.range.committed_bytes()
    }

    /// Offset just past the last mapped block: the next commit maps from here. It equals
    /// [`committed_bytes`](Self::committed_bytes) unless a failed rollback or release left a
    /// block mapped above a hole.
    pub fn committed_end(&self) -> u64 {
        self.range.committed_end()
    }

    /// The mappings as the manager records them, by address: one entry per mapping (one
    /// handle, mapped whole, of one or more granule windows).
    pub fn mappings(&self) -> Vec<MappedBlock> {
        self.range.mappings()
    }

    /// Windows released but kept mapped for reuse (see
    /// [`VmmConfig::park_released`](crate::VmmConfig::park_released)): pooled memory, not
    /// committed bytes. Empty when the manager does not park.
    pub fn parked(&self) -> Vec<MappedBlock> {
        self.range
            .parked
            .as_ref()
            .map(|p| p.list(self.range.granule()))
            .unwrap_or_default()
    }

    /// Whether the granule window starting at `offset` is mapped.
    pub fn is_mapped(&self, offset: u64) -> bool {
        self.range.is_mapped(offset)
    }

    /// What is mapped in the granule window starting at `offset`, if anything.
    pub fn window_kind(&self, offset: u64) -> Option<crate::mapping::BlockKind> {
        self.range.window_kind(offset)
    }

    /// Commits `bytes` (rounded up to whole granules) after the committed end, asking the
    /// governor for the bytes the pool cannot supply. A zero-byte commit does nothing. When a
    /// failed rollback or release left holes below the committed end, they are filled first
    /// (lowest first), so that the committed bytes grow from the base again.
    pub fn commit(&mut self, bytes: u64) -> VmmResult<Commit> {
        self.range.take_back_left_mapped();
        let granules = bytes.div_ceil(self.range.granule());
        self.range.commit_granules(granules, None)
    }

    /// Commits the bytes of `grant` (a whole number of granules, from this manager's governor
    /// and device, e.g. from [`VirtualMemory::try_grant`](crate::VirtualMemory::try_grant))
    /// after the committed end. The grant is consumed on success and rolled back on failure.
    pub fn commit_with_grant(&mut self, grant: MappedGrowthGrant) -> VmmResult<Commit> {
        self.range.take_back_left_mapped();
        if let Some(reason) = self.range.grant_mismatch(&grant) {
            return Err(VmmError::GrantMismatch { reason });
        }
        let granules = grant.bytes() / self.range.granule();
        self.range.commit_granules(granules, Some(grant))
    }

    /// Commits whole granules until every window holding a byte of `[0, len)` is mapped,
    /// holes left by a failed rollback or release included. Returns `None` if nothing was
    /// needed.
    pub fn ensure_committed(&mut self, len: u64) -> VmmResult<Option<Commit>> {
        self.range.take_back_left_mapped();
        if self.range.has_holes() {
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
        self.range.take_back_left_mapped();
        self.commit_ranges(&[(offset, len)])
    }

    /// Like [`commit_range`](Self::commit_range) over several ranges, in one transaction.
    pub fn commit_ranges(&mut self, ranges: &[(u64, u64)]) -> VmmResult<Option<Commit>> {
        self.range.take_back_left_mapped();
        let spans = self.range.missing_spans(ranges)?;
        if spans.is_empty() {
            return Ok(None);
        }
        self.range.commit_windows(&spans, None, None, &[]).map(Some)
    }

    /// Begins a commit of every unmapped window overlapping `ranges`, as
    /// [`commit_ranges`](Self::commit_ranges) would make it, but split so that its driver
    /// calls ([`CommitJob::run`](crate::CommitJob::run)) need no borrow of this reservation: the caller may release
    /// its lock on the reservation while they run, then [`finish_commit`](Self::finish_commit).
    /// Until then the windows are in flight (another commit of them is
    /// [`VmmError::Busy`]); one job at a time per reservation. `None` when every window is
    /// mapped. Blocks released while the job runs are not its windows; its own are recorded by
    /// `finish_commit`.
    pub fn begin_commit_ranges(
        &mut self,
        ranges: &[(u64, u64)],
    ) -> VmmResult<Option<crate::CommitJob>> {
        self.range.take_back_left_mapped();
        self.range.begin_commit(ranges)
    }

    /// Finishes a job begun here: runs it if it has not run, records the windows it mapped
    /// (or those a failed rollback left mapped) and returns the commit's result. A job of
    /// another reservation is refused (and undone as it is dropped).
    pub fn finish_commit(&mut self, job: crate::CommitJob) -> VmmResult<Commit> {
        self.range.take_back_left_mapped();
        self.range.finish_commit(job)
    }

    /// Undoes a job begun here, recorded first so that a window whose unmap fails stays in
    /// this reservation's books: runs it if it has not run, then releases exactly its windows
    /// (a transaction over several reservations rolling back the parts that succeeded).
    /// Returns the bytes unmapped.
    pub fn abort_commit(&mut self, job: crate::CommitJob) -> VmmResult<u64> {
        self.range.take_back_left_mapped();
        self.range.abort_commit(job)
    }

    /// Whether a [`CommitJob`](crate::CommitJob) begun here is not finished yet.
    pub fn has_commit_in_flight(&self) -> bool {
        self.range
            .in_flight
            .as_ref()
            .is_some_and(|f| f.mark.strong_count() > 0)
    }

    /// Commits the windows overlapping `ranges` as a new [`SharedHandles`] set that this
    /// reservation owns and maps read-write (the owner of a shared prefix writes it through
    /// this mapping). The bytes are granted and billed once, as shared. Every window must be
    /// unmapped; the transaction and rollback are those of a commit, and so is the cut into
    /// handles, except that no handle crosses the start of one of `ranges`: a sharer may
    /// map the set ([`map_shared`](Self::map_shared), whole handles only) up to any range
    /// boundary.
    pub fn commit_shared(&mut self, ranges: &[(u64, u64)]) -> VmmResult<Arc<SharedHandles>> {
        self.range.take_back_left_mapped();
        self.range.commit_shared(ranges)
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
        self.range.take_back_left_mapped();
        let mut named = windows.to_vec();
        named.sort_unstable();
        named.dedup();
        self.range.check_set(set)?;
        // The lowest index past the set is refused here: not every index has a range.
        if let Some(&i) = named.iter().find(|&&i| i >= set.len()) {
            return Err(VmmError::OutOfBounds {
                offset: i as u64,
                requested: 1,
                reserved: set.len() as u64,
            });
        }
        self.range.map_shared(
            set,
            &crate::reservation::sharing::index_ranges(&named),
            access,
        )
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
        self.range.take_back_left_mapped();
        self.range.map_shared(set, windows, access)
    }

    /// Unmaps every block, returns the handles to the pool (or releases them) and keeps the
    /// address range for later commits. Returns the bytes unmapped.
    ///
    /// Adjacent blocks are unmapped with one call where the backend allows it
    /// ([`Capabilities::unmap_spans_mappings`](kvvm_hal::Capabilities)), one call per block
    /// otherwise. On error, the blocks whose unmap failed stay recorded (still mapped),
    /// handles whose release failed are quarantined, and the first error is returned after
    /// every other block was processed.
    ///
    /// Unlike dropping the reservation, releasing does **not** synchronize the device: the
    /// caller orders its own device work, and any kernel or copy still reading or writing the
    /// released bytes must be finished first (its stream synchronized, or an event waited on).
    /// The same holds for [`truncate`](Self::truncate) and
    /// [`release_ranges`](Self::release_ranges). A serving engine shrinks between steps, so a
    /// device-wide synchronize on every release would stall the streams it did not need to.
    pub fn release(&mut self) -> VmmResult<u64> {
        self.range.take_back_left_mapped();
        self.truncate(0)
    }

    /// Releases every mapping that starts at or beyond `len` bytes from the base, like
    /// [`release`](Self::release). A mapping holding a byte below `len` stays whole (a
    /// multi-window handle straddling `len` stays mapped and committed until a later
    /// truncate reaches its start). Returns the bytes unmapped.
    pub fn truncate(&mut self, len: u64) -> VmmResult<u64> {
        self.range.take_back_left_mapped();
        self.range.truncate(len)
    }

    /// Releases the mappings lying wholly inside the union of `ranges` (offsets from the
    /// base), like [`release`](Self::release): owned handles go to the pool or the driver,
    /// shared mappings drop their reference; the others stay, a multi-window mapping only
    /// partly inside included (it is unmapped whole or not at all). Returns the bytes
    /// unmapped. This is how windows committed ahead of need are given back.
    pub fn release_ranges(&mut self, ranges: &[(u64, u64)]) -> VmmResult<u64> {
        self.range.take_back_left_mapped();
        self.range.release_ranges(ranges)
    }
}
