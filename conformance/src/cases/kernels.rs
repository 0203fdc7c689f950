//! Kernels: loads and stores through a read-only alias (the store in a child process).

use kvvm_hal::{ErrorKind, KernelProbeOp};

use crate::case::{ensure, fail, pattern, Outcome, Verdict, SAMPLE};
use crate::cases::aliases::aliased;
use crate::child::{ChildVerdict, CHILD_KERNEL_STORE};
use crate::ctx::Ctx;

pub(crate) fn kernel_load_through_read_alias(ctx: &Ctx<'_>) -> Outcome {
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

pub(crate) fn kernel_store_through_read_alias_faults(ctx: &Ctx<'_>) -> Outcome {
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
