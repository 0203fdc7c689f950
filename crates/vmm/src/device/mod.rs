//! [`DeviceState`]: the per-device state that the manager, every reservation and every shared
//! set hold: the device context, the handle pool and the parking lot. It is the pool's
//! [`Reclaimer`] and gives the pool back to the driver when the last holder is gone.
//!
//! Invariants it keeps: every handle it holds is in exactly one place (the pool's free list,
//! a parked window, or the quarantine); pooled bytes (free handles and parked windows) stay
//! under one cap and are counted by the governor as pooled; quarantined memory is never
//! reused or advertised as free.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | [`DeviceState`] and the reclaimer |
//! | `context.rs` | [`DeviceContext`]: backend, granule, access, governor, accounting; [`Source`] of bytes being disposed of |
//! | `pool.rs` | the handle pool (free handles and the parked-bytes count, under one cap) |
//! | `parking.rs` | parked windows: park, take back, evict, unpark under pressure |
//! | `quarantine.rs` | [`QuarantineEntry`](quarantine::QuarantineEntry), its constructors, the list |

mod context;
pub(crate) mod parking;
pub(crate) mod pool;
pub(crate) mod quarantine;

use kvvm_governor::Reclaimer;
use kvvm_hal::{BackendError, DeviceId, PhysicalHandle};

pub(crate) use context::{DeviceContext, Source};
use parking::ParkingLot;
use pool::HandlePool;

/// One device's shared state (behind an `Arc`).
pub(crate) struct DeviceState {
    pub(crate) ctx: DeviceContext,
    pub(crate) pool: HandlePool,
    pub(crate) parking: ParkingLot,
}

impl DeviceState {
    /// Returns an unmapped handle to the pool if it fits, otherwise releases it (see
    /// [`HandlePool::dispose`]).
    pub(crate) fn dispose(
        &self,
        handle: PhysicalHandle,
        size: u64,
        source: Source<'_>,
    ) -> Result<u64, BackendError> {
        self.pool.dispose(&self.ctx, handle, size, source)
    }

    /// Bytes held by the pool: free handles and parked windows.
    pub(crate) fn pooled_bytes(&self) -> u64 {
        self.pool.held_bytes()
    }

    /// Releases pooled handles, then parked windows, until at most `keep_bytes` of pooled
    /// memory stay; returns the bytes released.
    pub(crate) fn trim_pool_to(&self, keep_bytes: u64) -> u64 {
        let released = self.pool.trim_free(&self.ctx, keep_bytes);
        let over = self.pooled_bytes().saturating_sub(keep_bytes);
        released.saturating_add(self.parking.unpark(&self.ctx, &self.pool, over))
    }
}

impl Reclaimer for DeviceState {
    fn reclaim(&self, device: DeviceId, bytes: u64) -> u64 {
        if device != self.ctx.device || bytes == 0 {
            return 0;
        }
        let span = tracing::debug_span!("vmm.reclaim", device = device.0, bytes);
        let _e = span.enter();
        let held = self.pooled_bytes();
        let g = self.ctx.granule;
        let want = bytes.div_ceil(g).saturating_mul(g);
        self.trim_pool_to(held.saturating_sub(want))
    }

    fn reclaimable(&self, device: DeviceId) -> u64 {
        if device == self.ctx.device {
            self.pooled_bytes()
        } else {
            0
        }
    }
}

impl Drop for DeviceState {
    fn drop(&mut self) {
        // The last reservation is gone: give the pool back to the driver.
        self.trim_pool_to(0);
    }
}
