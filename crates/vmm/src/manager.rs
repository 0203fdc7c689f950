//! [`VirtualMemory`]: one manager per device, its handle pool and its quarantine.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use kvvm_governor::{Bucket, Governor, GovernorError, MappedGrowthGrant, Reclaimer};
use kvvm_hal::{
    AccessDescriptor, AllocationProperties, BackendError, Capabilities, DeviceAddress, DeviceId,
    PhysicalHandle, ShareableHandleType, VirtualMemoryBackend,
};

use crate::error::{VmmError, VmmResult};
use crate::reservation::{MappedBlock, Reservation};

/// Which of the driver's granularities the manager uses as its granule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GranularityChoice {
    /// The minimum granularity (finest commits).
    Minimum,
    /// The recommended granularity (what the driver says performs best); falls back to the
    /// minimum if the recommended one is not a multiple of it.
    #[default]
    Recommended,
}

/// Configuration of a [`VirtualMemory`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmmConfig {
    /// Most bytes of released handles kept for reuse (0: no pool).
    pub pool_cap_bytes: u64,
    /// Which granularity to use.
    pub granularity: GranularityChoice,
    /// The access set on every commit (empty: read-write for the manager's device).
    pub access: Vec<AccessDescriptor>,
    /// The shareable handle type of created handles.
    pub handle_type: ShareableHandleType,
    /// Park released windows instead of unmapping them: [`Reservation::release`] and
    /// [`Reservation::truncate`] keep the windows mapped (access set) as pooled memory of
    /// their reservation, within the pool cap, and a later commit of the same windows in the
    /// same reservation reuses them with no driver call at all. Parked windows are pooled
    /// bytes for the governor and are unmapped and released when it needs memory, when the
    /// pool is trimmed, when a shared mapping needs their place, and at teardown. Off by
    /// default. This is what recycling a sequence's reservation for the next request wants:
    /// on the H200 a remap costs about 30 us a window, a parked hit nothing.
    pub park_released: bool,
}

impl Default for VmmConfig {
    /// A 1 GiB pool, the recommended granularity, read-write access for the device, handles
    /// that are not exportable.
    fn default() -> Self {
        VmmConfig {
            pool_cap_bytes: 1 << 30,
            granularity: GranularityChoice::Recommended,
            access: Vec::new(),
            handle_type: ShareableHandleType::None,
            park_released: false,
        }
    }
}

impl VmmConfig {
    /// Sets the pool cap in bytes.
    #[must_use]
    pub fn pool_cap_bytes(mut self, bytes: u64) -> Self {
        self.pool_cap_bytes = bytes;
        self
    }

    /// Sets the granularity choice.
    #[must_use]
    pub fn granularity(mut self, choice: GranularityChoice) -> Self {
        self.granularity = choice;
        self
    }

    /// Parks released windows instead of unmapping them (see
    /// [`park_released`](Self::park_released)).
    #[must_use]
    pub fn park_released(mut self, park: bool) -> Self {
        self.park_released = park;
        self
    }
}

/// Why memory was quarantined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuarantineReason {
    /// Teardown could not synchronize the device: the memory cannot be proven idle, so nothing
    /// was unmapped, released or freed.
    TeardownSyncFailed,
    /// Teardown could not unmap these blocks; they and their address range stay.
    UnmapFailed,
    /// A handle was unmapped but its release failed.
    ReleaseFailed,
    /// The address range could not be freed (it holds no physical memory).
    FreeFailed,
}

/// Memory the manager will never reuse nor advertise as free. It stays with the driver until
/// the context is destroyed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuarantineEntry {
    /// Why.
    pub reason: QuarantineReason,
    /// The address range left reserved, if any.
    pub range: Option<(DeviceAddress, u64)>,
    /// Mappings left in place (each owns its handle).
    pub mappings: Vec<MappedBlock>,
    /// Unmapped handles left unreleased.
    pub handles: Vec<PhysicalHandle>,
    /// Physical bytes held (counted in the governor's quarantined bucket).
    pub bytes: u64,
    /// The error that caused it.
    pub error: BackendError,
}

#[derive(Debug, Default)]
struct Pool {
    handles: Vec<PhysicalHandle>,
    cap_bytes: u64,
}

/// Where the bytes of a handle being disposed of are accounted.
pub(crate) enum Source<'a> {
    /// A bucket of the governor.
    Bucket(Bucket),
    /// A grant not yet settled (a handle created by a failing commit).
    Grant(&'a mut MappedGrowthGrant),
}

