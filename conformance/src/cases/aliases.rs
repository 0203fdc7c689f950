//! Aliases: one handle mapped read-write and read-only at two addresses.

use kvvm_hal::{DeviceAddress, ErrorKind};

use crate::case::{ensure, expect_kind, pattern, read_back, Outcome, Verdict, SAMPLE};
use crate::ctx::Ctx;
use crate::scratch::Scratch;

/// Maps one handle read-write at `rw` and read-only at `ro`; writes `p` through `rw`.
pub(crate) fn aliased<'a>(
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

pub(crate) fn read_alias_reads_data(ctx: &Ctx<'_>) -> Outcome {
    let (_s, rw, ro, _) = aliased(ctx)?;
    let n = SAMPLE.min(ctx.granule as usize);
    let p = pattern(n, 21);
    ctx.backend.copy_to_device(rw, &p)?;
    ensure(
        read_back(ctx, ro, n)? == p,
        "the Read alias does not see the written bytes",
    )
}

pub(crate) fn read_alias_refuses_writes(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn read_alias_outlives_owner_mapping(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn release_while_mapped_defers_free(ctx: &Ctx<'_>) -> Outcome {
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
