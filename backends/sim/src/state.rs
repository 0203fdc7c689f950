//! The simulated driver's state and the semantics of each call.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use kvvm_hal::{
    Access, AccessDescriptor, AllocationProperties, BackendError, DeviceAddress, DeviceId,
    ErrorKind, MemoryInfo, Operation, PhysicalHandle, ShareableHandleType,
};

use crate::config::{SimConfig, SimDeviceConfig, SimQuirks};
use crate::faults::{op_index, FaultPlan, FaultRule};
use crate::ledger::{Ledger, LedgerAllocation, LedgerHandle, LedgerMapping, LedgerReservation};
use crate::sim_error;

/// Lowest simulated virtual address (1 TiB).
const VA_BASE: u64 = 1 << 40;
/// Data behind a handle is stored in chunks of this many bytes, allocated on first write.
const CHUNK: u64 = 64 * 1024;

#[derive(Debug)]
struct Reservation {
    size: u64,
    /// Set by a multi-mapping unmap under the `multi_unmap_breaks_free` quirk.
    broken_by_multi_unmap: bool,
}

#[derive(Debug)]
struct Allocation {
    device: DeviceId,
    size: u64,
    handle_type: ShareableHandleType,
    handles: u64,
    mappings: u64,
    data: HashMap<u64, Box<[u8]>>,
    /// A duplicate of each exported descriptor, kept so that its inode identifies the
    /// allocation on import for as long as the allocation lives.
    exports: Vec<(u64, OwnedFd)>,
}

#[derive(Debug)]
struct Mapping {
    size: u64,
    allocation: u64,
    /// Access per device ordinal.
    access: Vec<Access>,
}

#[derive(Debug)]
pub(crate) struct State {
    devices: Vec<SimDeviceConfig>,
    quirks: SimQuirks,
    address_space: u64,
    va_granule: u64,
    used: Vec<u64>,
    reservations: BTreeMap<u64, Reservation>,
    mappings: BTreeMap<u64, Mapping>,
    handles: HashMap<u64, u64>,
    allocations: HashMap<u64, Allocation>,
    next_handle: u64,
    next_allocation: u64,
    counts: [u64; Operation::ALL.len()],
    faults: FaultPlan,
    driver_time: Duration,
}

fn invalid(op: Operation, detail: impl Into<String>) -> BackendError {
    sim_error(op, ErrorKind::InvalidValue, detail)
}

fn not_supported(op: Operation, detail: impl Into<String>) -> BackendError {
    sim_error(op, ErrorKind::NotSupported, detail)
}

fn end_of(op: Operation, start: u64, size: u64) -> Result<u64, BackendError> {
    start
        .checked_add(size)
        .ok_or_else(|| invalid(op, "address range overflows"))
}

impl State {
    pub(crate) fn new(config: &SimConfig) -> Self {
        let va_granule = config
            .devices
            .iter()
            .map(|d| d.granularity.minimum.max(1))
            .min()
            .unwrap_or(1);
        State {
            devices: config.devices.clone(),
            quirks: config.quirks,
            address_space: config.address_space,
            va_granule,
            used: vec![0; config.devices.len()],
            reservations: BTreeMap::new(),
            mappings: BTreeMap::new(),
            handles: HashMap::new(),
            allocations: HashMap::new(),
            next_handle: 0x1000,
            next_allocation: 1,
            counts: [0; Operation::ALL.len()],
            faults: FaultPlan::default(),
            driver_time: Duration::ZERO,
        }
    }

    pub(crate) fn va_granule(&self) -> u64 {
        self.va_granule
    }

    pub(crate) fn inject(&mut self, rule: FaultRule) {
        let counts = self.counts;
        self.faults.install(rule, &counts);
    }

    pub(crate) fn clear_faults(&mut self) {
        self.faults.clear();
    }

    pub(crate) fn calls(&self, op: Operation) -> u64 {
        self.counts[op_index(op)]
    }

