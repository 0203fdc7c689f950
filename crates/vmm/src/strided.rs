//! Equally strided reservations carved out of one reserved address range: the driver range
//! they share ([`SharedRange`]), freed when the last of them is gone.
//!
//! `VirtualMemory::reserve_strided` (`manager.rs`) reserves `count x stride` bytes from the
//! driver once and hands out `count` reservations, the `i`-th at `base + i x stride`. Each of
//! them commits, shares, releases and tears down on its own, exactly like a reservation of its
//! own range; the one thing they share is the driver's range. Because the slots sit at a
//! constant stride, the same offset of every slot forms a regular strided array in the
//! device's address space: a batch of KV caches is one strided tensor per layer for a kernel,
//! while each sequence keeps its own commits.

use std::sync::Arc;

use kvvm_hal::DeviceAddress;

use crate::device::quarantine::QuarantineEntry;
use crate::device::DeviceState;

/// A driver address range shared by several reservations; freed when the last one drops.
pub(crate) struct SharedRange {
    state: Arc<DeviceState>,
    base: DeviceAddress,
    size: u64,
}

impl SharedRange {
    pub(crate) fn new(state: Arc<DeviceState>, base: DeviceAddress, size: u64) -> Self {
        SharedRange { state, base, size }
    }
}

impl Drop for SharedRange {
    fn drop(&mut self) {
        let ctx = &self.state.ctx;
        let span = tracing::debug_span!(
            "vmm.free_strided_range",
            device = ctx.device.0,
            base = self.base.0,
            size = self.size
        );
        let _e = span.enter();
        if let Err(error) = ctx.backend.free(self.base, self.size) {
            tracing::warn!(base = %self.base, size = self.size, %error, "address free failed; range quarantined");
            ctx.quarantine
                .add(QuarantineEntry::free_failed(self.base, self.size, error));
        }
    }
}
