//! The cases. Each is written once over `&dyn VirtualMemoryBackend`.

use std::fmt::Display;

use kvvm_hal::{
    AllocationProperties, BackendError, BackendResult, DeviceAddress, ErrorKind, KernelProbeOp,
    ShareableHandleType,
};

use crate::child::{ChildVerdict, CHILD_KERNEL_STORE};
use crate::scratch::Scratch;
use crate::Ctx;

/// Why a case did not pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The backend misbehaved.
    Fail(String),
    /// The case cannot run here.
    Skip(String),
}

impl From<BackendError> for Verdict {
    fn from(e: BackendError) -> Self {
        Verdict::Fail(format!("unexpected error: {e}"))
    }
}

/// What a case returns.
pub type Outcome = Result<(), Verdict>;

/// One named case of the suite.
#[derive(Clone, Copy)]
pub struct Case {
    /// Stable name (used in reports and `--case` filters).
    pub name: &'static str,
    /// What it checks.
    pub description: &'static str,
    pub(crate) run: fn(&Ctx<'_>) -> Outcome,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Case").field("name", &self.name).finish()
    }
}

fn fail(msg: impl Display) -> Verdict {
    Verdict::Fail(msg.to_string())
}

fn ensure(cond: bool, msg: impl Display) -> Outcome {
    if cond {
        Ok(())
    } else {
        Err(fail(msg))
    }
}

