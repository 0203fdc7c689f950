//! Data: copies between the host and mapped device memory (and row copies within it), stored lazily in chunks behind
//! each allocation (a 64 TiB reservation costs nothing until written).

use std::collections::HashMap;

use kvvm_hal::{Access, BackendError, DeviceAddress, DeviceId, ErrorKind, Operation, RowCopy};

use crate::state::{end_of, invalid, State};

/// Data behind a handle is stored in chunks of this many bytes, allocated on first write.
const CHUNK: u64 = 64 * 1024;

impl State {
    /// Splits `[start, start + len)` into (allocation, offset in allocation, length) pieces,
    /// checking that every byte is mapped with the needed access for the device that holds
    /// the memory (a copy runs on its copy engines).
    pub(crate) fn pieces(
        &self,
        op: Operation,
        start: u64,
        len: u64,
        write: bool,
    ) -> Result<Vec<(u64, u64, u64)>, BackendError> {
        self.pieces_for(op, start, len, write, None)
    }

    /// [`pieces`](Self::pieces) with the access of `device` checked instead (a kernel running
    /// there); `None` checks the holding device's.
    pub(crate) fn pieces_for(
        &self,
        op: Operation,
        start: u64,
        len: u64,
        write: bool,
        device: Option<DeviceId>,
    ) -> Result<Vec<(u64, u64, u64)>, BackendError> {
        let end = end_of(op, start, len)?;
        let mut out = Vec::new();
        let mut cursor = start;
        while cursor < end {
            let (ms, m) = self
                .mappings
                .range(..=cursor)
                .next_back()
                .filter(|(s, m)| cursor < s.saturating_add(m.size))
                .ok_or_else(|| invalid(op, format!("{cursor:#x} is not mapped")))?;
            let a = self
                .allocations
                .get(&m.allocation)
                .ok_or_else(|| invalid(op, "mapping without allocation"))?;
            let who = device.unwrap_or(a.device);
            let access = m
                .access
                .get(who.0 as usize)
                .copied()
                .unwrap_or(Access::None);
            let allowed = if write {
                access.can_write() || (self.quirks.ignore_read_only && access.can_read())
            } else {
                access.can_read()
            };
            if !allowed {
                return Err(invalid(
                    op,
                    format!(
                        "{cursor:#x} has access {access:?} for {who}, {} needed",
                        if write { "write" } else { "read" }
                    ),
                ));
            }
            let piece_end = ms.saturating_add(m.size).min(end);
            out.push((m.allocation, cursor - ms, piece_end - cursor));
            cursor = piece_end;
        }
        Ok(out)
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
    pub(crate) fn write_pieces(&mut self, pieces: &[(u64, u64, u64)], src: &[u8]) {
        let mut consumed = 0usize;
        for &(alloc, offset, len) in pieces {
            let len = len as usize;
            if let Some(a) = self.allocations.get_mut(&alloc) {
                write_bytes(&mut a.data, offset, &src[consumed..consumed + len]);
            }
            consumed += len;
        }
    }

    /// Reads the checked `pieces` (of [`pieces`](Self::pieces)) into `dst`, in order.
    pub(crate) fn read_pieces(&self, pieces: &[(u64, u64, u64)], dst: &mut [u8]) {
        let mut filled = 0usize;
        for &(alloc, offset, len) in pieces {
            let len = len as usize;
            if let Some(a) = self.allocations.get(&alloc) {
                read_bytes(&a.data, offset, &mut dst[filled..filled + len]);
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

fn write_bytes(data: &mut HashMap<u64, Box<[u8]>>, offset: u64, src: &[u8]) {
    let mut pos = offset;
    let mut done = 0usize;
    while done < src.len() {
        let chunk = pos / CHUNK;
        let within = (pos % CHUNK) as usize;
        let n = (CHUNK as usize - within).min(src.len() - done);
        let buf = data
            .entry(chunk)
            .or_insert_with(|| vec![0u8; CHUNK as usize].into_boxed_slice());
        buf[within..within + n].copy_from_slice(&src[done..done + n]);
        done += n;
        pos += n as u64;
    }
}

fn read_bytes(data: &HashMap<u64, Box<[u8]>>, offset: u64, dst: &mut [u8]) {
    let mut pos = offset;
    let mut done = 0usize;
    while done < dst.len() {
        let chunk = pos / CHUNK;
        let within = (pos % CHUNK) as usize;
        let n = (CHUNK as usize - within).min(dst.len() - done);
        match data.get(&chunk) {
            Some(buf) => dst[done..done + n].copy_from_slice(&buf[within..within + n]),
            None => dst[done..done + n].fill(0),
        }
        done += n;
        pos += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(crate) fn chunked_bytes_roundtrip_across_chunk_boundaries() {
        let mut data = HashMap::new();
        let src: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        write_bytes(&mut data, CHUNK - 7, &src);
        let mut back = vec![0u8; src.len()];
        read_bytes(&data, CHUNK - 7, &mut back);
        assert_eq!(back, src);
        let mut zeros = vec![1u8; 16];
        read_bytes(&data, 40 * CHUNK, &mut zeros);
        assert!(zeros.iter().all(|b| *b == 0));
    }
}