pub(crate) struct Inner {
    pub(crate) backend: Arc<dyn VirtualMemoryBackend>,
    pub(crate) device: DeviceId,
    pub(crate) props: AllocationProperties,
    pub(crate) granule: u64,
    pub(crate) caps: Capabilities,
    pub(crate) access: Vec<AccessDescriptor>,
    pub(crate) governor: Governor,
    pool: Mutex<Pool>,
    quarantine: Mutex<Vec<QuarantineEntry>>,
    accounting_errors: AtomicU64,
    /// Whether released windows are parked (see [`VmmConfig::park_released`]).
    pub(crate) park: bool,
    /// Parked windows of every live reservation.
    parked: Mutex<Vec<Weak<Parked>>>,
    /// Bytes parked in all reservations (part of the pooled bytes).
    parked_bytes: AtomicU64,
}

/// The parked windows of one reservation: still mapped at `base + offset` with the manager's
/// access, their handles accounted as pooled.
#[derive(Debug)]
pub(crate) struct Parked {
    pub(crate) base: DeviceAddress,
    pub(crate) blocks: Mutex<Vec<(u64, PhysicalHandle)>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section is a few pushes and pops that cannot be left half-done.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Inner {
    /// Records an accounting failure (a manager bug) without failing the operation.
    pub(crate) fn account(&self, r: Result<(), GovernorError>) {
        if let Err(e) = r {
            self.accounting_errors.fetch_add(1, Ordering::Relaxed);
            tracing::error!(error = %e, "governor accounting failed");
        }
    }

    /// Takes up to `n` handles out of the pool. They stay accounted as pooled until the
    /// caller settles them.
    pub(crate) fn take_from_pool(&self, n: u64) -> Vec<PhysicalHandle> {
        if n == 0 {
            return Vec::new();
        }
        let mut pool = lock(&self.pool);
        let keep = pool
            .handles
            .len()
            .saturating_sub(usize::try_from(n).unwrap_or(usize::MAX));
        pool.handles.split_off(keep)
    }

    /// Puts handles taken by [`take_from_pool`](Self::take_from_pool) back (accounted as
    /// pooled all along); releases those that no longer fit.
    pub(crate) fn untake(&self, handles: Vec<PhysicalHandle>) {
        for h in handles {
            // A failed release is quarantined and logged inside.
            let _ = self.dispose(h, Source::Bucket(Bucket::Pooled));
        }
    }

    /// Returns an unmapped handle to the pool if it fits, otherwise releases it; a failed
    /// release quarantines it (and is returned after that). Returns the bytes released to the
    /// driver.
    pub(crate) fn dispose(
        &self,
        handle: PhysicalHandle,
        source: Source<'_>,
    ) -> Result<u64, BackendError> {
        let g = self.granule;
        {
            let mut pool = lock(&self.pool);
            let held = (pool.handles.len() as u64)
                .saturating_mul(g)
                .saturating_add(self.parked_bytes.load(Ordering::Acquire));
            if held.saturating_add(g) <= pool.cap_bytes {
                // Account before the handle becomes visible to other threads.
                let r = match source {
                    Source::Bucket(b) => self.governor.transfer(self.device, b, Bucket::Pooled, g),
                    Source::Grant(grant) => grant.settle(g, Bucket::Pooled),
                };
                self.account(r);
                pool.handles.push(handle);
                return Ok(0);
            }
        }
        self.release_handle(handle, source)
    }

    /// Releases an unmapped handle; a failure quarantines it (and is returned after that).
    /// Returns the bytes released.
    pub(crate) fn release_handle(
        &self,
        handle: PhysicalHandle,
        source: Source<'_>,
    ) -> Result<u64, BackendError> {
        let g = self.granule;
        match self.backend.release(handle) {
            Ok(()) => {
                let r = match source {
                    Source::Bucket(b) => self.governor.free(self.device, b, g),
                    Source::Grant(grant) => grant.give_back(g),
                };
                self.account(r);
                Ok(g)
            }
            Err(error) => {
                tracing::warn!(%handle, %error, "release failed; handle quarantined");
                let r = match source {
                    Source::Bucket(b) => {
                        self.governor
                            .transfer(self.device, b, Bucket::Quarantined, g)
                    }
                    Source::Grant(grant) => grant.settle(g, Bucket::Quarantined),
                };
                self.account(r);
                self.add_quarantine(QuarantineEntry {
                    reason: QuarantineReason::ReleaseFailed,
                    range: None,
                    mappings: Vec::new(),
                    handles: vec![handle],
                    bytes: g,
                    error: error.clone(),
                });
                Err(error)
            }
        }
    }

    pub(crate) fn add_quarantine(&self, entry: QuarantineEntry) {
        lock(&self.quarantine).push(entry);
    }

    /// Releases pooled handles, then parked windows, until at most `keep_bytes` of pooled
    /// memory stay; returns the bytes released.
    fn trim_pool_to(&self, keep_bytes: u64) -> u64 {
        let g = self.granule;
        let victims = {
            let mut pool = lock(&self.pool);
            let parked = self.parked_bytes.load(Ordering::Acquire);
            let keep = usize::try_from(keep_bytes.saturating_sub(parked) / g).unwrap_or(usize::MAX);
            let keep = pool.handles.len().min(keep);
            pool.handles.split_off(keep)
        };
        let released = victims
            .into_iter()
            .map(|h| {
                self.release_handle(h, Source::Bucket(Bucket::Pooled))
                    .unwrap_or(0)
            })
            .fold(0u64, u64::saturating_add);
        let over = self.pooled_bytes().saturating_sub(keep_bytes);
        released.saturating_add(self.unpark(over))
    }

    /// Unmaps and releases parked windows (any reservation's) until `bytes` are released or
    /// none is left; returns the bytes released. A reservation busy on another thread is
    /// skipped (never waited for: the caller may be that thread, asking for memory).
    pub(crate) fn unpark(&self, bytes: u64) -> u64 {
        if bytes == 0 || self.parked_bytes.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let sets: Vec<Arc<Parked>> = {
            let mut sets = lock(&self.parked);
            sets.retain(|w| w.strong_count() > 0);
            sets.iter().filter_map(Weak::upgrade).collect()
        };
        let g = self.granule;
        let mut released = 0u64;
        for set in sets {
            let Ok(mut blocks) = set.blocks.try_lock() else {
                continue;
            };
            while released < bytes {
                let Some((offset, handle)) = blocks.pop() else {
                    break;
                };
                let addr = DeviceAddress(set.base.0.saturating_add(offset));
                if let Err(error) = self.backend.unmap(addr, g) {
                    tracing::warn!(%addr, %error, "unmap of a parked window failed; it stays parked");
                    blocks.push((offset, handle));
                    break;
                }
                self.parked_bytes.fetch_sub(g, Ordering::AcqRel);
                released = released.saturating_add(
                    self.release_handle(handle, Source::Bucket(Bucket::Pooled))
                        .unwrap_or(0),
                );
            }
            if released >= bytes {
                break;
            }
        }
        released
    }

    /// Registers a reservation's parked set.
    pub(crate) fn register_parked(&self, set: &Arc<Parked>) {
        lock(&self.parked).push(Arc::downgrade(set));
    }

    /// Parks `g` bytes if the pool cap allows it; returns whether it did (the caller moves
    /// the block and transfers its bytes to pooled).
    pub(crate) fn try_reserve_parking(&self) -> bool {
        let g = self.granule;
        let pool = lock(&self.pool);
        let held = (pool.handles.len() as u64)
            .saturating_mul(g)
            .saturating_add(self.parked_bytes.load(Ordering::Acquire));
        if self.park && held.saturating_add(g) <= pool.cap_bytes {
            self.parked_bytes.fetch_add(g, Ordering::AcqRel);
            true
        } else {
            false
        }
    }

    /// Counts `n` windows back into the parked bytes (windows taken out and put back).
    pub(crate) fn note_reparked(&self, n: u64) {
        self.parked_bytes
            .fetch_add(n.saturating_mul(self.granule), Ordering::AcqRel);
    }

    /// `n` parked windows left the parked state (reused or handed back to a reservation).
    pub(crate) fn note_unparked(&self, n: u64) {
        let bytes = n.saturating_mul(self.granule);
        let _ = self
            .parked_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
                Some(p.saturating_sub(bytes))
            });
    }

    fn pooled_bytes(&self) -> u64 {
        (lock(&self.pool).handles.len() as u64)
            .saturating_mul(self.granule)
            .saturating_add(self.parked_bytes.load(Ordering::Acquire))
    }
}

