//! Bookkeeping of the address space: what reserve and free may do.

use kvvm_hal::{BackendResult, DeviceAddress, Operation};

use crate::conv::end_of;
use crate::error::invalid;
use crate::state::{Reservation, State};

impl State {
    /// Checks a reservation's size and alignment; returns the alignment to honour.
    pub(crate) fn check_reserve(&self, size: u64, alignment: u64) -> BackendResult<u64> {
        let op = Operation::Reserve;
        self.check_size(op, size)?;
        if alignment != 0 && !alignment.is_power_of_two() {
            return Err(invalid(
                op,
                format!("alignment {alignment} is not a power of two"),
            ));
        }
        Ok(alignment.max(self.granule))
    }

    pub(crate) fn record_reservation(&mut self, address: u64, size: u64) {
        self.reservations.insert(address, Reservation { size });
    }

    /// Checks that `[address, address + size)` is exactly a live reservation holding no
    /// live mapping.
    pub(crate) fn check_free(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
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
        let end = end_of(op, address.0, size)?;
        if self.mappings.range(address.0..end).next().is_some() {
            return Err(invalid(op, "a mapping inside the range is still live"));
        }
        Ok(())
    }

    pub(crate) fn remove_reservation(&mut self, address: u64) {
        self.reservations.remove(&address);
    }

    /// Every live reservation (for teardown).
    pub(crate) fn reservation_ranges(&self) -> Vec<(u64, u64)> {
        self.reservations
            .iter()
            .map(|(a, r)| (*a, r.size))
            .collect()
    }

    pub(crate) fn reservation_containing(&self, address: u64) -> Option<(u64, u64)> {
        self.reservations
            .range(..=address)
            .next_back()
            .filter(|(s, r)| address < s.saturating_add(r.size))
            .map(|(s, r)| (*s, r.size))
    }
}