fn expect_kind<T>(r: BackendResult<T>, kind: ErrorKind, what: &str) -> Outcome {
    match r {
        Ok(_) => Err(fail(format!("{what}: succeeded, expected {kind}"))),
        Err(e) if e.kind == kind => Ok(()),
        Err(e) => Err(fail(format!("{what}: got {e}, expected {kind}"))),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
        .collect()
}

fn read_back(ctx: &Ctx<'_>, at: DeviceAddress, len: usize) -> BackendResult<Vec<u8>> {
    let mut v = vec![0u8; len];
    ctx.backend.copy_from_device(&mut v, at)?;
    Ok(v)
}

fn at(va: DeviceAddress, off: u64) -> Result<DeviceAddress, Verdict> {
    va.checked_add(off)
        .ok_or_else(|| fail("address arithmetic overflowed"))
}

const SAMPLE: usize = 4096;

macro_rules! case {
    ($f:ident, $d:expr) => {
        Case {
            name: stringify!($f),
            description: $d,
            run: $f,
        }
    };
}

/// Every case of the suite, in order.
pub fn all_cases() -> Vec<Case> {
    vec![
        case!(
            devices_are_listed,
            "at least one device, with a name and memory"
        ),
        case!(
            granularity_is_sane,
            "minimum > 0, a power of two, recommended a multiple of it"
        ),
        case!(
            granularity_posix_fd,
            "exportable allocations report a granularity too"
        ),
        case!(reserve_and_free, "reserve then free a range"),
        case!(
            reserve_honours_alignment,
            "a reservation is aligned as asked"
        ),
        case!(
            reserve_fixed_address_hint,
            "a free fixed address is honoured"
        ),
        case!(
            reserve_64_tib_uses_no_memory,
            "a 64 TiB reservation takes no physical memory"
        ),
        case!(
            reserve_beyond_address_space_is_out_of_memory,
            "2^48 bytes: OutOfMemory"
        ),
        case!(
            reserve_unaligned_size_is_invalid,
            "size not a granule multiple: InvalidValue"
        ),
        case!(
            free_twice_is_invalid,
            "second free of a range: InvalidValue"
        ),
        case!(
            free_with_live_mapping_is_invalid,
            "free fails while mapped, succeeds after unmap"
        ),
        case!(create_and_release, "create then release a handle"),
        case!(
            create_unaligned_size_is_invalid,
            "create of granule+1 bytes: InvalidValue"
        ),
        case!(
            release_twice_is_invalid,
            "second release of a handle: InvalidValue"
        ),
        case!(
            map_unaligned_address_is_invalid,
            "map of a whole handle at a VA not granule-aligned: InvalidValue"
        ),
        case!(
            map_half_granule_not_supported,
            "map of granule/2 bytes: NotSupported"
        ),
        case!(
            map_part_of_handle_not_supported,
            "map of one granule of a 2-granule handle: NotSupported"
        ),
        case!(
            map_unreserved_address_is_invalid,
            "map of a whole handle at a VA not reserved: InvalidValue"
        ),
        case!(
            map_over_mapping_is_invalid,
            "map of a whole handle over a mapped VA: InvalidValue"
        ),
        case!(
            map_multi_granule_handle,
            "one handle of several granules maps and holds data"
        ),
        case!(
            unmap_part_of_mapping_is_invalid,
            "unmap of half a mapping: InvalidValue"
        ),
        case!(
            unmap_twice_is_not_reported,
            "unmap of a range with no mapping succeeds"
        ),
        case!(
            unmap_spanning_mappings,
            "one unmap over several adjacent mappings"
        ),
        case!(
            copy_before_set_access_is_invalid,
            "copy before any set access: InvalidValue, device usable"
        ),
        case!(
            write_read_roundtrip,
            "bytes written read back, at both ends of a granule"
        ),
        case!(
            set_access_spans_adjacent_mappings,
            "one set access over k mappings; copies cross them"
        ),
        case!(
            read_alias_reads_data,
            "a Read alias of a handle reads what the RW mapping wrote"
        ),
        case!(
            read_alias_refuses_writes,
            "a write through a Read alias fails; device usable"
        ),
        case!(
            read_alias_outlives_owner_mapping,
            "the alias keeps reading after the owner unmaps"
        ),
        case!(
            release_while_mapped_defers_free,
            "a released mapped handle keeps its data until unmap"
        ),
        case!(
            remap_keeps_data,
            "a handle unmapped and mapped elsewhere keeps its bytes"
        ),
        case!(
            out_of_memory_when_full_then_recovers,
            "create until OutOfMemory, then the device works"
        ),
        case!(
            set_access_on_unmapped_range_is_invalid,
            "set access over an unmapped range: InvalidValue"
        ),
        case!(
            copy_from_unmapped_is_invalid,
            "a copy from an unmapped VA: InvalidValue"
        ),
        case!(
            export_import_posix_fd,
            "export as a POSIX fd, import, map, read"
        ),
        case!(
            synchronize_idle_device,
            "synchronize succeeds on an idle device"
        ),
        case!(
            threads_share_backend,
            "4 threads commit, copy and release concurrently"
        ),
        case!(
            many_cycles_leave_nothing,
            "2000 reserve/create/map/unmap/release/free cycles leak nothing"
        ),
        case!(
            kernel_load_through_read_alias,
            "a kernel load through a Read alias reads the data"
        ),
        case!(
            kernel_store_through_read_alias_faults,
            "a kernel store through a Read alias faults (child process)"
        ),
    ]
}

// ---------------------------------------------------------------- devices, granularity

fn devices_are_listed(ctx: &Ctx<'_>) -> Outcome {
    let devices = ctx.backend.devices()?;
    ensure(!devices.is_empty(), "no device listed")?;
    for (i, d) in devices.iter().enumerate() {
        ensure(d.id.0 as usize == i, format!("device {i} has id {}", d.id))?;
        ensure(!d.name.is_empty(), format!("device {i} has no name"))?;
        ensure(d.total_memory > 0, format!("device {i} reports no memory"))?;
        ensure(d.vmm_supported, format!("device {i} does not support VMM"))?;
    }
    let info = ctx.backend.memory_info(ctx.device)?;
    ensure(
        info.free <= info.total && info.total > 0,
        format!("memory info {info:?} is inconsistent"),
    )
}

fn granularity_is_sane(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx
        .backend
        .granularity(&AllocationProperties::device(ctx.device))?;
    ensure(g.minimum > 0, "minimum granularity is 0")?;
    ensure(
        g.minimum.is_power_of_two(),
        format!("minimum {} is not a power of two", g.minimum),
    )?;
    ensure(
        g.recommended >= g.minimum && g.recommended % g.minimum == 0,
        format!(
            "recommended {} is not a multiple of minimum {}",
            g.recommended, g.minimum
        ),
    )
}

fn granularity_posix_fd(ctx: &Ctx<'_>) -> Outcome {
    ctx.require_posix_fd()?;
    let props = AllocationProperties {
        device: ctx.device,
        handle_type: ShareableHandleType::PosixFd,
    };
    let g = ctx.backend.granularity(&props)?;
    ensure(
        g.minimum > 0 && g.minimum.is_power_of_two(),
        format!(
            "exportable minimum granularity {} is not a power of two",
            g.minimum
        ),
    )
}

// ---------------------------------------------------------------- address space

fn reserve_and_free(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let va = ctx.backend.reserve(4 * g, 0, None)?;
    ensure(va.0 != 0, "reserve returned address 0")?;
    ensure(va.0 % g == 0, format!("{va} is not granule-aligned"))?;
    ctx.backend.free(va, 4 * g)?;
    Ok(())
}

fn reserve_honours_alignment(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let align = g * 8;
    let va = ctx.backend.reserve(g, align, None)?;
    let aligned = va.0 % align == 0;
    ctx.backend.free(va, g)?;
    ensure(aligned, format!("{va} is not aligned to {align}"))
}

fn reserve_fixed_address_hint(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let size = 16 * g;
    let va = ctx.backend.reserve(size, 0, None)?;
    ctx.backend.free(va, size)?;
    let again = ctx.backend.reserve(size, 0, Some(va))?;
    let same = again == va;
    ctx.backend.free(again, size)?;
    ensure(
        same,
        format!("asked for the free address {va}, got {again}"),
    )
}

fn reserve_64_tib_uses_no_memory(ctx: &Ctx<'_>) -> Outcome {
    let size = 1u64 << 46;
    if !size.is_multiple_of(ctx.granule) {
        return Err(Verdict::Skip(format!(
            "granule {} does not divide 64 TiB",
            ctx.granule
        )));
    }
    let before = ctx.backend.memory_info(ctx.device)?;
    let va = ctx.backend.reserve(size, 0, None)?;
    let during = ctx.backend.memory_info(ctx.device);
    ctx.backend.free(va, size)?;
    let during = during?;
    // Page tables may take a little; physical use of the range itself would take 64 TiB.
    let tolerance = 64 << 20;
    ensure(
        before.free.abs_diff(during.free) <= tolerance,
        format!(
            "free memory went from {} to {} bytes",
            before.free, during.free
        ),
    )
}

fn reserve_beyond_address_space_is_out_of_memory(ctx: &Ctx<'_>) -> Outcome {
    let size = 1u64 << 48;
    let r = ctx.backend.reserve(size, 0, None);
    if let Ok(va) = &r {
        let _ = ctx.backend.free(*va, size);
    }
    expect_kind(r, ErrorKind::OutOfMemory, "reserve of 2^48 bytes")
}

fn reserve_unaligned_size_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let size = ctx.granule + ctx.granule / 2;
    let r = ctx.backend.reserve(size, 0, None);
    if let Ok(va) = &r {
        let _ = ctx.backend.free(*va, size);
    }
    expect_kind(r, ErrorKind::InvalidValue, "reserve of 1.5 granules")
}

