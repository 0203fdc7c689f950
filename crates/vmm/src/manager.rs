//! [`VirtualMemory`]: the manager of one device. It creates the per-device state (granule,
//! pool, parking, quarantine), registers the pool with the governor as a reclaimer, reserves
//! address ranges and reports on the pool and the quarantine.

use std::fmt;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Weak};

use kvvm_governor::{Backpressure, Governor, MappedGrowthGrant, Reclaimer};
use kvvm_hal::{
    AccessDescriptor, AllocationProperties, Capabilities, DeviceId, PhysicalHandle,
    VirtualMemoryBackend,
};

use crate::config::{GranularityChoice, VmmConfig};
use crate::device::parking::ParkingLot;
use crate::device::pool::HandlePool;
use crate::device::quarantine::QuarantineEntry;
use crate::device::DeviceContext;
use crate::device::DeviceState;
use crate::device::Source;
use crate::error::{VmmError, VmmResult};
use crate::reservation::Reservation;
use crate::shared::{SharedHandles, SharedPiece};
use crate::strided::SharedRange;

/// The virtual-memory manager of one device. Cheap to clone (clones share the pool, the
/// quarantine and the governor); `Send + Sync`.
#[derive(Clone)]
pub struct VirtualMemory {
    pub(crate) inner: Arc<DeviceState>,
}

impl fmt::Debug for VirtualMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VirtualMemory")
            .field("backend", &self.inner.ctx.backend.name())
            .field("device", &self.inner.ctx.device)
            .field("granule", &self.inner.ctx.granule)
            .field("pooled_bytes", &self.pooled_bytes())
            .finish()
    }
}

impl VirtualMemory {
    /// A manager for `device` of `backend`, charging `governor`. Queries the granularity and
    /// registers the handle pool as a [`Reclaimer`] with the governor.
    pub fn new(
        backend: Arc<dyn VirtualMemoryBackend>,
        device: DeviceId,
        governor: Governor,
        config: VmmConfig,
    ) -> VmmResult<Self> {
        let props = AllocationProperties {
            device,
            handle_type: config.handle_type,
        };
        let gran = backend.granularity(&props)?;
        let bad = VmmError::BadGranularity {
            device,
            minimum: gran.minimum,
            recommended: gran.recommended,
        };
        if gran.minimum == 0 {
            return Err(bad);
        }
        let granule = match config.granularity {
            GranularityChoice::Recommended
                if gran.recommended != 0 && gran.recommended % gran.minimum == 0 =>
            {
                gran.recommended
            }
            _ => gran.minimum,
        };
        let access = if config.access.is_empty() {
            vec![AccessDescriptor::read_write(device)]
        } else {
            config.access.clone()
        };
        // Every other device given access must reach this one's memory (peer access).
        for a in &access {
            if a.device != device && a.access != kvvm_hal::Access::None {
                let ok = backend.can_access_peer(device, a.device)?;
                if !ok {
                    return Err(VmmError::InvalidArgument {
                        reason: format!(
                            "{} cannot be given access to memory of {device}: the driver reports \
                             no peer access between them",
                            a.device
                        ),
                    });
                }
            }
        }
        let inner = Arc::new(DeviceState {
            ctx: DeviceContext::new(
                backend,
                props,
                granule,
                config.max_handle_bytes,
                access,
                governor.clone(),
            ),
            pool: HandlePool::new(config.pool_cap_bytes),
            parking: ParkingLot::new(config.park_released),
        });
        let weak: Weak<DeviceState> = Arc::downgrade(&inner);
        let weak: Weak<dyn Reclaimer> = weak;
        governor.register_reclaimer(weak);
        Ok(VirtualMemory { inner })
    }

    /// A manager with an unlimited governor and the default configuration.
    pub fn with_defaults(
        backend: Arc<dyn VirtualMemoryBackend>,
        device: DeviceId,
    ) -> VmmResult<Self> {
        VirtualMemory::new(backend, device, Governor::unlimited(), VmmConfig::default())
    }

