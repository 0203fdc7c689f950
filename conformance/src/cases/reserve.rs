//! Address space: reserve (alignment, fixed hints, huge ranges, bad sizes) and free.

use kvvm_hal::ErrorKind;

use crate::case::{ensure, expect_kind, fail, Outcome, Verdict};
use crate::ctx::Ctx;

pub(crate) fn reserve_and_free(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let va = ctx.backend.reserve(4 * g, 0, None)?;
    ensure(va.0 != 0, "reserve returned address 0")?;
    ensure(va.0 % g == 0, format!("{va} is not granule-aligned"))?;
    ctx.backend.free(va, 4 * g)?;
    Ok(())
}

pub(crate) fn reserve_honours_alignment(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let align = g * 8;
    let va = ctx.backend.reserve(g, align, None)?;
    let aligned = va.0 % align == 0;
    ctx.backend.free(va, g)?;
    ensure(aligned, format!("{va} is not aligned to {align}"))
}

/// Fresh free addresses the hint case tries before it fails: another thread of the process
/// (a test harness's, a host backend's neighbour) may map into a range the case has just
/// freed before the case reserves it again, so one address not honoured is not yet a backend
/// that ignores hints; every one of them not honoured is.
const HINT_ATTEMPTS: usize = 4;

pub(crate) fn reserve_fixed_address_hint(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let size = 16 * g;
    let mut missed = Vec::with_capacity(HINT_ATTEMPTS);
    for _ in 0..HINT_ATTEMPTS {
        let va = ctx.backend.reserve(size, 0, None)?;
        ctx.backend.free(va, size)?;
        let again = ctx.backend.reserve(size, 0, Some(va))?;
        ctx.backend.free(again, size)?;
        if again == va {
            return Ok(());
        }
        missed.push(format!("asked for the free address {va}, got {again}"));
    }
    Err(fail(missed.join("; ")))
}

pub(crate) fn reserve_64_tib_uses_no_memory(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn reserve_beyond_address_space_is_out_of_memory(ctx: &Ctx<'_>) -> Outcome {
    let size = 1u64 << 48;
    let r = ctx.backend.reserve(size, 0, None);
    if let Ok(va) = &r {
        let _ = ctx.backend.free(*va, size);
    }
    expect_kind(r, ErrorKind::OutOfMemory, "reserve of 2^48 bytes")
}

pub(crate) fn reserve_unaligned_size_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let size = ctx.granule + ctx.granule / 2;
    let r = ctx.backend.reserve(size, 0, None);
    if let Ok(va) = &r {
        let _ = ctx.backend.free(*va, size);
    }
    expect_kind(r, ErrorKind::InvalidValue, "reserve of 1.5 granules")
}

pub(crate) fn free_twice_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx.granule;
    let va = ctx.backend.reserve(2 * g, 0, None)?;
    ctx.backend.free(va, 2 * g)?;
    expect_kind(
        ctx.backend.free(va, 2 * g),
        ErrorKind::InvalidValue,
        "second free",
    )
}

pub(crate) fn free_with_live_mapping_is_invalid(ctx: &Ctx<'_>) -> Outcome {
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