    pub(crate) fn driver_time(&self) -> Duration {
        self.driver_time
    }

    pub(crate) fn add_driver_time(&mut self, d: Duration) {
        self.driver_time = self.driver_time.saturating_add(d);
    }

    pub(crate) fn reset_counters(&mut self) {
        self.counts = [0; Operation::ALL.len()];
        self.driver_time = Duration::ZERO;
        self.faults.clear();
    }

    pub(crate) fn count_and_check(&mut self, op: Operation) -> Option<ErrorKind> {
        let i = op_index(op);
        self.counts[i] = self.counts[i].saturating_add(1);
        if self.faults.is_empty() {
            return None;
        }
        let counts = self.counts;
        self.faults.check(op, &counts)
    }

    pub(crate) fn device(
        &self,
        op: Operation,
        device: DeviceId,
    ) -> Result<&SimDeviceConfig, BackendError> {
        self.devices
            .get(device.0 as usize)
            .ok_or_else(|| invalid(op, format!("no {device}")))
    }

    pub(crate) fn memory_info(&self, device: DeviceId) -> Result<MemoryInfo, BackendError> {
        let d = self.device(Operation::MemoryInfo, device)?;
        let used = self.used.get(device.0 as usize).copied().unwrap_or(0);
        Ok(MemoryInfo {
            free: d.capacity.saturating_sub(used),
            total: d.capacity,
        })
    }

    // ---- address space ----

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