    /// The granule every commit is made of, in bytes.
    pub fn granule(&self) -> u64 {
        self.inner.ctx.granule
    }

    /// The most granule windows one handle of a commit holds: `VmmConfig::max_handle_bytes`
    /// as a power-of-two number of windows (1: one handle per window).
    pub fn max_handle_windows(&self) -> u64 {
        self.inner.ctx.max_windows
    }

    /// The device.
    pub fn device(&self) -> DeviceId {
        self.inner.ctx.device
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn VirtualMemoryBackend> {
        &self.inner.ctx.backend
    }

    /// The governor this manager charges.
    pub fn governor(&self) -> &Governor {
        &self.inner.ctx.governor
    }

    /// The backend's capabilities, as read at creation.
    pub fn capabilities(&self) -> Capabilities {
        self.inner.ctx.caps
    }

    /// `bytes` rounded up to whole granules.
    pub fn round_up(&self, bytes: u64) -> VmmResult<u64> {
        let g = self.inner.ctx.granule;
        bytes
            .div_ceil(g)
            .checked_mul(g)
            .ok_or(VmmError::SizeOverflow {
                what: "rounding up to the granule",
            })
    }

    /// Reserves address space for up to `max_bytes` (rounded up to the granule); no physical
    /// memory is used until [`Reservation::commit`].
    pub fn reserve(&self, max_bytes: u64) -> VmmResult<Reservation> {
        let ctx = &self.inner.ctx;
        let span = tracing::debug_span!("vmm.reserve", device = ctx.device.0, max_bytes);
        let _e = span.enter();
        if max_bytes == 0 {
            return Err(VmmError::ZeroSize);
        }
        let size = self.round_up(max_bytes)?;
        let g = ctx.granule;
        let alignment = if g.is_power_of_two() { g } else { 0 };
        let base = ctx.backend.reserve(size, alignment, None)?;
        if base.checked_add(size).is_none() {
            // The driver handed out a range that wraps: give it back and refuse.
            if let Err(e) = ctx.backend.free(base, size) {
                ctx.quarantine
                    .add(QuarantineEntry::free_failed(base, size, e));
            }
            return Err(VmmError::SizeOverflow {
                what: "reservation end address",
            });
        }
        Ok(Reservation::new(self.inner.clone(), base, size))
    }

    /// Reserves `count` ranges of `bytes_each` bytes (each rounded up to the granule: the
    /// *stride*) in one driver reservation, at a constant stride from one another, and returns
    /// them in address order. No physical memory is used until they commit.
    ///
    /// Each returned [`Reservation`] behaves like one from [`reserve`](Self::reserve) (its own
    /// commits, shared mappings, release and teardown); the driver's range is freed when the
    /// last of them is dropped (`strided.rs`). [`Reservation::address`] of slot `i` is
    /// `base + i x stride`.
    ///
    /// Errors: [`VmmError::ZeroSize`] when `count` or `bytes_each` is 0;
    /// [`VmmError::SizeOverflow`] when the total does not fit in the address space; a failed
    /// driver reservation.
    pub fn reserve_strided(&self, count: u64, bytes_each: u64) -> VmmResult<Vec<Reservation>> {
        let ctx = &self.inner.ctx;
        let span = tracing::debug_span!(
            "vmm.reserve_strided",
            device = ctx.device.0,
            count,
            bytes_each
        );
        let _e = span.enter();
        if count == 0 || bytes_each == 0 {
            return Err(VmmError::ZeroSize);
        }
        let stride = self.round_up(bytes_each)?;
        let total = stride.checked_mul(count).ok_or(VmmError::SizeOverflow {
            what: "strided reservation size",
        })?;
        // One Vec entry per slot: refuse counts that could not be held before asking the driver.
        let slots = usize::try_from(count).map_err(|_| VmmError::SizeOverflow {
            what: "strided reservation count",
        })?;
        let g = ctx.granule;
        let alignment = if g.is_power_of_two() { g } else { 0 };
        let base = ctx.backend.reserve(total, alignment, None)?;
        let range = Arc::new(SharedRange::new(Arc::clone(&self.inner), base, total));
        if base.checked_add(total).is_none() {
            // Dropping `range` gives the wrapping range back (or quarantines it).
            drop(range);
            return Err(VmmError::SizeOverflow {
                what: "reservation end address",
            });
        }
        let mut out = Vec::with_capacity(slots);
        for i in 0..count {
            // In range: i < count and base + count x stride did not overflow.
            let addr = base.offset(i.saturating_mul(stride));
            out.push(Reservation::new_in_range(
                Arc::clone(&self.inner),
                addr,
                stride,
                Arc::clone(&range),
            ));
        }
        Ok(out)
    }

    /// Imports another process's exported shared handles ([`SharedHandles::export_fds`]:
    /// each a descriptor with the offset and granule windows of its piece) as a set that
    /// reservations of this manager map at the same offsets, read-only
    /// ([`Reservation::map_shared`] refuses write access to it). Billed nowhere here (the
    /// exporter's books, or a node broker's, hold the bytes); dropping the set releases the
    /// imported handles to the driver, and the memory lives until no process holds a handle,
    /// a descriptor or a mapping of it. Refused before any driver call unless every offset is
    /// granule-aligned, every piece spans at least one window and no two overlap; if an import
    /// fails, the handles imported so far are released.
    pub fn import_shared(
        &self,
        pieces: &[(BorrowedFd<'_>, u64, u64)],
    ) -> VmmResult<Arc<SharedHandles>> {
        let ctx = &self.inner.ctx;
        check_imported(pieces, ctx.granule)?;
        let mut imported: Vec<SharedPiece> = Vec::with_capacity(pieces.len());
        for (fd, offset, windows) in pieces {
            match ctx.backend.import_posix_fd(ctx.device, *fd) {
                Ok(handle) => imported.push(SharedPiece {
                    offset: *offset,
                    windows: *windows,
                    handle,
                }),
                Err(e) => {
                    for p in imported {
                        let bytes = p.windows.saturating_mul(ctx.granule);
                        let _ = ctx.release_handle(p.handle, bytes, Source::Unbilled);
                    }
                    return Err(e.into());
                }
            }
        }
        Ok(Arc::new(SharedHandles::imported(
            Arc::clone(&self.inner),
            imported,
        )))
    }

    /// An empty [`SharedHandles`] set of this manager: no handle and no byte, mapped nowhere.
    /// What a shared prefix holds as read-only windows when every byte of it lies before the
    /// end of its first window (such a prefix is handed on by copy only).
    pub fn empty_shared(&self) -> Arc<SharedHandles> {
        Arc::new(SharedHandles::new(Arc::clone(&self.inner), Vec::new()))
    }

    /// Whether `set` is this manager's (made or imported by it): what its reservations map.
    pub fn owns_set(&self, set: &SharedHandles) -> bool {
        set.is_from(&self.inner)
    }

    /// Whether `other` is this manager or a clone of it (the same pool, quarantine and
    /// reservations' books): what may share handles with it.
    pub fn same_manager(&self, other: &VirtualMemory) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Asks the governor for a grant of `bytes` rounded up to whole granules, for
    /// [`Reservation::commit_with_grant`].
    pub fn try_grant(&self, bytes: u64) -> VmmResult<MappedGrowthGrant> {
        let bytes = self.round_up(bytes)?;
        Ok(self
            .inner
            .ctx
            .governor
            .try_grant(self.inner.ctx.device, bytes)?)
    }

    /// The typed refusal for `needed` bytes when the driver, not the governor, ran out (a
    /// create that failed with out-of-memory after a grant): available is the smaller of
    /// what the governor counts as available ([`Governor::available_bytes`]: free budget
    /// plus what the pool and other reclaimers hold) and what the driver has free
    /// (`memory_info`) plus the pool, and `retry_after` the governor's estimate for the
    /// shortfall.
    pub fn backpressure(&self, needed: u64) -> Backpressure {
        let ctx = &self.inner.ctx;
        let device = ctx.device;
        let governor_available = ctx.governor.available_bytes(device);
        let driver_available = ctx
            .backend
            .memory_info(device)
            .map_or(governor_available, |m| {
                m.free.saturating_add(self.pooled_bytes())
            });
        let available = governor_available.min(driver_available);
        Backpressure {
            device,
            needed,
            available,
            retry_after: ctx
                .governor
                .estimate_retry_after(device, needed.saturating_sub(available)),
        }
    }

    /// Bytes held by the pool: free handles and parked windows.
    pub fn pooled_bytes(&self) -> u64 {
        self.inner.pooled_bytes()
    }

    /// Bytes of parked windows (still mapped in their reservations), part of
    /// [`pooled_bytes`](Self::pooled_bytes).
    pub fn parked_bytes(&self) -> u64 {
        self.inner.pool.parked_bytes()
    }

    /// The free (unmapped) handles in the pool; parked windows are listed by
    /// [`Reservation::parked`].
    pub fn pooled_handles(&self) -> Vec<PhysicalHandle> {
        self.inner.pool.handles()
    }

    /// The pool cap in bytes.
    pub fn pool_cap_bytes(&self) -> u64 {
        self.inner.pool.cap_bytes()
    }

    /// Changes the pool cap; handles beyond it are released. Returns the bytes released.
    pub fn set_pool_cap_bytes(&self, bytes: u64) -> u64 {
        self.inner.pool.set_cap_bytes(bytes);
        self.inner.trim_pool_to(bytes)
    }

    /// Releases pooled handles until at most `keep_bytes` stay; returns the bytes released.
    pub fn trim_pool(&self, keep_bytes: u64) -> u64 {
        let span = tracing::debug_span!(
            "vmm.trim_pool",
            device = self.inner.ctx.device.0,
            keep_bytes
        );
        let _e = span.enter();
        self.inner.trim_pool_to(keep_bytes)
    }

    /// Everything in quarantine.
    pub fn quarantine(&self) -> Vec<QuarantineEntry> {
        self.inner.ctx.quarantine.entries()
    }

    /// Physical bytes in quarantine.
    pub fn quarantined_bytes(&self) -> u64 {
        self.inner.ctx.quarantine.bytes()
    }

    /// How many governor updates failed (a manager bug if ever non-zero; tests assert 0).
    pub fn accounting_errors(&self) -> u64 {
        self.inner.ctx.accounting_errors()
    }
}

/// Checks the pieces of an import: at least one, aligned, non-empty, not overlapping.
fn check_imported(pieces: &[(BorrowedFd<'_>, u64, u64)], granule: u64) -> VmmResult<()> {
    let invalid = |reason: String| VmmError::InvalidArgument { reason };
    if pieces.is_empty() {
        return Err(invalid("an import needs at least one handle".to_owned()));
    }
    let mut spans: Vec<(u64, u64)> = Vec::with_capacity(pieces.len());
    for (_, offset, windows) in pieces {
        if *windows == 0 || offset % granule != 0 {
            return Err(invalid(format!(
                "imported piece at offset {offset} of {windows} windows: offsets are multiples \
                 of the granule ({granule}) and a piece spans at least one window"
            )));
        }
        let end = windows
            .checked_mul(granule)
            .and_then(|b| offset.checked_add(b))
            .ok_or_else(|| invalid(format!("imported piece at offset {offset} overflows")))?;
        spans.push((*offset, end));
    }
    spans.sort_unstable();
    if let Some(pair) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(invalid(format!(
            "imported pieces overlap: {:?} and {:?}",
            pair[0], pair[1]
        )));
    }
    Ok(())
}
