//! [`Reservation`]: one reserved address range, its committed blocks, commit, release and
//! teardown.

use std::fmt;
use std::sync::Arc;

use kvvm_governor::{Bucket, MappedGrowthGrant};
use kvvm_hal::{BackendError, DeviceAddress, PhysicalHandle};

use crate::error::{VmmError, VmmResult};
use crate::manager::{Inner, Parked, QuarantineEntry, QuarantineReason, Source};
use crate::shared::SharedHandles;
use crate::strided::SharedRange;

/// Who owns the physical memory behind a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BlockKind {
    /// The reservation owns the handle: release returns it to the pool or the driver.
    Owned,
    /// A mapping of a [`SharedHandles`] set (a shared prefix): unmapping it only drops a
    /// reference (`note_unmapped`); the handle is released when the set is dropped, which
    /// cannot happen before every mapping of it is gone (DESIGN invariant 4).
    Shared {
        /// Whether this mapping has write access (the owner's) or read-only (a sharer's).
        writable: bool,
    },
}

/// One mapped block of a reservation, as the manager records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MappedBlock {
    /// Where it is mapped.
    pub address: DeviceAddress,
    /// Its size (one granule).
    pub size: u64,
    /// The physical handle mapped there.
    pub handle: PhysicalHandle,
    /// Who owns the handle.
    pub kind: BlockKind,
}

#[derive(Debug, Clone)]
struct Block {
    offset: u64,
    handle: PhysicalHandle,
    kind: BlockKind,
    /// For shared blocks: the set the handle belongs to (keeps it alive while mapped).
    shared: Option<Arc<SharedHandles>>,
}

/// What a successful commit did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    /// Address of the first newly mapped byte.
    pub address: DeviceAddress,
    /// Bytes newly mapped.
    pub bytes: u64,
    /// Granules newly mapped.
    pub granules: u64,
    /// Of those, granules whose handle came from the pool (no create).
    pub from_pool: u64,
}

/// Where a handle of a commit in progress came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    Pool,
    Created,
}

/// A reserved device address range whose base never changes, committed granule by granule.
///
/// Dropping it tears it down: synchronize the device, unmap, return or release the handles,
/// free the range. If the device cannot be synchronized, nothing is unmapped, released or
/// freed: the blocks go to quarantine (see the crate docs).
pub struct Reservation {
    vm: Arc<Inner>,
    base: DeviceAddress,
    size: u64,
    /// Mapped blocks, sorted by offset, each one granule.
    blocks: Vec<Block>,
    /// Released windows kept mapped for reuse (when the manager parks released windows).
    parked: Option<Arc<Parked>>,
    /// The driver range this reservation is a slot of, when it was carved out of a larger
    /// one ([`VirtualMemory::reserve_strided`](crate::VirtualMemory::reserve_strided)): the
    /// range is freed when its last slot is gone, not by this reservation.
    range: Option<Arc<SharedRange>>,
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation")
            .field("base", &self.base)
            .field("size", &self.size)
            .field("blocks", &self.blocks.len())
            .field("granule", &self.vm.granule)
            .finish()
    }
}

impl Reservation {
    pub(crate) fn new(vm: Arc<Inner>, base: DeviceAddress, size: u64) -> Self {
        let parked = vm.park.then(|| {
            let set = Arc::new(Parked {
                base,
                blocks: std::sync::Mutex::new(Vec::new()),
            });
            vm.register_parked(&set);
            set
        });
        Reservation {
            vm,
            base,
            size,
            blocks: Vec::new(),
            parked,
            range: None,
        }
    }

    /// A reservation of `[base, base + size)` inside the driver range `range`.
    pub(crate) fn new_in_range(
        vm: Arc<Inner>,
        base: DeviceAddress,
        size: u64,
        range: Arc<SharedRange>,
    ) -> Self {
        let mut r = Reservation::new(vm, base, size);
        r.range = Some(range);
        r
    }

    /// Whether this reservation is a slot of a range shared with other reservations.
    pub fn is_strided_slot(&self) -> bool {
        self.range.is_some()
    }

    /// Keeps the driver range reserved forever: called when this reservation's memory is
    /// quarantined (still mapped), so that neither it nor its sibling slots free the range.
    fn pin_range(&mut self) {
        if let Some(range) = self.range.take() {
            std::mem::forget(range);
        }
    }

