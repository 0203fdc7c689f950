//! [`DeviceContext`]: what every part of the manager needs to talk to one device's driver and
//! keep its books: the backend, the granule, the access it sets, the governor it charges, the
//! quarantine and the count of accounting failures.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvvm_governor::{Bucket, Governor, GovernorError, Limit, MappedGrowthGrant, NeverFits};
use kvvm_hal::{
    AccessDescriptor, AllocationProperties, BackendError, Capabilities, DeviceAddress, DeviceId,
    LatencyModel, PhysicalHandle, VirtualMemoryBackend,
};

use crate::device::quarantine::{Quarantine, QuarantineEntry};

/// Where the bytes of a handle being disposed of are accounted.
pub(crate) enum Source<'a> {
    /// A bucket of the governor.
    Bucket(Bucket),
    /// A grant not yet settled (a handle created by a failing commit).
    Grant(&'a mut MappedGrowthGrant),
    /// Billed nowhere in this process: a handle imported from another process's export
    /// (its bytes are billed where it was created, for a node's broker to its tenant).
    Unbilled,
}

impl Source<'_> {
    /// Moves `bytes` from this source to `to` (still held by the process).
    pub(crate) fn settle(
        self,
        ctx: &DeviceContext,
        to: Bucket,
        bytes: u64,
    ) -> Result<(), GovernorError> {
        match self {
            Source::Bucket(b) => ctx.governor.transfer(ctx.device, b, to, bytes),
            Source::Grant(grant) => grant.settle(bytes, to),
            Source::Unbilled => Ok(()),
        }
    }

    /// `bytes` from this source went back to the driver.
    fn free(self, ctx: &DeviceContext, bytes: u64) -> Result<(), GovernorError> {
        match self {
            Source::Bucket(b) => ctx.governor.free(ctx.device, b, bytes),
            Source::Grant(grant) => grant.give_back(bytes),
            Source::Unbilled => Ok(()),
        }
    }
}

/// One device as the manager sees it. Immutable after creation except for the quarantine and
/// the accounting-error count.
pub(crate) struct DeviceContext {
    pub(crate) backend: Arc<dyn VirtualMemoryBackend>,
    pub(crate) device: DeviceId,
    pub(crate) props: AllocationProperties,
    /// The granule every commit is made of.
    pub(crate) granule: u64,
    /// Most granule windows one handle of a commit spans (a power of two, at least 1).
    pub(crate) max_windows: u64,
    pub(crate) caps: Capabilities,
    /// The access set on every commit.
    pub(crate) access: Vec<AccessDescriptor>,
    pub(crate) governor: Governor,
    pub(crate) quarantine: Quarantine,
    /// The device's physical memory as the driver reported it at creation (`None`: unknown).
    pub(crate) capacity: Option<u64>,
    /// The driver costs a commit chooses between pooled and fresh handles by
    /// (`VmmConfig::commit_cost`).
    pub(crate) commit_cost: LatencyModel,
    accounting_errors: AtomicU64,
}

impl DeviceContext {
    pub(crate) fn new(
        backend: Arc<dyn VirtualMemoryBackend>,
        props: AllocationProperties,
        granule: u64,
        max_handle_bytes: u64,
        access: Vec<AccessDescriptor>,
        governor: Governor,
        commit_cost: LatencyModel,
    ) -> Self {
        let max_windows = crate::windows::cut::max_handle_windows(max_handle_bytes, granule);
        let caps = backend.capabilities();
        let capacity = backend
            .memory_info(props.device)
            .ok()
            .map(|m| m.total)
            .filter(|&t| t > 0);
        DeviceContext {
            backend,
            device: props.device,
            props,
            granule,
            max_windows,
            caps,
            access,
            governor,
            quarantine: Quarantine::default(),
            capacity,
            commit_cost,
            accounting_errors: AtomicU64::new(0),
        }
    }

    /// Records an accounting failure (a manager bug) without failing the operation.
    pub(crate) fn account(&self, r: Result<(), GovernorError>) {
        if let Err(e) = r {
            self.accounting_errors.fetch_add(1, Ordering::Relaxed);
            tracing::error!(error = %e, "governor accounting failed");
        }
    }

    /// Every device that may touch this manager's memory: its own and each device given
    /// access, once each, in order.
    pub(crate) fn accessing_devices(&self) -> Vec<DeviceId> {
        let mut out = vec![self.device];
        for a in &self.access {
            if a.access != kvvm_hal::Access::None && !out.contains(&a.device) {
                out.push(a.device);
            }
        }
        out
    }

    /// Synchronizes every device that may touch this manager's memory
    /// ([`accessing_devices`](Self::accessing_devices)); the first failure is returned.
    pub(crate) fn synchronize_all(&self) -> Result<(), BackendError> {
        for d in self.accessing_devices() {
            self.backend.synchronize(d)?;
        }
        Ok(())
    }

    /// Refuses, in O(1), a request after which its requester would hold `holding` bytes of
    /// physical memory on this device, when no freeing by anyone else could ever make room
    /// for that: more than the device holds, or than the governor's limits allow once
    /// everything but the quarantine is freed ([`Governor::check_fits`]). A reservation asks
    /// it through `Reservation::check_fits`, with what it maps plus what it adds.
    pub(crate) fn check_fits(&self, holding: u64) -> Result<(), NeverFits> {
        let device = self
            .capacity
            .filter(|&t| holding > t)
            .map(|total| NeverFits {
                device: self.device,
                needed: holding,
                limit: Limit::DeviceMemory,
                limit_bytes: total,
            });
        let budget = self.governor.check_fits(self.device, holding).err();
        // The tighter limit is the one reported.
        match (device, budget) {
            (Some(d), Some(b)) if d.limit_bytes < b.limit_bytes => Err(d),
            (_, Some(b)) => Err(b),
            (Some(d), None) => Err(d),
            (None, None) => Ok(()),
        }
    }

    /// How many governor updates failed.
    pub(crate) fn accounting_errors(&self) -> u64 {
        self.accounting_errors.load(Ordering::Relaxed)
    }

    /// Releases an unmapped handle of `g` bytes; a failure quarantines it (and is returned
    /// after that). Returns the bytes released.
    pub(crate) fn release_handle(
        &self,
        handle: PhysicalHandle,
        g: u64,
        source: Source<'_>,
    ) -> Result<u64, BackendError> {
        match self.backend.release(handle) {
            Ok(()) => {
                self.account(source.free(self, g));
                Ok(g)
            }
            Err(error) => {
                tracing::warn!(%handle, %error, "release failed; handle quarantined");
                self.account(source.settle(self, Bucket::Quarantined, g));
                self.quarantine
                    .add(QuarantineEntry::release_failed(handle, g, error.clone()));
                Err(error)
            }
        }
    }

    /// Sets `access` over `[addr, addr + bytes)`, retried
    /// [`Capabilities::set_access_retries`] extra times.
    pub(crate) fn set_access_retrying(
        &self,
        addr: DeviceAddress,
        bytes: u64,
        access: &[AccessDescriptor],
    ) -> Result<(), BackendError> {
        let mut attempt = 0u32;
        loop {
            match self.backend.set_access(addr, bytes, access) {
                Ok(()) => return Ok(()),
                Err(e) if attempt < self.caps.set_access_retries => {
                    tracing::debug!(error = %e, attempt, "set_access failed; retrying");
                    attempt = attempt.saturating_add(1);
                }
                Err(e) => return Err(e),
            }
        }
    }
}
