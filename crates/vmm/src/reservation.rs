//! [`Reservation`]: one reserved address range, its committed blocks, commit, release and
//! teardown.

use std::fmt;
use std::sync::Arc;

use kvvm_governor::{Bucket, MappedGrowthGrant};
use kvvm_hal::{BackendError, DeviceAddress, PhysicalHandle};

use crate::error::{VmmError, VmmResult};
use crate::manager::{Inner, QuarantineEntry, QuarantineReason, Source};

/// Who owns the physical memory behind a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BlockKind {
    /// The reservation owns the handle: release returns it to the pool or the driver.
    Owned,
    // Issue 6 adds `Shared(handle id)`: a mapping of a shared prefix's handle, whose release
    // only drops a reference (`note_unmapped`) and never releases the handle itself.
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

#[derive(Debug, Clone, Copy)]
struct Block {
    offset: u64,
    handle: PhysicalHandle,
    kind: BlockKind,
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
        Reservation {
            vm,
            base,
            size,
            blocks: Vec::new(),
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

    fn commit_granules(
        &mut self,
        granules: u64,
        grant: Option<MappedGrowthGrant>,
    ) -> VmmResult<Commit> {
        let vm = Arc::clone(&self.vm);
        let g = vm.granule;
        let span = tracing::debug_span!(
            "vmm.commit",
            device = vm.device.0,
            base = self.base.0,
            granules
        );
        let _e = span.enter();
        let offset = self.committed_end();
        let bytes = granules.checked_mul(g).ok_or(VmmError::SizeOverflow {
            what: "commit size",
        })?;
        let start = self.addr(offset)?;
        if granules == 0 {
            // A grant handed in is rolled back by its drop.
            return Ok(Commit {
                address: start,
                bytes: 0,
                granules: 0,
                from_pool: 0,
            });
        }
        let end = offset
            .checked_add(bytes)
            .ok_or(VmmError::SizeOverflow { what: "commit end" })?;
        if end > self.size {
            return Err(VmmError::OutOfBounds {
                offset,
                requested: bytes,
                reserved: self.size,
            });
        }
        // Last address of the commit: checked once, so per-block additions cannot overflow.
        self.addr(end)?;

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

        // Create (or take) and map granule by granule.
        let mut mapped: Vec<(PhysicalHandle, Origin)> = Vec::new();
        let mut failure: Option<BackendError> = None;
        for i in 0..granules {
            let addr = DeviceAddress(start.0.saturating_add(i.saturating_mul(g)));
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
            mapped.push((handle, origin));
        }

        // One set access over the whole contiguous range, retried as the backend asks.
        if failure.is_none() {
            let mut attempt = 0u32;
            loop {
                match vm.backend.set_access(start, bytes, &vm.access) {
                    Ok(()) => break,
                    Err(e) if attempt < vm.caps.set_access_retries => {
                        tracing::debug!(error = %e, attempt, "set_access failed; retrying");
                        attempt = attempt.saturating_add(1);
                    }
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
        }

        // Handles taken from the pool but not reached go back.
        vm.untake(pooled);

        if let Some(error) = failure {
            tracing::debug!(%error, mapped = mapped.len(), "commit failed; rolling back");
            self.rollback(&vm, offset, mapped, &mut grant);
            grant.rollback();
            return Err(error.into());
        }

        let created =
            (mapped.iter().filter(|(_, o)| *o == Origin::Created).count() as u64).saturating_mul(g);
        let reused = from_pool.saturating_mul(g);
        vm.account(grant.settle(created, Bucket::Committed));
        vm.account(
            vm.governor
                .transfer(vm.device, Bucket::Pooled, Bucket::Committed, reused),
        );
        grant.rollback();
        let mut block_offset = offset;
        self.blocks.reserve(mapped.len());
        for (handle, _) in mapped {
            self.blocks.push(Block {
                offset: block_offset,
                handle,
                kind: BlockKind::Owned,
            });
            block_offset = block_offset.saturating_add(g);
        }
        Ok(Commit {
            address: start,
            bytes,
            granules,
            from_pool,
        })
    }

    /// Undoes the maps of a failed commit in reverse order. A block whose unmap fails stays
    /// recorded (it is still mapped) and its bytes are accounted as committed.
    fn rollback(
        &mut self,
        vm: &Inner,
        offset: u64,
        mapped: Vec<(PhysicalHandle, Origin)>,
        grant: &mut MappedGrowthGrant,
    ) {
        let g = vm.granule;
        let mut kept = Vec::new();
        for (i, (handle, origin)) in mapped.into_iter().enumerate().rev() {
            let block_offset = offset.saturating_add((i as u64).saturating_mul(g));
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
                    });
                }
            }
        }
        if !kept.is_empty() {
            kept.reverse();
            self.blocks.extend(kept);
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
        match self.unmap_from(&vm, first) {
            (bytes, None) => Ok(bytes),
            (_, Some(e)) => Err(e.into()),
        }
    }

    /// Unmaps the blocks from index `first` on, last first, in runs of adjacent blocks where
    /// allowed. Returns the bytes unmapped and the first error.
    fn unmap_from(&mut self, vm: &Inner, first: usize) -> (u64, Option<BackendError>) {
        let g = vm.granule;
        let span_runs = vm.caps.unmap_spans_mappings;
        let mut first_error: Option<BackendError> = None;
        let mut unmapped = 0u64;
        let mut kept_rev: Vec<Block> = Vec::new();
        let mut todo = self.blocks.split_off(first.min(self.blocks.len()));
        while let Some(last) = todo.last().copied() {
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
                        match b.kind {
                            BlockKind::Owned => {
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
        self.blocks.extend(kept_rev);
        (unmapped, first_error)
    }

    fn quarantine_blocks(&mut self, reason: QuarantineReason, error: BackendError) {
        let vm = Arc::clone(&self.vm);
        let mappings = self.mappings();
        let bytes = self.committed_bytes();
        vm.account(
            vm.governor
                .transfer(vm.device, Bucket::Committed, Bucket::Quarantined, bytes),
        );
        self.blocks.clear();
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
                return;
            }
            if let (_, Some(error)) = self.unmap_from(&vm, 0) {
                if !self.blocks.is_empty() {
                    self.quarantine_blocks(QuarantineReason::UnmapFailed, error);
                    return;
                }
            }
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
