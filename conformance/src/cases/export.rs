//! Export: POSIX file-descriptor handles.

use kvvm_hal::{AllocationProperties, ShareableHandleType};

use crate::case::{ensure, pattern, read_back, Outcome, SAMPLE};
use crate::ctx::Ctx;

pub(crate) fn export_import_posix_fd(ctx: &Ctx<'_>) -> Outcome {
    ctx.require_posix_fd()?;
    let props = AllocationProperties {
        device: ctx.device,
        handle_type: ShareableHandleType::PosixFd,
    };
    let g = ctx.backend.granularity(&props)?.minimum.max(ctx.granule);
    let mut s = ctx.scratch();
    let a = s.reserve(g)?;
    let b = s.reserve(g)?;
    let h = s.create_with(g, &props)?;
    s.map(a, g, h)?;
    s.rw(a, g)?;
    let p = pattern(SAMPLE.min(g as usize), 27);
    ctx.backend.copy_to_device(a, &p)?;
    let fd = ctx.backend.export_posix_fd(h)?;
    let imported = ctx
        .backend
        .import_posix_fd(ctx.device, std::os::fd::AsFd::as_fd(&fd))?;
    s.track_handle(imported);
    s.map(b, g, imported)?;
    s.ro(b, g)?;
    ensure(
        read_back(ctx, b, p.len())? == p,
        "the imported handle does not show the exported bytes",
    )
}
