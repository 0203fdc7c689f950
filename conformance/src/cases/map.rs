//! Map: what a map accepts (whole handles at reserved, granule-aligned, unmapped addresses) and refuses; a handle keeps its data across remaps.

use kvvm_hal::ErrorKind;

use crate::case::{at, ensure, expect_kind, pattern, read_back, Outcome, SAMPLE};
use crate::ctx::Ctx;

pub(crate) fn map_unaligned_address_is_invalid(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn map_half_granule_not_supported(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn map_unreserved_address_is_invalid(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn map_over_mapping_is_invalid(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn map_part_of_handle_not_supported(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn map_multi_granule_handle(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn remap_keeps_data(ctx: &Ctx<'_>) -> Outcome {
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
