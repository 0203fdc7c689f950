//! Peer access: memory of this device given access from another device of the same backend.
//! Skipped, with the reason, on a backend with one device or no peer link.

use kvvm_hal::{Access, AccessDescriptor, DeviceId, KernelProbeOp};

use crate::case::{ensure, fail, pattern, read_back, Outcome, Verdict, SAMPLE};
use crate::ctx::Ctx;

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

pub(crate) fn peer_reads_through_a_shared_mapping(ctx: &Ctx<'_>) -> Outcome {
    let peer = a_peer(ctx)?;
    let g = ctx.granule;
    let mut s = ctx.scratch();
    let va = s.reserve(g)?;
    let h = s.create(g)?;
    s.map(va, g, h)?;
    let desc = [
        AccessDescriptor::read_write(ctx.device),
        AccessDescriptor {
            device: peer,
            access: Access::Read,
        },
    ];
    ctx.backend.set_access(va, g, &desc)?;
    let n = SAMPLE.min(g as usize);
    let p = pattern(n, 41);
    ctx.backend.copy_to_device(va, &p)?;
    ensure(read_back(ctx, va, n)? == p, "the bytes do not read back")?;
    if let Some(k) = ctx.backend.kernel_probe() {
        // A load on the peer device through the mapping sees the owner's bytes.
        let sum = k.run(peer, KernelProbeOp::Load, va, n as u64, 0)?;
        let want = p
            .iter()
            .map(|&b| u64::from(b))
            .fold(0u64, u64::wrapping_add);
        ensure(
            sum == want,
            format!("{peer} loaded a sum of {sum}, expected {want}"),
        )?;
    }
    Ok(())
}
