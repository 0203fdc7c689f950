//! Address space: reserve and free, in the driver's semantics. The books and their checks are
//! the shared model's; the simulator picks the addresses (first fit from [`VA_BASE`]) and keeps
//! the ROCm multi-unmap quirk's mark.

use kvvm_hal::{BackendError, DeviceAddress, ErrorKind, Operation};

use super::{invalid, State, VA_BASE};
use crate::error::sim_error;

impl State {
    pub(crate) fn reserve(
        &mut self,
        size: u64,
        alignment: u64,
        fixed: Option<DeviceAddress>,
    ) -> Result<DeviceAddress, BackendError> {
        let align = self.model.check_reserve(size, alignment, self.va_granule)?;
        let limit = VA_BASE.saturating_add(self.address_space);
        // Like the driver, a fixed address is a hint: a taken one falls through to any free
        // range.
        let hinted = fixed.map(|a| a.0).filter(|&a| {
            a % align == 0
                && a >= VA_BASE
                && a.checked_add(size)
                    .is_some_and(|end| end <= limit && self.model.range_free(a, end))
        });
        let start = match hinted {
            Some(a) => a,
            None => self.first_fit(size, align, limit)?,
        };
        self.model.insert_range(start, size);
        Ok(DeviceAddress(start))
    }

    /// The lowest `align`-aligned free range of `size` bytes below `limit`.
    fn first_fit(&self, size: u64, align: u64, limit: u64) -> Result<u64, BackendError> {
        let mut candidate = VA_BASE;
        for (start, reserved) in self.model.ranges() {
            let aligned = align_up(candidate, align).ok_or_else(|| oom_va(size))?;
            if aligned.checked_add(size).is_some_and(|end| end <= start) {
                break;
            }
            candidate = start.saturating_add(reserved);
        }
        let aligned = align_up(candidate, align).ok_or_else(|| oom_va(size))?;
        let end = aligned.checked_add(size).ok_or_else(|| oom_va(size))?;
        if end > limit {
            return Err(oom_va(size));
        }
        Ok(aligned)
    }

    pub(crate) fn free(&mut self, address: DeviceAddress, size: u64) -> Result<(), BackendError> {
        self.model.check_free(address, size)?;
        if self.broken_by_multi_unmap.contains(&address.0) {
            return Err(invalid(
                Operation::Free,
                "address free after a multi-mapping unmap (ROCR-Runtime #285 quirk)",
            ));
        }
        self.model.remove_range(address.0);
        Ok(())
    }
}

pub(crate) fn align_up(v: u64, align: u64) -> Option<u64> {
    let mask = align.checked_sub(1)?;
    v.checked_add(mask).map(|x| x & !mask)
}

fn oom_va(size: u64) -> BackendError {
    sim_error(
        Operation::Reserve,
        ErrorKind::OutOfMemory,
        format!("no free virtual range of {size} bytes"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(crate) fn align_up_checks_overflow() {
        assert_eq!(align_up(5, 4), Some(8));
        assert_eq!(align_up(8, 4), Some(8));
        assert_eq!(align_up(u64::MAX, 4), None);
    }
}
