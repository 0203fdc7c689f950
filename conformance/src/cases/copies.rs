//! Row copies: a strided device-to-device copy queued on the default stream lands row by row,
//! also when the rows lie in separate mappings with unmapped address space between them (what
//! a decode step's store into a batch of KV caches is); an ill-formed one is refused.

use kvvm_hal::{ErrorKind, RowCopy, StreamHandle};

use crate::case::{at, ensure, expect_kind, pattern, read_back, Outcome, Verdict};
use crate::ctx::Ctx;

/// Rows of the copies below, and their width.
const ROWS: u64 = 8;
const WIDTH: u64 = 96;

/// Skips the case, before anything is allocated, when the backend cannot copy rows (an empty
/// copy is answered `NotSupported` there and `Ok` everywhere else).
fn require_row_copies(ctx: &Ctx<'_>) -> Outcome {
    let empty = RowCopy {
        dst: kvvm_hal::DeviceAddress(0),
        dst_pitch: 0,
        src: kvvm_hal::DeviceAddress(0),
        src_pitch: 0,
        width: 0,
        rows: 0,
    };
    match ctx.backend.copy_rows_async(&empty, StreamHandle(0)) {
        Err(e) if e.kind == ErrorKind::NotSupported => Err(Verdict::Skip(format!(
            "backend {} cannot copy rows on a stream",
            ctx.backend.name()
        ))),
        r => Ok(r?),
    }
}

pub(crate) fn copy_rows_strided(ctx: &Ctx<'_>) -> Outcome {
    require_row_copies(ctx)?;
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(2 * g)?;
    s.commit(va, 2 * g)?;
    // Source: ROWS rows packed WIDTH bytes apart in the first granule; destination: one row
    // every g / ROWS bytes of the second one (a pitch far larger than the width).
    let src = va;
    let dst = at(va, g)?;
    let dst_pitch = g / ROWS;
    let data = pattern((ROWS * WIDTH) as usize, 7);
    ctx.backend.copy_to_device(src, &data)?;
    ctx.backend.copy_to_device(dst, &vec![0u8; g as usize])?;
    let copy = RowCopy {
        dst,
        dst_pitch,
        src,
        src_pitch: WIDTH,
        width: WIDTH,
        rows: ROWS,
    };
    ctx.backend.copy_rows_async(&copy, StreamHandle(0))?;
    ctx.backend.synchronize(ctx.device)?;
    for row in 0..ROWS {
        let got = read_back(ctx, at(dst, row * dst_pitch)?, (WIDTH + 8) as usize)?;
        let want = &data[(row * WIDTH) as usize..((row + 1) * WIDTH) as usize];
        ensure(&got[..WIDTH as usize] == want, format!("row {row} differs"))?;
        ensure(
            got[WIDTH as usize..].iter().all(|&b| b == 0),
            format!("bytes after row {row} were written"),
        )?;
    }
    Ok(())
}

pub(crate) fn copy_rows_across_unmapped_gaps(ctx: &Ctx<'_>) -> Outcome {
    require_row_copies(ctx)?;
    let g = ctx.granule;
    let mut s = ctx.scratch();
    // Granule 0 holds the source; rows go to granules 1, 3 and 5, each its own mapping, with
    // granules 2 and 4 reserved but unmapped: the span of the copy is not one mapped range.
    let va = s.reserve(6 * g)?;
    for i in [0, 1, 3, 5] {
        s.commit(at(va, i * g)?, g)?;
    }
    let rows = 3;
    let data = pattern((rows * WIDTH) as usize, 11);
    ctx.backend.copy_to_device(va, &data)?;
    let copy = RowCopy {
        dst: at(va, g + 64)?,
        dst_pitch: 2 * g,
        src: va,
        src_pitch: WIDTH,
        width: WIDTH,
        rows,
    };
    ctx.backend.copy_rows_async(&copy, StreamHandle(0))?;
    ctx.backend.synchronize(ctx.device)?;
    for row in 0..rows {
        let got = read_back(ctx, at(va, (1 + 2 * row) * g + 64)?, WIDTH as usize)?;
        let want = &data[(row * WIDTH) as usize..((row + 1) * WIDTH) as usize];
        ensure(got == want, format!("row {row} differs"))?;
    }
    Ok(())
}

pub(crate) fn copy_rows_pitch_below_width_is_invalid(ctx: &Ctx<'_>) -> Outcome {
    require_row_copies(ctx)?;
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(2 * g)?;
    s.commit(va, 2 * g)?;
    let copy = RowCopy {
        dst: at(va, g)?,
        dst_pitch: WIDTH / 2,
        src: va,
        src_pitch: WIDTH,
        width: WIDTH,
        rows: ROWS,
    };
    let r = ctx.backend.copy_rows_async(&copy, StreamHandle(0));
    if matches!(&r, Err(e) if e.kind == ErrorKind::NotSupported) {
        return Err(Verdict::Skip(format!(
            "backend {} cannot copy rows on a stream",
            ctx.backend.name()
        )));
    }
    expect_kind(
        r,
        ErrorKind::InvalidValue,
        "rows overlapping their own pitch",
    )
}