fn free_twice_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let va = ctx.backend.reserve(2 * g, 0, None)?;
    ctx.backend.free(va, 2 * g)?;
    expect_kind(
        ctx.backend.free(va, 2 * g),
        ErrorKind::InvalidValue,
        "second free",
    )
}

fn free_with_live_mapping_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(2 * g)?;
    let h = s.create(g)?;
    s.map(va, g, h)?;
    let r = ctx.backend.free(va, 2 * g);
    if r.is_ok() {
        // The range is gone; do not free it again.
        s.unmap(va, g)?;
        return Err(fail("free succeeded while a mapping was live"));
    }
    expect_kind(
        r,
        ErrorKind::InvalidValue,
        "free of a range with a live mapping",
    )?;
    s.unmap(va, g)?;
    s.free(va, 2 * g)?;
    s.release(h)?;
    Ok(())
}

// ---------------------------------------------------------------- physical handles

fn create_and_release(ctx: &Ctx<'_>) -> Outcome {
    let before = ctx.backend.memory_info(ctx.device)?;
    let h = ctx
        .backend
        .create(ctx.granule, &AllocationProperties::device(ctx.device))?;
    let during = ctx.backend.memory_info(ctx.device);
    ctx.backend.release(h)?;
    let during = during?;
    ensure(
        during.free < before.free,
        format!(
            "free memory did not drop after create ({} -> {})",
            before.free, during.free
        ),
    )
}

fn create_unaligned_size_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let r = ctx
        .backend
        .create(ctx.granule + 1, &AllocationProperties::device(ctx.device));
    if let Ok(h) = &r {
        let _ = ctx.backend.release(*h);
    }
    expect_kind(r, ErrorKind::InvalidValue, "create of granule+1 bytes")
}