    fn parked_blocks(&self) -> Option<std::sync::MutexGuard<'_, Vec<(u64, PhysicalHandle)>>> {
        self.parked
            .as_ref()
            .map(|p| p.blocks.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Windows released but kept mapped for reuse (see
    /// [`VmmConfig::park_released`](crate::VmmConfig::park_released)): pooled memory, not
    /// committed bytes. Empty when the manager does not park.
    pub fn parked(&self) -> Vec<MappedBlock> {
        let g = self.vm.granule;
        self.parked_blocks()
            .map(|b| {
                b.iter()
                    .map(|(o, h)| MappedBlock {
                        address: DeviceAddress(self.base.0.saturating_add(*o)),
                        size: g,
                        handle: *h,
                        kind: BlockKind::Owned,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Takes the parked windows at `offsets` out of the parked set (they stay mapped).
    fn take_parked(&self, offsets: &[u64]) -> Vec<(u64, PhysicalHandle)> {
        let Some(mut parked) = self.parked_blocks() else {
            return Vec::new();
        };
        let mut taken = Vec::new();
        parked.retain(|&(o, h)| {
            if offsets.binary_search(&o).is_ok() {
                taken.push((o, h));
                false
            } else {
                true
            }
        });
        drop(parked);
        self.vm.note_unparked(taken.len() as u64);
        taken
    }

    /// Puts windows taken by [`take_parked`](Self::take_parked) back.
    fn return_parked(&self, blocks: Vec<(u64, PhysicalHandle)>) {
        if blocks.is_empty() {
            return;
        }
        let n = blocks.len() as u64;
        if let Some(mut parked) = self.parked_blocks() {
            parked.extend(blocks);
            parked.sort_unstable_by_key(|(o, _)| *o);
        }
        // They were counted out by `take_parked`: count them back in (the cap was checked
        // when they were first parked).
        self.vm.note_reparked(n);
    }

    /// Unmaps and releases the parked windows at `offsets` so that something else can be
    /// mapped there.
    fn evict_parked(&self, offsets: &[u64]) -> Result<(), BackendError> {
        let vm = &self.vm;
        let g = vm.granule;
        let victims = self.take_parked(offsets);
        let mut failed = Vec::new();
        let mut first_error = None;
        for (o, h) in victims {
            let addr = DeviceAddress(self.base.0.saturating_add(o));
            match vm.backend.unmap(addr, g) {
                Ok(()) => {
                    // A failed release is quarantined inside.
                    let _ = vm.dispose(h, Source::Bucket(Bucket::Pooled));
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                    failed.push((o, h));
                }
            }
        }
        self.return_parked(failed);
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
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
        self.vm.granule
    }

    /// Committed bytes: granule x mapped blocks (DESIGN invariant 1).
    pub fn committed_bytes(&self) -> u64 {
        (self.blocks.len() as u64).saturating_mul(self.vm.granule)
    }

    /// Offset just past the last mapped block: the next commit maps from here. It equals
    /// [`committed_bytes`](Self::committed_bytes) unless a failed rollback or release left a
    /// block mapped above a hole.
    pub fn committed_end(&self) -> u64 {
        self.blocks
            .last()
            .map_or(0, |b| b.offset.saturating_add(self.vm.granule))
    }

    /// The blocks as the manager records them, by address.
    pub fn mappings(&self) -> Vec<MappedBlock> {
        self.blocks.iter().map(|b| self.mapped_block(b)).collect()
    }

    fn mapped_block(&self, b: &Block) -> MappedBlock {
        MappedBlock {
            address: DeviceAddress(self.base.0.saturating_add(b.offset)),
            size: self.vm.granule,
            handle: b.handle,
            kind: b.kind,
        }
    }

    fn addr(&self, offset: u64) -> VmmResult<DeviceAddress> {
        self.base.checked_add(offset).ok_or(VmmError::SizeOverflow {
            what: "block address",
        })
    }

    /// Commits `bytes` (rounded up to whole granules) after the committed end, asking the
    /// governor for the bytes the pool cannot supply. A zero-byte commit does nothing.
    pub fn commit(&mut self, bytes: u64) -> VmmResult<Commit> {
        let g = self.vm.granule;
        let granules = bytes.div_ceil(g);
        self.commit_granules(granules, None)
    }

    /// Commits the bytes of `grant` (a whole number of granules, from this manager's governor
    /// and device, e.g. from [`VirtualMemory::try_grant`](crate::VirtualMemory::try_grant))
    /// after the committed end. The grant is consumed on success and rolled back on failure.
    pub fn commit_with_grant(&mut self, grant: MappedGrowthGrant) -> VmmResult<Commit> {
        let g = self.vm.granule;
        let reason = if grant.device() != self.vm.device {
            Some(format!(
                "grant is for {}, manager for {}",
                grant.device(),
                self.vm.device
            ))
        } else if !grant.is_from(&self.vm.governor) {
            Some("grant is from another governor".to_owned())
        } else if grant.bytes().checked_rem(g) != Some(0) {
            Some(format!(
                "{} bytes is not a multiple of the granule {g}",
                grant.bytes()
            ))
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(VmmError::GrantMismatch { reason });
        }
        let granules = grant.bytes() / g;
        self.commit_granules(granules, Some(grant))
    }

    /// Commits whole granules until at least `len` bytes from the base are committed
    /// (measured by [`committed_end`](Self::committed_end)). Returns `None` if nothing was
    /// needed.
    pub fn ensure_committed(&mut self, len: u64) -> VmmResult<Option<Commit>> {
        let end = self.committed_end();
        if len <= end {
            return Ok(None);
        }
        self.commit(len.saturating_sub(end)).map(Some)
    }

    /// Whether the granule window starting at `offset` is mapped.
    pub fn is_mapped(&self, offset: u64) -> bool {
        self.blocks
            .binary_search_by_key(&offset, |b| b.offset)
            .is_ok()
    }

    /// Commits every granule window that overlaps `[offset, offset + len)` and is not mapped
    /// yet, as one transaction (all of them or none), wherever they are in the reservation
    /// (the windows holding live bytes of a head-major KV cache are spread over many
    /// fragments). Access is set once over each contiguous run of new windows. Returns `None`
    /// when every window was already mapped.
    pub fn commit_range(&mut self, offset: u64, len: u64) -> VmmResult<Option<Commit>> {
        self.commit_ranges(&[(offset, len)])
    }

    /// Like [`commit_range`](Self::commit_range) over several ranges, in one transaction.
    pub fn commit_ranges(&mut self, ranges: &[(u64, u64)]) -> VmmResult<Option<Commit>> {
        let offsets = self.missing_windows(ranges)?;
        if offsets.is_empty() {
            return Ok(None);
        }
        self.commit_windows(&offsets, None, None).map(Some)
    }

    /// The end of `[offset, offset + len)`, refused when it overflows or runs past the
    /// reservation (the driver does not check reservation bounds; the manager always does).
    fn checked_end(&self, offset: u64, len: u64, what: &'static str) -> VmmResult<u64> {
        let end = offset
            .checked_add(len)
            .ok_or(VmmError::SizeOverflow { what })?;
        if end > self.size {
            return Err(VmmError::OutOfBounds {
                offset,
                requested: len,
                reserved: self.size,
            });
        }
        Ok(end)
    }

    /// A free window of this reservation: in bounds, granule-aligned, not mapped.
    fn check_free_window(&self, offset: u64) -> VmmResult<()> {
        let g = self.vm.granule;
        self.checked_end(offset, g, "window end")?;
        if !offset.is_multiple_of(g) {
            return Err(VmmError::OutOfBounds {
                offset,
                requested: g,
                reserved: self.size,
            });
        }
        if self.is_mapped(offset) {
            return Err(VmmError::AlreadyMapped { offset });
        }
        Ok(())
    }

    /// The sorted, unmapped window offsets overlapping `ranges`, bounds-checked.
    pub(crate) fn missing_windows(&self, ranges: &[(u64, u64)]) -> VmmResult<Vec<u64>> {
        let g = self.vm.granule;
        let mut offsets = Vec::new();
        for &(offset, len) in ranges {
            if len == 0 {
                continue;
            }
            let end = self.checked_end(offset, len, "range end")?;
            let first = offset / g;
            let last = end.div_ceil(g);
            for w in first..last {
                let o = w.saturating_mul(g);
                if !self.is_mapped(o) {
                    offsets.push(o);
                }
            }
        }
        offsets.sort_unstable();
        offsets.dedup();
        Ok(offsets)
    }

    fn commit_granules(
        &mut self,
        granules: u64,
        grant: Option<MappedGrowthGrant>,
    ) -> VmmResult<Commit> {
        let g = self.vm.granule;
        let offset = self.committed_end();
        let bytes = granules.checked_mul(g).ok_or(VmmError::SizeOverflow {
            what: "commit size",
        })?;
        if granules == 0 {
            // A grant handed in is rolled back by its drop.
            return Ok(Commit {
                address: self.addr(offset)?,
                bytes: 0,
                granules: 0,
                from_pool: 0,
            });
        }
        self.checked_end(offset, bytes, "commit end")?;
        let offsets: Vec<u64> = (0..granules)
            .map(|i| offset.saturating_add(i.saturating_mul(g)))
            .collect();
        self.commit_windows(&offsets, grant, None)
    }

    /// The commit transaction over sorted, distinct, unmapped, in-bounds window offsets.
    /// With `shared`, the new handles form a shared set (accounted once, as shared) that this
    /// reservation maps read-write as its owner.
    pub(crate) fn commit_windows(
        &mut self,
        offsets: &[u64],
        grant: Option<MappedGrowthGrant>,
        shared: Option<&mut Vec<(u64, PhysicalHandle)>>,
    ) -> VmmResult<Commit> {
        let vm = Arc::clone(&self.vm);
        let g = vm.granule;
        let granules = offsets.len() as u64;
        let span = tracing::debug_span!(
            "vmm.commit",
            device = vm.device.0,
            base = self.base.0,
            granules
        );
        let _e = span.enter();
        let first = offsets.first().copied().unwrap_or(0);
        let start = self.addr(first)?;
        let bytes = granules.checked_mul(g).ok_or(VmmError::SizeOverflow {
            what: "commit size",
        })?;
        // Every window must be in bounds and unmapped: the driver checks neither.
        for &o in offsets {
            self.check_free_window(o)?;
        }
        let target = if shared.is_some() {
            Bucket::Shared
        } else {
            Bucket::Committed
        };

        // Parked windows of this reservation at these offsets: reused as they are (no driver
        // call) for a private commit; unmapped first for a shared one.
        let reused: Vec<(u64, PhysicalHandle)> = if shared.is_some() {
            self.evict_parked(offsets)?;
            Vec::new()
        } else {
            self.take_parked(offsets)
        };
        if !reused.is_empty() {
            let fresh: Vec<u64> = offsets
                .iter()
                .copied()
                .filter(|o| reused.binary_search_by_key(o, |(r, _)| *r).is_err())
                .collect();
            let reused_bytes = (reused.len() as u64).saturating_mul(g);
            let result = if fresh.is_empty() {
                if let Some(grant) = grant {
                    grant.rollback();
                }
                Ok(Commit {
                    address: start,
                    bytes: 0,
                    granules: 0,
                    from_pool: 0,
                })
            } else {
                self.commit_windows(&fresh, grant, None)
            };
            return match result {
                Ok(c) => {
                    vm.account(vm.governor.transfer(
                        vm.device,
                        Bucket::Pooled,
                        Bucket::Committed,
                        reused_bytes,
                    ));
                    let n = reused.len() as u64;
                    self.insert_blocks(reused.into_iter().map(|(offset, handle)| Block {
                        offset,
                        handle,
                        kind: BlockKind::Owned,
                        shared: None,
                    }));
                    Ok(Commit {
                        address: start,
                        bytes,
                        granules,
                        from_pool: c.from_pool.saturating_add(n),
                    })
                }
                Err(e) => {
                    self.return_parked(reused);
                    Err(e)
                }
            };
        }

        // Pool first: a hit needs neither a create nor any new budget.
        let mut pooled = vm.take_from_pool(granules);
        let from_pool = pooled.len() as u64;
        let new_bytes = (granules.saturating_sub(from_pool)).saturating_mul(g);
        let mut grant = match grant {
            Some(grant) => grant,
            None => match vm.governor.try_grant(vm.device, new_bytes) {
                Ok(grant) => grant,
                Err(bp) => {
                    vm.untake(pooled);
                    return Err(bp.into());
                }
            },
        };

        // Create (or take) and map window by window.
        let mut mapped: Vec<(u64, PhysicalHandle, Origin)> = Vec::new();
        let mut failure: Option<BackendError> = None;
        for &o in offsets {
            let addr = DeviceAddress(self.base.0.saturating_add(o));
            let (handle, origin) = match pooled.pop() {
                Some(h) => (h, Origin::Pool),
                None => match vm.backend.create(g, &vm.props) {
                    Ok(h) => (h, Origin::Created),
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                },
            };
            if let Err(e) = vm.backend.map(addr, g, handle) {
                // A failed release is quarantined inside; the map error is the one reported.
                let _ = match origin {
                    Origin::Pool => vm.dispose(handle, Source::Bucket(Bucket::Pooled)),
                    Origin::Created => vm.dispose(handle, Source::Grant(&mut grant)),
                };
                failure = Some(e);
                break;
            }
            mapped.push((o, handle, origin));
        }

        // One set access over each contiguous run, retried as the backend asks.
        if failure.is_none() {
            for (run_offset, run_bytes) in runs(offsets, g) {
                let addr = DeviceAddress(self.base.0.saturating_add(run_offset));
                if let Err(e) = set_access_retrying(&vm, addr, run_bytes, &vm.access) {
                    failure = Some(e);
                    break;
                }
            }
        }

        // Handles taken from the pool but not reached go back.
        vm.untake(pooled);

        if let Some(error) = failure {
            tracing::debug!(%error, mapped = mapped.len(), "commit failed; rolling back");
            self.rollback(&vm, mapped, &mut grant);
            grant.rollback();
            return Err(error.into());
        }

        let created = (mapped
            .iter()
            .filter(|(_, _, o)| *o == Origin::Created)
            .count() as u64)
            .saturating_mul(g);
        let reused = from_pool.saturating_mul(g);
        vm.account(grant.settle(created, target));
        vm.account(
            vm.governor
                .transfer(vm.device, Bucket::Pooled, target, reused),
        );
        grant.rollback();
        let kind = match shared {
            Some(set) => {
                set.extend(mapped.iter().map(|(o, h, _)| (*o, *h)));
                BlockKind::Shared { writable: true }
            }
            None => BlockKind::Owned,
        };
        self.insert_blocks(mapped.into_iter().map(|(offset, handle, _)| Block {
            offset,
            handle,
            kind,
            shared: None,
        }));
        Ok(Commit {
            address: start,
            bytes,
            granules,
            from_pool,
        })
    }

    /// Commits the windows overlapping `ranges` as a new [`SharedHandles`] set that this
    /// reservation owns and maps read-write (the owner of a shared prefix writes it through
    /// this mapping). The bytes are granted and billed once, as shared. Every window must be
    /// unmapped; the transaction and rollback are those of a commit.
    pub fn commit_shared(&mut self, ranges: &[(u64, u64)]) -> VmmResult<Arc<SharedHandles>> {
        let offsets = self.missing_windows(ranges)?;
        let mut total = 0u64;
        for &(o, len) in ranges {
            let g = self.vm.granule;
            let first = o / g;
            let last = o.saturating_add(len).div_ceil(g);
            total = total.saturating_add(last.saturating_sub(first));
        }
        if (offsets.len() as u64) < total {
            let taken = ranges
                .iter()
                .flat_map(|&(o, len)| {
                    let g = self.vm.granule;
                    (o / g..o.saturating_add(len).div_ceil(g)).map(move |w| w.saturating_mul(g))
                })
                .find(|o| self.is_mapped(*o))
                .unwrap_or(0);
            return Err(VmmError::AlreadyMapped { offset: taken });
        }
        let mut windows = Vec::with_capacity(offsets.len());
        self.commit_windows(&offsets, None, Some(&mut windows))?;
        let set = Arc::new(SharedHandles::new(Arc::clone(&self.vm), windows));
        self.attach_shared(&set);
        Ok(set)
    }

    /// Inserts blocks and keeps the list sorted by offset.
    fn insert_blocks(&mut self, new: impl Iterator<Item = Block>) {
        let before = self.blocks.len();
        self.blocks.extend(new);
        let sorted_tail = self.blocks[before..]
            .first()
            .is_none_or(|b| before == 0 || self.blocks[before - 1].offset < b.offset);
        if !sorted_tail {
            self.blocks.sort_by_key(|b| b.offset);
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
        access: kvvm_hal::Access,
    ) -> VmmResult<u64> {
        let vm = Arc::clone(&self.vm);
        let g = vm.granule;
        if !set.is_from(&vm) {
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
        self.evict_parked(&offsets)?;
        let span = tracing::debug_span!(
            "vmm.map_shared",
            device = vm.device.0,
            base = self.base.0,
            windows = chosen.len()
        );
        let _e = span.enter();
        let mut done: Vec<u64> = Vec::new();
        let mut failure = None;
        for &(o, h) in &chosen {
            let addr = DeviceAddress(self.base.0.saturating_add(o));
            match vm.backend.map(addr, g, h) {
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
            let desc = [kvvm_hal::AccessDescriptor {
                device: vm.device,
                access,
            }];
            for (run_offset, run_bytes) in runs(&offsets, g) {
                let addr = DeviceAddress(self.base.0.saturating_add(run_offset));
                if let Err(e) = set_access_retrying(&vm, addr, run_bytes, &desc) {
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
                let addr = DeviceAddress(self.base.0.saturating_add(o));
                match vm.backend.unmap(addr, g) {
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

    /// Undoes the maps of a failed commit in reverse order. A block whose unmap fails stays
    /// recorded (it is still mapped) and its bytes are accounted as committed.
    fn rollback(
        &mut self,
        vm: &Inner,
        mapped: Vec<(u64, PhysicalHandle, Origin)>,
        grant: &mut MappedGrowthGrant,
    ) {
        let g = vm.granule;
        let mut kept = Vec::new();
        for (block_offset, handle, origin) in mapped.into_iter().rev() {
            let addr = DeviceAddress(self.base.0.saturating_add(block_offset));
            match vm.backend.unmap(addr, g) {
                Ok(()) => {
                    // A failed release is quarantined inside; the commit's error is reported.
                    let _ = match origin {
                        Origin::Pool => vm.dispose(handle, Source::Bucket(Bucket::Pooled)),
                        Origin::Created => vm.dispose(handle, Source::Grant(grant)),
                    };
                }
                Err(error) => {
                    tracing::warn!(%addr, %error, "rollback unmap failed; block stays recorded");
                    // Still mapped: it stays as an owned block of this reservation, even when
                    // the commit was for a shared set (the set never saw it).
                    let r = match origin {
                        Origin::Pool => {
                            vm.governor
                                .transfer(vm.device, Bucket::Pooled, Bucket::Committed, g)
                        }
                        Origin::Created => grant.settle(g, Bucket::Committed),
                    };
                    vm.account(r);
                    kept.push(Block {
                        offset: block_offset,
                        handle,
                        kind: BlockKind::Owned,
                        shared: None,
                    });
                }
            }
        }
        if !kept.is_empty() {
            self.insert_blocks(kept.into_iter());
        }
    }

    /// Unmaps every block, returns the handles to the pool (or releases them) and keeps the
    /// address range for later commits. Returns the bytes unmapped.
    ///
    /// Adjacent blocks are unmapped with one call where the backend allows it
    /// ([`Capabilities::unmap_spans_mappings`](kvvm_hal::Capabilities)), one call per block
    /// otherwise. On error, the blocks whose unmap failed stay recorded (still mapped),
    /// handles whose release failed are quarantined, and the first error is returned after
    /// every other block was processed.
    pub fn release(&mut self) -> VmmResult<u64> {
        self.truncate(0)
    }

    /// Releases every block at or beyond `len` bytes from the base (blocks holding a byte
    /// below `len` stay), like [`release`](Self::release). Returns the bytes unmapped.
    pub fn truncate(&mut self, len: u64) -> VmmResult<u64> {
        let vm = Arc::clone(&self.vm);
        let span =
            tracing::debug_span!("vmm.release", device = vm.device.0, base = self.base.0, len);
        let _e = span.enter();
        let keep_end = len.div_ceil(vm.granule).saturating_mul(vm.granule);
        let first = self.blocks.partition_point(|b| b.offset < keep_end);
        if self.parked.is_some() {
            self.park_from(first);
        }
        match self.unmap_from(&vm, first) {
            (bytes, None) => Ok(bytes),
            (_, Some(e)) => Err(e.into()),
        }
    }

    /// Releases the blocks whose whole window lies inside one of `ranges` (offsets from the
    /// base), like [`release`](Self::release): owned handles go to the pool or the driver,
    /// shared mappings drop their reference; blocks outside the ranges stay. Returns the bytes
    /// unmapped. This is how windows committed ahead of need are given back.
    pub fn release_ranges(&mut self, ranges: &[(u64, u64)]) -> VmmResult<u64> {
        let vm = Arc::clone(&self.vm);
        let g = vm.granule;
        let span = tracing::debug_span!(
            "vmm.release_ranges",
            device = vm.device.0,
            base = self.base.0,
            ranges = ranges.len()
        );
        let _e = span.enter();
        let inside = |o: u64| {
            ranges
                .iter()
                .any(|&(start, len)| o >= start && o.saturating_add(g) <= start.saturating_add(len))
        };
        let (todo, keep): (Vec<Block>, Vec<Block>) = std::mem::take(&mut self.blocks)
            .into_iter()
            .partition(|b| inside(b.offset));
        self.blocks = keep;
        match self.unmap_blocks(&vm, todo) {
            (bytes, None) => Ok(bytes),
            (_, Some(e)) => Err(e.into()),
        }
    }

    /// Parks the owned blocks from index `first` on, as many as the pool cap allows: they stay
    /// mapped, their bytes move from committed to pooled. The others stay for unmapping.
    fn park_from(&mut self, first: usize) {
        let vm = Arc::clone(&self.vm);
        let g = vm.granule;
        let tail = self.blocks.split_off(first.min(self.blocks.len()));
        let mut keep = Vec::new();
        let mut parked = Vec::new();
        for b in tail {
            if b.shared.is_none() && b.kind == BlockKind::Owned && vm.try_reserve_parking() {
                parked.push((b.offset, b.handle));
            } else {
                keep.push(b);
            }
        }
        if !parked.is_empty() {
            let bytes = (parked.len() as u64).saturating_mul(g);
            vm.account(
                vm.governor
                    .transfer(vm.device, Bucket::Committed, Bucket::Pooled, bytes),
            );
            if let Some(mut set) = self.parked_blocks() {
                set.extend(parked);
                set.sort_unstable_by_key(|(o, _)| *o);
            }
        }
        self.blocks.extend(keep);
    }

    /// Unmaps the blocks from index `first` on, last first, in runs of adjacent blocks where
    /// allowed. Returns the bytes unmapped and the first error.
    fn unmap_from(&mut self, vm: &Inner, first: usize) -> (u64, Option<BackendError>) {
        let todo = self.blocks.split_off(first.min(self.blocks.len()));
        self.unmap_blocks(vm, todo)
    }

    /// Unmaps `todo` (sorted blocks taken out of `self.blocks`), last first, in runs of
    /// adjacent blocks where allowed; blocks whose unmap fails go back into `self.blocks`.
    fn unmap_blocks(&mut self, vm: &Inner, mut todo: Vec<Block>) -> (u64, Option<BackendError>) {
        let g = vm.granule;
        let span_runs = vm.caps.unmap_spans_mappings;
        let mut first_error: Option<BackendError> = None;
        let mut unmapped = 0u64;
        let mut kept_rev: Vec<Block> = Vec::new();
        while let Some(last) = todo.last().cloned() {
            // The run: trailing blocks of `todo` adjacent to each other.
            let mut run_start = todo.len().saturating_sub(1);
            if span_runs {
                while run_start > 0 {
                    let prev = todo[run_start - 1].offset;
                    if prev.saturating_add(g) == todo[run_start].offset {
                        run_start -= 1;
                    } else {
                        break;
                    }
                }
            }
            let run = todo.split_off(run_start);
            let run_offset = run.first().map_or(last.offset, |b| b.offset);
            let run_bytes = (run.len() as u64).saturating_mul(g);
            let addr = DeviceAddress(self.base.0.saturating_add(run_offset));
            match vm.backend.unmap(addr, run_bytes) {
                Ok(()) => {
                    unmapped = unmapped.saturating_add(run_bytes);
                    for b in run.into_iter().rev() {
                        match (b.kind, b.shared) {
                            (BlockKind::Shared { .. }, Some(set)) => {
                                // Only a reference goes; the set releases its handles when
                                // its last holder (mapping, owner, cache) is gone.
                                set.note_unmapped();
                                drop(set);
                            }
                            _ => {
                                if let Err(error) =
                                    vm.dispose(b.handle, Source::Bucket(Bucket::Committed))
                                {
                                    // The handle is quarantined; report the first error.
                                    first_error.get_or_insert(error);
                                }
                            }
                        }
                    }
                }
                Err(error) => {
                    tracing::warn!(%addr, bytes = run_bytes, %error, "unmap failed; blocks stay recorded");
                    first_error.get_or_insert(error);
                    kept_rev.extend(run.into_iter().rev());
                }
            }
        }
        kept_rev.reverse();
        self.insert_blocks(kept_rev.into_iter());
        (unmapped, first_error)
    }

    fn quarantine_blocks(&mut self, reason: QuarantineReason, error: BackendError) {
        let vm = Arc::clone(&self.vm);
        let mappings = self.mappings();
        let owned = self.blocks.iter().filter(|b| b.shared.is_none()).count() as u64;
        let bytes = owned.saturating_mul(vm.granule);
        vm.account(
            vm.governor
                .transfer(vm.device, Bucket::Committed, Bucket::Quarantined, bytes),
        );
        for b in self.blocks.drain(..) {
            if let Some(set) = b.shared {
                // A shared handle still mapped here cannot be proven idle: its set is never
                // dropped, so it is never released, and its bytes stay accounted as shared.
                set.quarantine();
                std::mem::forget(set);
            }
        }
        vm.add_quarantine(QuarantineEntry {
            reason,
            range: Some((self.base, self.size)),
            mappings,
            handles: Vec::new(),
            bytes,
            error,
        });
    }
}

/// Contiguous runs `(offset, bytes)` of sorted window offsets.
fn runs(offsets: &[u64], g: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &o in offsets {
        match out.last_mut() {
            Some((start, len)) if start.saturating_add(*len) == o => *len = len.saturating_add(g),
            _ => out.push((o, g)),
        }
    }
    out
}

fn set_access_retrying(
    vm: &Inner,
    addr: DeviceAddress,
    bytes: u64,
    access: &[kvvm_hal::AccessDescriptor],
) -> Result<(), BackendError> {
    let mut attempt = 0u32;
    loop {
        match vm.backend.set_access(addr, bytes, access) {
            Ok(()) => return Ok(()),
            Err(e) if attempt < vm.caps.set_access_retries => {
                tracing::debug!(error = %e, attempt, "set_access failed; retrying");
                attempt = attempt.saturating_add(1);
            }
            Err(e) => return Err(e),
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let vm = Arc::clone(&self.vm);
        let span = tracing::debug_span!(
            "vmm.teardown",
            device = vm.device.0,
            base = self.base.0,
            blocks = self.blocks.len()
        );
        let _e = span.enter();
        // Parked windows are torn down like committed ones.
        let parked: Vec<(u64, PhysicalHandle)> = match self.parked_blocks() {
            Some(mut set) => std::mem::take(&mut *set),
            None => Vec::new(),
        };
        if !parked.is_empty() {
            let n = parked.len() as u64;
            vm.note_unparked(n);
            vm.account(vm.governor.transfer(
                vm.device,
                Bucket::Pooled,
                Bucket::Committed,
                n.saturating_mul(vm.granule),
            ));
            self.insert_blocks(parked.into_iter().map(|(offset, handle)| Block {
                offset,
                handle,
                kind: BlockKind::Owned,
                shared: None,
            }));
        }
        if !self.blocks.is_empty() {
            if let Err(error) = vm.backend.synchronize(vm.device) {
                tracing::warn!(
                    base = %self.base,
                    blocks = self.blocks.len(),
                    %error,
                    "reservation teardown synchronization failed; quarantining its blocks \
                     and address range (nothing unmapped, released or freed)"
                );
                self.quarantine_blocks(QuarantineReason::TeardownSyncFailed, error);
                self.pin_range();
                return;
            }
            if let (_, Some(error)) = self.unmap_from(&vm, 0) {
                if !self.blocks.is_empty() {
                    self.quarantine_blocks(QuarantineReason::UnmapFailed, error);
                    self.pin_range();
                    return;
                }
            }
        }
        if let Some(range) = self.range.take() {
            // A slot: the shared range is freed with its last slot.
            drop(range);
            return;
        }
        if let Err(error) = vm.backend.free(self.base, self.size) {
            tracing::warn!(base = %self.base, size = self.size, %error, "address free failed; range quarantined");
            vm.add_quarantine(QuarantineEntry {
                reason: QuarantineReason::FreeFailed,
                range: Some((self.base, self.size)),
                mappings: Vec::new(),
                handles: Vec::new(),
                bytes: 0,
                error,
            });
        }
    }
}
