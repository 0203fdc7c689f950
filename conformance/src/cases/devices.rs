//! Devices and granularity: enumeration, and granularities a manager can use.

use kvvm_hal::{AllocationProperties, ShareableHandleType};

use crate::case::{ensure, Outcome};
use crate::ctx::Ctx;

pub(crate) fn devices_are_listed(ctx: &Ctx<'_>) -> Outcome {
    let devices = ctx.backend.devices()?;
    ensure(!devices.is_empty(), "no device listed")?;
    for (i, d) in devices.iter().enumerate() {
        ensure(d.id.0 as usize == i, format!("device {i} has id {}", d.id))?;
        ensure(!d.name.is_empty(), format!("device {i} has no name"))?;
        ensure(d.total_memory > 0, format!("device {i} reports no memory"))?;
        ensure(d.vmm_supported, format!("device {i} does not support VMM"))?;
    }
    let info = ctx.backend.memory_info(ctx.device)?;
    ensure(
        info.free <= info.total && info.total > 0,
        format!("memory info {info:?} is inconsistent"),
    )
}

pub(crate) fn granularity_is_sane(ctx: &Ctx<'_>) -> Outcome {
    let g = ctx
        .backend
        .granularity(&AllocationProperties::device(ctx.device))?;
    ensure(g.minimum > 0, "minimum granularity is 0")?;
    ensure(
        g.minimum.is_power_of_two(),
        format!("minimum {} is not a power of two", g.minimum),
    )?;
    ensure(
        g.recommended >= g.minimum && g.recommended % g.minimum == 0,
        format!(
            "recommended {} is not a multiple of minimum {}",
            g.recommended, g.minimum
        ),
    )
}

pub(crate) fn granularity_posix_fd(ctx: &Ctx<'_>) -> Outcome {
    ctx.require_posix_fd()?;
    let props = AllocationProperties {
        device: ctx.device,
        handle_type: ShareableHandleType::PosixFd,
    };
    let g = ctx.backend.granularity(&props)?;
    ensure(
        g.minimum > 0 && g.minimum.is_power_of_two(),
        format!(
            "exportable minimum granularity {} is not a power of two",
            g.minimum
        ),
    )
}