fn release_twice_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let h = ctx
        .backend
        .create(ctx.granule, &AllocationProperties::device(ctx.device))?;
    ctx.backend.release(h)?;
    expect_kind(
        ctx.backend.release(h),
        ErrorKind::InvalidValue,
        "second release",
    )
}

// ---------------------------------------------------------------- map

fn map_unaligned_address_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(4 * g)?;
    let h = s.create(g)?;
    let off = if g >= 2 * 4096 { g / 2 } else { g / 2 + 1 };
    let target = at(va, off)?;
    let r = ctx.backend.map(target, g, h);
    if r.is_ok() {
        ctx.backend.unmap(target, g)?;
    }
    expect_kind(r, ErrorKind::InvalidValue, "map at a VA half a granule in")
}

fn map_half_granule_not_supported(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(2 * g)?;
    let h = s.create(g)?;
    let r = ctx.backend.map(va, g / 2, h);
    if r.is_ok() {
        ctx.backend.unmap(va, g / 2)?;
    }
    expect_kind(r, ErrorKind::NotSupported, "map of granule/2 bytes")
}

fn map_unreserved_address_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    // A range that was reserved and freed again is, for the moment, reserved by nobody.
    let gone = ctx.backend.reserve(4 * g, 0, None)?;
    ctx.backend.free(gone, 4 * g)?;
    let h = s.create(g)?;
    let r = ctx.backend.map(gone, g, h);
    if r.is_ok() {
        ctx.backend.unmap(gone, g)?;
    }
    expect_kind(r, ErrorKind::InvalidValue, "map at a freed VA")
}

fn map_over_mapping_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(2 * g)?;
    let h1 = s.create(g)?;
    let h2 = s.create(g)?;
    s.map(va, g, h1)?;
    let r = ctx.backend.map(va, g, h2);
    expect_kind(r, ErrorKind::InvalidValue, "map over a live mapping")?;
    // The first mapping is untouched: it still takes access and data.
    s.rw(va, g)?;
    let p = pattern(64, 9);
    ctx.backend.copy_to_device(va, &p)?;
    ensure(read_back(ctx, va, 64)? == p, "first mapping lost its data")
}

fn map_part_of_handle_not_supported(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(4 * g)?;
    let h = s.create(2 * g)?;
    let r = ctx.backend.map(va, g, h);
    if r.is_ok() {
        ctx.backend.unmap(va, g)?;
    }
    expect_kind(
        r,
        ErrorKind::NotSupported,
        "map of the first granule of a 2-granule handle",
    )?;
    // The whole handle maps at the same place.
    s.map(va, 2 * g, h)?;
    Ok(())
}

fn map_multi_granule_handle(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(8 * g)?;
    s.commit(va, 4 * g)?;
    let last = at(va, 4 * g - SAMPLE as u64)?;
    let p = pattern(SAMPLE, 3);
    ctx.backend.copy_to_device(last, &p)?;
    ensure(
        read_back(ctx, last, SAMPLE)? == p,
        "last bytes of a 4-granule handle differ",
    )
}

// ---------------------------------------------------------------- unmap

fn unmap_part_of_mapping_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(4 * g)?;
    let h = s.create(2 * g)?;
    s.map(va, 2 * g, h)?;
    let r = ctx.backend.unmap(va, g);
    if r.is_ok() {
        return Err(fail("unmap of half a mapping succeeded"));
    }
    expect_kind(r, ErrorKind::InvalidValue, "unmap of half a mapping")
}

fn unmap_twice_is_not_reported(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(2 * g)?;
    let h = s.create(g)?;
    s.map(va, g, h)?;
    s.unmap(va, g)?;
    match ctx.backend.unmap(va, g) {
        Ok(()) => Ok(()),
        Err(e) => Err(fail(format!(
            "second unmap reported {e}; drivers do not report it"
        ))),
    }
}

fn unmap_spanning_mappings(ctx: &Ctx<'_>) -> Outcome {
    if !ctx.backend.capabilities().unmap_spans_mappings {
        return Err(Verdict::Skip(
            "backend does not allow one unmap over several mappings".into(),
        ));
    }
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(4 * g)?;
    for i in 0..3 {
        let h = s.create(g)?;
        s.map(at(va, i * g)?, g, h)?;
    }
    s.unmap(va, 3 * g)?;
    // Every granule is free again: mapping anew at each offset succeeds.
    let h = s.create(3 * g)?;
    s.map(va, 3 * g, h)?;
    s.unmap(va, 3 * g)?;
    s.free(va, 4 * g)?;
    Ok(())
}

