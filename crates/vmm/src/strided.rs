//! Equally strided reservations carved out of one reserved address range.
//!
//! [`VirtualMemory::reserve_strided`] reserves `count x stride` bytes from the driver once and
//! hands out `count` [`Reservation`]s, the `i`-th at `base + i x stride`. Each of them commits,
//! shares, releases and tears down on its own, exactly like a reservation of its own range;
//! the one thing they share is the driver's range, which is freed when the last of them is
//! gone. Because the slots sit at a constant stride, the same offset of every slot forms a
//! regular strided array in the device's address space: a batch of KV caches is one strided
//! tensor per layer for a kernel, while each sequence keeps its own commits.

use std::sync::Arc;

use kvvm_hal::DeviceAddress;

use crate::error::{VmmError, VmmResult};
use crate::manager::{Inner, QuarantineEntry, QuarantineReason, VirtualMemory};
use crate::reservation::Reservation;

/// A driver address range shared by several [`Reservation`]s; freed when the last one drops.
pub(crate) struct SharedRange {
    vm: Arc<Inner>,
    base: DeviceAddress,
    size: u64,
}

impl Drop for SharedRange {
    fn drop(&mut self) {
        let span = tracing::debug_span!(
            "vmm.free_strided_range",
            device = self.vm.device.0,
            base = self.base.0,
            size = self.size
        );
        let _e = span.enter();
        if let Err(error) = self.vm.backend.free(self.base, self.size) {
            tracing::warn!(base = %self.base, size = self.size, %error, "address free failed; range quarantined");
            self.vm.add_quarantine(QuarantineEntry {
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

impl VirtualMemory {
    /// Reserves `count` ranges of `bytes_each` bytes (each rounded up to the granule: the
    /// *stride*) in one driver reservation, at a constant stride from one another, and returns
    /// them in address order. No physical memory is used until they commit.
    ///
    /// Each returned [`Reservation`] behaves like one from [`reserve`](Self::reserve) (its own
    /// commits, shared mappings, release and teardown); the driver's range is freed when the
    /// last of them is dropped. [`Reservation::address`] of slot `i` is `base + i x stride`.
    ///
    /// Errors: [`VmmError::ZeroSize`] when `count` or `bytes_each` is 0;
    /// [`VmmError::SizeOverflow`] when the total does not fit in the address space; a failed
    /// driver reservation.
    pub fn reserve_strided(&self, count: u64, bytes_each: u64) -> VmmResult<Vec<Reservation>> {
        let span = tracing::debug_span!(
            "vmm.reserve_strided",
            device = self.inner.device.0,
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
        let g = self.inner.granule;
        let alignment = if g.is_power_of_two() { g } else { 0 };
        let base = self.inner.backend.reserve(total, alignment, None)?;
        let range = Arc::new(SharedRange {
            vm: Arc::clone(&self.inner),
            base,
            size: total,
        });
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
            let addr = DeviceAddress(base.0 + i * stride);
            out.push(Reservation::new_in_range(
                Arc::clone(&self.inner),
                addr,
                stride,
                Arc::clone(&range),
            ));
        }
        Ok(out)
    }
}
