//! Kernels: loads and stores through a read-only alias (the store in a child process where a
//! fault is not recoverable).

use kvvm_hal::{DeviceAddress, ErrorKind, KernelProbe, KernelProbeOp};

use crate::case::{ensure, pattern, read_back, Outcome, Verdict, SAMPLE};
use crate::cases::aliases::aliased;
use crate::child::{ChildVerdict, CHILD_KERNEL_STORE};
use crate::ctx::{expect_fault, Ctx};
use crate::scratch::Scratch;

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

/// The body of `kernel_store_through_read_alias_faults` (in a child process where a fault is
/// not recoverable): loads through the alias see the owner's bytes, then the store faults.
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
        Ok((s, rw, ro, p))
    };
    let (s, rw, ro, p) = match setup() {
        Ok(v) => v,
        Err(Verdict::Fail(m) | Verdict::Skip(m)) => return ChildVerdict::Error(m),
    };
    crate::child::arm();
    let verdict = store_verdict(probe.run(ctx.device, KernelProbeOp::Store, ro, 256, 0xAB));
    finish_faulting(ctx, probe, s, rw, &p, verdict)
}

/// The verdict of a store that should fault: `DeviceLost` is the fault, success is none.
pub(crate) fn store_verdict(result: kvvm_hal::BackendResult<u64>) -> ChildVerdict {
    match result {
        Ok(_) => ChildVerdict::NoFault,
        Err(e) if e.kind == ErrorKind::DeviceLost => ChildVerdict::Fault(e.to_string()),
        Err(e) => ChildVerdict::Error(format!("store kernel failed unexpectedly: {e}")),
    }
}

/// Ends a faulting body. Where a fault is recoverable the device is still usable: the bytes
/// at `rw` must still be `before` (a refused store writes nothing), and the scratch is torn
/// down. Elsewhere the context is unusable after a fault, so the child process exits without
/// tearing down.
pub(crate) fn finish_faulting(
    ctx: &Ctx<'_>,
    probe: &dyn KernelProbe,
    s: Scratch<'_>,
    rw: DeviceAddress,
    before: &[u8],
    verdict: ChildVerdict,
) -> ChildVerdict {
    if !probe.faults_are_recoverable() {
        std::mem::forget(s);
        return verdict;
    }
    if let ChildVerdict::Fault(_) = verdict {
        match read_back(ctx, rw, before.len()) {
            Ok(now) if now == before => {}
            Ok(_) => return ChildVerdict::Error("the faulting store changed the bytes".into()),
            Err(e) => return ChildVerdict::Error(format!("read back after the fault: {e:?}")),
        }
    }
    drop(s);
    verdict
}

pub(crate) fn kernel_store_through_read_alias_faults(ctx: &Ctx<'_>) -> Outcome {
    let verdict = ctx.run_faulting(CHILD_KERNEL_STORE, kernel_store_child)?;
    expect_fault(
        verdict,
        "a kernel store through the Read alias completed without a fault",
    )
}
