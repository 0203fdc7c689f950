//! [`RawRange`]: an address range driven with raw driver calls, the baseline the manager's
//! commit is measured against.

use std::time::{Duration, Instant};

use kvvm::hal::{
    AccessDescriptor, AllocationProperties, BackendError, DeviceAddress, DeviceId, PhysicalHandle,
    VirtualMemoryBackend,
};
use kvvm::vmm::VmmResult;

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
        let (commit, _) = self.time_run(g, k)?;
        Ok(commit)
    }

    /// Times the commit of `handles` handles of `handle_bytes` each from the base (create and
    /// map each, then one set access over all of them) and of their teardown (unmap: one call
    /// over all where the backend allows it, one per mapping, last first, otherwise; then
    /// release each). Whatever fails, everything made is unmapped and released before
    /// returning.
    pub(crate) fn time_run(
        &self,
        handle_bytes: u64,
        handles: u64,
    ) -> VmmResult<(Duration, Duration)> {
        let props = AllocationProperties::device(self.device);
        let access = [AccessDescriptor::read_write(self.device)];
        let bytes = handles.saturating_mul(handle_bytes);
        let mut made: Vec<PhysicalHandle> = Vec::new();
        let mut mapped = 0u64;
        let t0 = Instant::now();
        let mut result: Result<(), BackendError> = Ok(());
        for i in 0..handles {
            let addr = self.base.offset(i.saturating_mul(handle_bytes));
            match self.backend.create(handle_bytes, &props) {
                Ok(h) => {
                    made.push(h);
                    if let Err(e) = self.backend.map(addr, handle_bytes, h) {
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
            result = self.backend.set_access(self.base, bytes, &access);
        }
        let commit = t0.elapsed();
        let t1 = Instant::now();
        let mut cleanup: Result<(), BackendError> = Ok(());
        if self.backend.capabilities().unmap_spans_mappings && mapped > 0 {
            if let Err(e) = self
                .backend
                .unmap(self.base, mapped.saturating_mul(handle_bytes))
            {
                cleanup = Err(e);
            }
        } else {
            for i in (0..mapped).rev() {
                let addr = self.base.offset(i.saturating_mul(handle_bytes));
                if let Err(e) = self.backend.unmap(addr, handle_bytes) {
                    cleanup = cleanup.and(Err(e));
                }
            }
        }
        for h in made {
            if let Err(e) = self.backend.release(h) {
                cleanup = cleanup.and(Err(e));
            }
        }
        let teardown = t1.elapsed();
        result?;
        cleanup?;
        Ok((commit, teardown))
    }

    pub(crate) fn free(self) -> VmmResult<()> {
        if self.owned {
            self.backend.free(self.base, self.size)?;
        }
        Ok(())
    }
}
