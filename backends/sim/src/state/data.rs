//! Data: copies between the host and mapped device memory (and row copies within it). The
//! bytes live behind each allocation in a [`ChunkStore`](crate::store::ChunkStore), only where
//! they were written (a 64 TiB reservation or a 140 GiB device costs nothing until written).

use kvvm_hal::model::{Need, Piece};
use kvvm_hal::{BackendError, DeviceAddress, DeviceId, ErrorKind, Operation, RowCopy};

use super::State;

impl State {
    /// Splits `[start, start + len)` into pieces of one allocation each, checking that every
    /// byte is mapped with the needed access for the device that holds the memory (a copy
    /// runs on its copy engines).
    pub(crate) fn pieces(
        &self,
        op: Operation,
        start: u64,
        len: u64,
        write: bool,
    ) -> Result<Vec<Piece>, BackendError> {
        self.pieces_for(op, start, len, write, None)
    }

    /// [`pieces`](Self::pieces) with the access of `device` checked instead (a kernel running
    /// there); `None` checks the holding device's. Under the `ignore_read_only` quirk a write
    /// needs read access only.
    pub(crate) fn pieces_for(
        &self,
        op: Operation,
        start: u64,
        len: u64,
        write: bool,
        device: Option<DeviceId>,
    ) -> Result<Vec<Piece>, BackendError> {
        let need = match (write, self.quirks.ignore_read_only) {
            (true, false) => Need::Write,
            _ => Need::Read,
        };
        self.model.pieces(op, start, len, need, device)
    }

    pub(crate) fn copy_to_device(
        &mut self,
        dst: DeviceAddress,
        src: &[u8],
    ) -> Result<(), BackendError> {
        let pieces = self.pieces(Operation::CopyToDevice, dst.0, src.len() as u64, true)?;
        self.write_pieces(&pieces, src);
        Ok(())
    }

    pub(crate) fn copy_from_device(
        &self,
        dst: &mut [u8],
        src: DeviceAddress,
    ) -> Result<(), BackendError> {
        let pieces = self.pieces(Operation::CopyFromDevice, src.0, dst.len() as u64, false)?;
        self.read_pieces(&pieces, dst);
        Ok(())
    }

    /// Writes `src` over the checked `pieces` (of [`pieces`](Self::pieces)), in order.
    pub(crate) fn write_pieces(&mut self, pieces: &[Piece], src: &[u8]) {
        let mut consumed = 0usize;
        for p in pieces {
            let len = p.len as usize;
            if let Some(a) = self.model.allocation_mut(p.allocation) {
                a.extra.data.write(p.offset, &src[consumed..consumed + len]);
            }
            consumed += len;
        }
    }

    /// Reads the checked `pieces` (of [`pieces`](Self::pieces)) into `dst`, in order.
    pub(crate) fn read_pieces(&self, pieces: &[Piece], dst: &mut [u8]) {
        let mut filled = 0usize;
        for p in pieces {
            let len = p.len as usize;
            if let Some(a) = self.model.allocation(p.allocation) {
                a.extra.data.read(p.offset, &mut dst[filled..filled + len]);
            }
            filled += len;
        }
    }
}

impl State {
    /// A row copy, done at once (the simulated device has no queue): every row is read whole
    /// before it is written, with the same access checks as the copies above.
    pub(crate) fn copy_rows(&mut self, copy: &RowCopy) -> Result<(), BackendError> {
        let op = Operation::CopyRows;
        copy.check()?;
        let width = usize::try_from(copy.width).map_err(|_| {
            BackendError::raised(op, ErrorKind::InvalidValue, "row width past usize")
        })?;
        // Check every row before any is written: a refused copy writes nothing.
        for row in 0..copy.rows {
            self.pieces(op, copy.src.0 + row * copy.src_pitch, copy.width, false)?;
            self.pieces(op, copy.dst.0 + row * copy.dst_pitch, copy.width, true)?;
        }
        let mut buf = vec![0u8; width];
        for row in 0..copy.rows {
            self.copy_from_device(&mut buf, DeviceAddress(copy.src.0 + row * copy.src_pitch))?;
            self.copy_to_device(DeviceAddress(copy.dst.0 + row * copy.dst_pitch), &buf)?;
        }
        Ok(())
    }
}
