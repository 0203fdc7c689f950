//! Access and data: set access, copies in and out, synchronize.

use kvvm_hal::ErrorKind;

use crate::case::{at, ensure, expect_kind, pattern, read_back, Outcome, SAMPLE};
use crate::ctx::Ctx;

pub(crate) fn copy_before_set_access_is_invalid(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn write_read_roundtrip(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn set_access_spans_adjacent_mappings(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn set_access_on_unmapped_range_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(2 * g)?;
    expect_kind(
        s.rw(va, g),
        ErrorKind::InvalidValue,
        "set access on an unmapped range",
    )
}

pub(crate) fn copy_from_unmapped_is_invalid(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn synchronize_idle_device(ctx: &Ctx<'_>) -> Outcome {
    ctx.backend.synchronize(ctx.device)?;
    Ok(())
}