// ---------------------------------------------------------------- access and data

fn copy_before_set_access_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(g)?;
    let h = s.create(g)?;
    s.map(va, g, h)?;
    let p = pattern(64, 1);
    expect_kind(
        ctx.backend.copy_to_device(va, &p),
        ErrorKind::InvalidValue,
        "copy to a mapping with no access",
    )?;
    s.rw(va, g)?;
    ctx.backend.copy_to_device(va, &p)?;
    ensure(
        read_back(ctx, va, 64)? == p,
        "device not usable after the refused copy",
    )
}

fn write_read_roundtrip(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(2 * g)?;
    s.commit(va, g)?;
    let n = SAMPLE.min(g as usize);
    for (off, seed) in [(0, 11u8), (g - n as u64, 12u8)] {
        let p = pattern(n, seed);
        let a = at(va, off)?;
        ctx.backend.copy_to_device(a, &p)?;
        ensure(
            read_back(ctx, a, n)? == p,
            format!("bytes at +{off:#x} differ"),
        )?;
    }
    Ok(())
}

fn set_access_spans_adjacent_mappings(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let k = 4u64;
    let mut s = ctx.scratch();
    let va = s.reserve(k * g)?;
    for i in 0..k {
        let h = s.create(g)?;
        s.map(at(va, i * g)?, g, h)?;
    }
    s.rw(va, k * g)?;
    // A copy that crosses every boundary between mappings.
    let n = SAMPLE.min(g as usize);
    for i in 1..k {
        let a = at(va, i * g - (n / 2) as u64)?;
        let p = pattern(n, i as u8);
        ctx.backend.copy_to_device(a, &p)?;
        ensure(
            read_back(ctx, a, n)? == p,
            format!("copy across boundary {i} differs"),
        )?;
    }
    Ok(())
}

/// Maps one handle read-write at `rw` and read-only at `ro`; writes `p` through `rw`.
fn aliased<'a>(
    ctx: &'a Ctx<'a>,
) -> Result<
    (
        Scratch<'a>,
        DeviceAddress,
        DeviceAddress,
        kvvm_hal::PhysicalHandle,
    ),
    Verdict,
> {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let rw = s.reserve(g)?;
    let ro = s.reserve(g)?;
    let h = s.create(g)?;
    s.map(rw, g, h)?;
    s.rw(rw, g)?;
    s.map(ro, g, h)?;
    s.ro(ro, g)?;
    Ok((s, rw, ro, h))
}

fn read_alias_reads_data(ctx: &Ctx<'_>) -> Outcome {
    let (_s, rw, ro, _) = aliased(ctx)?;
    let n = SAMPLE.min(ctx.granule as usize);
    let p = pattern(n, 21);
    ctx.backend.copy_to_device(rw, &p)?;
    ensure(
        read_back(ctx, ro, n)? == p,
        "the Read alias does not see the written bytes",
    )
}

fn read_alias_refuses_writes(ctx: &Ctx<'_>) -> Outcome {
    let (_s, rw, ro, _) = aliased(ctx)?;
    let p = pattern(64, 22);
    ctx.backend.copy_to_device(rw, &p)?;
    expect_kind(
        ctx.backend.copy_to_device(ro, &pattern(64, 99)),
        ErrorKind::InvalidValue,
        "write through the Read alias",
    )?;
    ensure(
        read_back(ctx, rw, 64)? == p,
        "the refused write changed the data, or the device is unusable",
    )
}

fn read_alias_outlives_owner_mapping(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let (mut s, rw, ro, _) = aliased(ctx)?;
    let p = pattern(64, 23);
    ctx.backend.copy_to_device(rw, &p)?;
    s.unmap(rw, g)?;
    ensure(
        read_back(ctx, ro, 64)? == p,
        "the alias lost the data when the owner unmapped",
    )
}

fn release_while_mapped_defers_free(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(g)?;
    let h = s.commit(va, g)?;
    let p = pattern(SAMPLE.min(g as usize), 24);
    ctx.backend.copy_to_device(va, &p)?;
    let before = ctx.backend.memory_info(ctx.device)?;
    s.release(h)?;
    let after_release = ctx.backend.memory_info(ctx.device)?;
    ensure(
        read_back(ctx, va, p.len())? == p,
        "data lost when the mapped handle was released",
    )?;
    ensure(
        after_release.free <= before.free,
        "memory was freed while the handle was still mapped",
    )?;
    s.unmap(va, g)?;
    let after_unmap = ctx.backend.memory_info(ctx.device)?;
    ensure(
        after_unmap.free > after_release.free,
        "memory was not freed by the last unmap",
    )
}

