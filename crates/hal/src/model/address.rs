//! Address space: reserve and free, and what a range holds.

use crate::{BackendError, DeviceAddress, Operation};

use super::DriverModel;

impl<A, H> DriverModel<A, H> {
    /// `InvalidValue` unless `size` is a non-zero multiple of `granule` (what a reserve or a
    /// create of another size gets).
    pub fn check_size(&self, op: Operation, size: u64, granule: u64) -> Result<(), BackendError> {
        if size != 0 && granule != 0 && size.is_multiple_of(granule) {
            Ok(())
        } else {
            Err(self.invalid(
                op,
                format!("size {size} is not a non-zero multiple of {granule}"),
            ))
        }
    }

    /// Checks a reservation's size and alignment (0 or a power of two); returns the
    /// alignment to honour (at least `granule`).
    pub fn check_reserve(
        &self,
        size: u64,
        alignment: u64,
        granule: u64,
    ) -> Result<u64, BackendError> {
        let op = Operation::Reserve;
        self.check_size(op, size, granule)?;
        if alignment != 0 && !alignment.is_power_of_two() {
            return Err(self.invalid(op, format!("alignment {alignment} is not a power of two")));
        }
        Ok(alignment.max(granule))
    }

    /// Records a reservation the driver made.
    pub fn insert_range(&mut self, start: u64, size: u64) {
        self.ranges.insert(start, size);
    }

    /// Whether `[start, end)` overlaps no reserved range.
    pub fn range_free(&self, start: u64, end: u64) -> bool {
        // The last range starting before `end` must end at or before `start`.
        match self.ranges.range(..end).next_back() {
            Some((&s, &size)) => s.saturating_add(size) <= start,
            None => true,
        }
    }

    /// The reserved range `(start, size)` holding `address`.
    pub fn range_containing(&self, address: u64) -> Option<(u64, u64)> {
        self.ranges
            .range(..=address)
            .next_back()
            .filter(|(s, size)| address < s.saturating_add(**size))
            .map(|(s, size)| (*s, *size))
    }

    /// Checks a free: `[address, address + size)` is exactly a reserved range and holds no
    /// live mapping (`InvalidValue` otherwise: a second free, a wrong size, a free under a
    /// mapping).
    pub fn check_free(&self, address: DeviceAddress, size: u64) -> Result<(), BackendError> {
        let op = Operation::Free;
        let reserved = *self
            .ranges
            .get(&address.0)
            .ok_or_else(|| self.invalid(op, format!("no reservation at {address}")))?;
        if reserved != size {
            return Err(self.invalid(
                op,
                format!("size {size} differs from the reserved {reserved}"),
            ));
        }
        let end = self.end_of(op, address.0, size)?;
        if self.mappings.range(address.0..end).next().is_some() {
            return Err(self.invalid(op, "a mapping inside the range is still live"));
        }
        Ok(())
    }

    /// Forgets the range starting at `start` (a free the driver made).
    pub fn remove_range(&mut self, start: u64) {
        self.ranges.remove(&start);
    }
}
