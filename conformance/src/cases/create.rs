//! Physical handles: create and release, bad sizes, and running the device out of memory.

use kvvm_hal::{AllocationProperties, ErrorKind};

use crate::case::{ensure, expect_kind, fail, pattern, read_back, Outcome};
use crate::ctx::Ctx;

pub(crate) fn create_and_release(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn create_unaligned_size_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    let r = ctx
        .backend
        .create(ctx.granule + 1, &AllocationProperties::device(ctx.device));
    if let Ok(h) = &r {
        let _ = ctx.backend.release(*h);
    }
    expect_kind(r, ErrorKind::InvalidValue, "create of granule+1 bytes")
}

pub(crate) fn release_twice_is_invalid(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn out_of_memory_when_full_then_recovers(ctx: &Ctx<'_>) -> Outcome {
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