fn remap_keeps_data(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let a = s.reserve(g)?;
    let b = s.reserve(2 * g)?;
    let h = s.commit(a, g)?;
    let p = pattern(SAMPLE.min(g as usize), 25);
    ctx.backend.copy_to_device(a, &p)?;
    s.unmap(a, g)?;
    let b1 = at(b, g)?;
    s.map(b1, g, h)?;
    s.rw(b1, g)?;
    ensure(
        read_back(ctx, b1, p.len())? == p,
        "bytes changed across unmap and remap",
    )
}

fn out_of_memory_when_full_then_recovers(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let info = ctx.backend.memory_info(ctx.device)?;
    let big = (info.total / 64 / g).max(1) * g;
    let mut handles = Vec::new();
    let mut oom = None;
    let limit = info.total / g + 64;
    let mut size = big;
    while (handles.len() as u64) < limit {
        match ctx
            .backend
            .create(size, &AllocationProperties::device(ctx.device))
        {
            Ok(h) => handles.push(h),
            Err(e) if e.kind == ErrorKind::OutOfMemory && size > g => size = g,
            Err(e) => {
                oom = Some(e);
                break;
            }
        }
    }
    let mut release_error = None;
    for h in handles.drain(..).rev() {
        if let Err(e) = ctx.backend.release(h) {
            release_error.get_or_insert(e);
        }
    }
    if let Some(e) = release_error {
        return Err(fail(format!("release after filling failed: {e}")));
    }
    match oom {
        None => return Err(fail("the device never reported OutOfMemory")),
        Some(e) if e.kind != ErrorKind::OutOfMemory => {
            return Err(fail(format!("filling the device ended with {e}")))
        }
        Some(_) => {}
    }
    // The device still works.
    let mut s = ctx.scratch();
    let va = s.reserve(g)?;
    s.commit(va, g)?;
    let p = pattern(64, 26);
    ctx.backend.copy_to_device(va, &p)?;
    ensure(
        read_back(ctx, va, 64)? == p,
        "device unusable after OutOfMemory",
    )
}

fn set_access_on_unmapped_range_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(2 * g)?;
    expect_kind(
        s.rw(va, g),
        ErrorKind::InvalidValue,
        "set access on an unmapped range",
    )
}

fn copy_from_unmapped_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(2 * g)?;
    s.commit(va, g)?;
    let mut buf = vec![0u8; 64];
    expect_kind(
        ctx.backend.copy_from_device(&mut buf, at(va, g)?),
        ErrorKind::InvalidValue,
        "copy from the unmapped second granule",
    )
}

fn export_import_posix_fd(ctx: &Ctx<'_>) -> Outcome {
    ctx.require_posix_fd()?;
    let props = AllocationProperties {
        device: ctx.device,
        handle_type: ShareableHandleType::PosixFd,
    };
    let g = ctx.backend.granularity(&props)?.minimum.max(ctx.granule);
    let mut s = ctx.scratch();
    let a = s.reserve(g)?;
    let b = s.reserve(g)?;
    let h = s.create_with(g, &props)?;
    s.map(a, g, h)?;
    s.rw(a, g)?;
    let p = pattern(SAMPLE.min(g as usize), 27);
    ctx.backend.copy_to_device(a, &p)?;
    let fd = ctx.backend.export_posix_fd(h)?;
    let imported = ctx.backend.import_posix_fd(std::os::fd::AsFd::as_fd(&fd))?;
    s.track_handle(imported);
    s.map(b, g, imported)?;
    s.ro(b, g)?;
    ensure(
        read_back(ctx, b, p.len())? == p,
        "the imported handle does not show the exported bytes",
    )
}

fn synchronize_idle_device(ctx: &Ctx<'_>) -> Outcome {
    ctx.backend.synchronize(ctx.device)?;
    Ok(())
}

