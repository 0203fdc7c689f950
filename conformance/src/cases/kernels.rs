//! Kernels: loads and stores through a read-only alias (the store in a child process where a
//! fault is not recoverable).

use kvvm_hal::{DeviceAddress, DeviceId, ErrorKind, KernelProbeOp};

use crate::case::{ensure, load_sum, pattern, read_back, Outcome, Verdict, SAMPLE};
use crate::cases::aliases::aliased;
use crate::child::{ChildVerdict, CHILD_KERNEL_STORE};
use crate::ctx::{expect_fault, Ctx};
use crate::scratch::Scratch;

pub(crate) fn kernel_load_through_read_alias(ctx: &Ctx<'_>) -> Outcome {
    let probe = ctx.require_kernels()?;
    let (_s, rw, ro, _) = aliased(ctx)?;
    let p = pattern(SAMPLE.min(ctx.granule as usize), 28);
    ctx.backend.copy_to_device(rw, &p)?;
    let expected = load_sum(&p);
    let sum = probe.run(ctx.device, KernelProbeOp::Load, ro, p.len() as u64, 0)?;
    ensure(
        sum == expected,
        format!("kernel load through the Read alias summed {sum}, expected {expected}"),
    )
}

/// A store that must fault, as a faulting body sets it up: `bytes` written through the
/// owner's mapping at `owner`, then loaded and stored by a kernel on `device` at `at`.
pub(crate) struct FaultingStore<'a> {
    /// What the body created (given back unless the fault left the context unusable).
    pub(crate) scratch: Scratch<'a>,
    /// The device whose kernel loads and stores.
    pub(crate) device: DeviceId,
    /// Where its kernel loads and stores.
    pub(crate) at: DeviceAddress,
    /// The owner's read-write mapping of the same bytes.
    pub(crate) owner: DeviceAddress,
    /// The bytes there.
    pub(crate) bytes: Vec<u8>,
}

/// The body of a faulting-store case (in a child process where a fault is not recoverable):
/// after `setup`, a load on the kernel's device sees the owner's bytes, then its store of
/// `value` must fault. Where the fault is recoverable, the bytes must be unchanged after it
/// and the scratch is given back; elsewhere the context is unusable after a fault, so the
/// child exits without tearing down.
pub(crate) fn store_must_fault<'a>(
    ctx: &Ctx<'a>,
    setup: impl FnOnce() -> Result<FaultingStore<'a>, Verdict>,
    value: u8,
) -> ChildVerdict {
    let Some(probe) = ctx.backend.kernel_probe() else {
        return ChildVerdict::Error("backend has no kernel probe".into());
    };
    let loaded = |f: &FaultingStore<'_>| -> Result<(), Verdict> {
        let n = f.bytes.len() as u64;
        let sum = probe.run(f.device, KernelProbeOp::Load, f.at, n, 0)?;
        let expected = load_sum(&f.bytes);
        ensure(
            sum == expected,
            format!("a load on {} summed {sum}, expected {expected}", f.device),
        )
    };
    let f = match setup().and_then(|f| loaded(&f).map(|()| f)) {
        Ok(f) => f,
        Err(Verdict::Fail(m) | Verdict::Skip(m)) => return ChildVerdict::Error(m),
    };
    crate::child::arm();
    let verdict = match probe.run(
        f.device,
        KernelProbeOp::Store,
        f.at,
        f.bytes.len() as u64,
        value,
    ) {
        Ok(_) => ChildVerdict::NoFault,
        Err(e) if e.kind == ErrorKind::DeviceLost => ChildVerdict::Fault(e.to_string()),
        Err(e) => ChildVerdict::Error(format!("store kernel failed unexpectedly: {e}")),
    };
    if !probe.faults_are_recoverable() {
        std::mem::forget(f.scratch);
        return verdict;
    }
    if let ChildVerdict::Fault(_) = verdict {
        match read_back(ctx, f.owner, f.bytes.len()) {
            Ok(now) if now == f.bytes => {}
            Ok(_) => return ChildVerdict::Error("the faulting store changed the bytes".into()),
            Err(e) => return ChildVerdict::Error(format!("read back after the fault: {e:?}")),
        }
    }
    verdict
}

/// The body of `kernel_store_through_read_alias_faults`: loads through the Read alias see
/// the owner's bytes, then the store through it faults.
pub(crate) fn kernel_store_child(ctx: &Ctx<'_>) -> ChildVerdict {
    let setup = || -> Result<_, Verdict> {
        let (scratch, rw, ro, _) = aliased(ctx)?;
        let bytes = pattern(256, 29);
        ctx.backend.copy_to_device(rw, &bytes)?;
        Ok(FaultingStore {
            scratch,
            device: ctx.device,
            at: ro,
            owner: rw,
            bytes,
        })
    };
    store_must_fault(ctx, setup, 0xAB)
}

pub(crate) fn kernel_store_through_read_alias_faults(ctx: &Ctx<'_>) -> Outcome {
    let verdict = ctx.run_faulting(CHILD_KERNEL_STORE, kernel_store_child)?;
    expect_fault(
        verdict,
        "a kernel store through the Read alias completed without a fault",
    )
}
