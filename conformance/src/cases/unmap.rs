//! Unmap: partial unmaps, unmapping nothing, one unmap over several mappings.

use kvvm_hal::ErrorKind;

use crate::case::{at, expect_kind, fail, Outcome, Verdict};
use crate::ctx::Ctx;

pub(crate) fn unmap_part_of_mapping_is_invalid(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn unmap_twice_is_not_reported(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn unmap_spanning_mappings(ctx: &Ctx<'_>) -> Outcome {
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
