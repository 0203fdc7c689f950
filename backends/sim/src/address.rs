//! Address space: reserve and free, in the driver's semantics.

use kvvm_hal::{BackendError, DeviceAddress, ErrorKind, Operation};

use crate::sim_error;
use crate::state::{end_of, invalid, Reservation, State, VA_BASE};

impl State {
    pub(crate) fn reserve(
        &mut self,
        size: u64,
        alignment: u64,
        fixed: Option<DeviceAddress>,
    ) -> Result<DeviceAddress, BackendError> {
        let op = Operation::Reserve;
        let g = self.va_granule;
        if size == 0 || !size.is_multiple_of(g) {
            return Err(invalid(op, format!("size {size} is not a multiple of {g}")));
        }
        if alignment != 0 && !alignment.is_power_of_two() {
            return Err(invalid(
                op,
                format!("alignment {alignment} is not a power of two"),
            ));
        }
        let align = alignment.max(g);
        let limit = VA_BASE.saturating_add(self.address_space);
        if let Some(addr) = fixed {
            let a = addr.0;
            if a % align == 0 && a >= VA_BASE {
                if let Some(end) = a.checked_add(size) {
                    if end <= limit && self.va_range_free(a, end) {
                        self.reservations.insert(
                            a,
                            Reservation {
                                size,
                                broken_by_multi_unmap: false,
                            },
                        );
                        return Ok(addr);
                    }
                }
            }
            // Like the driver, a fixed address is a hint: fall through to any free range.
        }
        let mut candidate = VA_BASE;
        for (&start, r) in &self.reservations {
            let aligned = align_up(candidate, align).ok_or_else(|| oom_va(size))?;
            if aligned.checked_add(size).is_some_and(|end| end <= start) {
                break;
            }
            candidate = start.saturating_add(r.size);
        }
        let aligned = align_up(candidate, align).ok_or_else(|| oom_va(size))?;
        let end = aligned.checked_add(size).ok_or_else(|| oom_va(size))?;
        if end > limit {
            return Err(oom_va(size));
        }
        self.reservations.insert(
            aligned,
            Reservation {
                size,
                broken_by_multi_unmap: false,
            },
        );
        Ok(DeviceAddress(aligned))
    }

    pub(crate) fn va_range_free(&self, start: u64, end: u64) -> bool {
        // The last reservation starting before `end` must end at or before `start`.
        match self.reservations.range(..end).next_back() {
            Some((&s, r)) => s.saturating_add(r.size) <= start,
            None => true,
        }
    }

    pub(crate) fn free(&mut self, address: DeviceAddress, size: u64) -> Result<(), BackendError> {
        let op = Operation::Free;
        let r = self
            .reservations
            .get(&address.0)
            .ok_or_else(|| invalid(op, format!("no reservation at {address}")))?;
        if r.size != size {
            return Err(invalid(
                op,
                format!("size {size} differs from the reserved {}", r.size),
            ));
        }
        if r.broken_by_multi_unmap {
            return Err(invalid(
                op,
                "address free after a multi-mapping unmap (ROCR-Runtime #285 quirk)",
            ));
        }
        let end = end_of(op, address.0, size)?;
        if self.mappings.range(address.0..end).next().is_some() {
            return Err(invalid(op, "a mapping inside the range is still live"));
        }
        self.reservations.remove(&address.0);
        Ok(())
    }

    pub(crate) fn reservation_containing(&self, addr: u64) -> Option<(u64, &Reservation)> {
        self.reservations
            .range(..=addr)
            .next_back()
            .filter(|(s, r)| addr < s.saturating_add(r.size))
            .map(|(s, r)| (*s, r))
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
