//! Peer access: memory of this device given access from another device of the same backend:
//! read there, written there with ReadWrite access, a store refused with Read access (in a
//! child process where the fault is not recoverable), and a teardown that synchronizes both
//! devices. Skipped, with the reason, on a backend with one device or no peer link.

use kvvm_hal::{Access, AccessDescriptor, DeviceAddress, DeviceId, KernelProbeOp};

use crate::case::{ensure, fail, load_sum, pattern, read_back, Outcome, Verdict, SAMPLE};
use crate::cases::kernels::{store_must_fault, FaultingStore};
use crate::child::{ChildVerdict, CHILD_PEER_STORE};
use crate::ctx::{expect_fault, Ctx};
use crate::scratch::Scratch;

/// Another device this one's memory can be given access from, or the skip saying why not.
fn a_peer(ctx: &Ctx<'_>) -> Result<DeviceId, Verdict> {
    let devices = ctx.backend.devices()?;
    if devices.len() < 2 {
        return Err(Verdict::Skip(format!(
            "skipped: one device ({}): no peer to give access to",
            devices.len()
        )));
    }
    for d in devices.iter().filter(|d| d.id != ctx.device) {
        if ctx.backend.can_access_peer(ctx.device, d.id)? {
            return Ok(d.id);
        }
    }
    Err(Verdict::Skip(format!(
        "skipped: the driver reports no peer access to {} from any other device",
        ctx.device
    )))
}

pub(crate) fn peer_access_is_reported_consistently(ctx: &Ctx<'_>) -> Outcome {
    let devices = ctx.backend.devices()?;
    ensure(
        ctx.backend.can_access_peer(ctx.device, ctx.device)?,
        "a device does not reach its own memory",
    )?;
    if devices.len() < 2 {
        return Err(Verdict::Skip(
            "skipped: one device: no peer to ask about".to_owned(),
        ));
    }
    for d in &devices {
        for p in &devices {
            let there = ctx.backend.can_access_peer(d.id, p.id)?;
            let back = ctx.backend.can_access_peer(p.id, d.id)?;
            if there != back {
                return Err(fail(format!(
                    "{} -> {} is {there} but the reverse is {back}",
                    d.id, p.id
                )));
            }
        }
    }
    Ok(())
}

/// One granule of the device under test, mapped ReadWrite for it and with `access` for
/// `peer`, holding a pattern (returned) of up to `SAMPLE` bytes at its start.
fn shared_with<'a>(
    ctx: &'a Ctx<'a>,
    peer: DeviceId,
    access: Access,
    seed: u8,
) -> Result<(Scratch<'a>, DeviceAddress, Vec<u8>), Verdict> {
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(g)?;
    let h = s.create(g)?;
    s.map(va, g, h)?;
    s.shared_with(peer);
    let desc = [
        AccessDescriptor::read_write(ctx.device),
        AccessDescriptor {
            device: peer,
            access,
        },
    ];
    ctx.backend.set_access(va, g, &desc)?;
    let p = pattern(SAMPLE.min(g as usize), seed);
    ctx.backend.copy_to_device(va, &p)?;
    ensure(
        read_back(ctx, va, p.len())? == p,
        "the bytes do not read back",
    )?;
    Ok((s, va, p))
}

pub(crate) fn peer_reads_through_a_shared_mapping(ctx: &Ctx<'_>) -> Outcome {
    let peer = a_peer(ctx)?;
    let (mut s, va, p) = shared_with(ctx, peer, Access::Read, 41)?;
    if let Some(k) = ctx.backend.kernel_probe() {
        // A load on the peer device through the mapping sees the owner's bytes.
        let got = k.run(peer, KernelProbeOp::Load, va, p.len() as u64, 0)?;
        ensure(
            got == load_sum(&p),
            format!("{peer} loaded a sum of {got}, expected {}", load_sum(&p)),
        )?;
    }
    // Teardown: both devices synchronized, then unmap, release, free.
    s.finish()?;
    Ok(())
}

pub(crate) fn peer_writes_through_read_write_access(ctx: &Ctx<'_>) -> Outcome {
    let probe = ctx.require_kernels()?;
    let peer = a_peer(ctx)?;
    let (mut s, va, p) = shared_with(ctx, peer, Access::ReadWrite, 43)?;
    let n = p.len() as u64;
    probe.run(peer, KernelProbeOp::Store, va, n, 0x5A)?;
    // The owner's copy engine and a kernel on the owner see the peer's store.
    ensure(
        read_back(ctx, va, p.len())?.iter().all(|&b| b == 0x5A),
        format!("the bytes {peer} stored are not what {} reads", ctx.device),
    )?;
    let got = probe.run(ctx.device, KernelProbeOp::Load, va, n, 0)?;
    ensure(
        got == 0x5A * n,
        format!(
            "{} loaded a sum of {got} after the peer's store, expected {}",
            ctx.device,
            0x5A * n
        ),
    )?;
    s.finish()?;
    Ok(())
}

pub(crate) fn peer_store_through_read_access_faults(ctx: &Ctx<'_>) -> Outcome {
    ctx.require_kernels()?;
    a_peer(ctx)?;
    let verdict = ctx.run_faulting(CHILD_PEER_STORE, peer_store_child)?;
    expect_fault(
        verdict,
        "a peer's kernel store through its Read access completed without a fault",
    )
}

/// The body of `peer_store_through_read_access_faults`: the peer's load sees the owner's
/// bytes, then its store through its Read access faults.
pub(crate) fn peer_store_child(ctx: &Ctx<'_>) -> ChildVerdict {
    let setup = || -> Result<_, Verdict> {
        let peer = a_peer(ctx)?;
        let (scratch, va, bytes) = shared_with(ctx, peer, Access::Read, 47)?;
        Ok(FaultingStore {
            scratch,
            device: peer,
            at: va,
            owner: va,
            bytes,
        })
    };
    store_must_fault(ctx, setup, 0xCD)
}
