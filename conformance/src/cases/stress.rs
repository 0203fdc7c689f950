//! Stress: threads sharing a backend, thousands of cycles leaking nothing.

use crate::case::{at, ensure, fail, pattern, read_back, Outcome};
use crate::ctx::Ctx;

pub(crate) fn threads_share_backend(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn many_cycles_leave_nothing(ctx: &Ctx<'_>) -> Outcome {
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
