//! What a copy or a probe may touch: every byte mapped, with the access it needs.

use crate::{BackendError, DeviceId, Operation};

use super::{AllocationId, DriverModel};

/// The access a copy needs on every byte it touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Only that the bytes are mapped (a probe whose accesses the MMU checks).
    Mapped,
    /// Read access (a copy from the device).
    Read,
    /// Write access (a copy to the device).
    Write,
}

/// One piece of a range, inside one mapping: `len` bytes at `offset` of `allocation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The allocation the bytes are in.
    pub allocation: AllocationId,
    /// Where they start in it.
    pub offset: u64,
    /// How many.
    pub len: u64,
}

impl<A, H> DriverModel<A, H> {
    /// Splits `[start, start + len)` into pieces of one mapping each, checking that every
    /// byte is mapped with the access `need` says, for `device` (`None`: the device that
    /// holds the memory, whose copy engines run a copy). `InvalidValue` names the first byte
    /// that is not.
    pub fn pieces(
        &self,
        op: Operation,
        start: u64,
        len: u64,
        need: Need,
        device: Option<DeviceId>,
    ) -> Result<Vec<Piece>, BackendError> {
        let end = self.end_of(op, start, len)?;
        let mut out = Vec::new();
        let mut cursor = start;
        while cursor < end {
            let (ms, m) = self
                .mappings
                .range(..=cursor)
                .next_back()
                .filter(|(s, m)| cursor < s.saturating_add(m.size))
                .ok_or_else(|| self.invalid(op, format!("{cursor:#x} is not mapped")))?;
            let owner = self.allocation(m.allocation).map(|a| a.device);
            let who = device.or(owner).unwrap_or(DeviceId(0));
            let access = m.access_of(who);
            let allowed = match need {
                Need::Mapped => true,
                Need::Read => access.can_read(),
                Need::Write => access.can_write(),
            };
            if !allowed {
                return Err(self.invalid(
                    op,
                    format!("{cursor:#x} has access {access:?} for {who}, {need:?} needed"),
                ));
            }
            let piece_end = ms.saturating_add(m.size).min(end);
            out.push(Piece {
                allocation: m.allocation,
                offset: cursor - ms,
                len: piece_end - cursor,
            });
            cursor = piece_end;
        }
        Ok(out)
    }
}