    fn va_range_free(&self, start: u64, end: u64) -> bool {
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

    fn reservation_containing(&self, addr: u64) -> Option<(u64, &Reservation)> {
        self.reservations
            .range(..=addr)
            .next_back()
            .filter(|(s, r)| addr < s.saturating_add(r.size))
            .map(|(s, r)| (*s, r))
    }

    // ---- physical memory ----

    pub(crate) fn create(
        &mut self,
        size: u64,
        props: &AllocationProperties,
    ) -> Result<PhysicalHandle, BackendError> {
        let op = Operation::Create;
        let d = self.device(op, props.device)?;
        let g = d.granularity.minimum.max(1);
        if size == 0 || !size.is_multiple_of(g) {
            return Err(invalid(op, format!("size {size} is not a multiple of {g}")));
        }
        if props.handle_type == ShareableHandleType::PosixFd && !d.posix_fd {
            return Err(not_supported(op, "POSIX fd handles not supported"));
        }
        let capacity = d.capacity;
        let idx = props.device.0 as usize;
        let used = self.used.get(idx).copied().unwrap_or(0);
        if used.checked_add(size).is_none_or(|u| u > capacity) {
            return Err(sim_error(
                op,
                ErrorKind::OutOfMemory,
                format!(
                    "{size} bytes requested, {} free",
                    capacity.saturating_sub(used)
                ),
            ));
        }
        if let Some(u) = self.used.get_mut(idx) {
            *u = used + size;
        }
        let id = self.next_allocation;
        self.next_allocation += 1;
        self.allocations.insert(
            id,
            Allocation {
                device: props.device,
                size,
                handle_type: props.handle_type,
                handles: 1,
                mappings: 0,
                data: HashMap::new(),
                exports: Vec::new(),
            },
        );
        Ok(self.new_handle(id))
    }

    fn new_handle(&mut self, allocation: u64) -> PhysicalHandle {
        let h = self.next_handle;
        self.next_handle += 0x10;
        self.handles.insert(h, allocation);
        PhysicalHandle(h)
    }

    pub(crate) fn release(&mut self, handle: PhysicalHandle) -> Result<(), BackendError> {
        let op = Operation::Release;
        let id = self
            .handles
            .remove(&handle.0)
            .ok_or_else(|| invalid(op, format!("{handle} is not live")))?;
        if let Some(a) = self.allocations.get_mut(&id) {
            a.handles = a.handles.saturating_sub(1);
            if self.quirks.release_frees_mapped && a.handles == 0 {
                // Deliberately wrong: drop the data and the capacity at once.
                a.data.clear();
                let (dev, size) = (a.device.0 as usize, a.size);
                a.size = 0;
                if let Some(u) = self.used.get_mut(dev) {
                    *u = u.saturating_sub(size);
                }
            }
        }
        self.maybe_free_allocation(id);
        Ok(())
    }

    fn maybe_free_allocation(&mut self, id: u64) {
        let dead = self
            .allocations
            .get(&id)
            .is_some_and(|a| a.handles == 0 && a.mappings == 0);
        if dead {
            if let Some(a) = self.allocations.remove(&id) {
                if let Some(u) = self.used.get_mut(a.device.0 as usize) {
                    *u = u.saturating_sub(a.size);
                }
            }
        }
    }

    /// The allocation a live handle refers to, or `InvalidValue`.
    fn allocation_of(&self, op: Operation, handle: PhysicalHandle) -> Result<u64, BackendError> {
        self.handles
            .get(&handle.0)
            .copied()
            .ok_or_else(|| invalid(op, format!("{handle} is not live")))
    }

    // ---- mappings ----

    pub(crate) fn map(
        &mut self,
        address: DeviceAddress,
        size: u64,
        handle: PhysicalHandle,
    ) -> Result<(), BackendError> {
        let op = Operation::Map;
        let id = self.allocation_of(op, handle)?;
        let a = self
            .allocations
            .get(&id)
            .ok_or_else(|| invalid(op, format!("{handle} has no allocation")))?;
        let g = self.device(op, a.device)?.granularity.minimum.max(1);
        let a_size = a.size;
        if size == 0 {
            return Err(invalid(op, "size 0"));
        }
        if size > a_size {
            return Err(invalid(
                op,
                format!("size {size} exceeds the handle's {a_size}"),
            ));
        }
        // Measured on the H200 (driver 580.159.04): a handle is mapped whole. A map of part of
        // a handle is refused with NOT_SUPPORTED before any address check; with the whole
        // handle, a bad address (unaligned, unreserved, already mapped) is INVALID_VALUE.
        if size != a_size || !size.is_multiple_of(g) {
            return Err(not_supported(
                op,
                format!("map of {size} bytes of a {a_size}-byte handle (a handle is mapped whole)"),
            ));
        }
        if !address.0.is_multiple_of(g) {
            return Err(invalid(op, format!("{address} not aligned to {g}")));
        }
        let end = end_of(op, address.0, size)?;
        let (r_start, r) = self
            .reservation_containing(address.0)
            .ok_or_else(|| invalid(op, format!("{address} is not reserved")))?;
        if end > r_start.saturating_add(r.size) {
            // The real driver does not check this; the simulator does, so that bugs surface.
            return Err(invalid(
                op,
                format!("map of {size} bytes at {address} runs past its reservation"),
            ));
        }
        let overlaps = self
            .mappings
            .range(..end)
            .next_back()
            .is_some_and(|(s, m)| s.saturating_add(m.size) > address.0);
        if overlaps {
            return Err(invalid(op, format!("{address} is already mapped")));
        }
        self.mappings.insert(
            address.0,
            Mapping {
                size,
                allocation: id,
                access: vec![Access::None; self.devices.len()],
            },
        );
        if let Some(a) = self.allocations.get_mut(&id) {
            a.mappings += 1;
        }
        Ok(())
    }

    /// Mapping starts covering `[start, end)` exactly and contiguously, or an error.
    fn whole_mappings(
        &self,
        op: Operation,
        start: u64,
        end: u64,
    ) -> Result<Vec<u64>, BackendError> {
        let mut cursor = start;
        let mut out = Vec::new();
        if let Some((s, m)) = self.mappings.range(..start).next_back() {
            if s.saturating_add(m.size) > start {
                return Err(invalid(op, "range starts inside a mapping"));
            }
        }
        for (&s, m) in self.mappings.range(start..end) {
            if s != cursor {
                return Err(invalid(op, format!("{:#x} is not mapped", cursor)));
            }
            let e = s.saturating_add(m.size);
            if e > end {
                return Err(invalid(op, "range ends inside a mapping"));
            }
            out.push(s);
            cursor = e;
        }
        if cursor != end {
            return Err(invalid(op, format!("{cursor:#x} is not mapped")));
        }
        Ok(out)
    }

    pub(crate) fn set_access(
        &mut self,
        address: DeviceAddress,
        size: u64,
        access: &[AccessDescriptor],
    ) -> Result<(), BackendError> {
        let op = Operation::SetAccess;
        if size == 0 || access.is_empty() {
            return Err(invalid(op, "empty range or access list"));
        }
        for d in access {
            self.device(op, d.device)?;
        }
        let end = end_of(op, address.0, size)?;
        let starts = self.whole_mappings(op, address.0, end)?;
        for s in starts {
            if let Some(m) = self.mappings.get_mut(&s) {
                for d in access {
                    if let Some(slot) = m.access.get_mut(d.device.0 as usize) {
                        *slot = d.access;
                    }
                }
            }
        }
        Ok(())
    }

    /// Unmaps; returns the number of mappings removed.
    pub(crate) fn unmap(&mut self, address: DeviceAddress, size: u64) -> Result<u64, BackendError> {
        let op = Operation::Unmap;
        if size == 0 {
            return Err(invalid(op, "size 0"));
        }
        let end = end_of(op, address.0, size)?;
        if let Some((s, m)) = self.mappings.range(..address.0).next_back() {
            if s.saturating_add(m.size) > address.0 {
                return Err(invalid(op, "unmap of part of a mapping"));
            }
        }
        let starts: Vec<(u64, u64)> = self
            .mappings
            .range(address.0..end)
            .map(|(s, m)| (*s, m.size))
            .collect();
        if starts.iter().any(|(s, sz)| s.saturating_add(*sz) > end) {
            return Err(invalid(op, "unmap of part of a mapping"));
        }
        if starts.is_empty() && self.quirks.report_double_unmap {
            return Err(invalid(op, "nothing mapped (quirk: double unmap reported)"));
        }
        if starts.len() > 1 && self.quirks.multi_unmap_breaks_free {
            if let Some((rs, _)) = self.reservation_containing(address.0) {
                if let Some(r) = self.reservations.get_mut(&rs) {
                    r.broken_by_multi_unmap = true;
                }
            }
        }
        for (s, _) in &starts {
            if let Some(m) = self.mappings.remove(s) {
                if let Some(a) = self.allocations.get_mut(&m.allocation) {
                    a.mappings = a.mappings.saturating_sub(1);
                }
                self.maybe_free_allocation(m.allocation);
            }
        }
        Ok(starts.len() as u64)
    }

    // ---- copies ----

    /// Splits `[start, start + len)` into (allocation, offset in allocation, length) pieces,
    /// checking that every byte is mapped with the needed access.
    fn pieces(
        &self,
        op: Operation,
        start: u64,
        len: u64,
        write: bool,
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
            let access = m
                .access
                .get(a.device.0 as usize)
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
                        "{cursor:#x} has access {access:?} for {}, {} needed",
                        a.device,
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
        let mut consumed = 0usize;
        for (alloc, offset, len) in pieces {
            let len = len as usize;
            if let Some(a) = self.allocations.get_mut(&alloc) {
                write_bytes(&mut a.data, offset, &src[consumed..consumed + len]);
            }
            consumed += len;
        }
        Ok(())
    }

    pub(crate) fn copy_from_device(
        &self,
        dst: &mut [u8],
        src: DeviceAddress,
    ) -> Result<(), BackendError> {
        let pieces = self.pieces(Operation::CopyFromDevice, src.0, dst.len() as u64, false)?;
        let mut filled = 0usize;
        for (alloc, offset, len) in pieces {
            let len = len as usize;
            if let Some(a) = self.allocations.get(&alloc) {
                read_bytes(&a.data, offset, &mut dst[filled..filled + len]);
            }
            filled += len;
        }
        Ok(())
    }

    // ---- export / import ----

    pub(crate) fn export(&mut self, handle: PhysicalHandle) -> Result<OwnedFd, BackendError> {
        let op = Operation::Export;
        let id = self.allocation_of(op, handle)?;
        let a = self
            .allocations
            .get_mut(&id)
            .ok_or_else(|| invalid(op, "handle without allocation"))?;
        if a.handle_type != ShareableHandleType::PosixFd {
            return Err(invalid(
                op,
                "handle was not created exportable as a POSIX fd",
            ));
        }
        let io = |e: std::io::Error| sim_error(op, ErrorKind::Other, e.to_string());
        let (exported, _peer) = UnixStream::pair().map_err(io)?;
        let fd: OwnedFd = exported.into();
        let keep = fd.try_clone().map_err(io)?;
        let ino = File::from(keep.try_clone().map_err(io)?)
            .metadata()
            .map_err(io)?
            .ino();
        a.exports.push((ino, keep));
        Ok(fd)
    }

    pub(crate) fn import(&mut self, fd: BorrowedFd<'_>) -> Result<PhysicalHandle, BackendError> {
        let op = Operation::Import;
        let io = |e: std::io::Error| invalid(op, e.to_string());
        let ino = File::from(fd.try_clone_to_owned().map_err(io)?)
            .metadata()
            .map_err(io)?
            .ino();
        let id = self
            .allocations
            .iter()
            .find(|(_, a)| a.exports.iter().any(|(i, _)| *i == ino))
            .map(|(id, _)| *id)
            .ok_or_else(|| invalid(op, "descriptor was not exported by this driver"))?;
        if let Some(a) = self.allocations.get_mut(&id) {
            a.handles += 1;
        }
        Ok(self.new_handle(id))
    }

    // ---- ledger ----

    pub(crate) fn ledger(&self) -> Ledger {
        let mut handles: Vec<LedgerHandle> = self
            .handles
            .iter()
            .filter_map(|(h, id)| {
                self.allocations.get(id).map(|a| LedgerHandle {
                    handle: PhysicalHandle(*h),
                    allocation: *id,
                    size: a.size,
                    device: a.device,
                })
            })
            .collect();
        handles.sort_by_key(|h| h.handle);
        let mut allocations: Vec<LedgerAllocation> = self
            .allocations
            .iter()
            .map(|(id, a)| LedgerAllocation {
                id: *id,
                device: a.device,
                size: a.size,
                handles: a.handles,
                mappings: a.mappings,
            })
            .collect();
        allocations.sort_by_key(|a| a.id);
        Ledger {
            reservations: self
                .reservations
                .iter()
                .map(|(a, r)| LedgerReservation {
                    address: DeviceAddress(*a),
                    size: r.size,
                })
                .collect(),
            handles,
            allocations,
            mappings: self
                .mappings
                .iter()
                .map(|(a, m)| LedgerMapping {
                    address: DeviceAddress(*a),
                    size: m.size,
                    allocation: m.allocation,
                    access: m
                        .access
                        .iter()
                        .enumerate()
                        .filter(|(_, acc)| **acc != Access::None)
                        .map(|(i, acc)| AccessDescriptor {
                            device: DeviceId(u32::try_from(i).unwrap_or(u32::MAX)),
                            access: *acc,
                        })
                        .collect(),
                })
                .collect(),
            physical_bytes: self.used.clone(),
        }
    }
}

fn align_up(v: u64, align: u64) -> Option<u64> {
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
    fn chunked_bytes_roundtrip_across_chunk_boundaries() {
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

    #[test]
    fn align_up_checks_overflow() {
        assert_eq!(align_up(5, 4), Some(8));
        assert_eq!(align_up(8, 4), Some(8));
        assert_eq!(align_up(u64::MAX, 4), None);
    }
}