impl Reclaimer for Inner {
    fn reclaim(&self, device: DeviceId, bytes: u64) -> u64 {
        if device != self.device || bytes == 0 {
            return 0;
        }
        let span = tracing::debug_span!("vmm.reclaim", device = device.0, bytes);
        let _e = span.enter();
        let held = self.pooled_bytes();
        let want = bytes.div_ceil(self.granule).saturating_mul(self.granule);
        self.trim_pool_to(held.saturating_sub(want))
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The last reservation is gone: give the pool back to the driver.
        self.trim_pool_to(0);
    }
}

/// The virtual-memory manager of one device. Cheap to clone (clones share the pool, the
/// quarantine and the governor); `Send + Sync`.
#[derive(Clone)]
pub struct VirtualMemory {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for VirtualMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VirtualMemory")
            .field("backend", &self.inner.backend.name())
            .field("device", &self.inner.device)
            .field("granule", &self.inner.granule)
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
        let caps = backend.capabilities();
        let inner = Arc::new(Inner {
            backend,
            device,
            props,
            granule,
            caps,
            access,
            governor: governor.clone(),
            pool: Mutex::new(Pool {
                handles: Vec::new(),
                cap_bytes: config.pool_cap_bytes,
            }),
            quarantine: Mutex::new(Vec::new()),
            accounting_errors: AtomicU64::new(0),
            park: config.park_released,
            parked: Mutex::new(Vec::new()),
            parked_bytes: AtomicU64::new(0),
        });
        let weak: Weak<Inner> = Arc::downgrade(&inner);
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
        self.inner.granule
    }

    /// The device.
    pub fn device(&self) -> DeviceId {
        self.inner.device
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn VirtualMemoryBackend> {
        &self.inner.backend
    }

    /// The governor this manager charges.
    pub fn governor(&self) -> &Governor {
        &self.inner.governor
    }

    /// The backend's capabilities, as read at creation.
    pub fn capabilities(&self) -> Capabilities {
        self.inner.caps
    }

    /// `bytes` rounded up to whole granules.
    pub fn round_up(&self, bytes: u64) -> VmmResult<u64> {
        let g = self.inner.granule;
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
        let span = tracing::debug_span!("vmm.reserve", device = self.inner.device.0, max_bytes);
        let _e = span.enter();
        if max_bytes == 0 {
            return Err(VmmError::ZeroSize);
        }
        let size = self.round_up(max_bytes)?;
        let g = self.inner.granule;
        let alignment = if g.is_power_of_two() { g } else { 0 };
        let base = self.inner.backend.reserve(size, alignment, None)?;
        if base.checked_add(size).is_none() {
            // The driver handed out a range that wraps: give it back and refuse.
            if let Err(e) = self.inner.backend.free(base, size) {
                self.inner.add_quarantine(QuarantineEntry {
                    reason: QuarantineReason::FreeFailed,
                    range: Some((base, size)),
                    mappings: Vec::new(),
                    handles: Vec::new(),
                    bytes: 0,
                    error: e,
                });
            }
            return Err(VmmError::SizeOverflow {
                what: "reservation end address",
            });
        }
        Ok(Reservation::new(self.inner.clone(), base, size))
    }

    /// Asks the governor for a grant of `bytes` rounded up to whole granules, for
    /// [`Reservation::commit_with_grant`].
    pub fn try_grant(&self, bytes: u64) -> VmmResult<MappedGrowthGrant> {
        let bytes = self.round_up(bytes)?;
        Ok(self.inner.governor.try_grant(self.inner.device, bytes)?)
    }

    /// Bytes held by the pool: free handles and parked windows.
    pub fn pooled_bytes(&self) -> u64 {
        self.inner.pooled_bytes()
    }

    /// Bytes of parked windows (still mapped in their reservations), part of
    /// [`pooled_bytes`](Self::pooled_bytes).
    pub fn parked_bytes(&self) -> u64 {
        self.inner.parked_bytes.load(Ordering::Acquire)
    }

    /// The free (unmapped) handles in the pool; parked windows are listed by
    /// [`Reservation::parked`].
    pub fn pooled_handles(&self) -> Vec<PhysicalHandle> {
        lock(&self.inner.pool).handles.clone()
    }

    /// The pool cap in bytes.
    pub fn pool_cap_bytes(&self) -> u64 {
        lock(&self.inner.pool).cap_bytes
    }

    /// Changes the pool cap; handles beyond it are released. Returns the bytes released.
    pub fn set_pool_cap_bytes(&self, bytes: u64) -> u64 {
        lock(&self.inner.pool).cap_bytes = bytes;
        self.inner.trim_pool_to(bytes)
    }

    /// Releases pooled handles until at most `keep_bytes` stay; returns the bytes released.
    pub fn trim_pool(&self, keep_bytes: u64) -> u64 {
        let span = tracing::debug_span!("vmm.trim_pool", device = self.inner.device.0, keep_bytes);
        let _e = span.enter();
        self.inner.trim_pool_to(keep_bytes)
    }

    /// Everything in quarantine.
    pub fn quarantine(&self) -> Vec<QuarantineEntry> {
        lock(&self.inner.quarantine).clone()
    }

    /// Physical bytes in quarantine.
    pub fn quarantined_bytes(&self) -> u64 {
        lock(&self.inner.quarantine)
            .iter()
            .map(|q| q.bytes)
            .fold(0u64, u64::saturating_add)
    }

    /// How many governor updates failed (a manager bug if ever non-zero; tests assert 0).
    pub fn accounting_errors(&self) -> u64 {
        self.inner.accounting_errors.load(Ordering::Relaxed)
    }
}
