//! [`RawRange`]: an address range driven with raw driver calls, the baseline the manager's
//! commit is measured against.

use std::time::{Duration, Instant};

use kvvm_hal::{
    AccessDescriptor, AllocationProperties, BackendError, DeviceAddress, DeviceId, PhysicalHandle,
    VirtualMemoryBackend,
};
use kvvm_vmm::VmmResult;

/// A range driven with raw driver calls (the baseline).
pub(crate) struct RawRange<'a> {
    pub(crate) backend: &'a dyn VirtualMemoryBackend,
    pub(crate) device: DeviceId,
    pub(crate) base: DeviceAddress,
    pub(crate) size: u64,
    /// Whether this range reserved its address space (and frees it).
    pub(crate) owned: bool,
}

impl<'a> RawRange<'a> {
    pub(crate) fn reserve(
        backend: &'a dyn VirtualMemoryBackend,
        device: DeviceId,
        size: u64,
    ) -> VmmResult<Self> {
        let base = backend.reserve(size, 0, None)?;
        Ok(RawRange {
            backend,
            device,
            base,
            size,
            owned: true,
        })
    }

    /// Times create + map of `k` granules and one set access, then (untimed) unmaps and
    /// releases them.
    pub(crate) fn time_commit(&self, k: u64, g: u64) -> VmmResult<Duration> {
        let props = AllocationProperties::device(self.device);
        let access = [AccessDescriptor::read_write(self.device)];
        let mut handles: Vec<PhysicalHandle> = Vec::new();
        let mut mapped = 0u64;
        let t0 = Instant::now();
        let mut result: Result<(), BackendError> = Ok(());
        for i in 0..k {
            let addr = self.base.offset(i.saturating_mul(g));
            match self.backend.create(g, &props) {
                Ok(h) => {
                    handles.push(h);
                    if let Err(e) = self.backend.map(addr, g, h) {
                        result = Err(e);
                        break;
                    }
                    mapped = mapped.saturating_add(1);
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        if result.is_ok() {
            result = self
                .backend
                .set_access(self.base, k.saturating_mul(g), &access);
        }
        let elapsed = t0.elapsed();
        // Clean up (untimed), whatever happened.
        let mut cleanup: Result<(), BackendError> = Ok(());
        if self.backend.capabilities().unmap_spans_mappings && mapped > 0 {
            if let Err(e) = self.backend.unmap(self.base, mapped.saturating_mul(g)) {
                cleanup = Err(e);
            }
        } else {
            for i in (0..mapped).rev() {
                let addr = self.base.offset(i.saturating_mul(g));
                if let Err(e) = self.backend.unmap(addr, g) {
                    cleanup = cleanup.and(Err(e));
                }
            }
        }
        for h in handles {
            if let Err(e) = self.backend.release(h) {
                cleanup = cleanup.and(Err(e));
            }
        }
        result?;
        cleanup?;
        Ok(elapsed)
    }

    pub(crate) fn free(self) -> VmmResult<()> {
        if self.owned {
            self.backend.free(self.base, self.size)?;
        }
        Ok(())
    }
}