fn threads_share_backend(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let results: Vec<Outcome> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4u8)
            .map(|t| {
                scope.spawn(move || -> Outcome {
                    for i in 0..25u8 {
                        let mut s = ctx.scratch();
                        let va = s.reserve(2 * g)?;
                        s.commit(va, g)?;
                        let p = pattern(256, t.wrapping_mul(64).wrapping_add(i));
                        ctx.backend.copy_to_device(va, &p)?;
                        ensure(
                            read_back(ctx, va, 256)? == p,
                            format!("thread {t} iteration {i} read other bytes"),
                        )?;
                        s.finish()?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(fail("a worker thread panicked")))
            })
            .collect()
    });
    results.into_iter().collect()
}

fn many_cycles_leave_nothing(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let before = ctx.backend.memory_info(ctx.device)?;
    for i in 0..2000u32 {
        let mut s = ctx.scratch();
        let va = s.reserve(2 * g)?;
        let h = s.create(g)?;
        s.map(at(va, u64::from(i % 2) * g)?, g, h)?;
        s.finish()
            .map_err(|e| fail(format!("cycle {i}: teardown failed: {e}")))?;
    }
    let after = ctx.backend.memory_info(ctx.device)?;
    let tolerance = 4 * g;
    ensure(
        after.free + tolerance >= before.free,
        format!(
            "free memory dropped from {} to {} bytes over 2000 cycles",
            before.free, after.free
        ),
    )
}

// ---------------------------------------------------------------- kernels

fn kernel_load_through_read_alias(ctx: &Ctx<'_>) -> Outcome {
    let probe = ctx.require_kernels()?;
    let (_s, rw, ro, _) = aliased(ctx)?;
    let p = pattern(SAMPLE.min(ctx.granule as usize), 28);
    ctx.backend.copy_to_device(rw, &p)?;
    let expected: u64 = p.iter().map(|b| u64::from(*b)).sum();
    let sum = probe.run(ctx.device, KernelProbeOp::Load, ro, p.len() as u64, 0)?;
    ensure(
        sum == expected,
        format!("kernel load through the Read alias summed {sum}, expected {expected}"),
    )
}

/// The body that runs in the child process: returns whether the store faulted.
pub(crate) fn kernel_store_child(ctx: &Ctx<'_>) -> ChildVerdict {
    let probe = match ctx.backend.kernel_probe() {
        Some(p) => p,
        None => return ChildVerdict::Error("backend has no kernel probe".into()),
    };
    let setup = || -> Result<_, Verdict> {
        let (s, rw, ro, _) = aliased(ctx)?;
        let p = pattern(256, 29);
        ctx.backend.copy_to_device(rw, &p)?;
        // Loads through the alias see the owner's bytes before the store is tried.
        let expected: u64 = p.iter().map(|b| u64::from(*b)).sum();
        let sum = probe.run(ctx.device, KernelProbeOp::Load, ro, 256, 0)?;
        ensure(
            sum == expected,
            format!("load through the alias summed {sum}, expected {expected}"),
        )?;
        Ok((s, ro))
    };
    let (s, ro) = match setup() {
        Ok(v) => v,
        Err(Verdict::Fail(m) | Verdict::Skip(m)) => return ChildVerdict::Error(m),
    };
    crate::child::arm();
    let verdict = match probe.run(ctx.device, KernelProbeOp::Store, ro, 256, 0xAB) {
        Ok(_) => ChildVerdict::NoFault,
        Err(e) if e.kind == ErrorKind::DeviceLost => ChildVerdict::Fault(e.to_string()),
        Err(e) => ChildVerdict::Error(format!("store kernel failed unexpectedly: {e}")),
    };
    // After a fault the context is unusable; the process exits without tearing down.
    std::mem::forget(s);
    verdict
}

fn kernel_store_through_read_alias_faults(ctx: &Ctx<'_>) -> Outcome {
    ctx.require_kernels()?;
    let runner = ctx.child.ok_or_else(|| {
        Verdict::Skip("no child-process runner (run it through `kvvm conformance`)".into())
    })?;
    match runner.run(ctx.backend.name(), CHILD_KERNEL_STORE) {
        Ok(ChildVerdict::Fault(msg)) => {
            let _ = msg;
            Ok(())
        }
        Ok(ChildVerdict::NoFault) => Err(fail(
            "a kernel store through the Read alias completed without a fault",
        )),
        Ok(ChildVerdict::Error(m)) => Err(fail(format!("child process: {m}"))),
        Err(m) => Err(fail(format!("child process: {m}"))),
    }
}
