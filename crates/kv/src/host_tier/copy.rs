//! The tier's copies, written once for every holder of chunks (a sequence's swap, the prefix
//! cache's host level): windows grouped into runs (adjacent on the device and in one buffer:
//! one copy each), queued on the tier's stream either way, then one event; and the wait for
//! them, which after a failure settles the device or says it could not.

use std::sync::Arc;

use kvvm_hal::{DeviceAddress, HostCopy, StreamHandle};
use kvvm_num::{add, mul};

use super::{CopyEvent, Fence, HostChunks, HostTier};
use crate::error::KvCacheError;

/// Consecutive windows copied as one: from `offset` past a base address on the device, into
/// chunks `first..` of the holder's chunks (one buffer, contiguous).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) offset: u64,
    pub(crate) first: usize,
    pub(crate) windows: u64,
}

/// The copies of `windows` (each a device offset and the index of the chunk it goes to, in
/// ascending order of offset) from or into `host`'s chunks: adjacent windows whose chunks are
/// consecutive and adjacent in one buffer in one copy, of at most the tier's
/// `max_copy_bytes`.
pub(crate) fn runs(
    windows: impl IntoIterator<Item = (u64, usize)>,
    host: &HostChunks,
    g: u64,
) -> Vec<Run> {
    let most = host.tier().max_copy_windows();
    let mut out: Vec<Run> = Vec::new();
    let mut prev: Option<usize> = None;
    for (w, i) in windows {
        if let (Some(last), Some(p)) = (out.last_mut(), prev) {
            let room = last.windows < most;
            let next_device = last.offset.saturating_add(last.windows.saturating_mul(g)) == w;
            let next_host = match (host.chunks.get(p), host.chunks.get(i)) {
                (Some(a), Some(b)) => {
                    p.checked_add(1) == Some(i)
                        && a.buffer == b.buffer
                        && a.offset.saturating_add(g) == b.offset
                }
                _ => false,
            };
            if room && next_device && next_host {
                last.windows += 1;
                prev = Some(i);
                continue;
            }
        }
        out.push(Run {
            offset: w,
            first: i,
            windows: 1,
        });
        prev = Some(i);
    }
    out
}

/// Queues the copies of every run (from `base`), host -> device when `back`, else device ->
/// host, on the tier's stream, then records their event. On an error, waits for what was
/// queued and returns whether that could be proven done.
pub(crate) fn queue_runs(
    host: &HostChunks,
    base: DeviceAddress,
    runs: &[Run],
    back: bool,
) -> Result<Arc<Fence>, (KvCacheError, bool)> {
    let tier = host.tier();
    let backend = tier.vm().backend();
    let (device, stream) = (tier.vm().device(), tier.stream());
    let g = tier.chunk_bytes();
    let queued = runs.iter().try_for_each(|r| {
        let chunk = host.chunks.get(r.first).ok_or(KvCacheError::Swap {
            reason: "a run names a chunk the holder does not hold".to_owned(),
        })?;
        let copy = HostCopy {
            device: DeviceAddress(add(base.0, r.offset, "copy address")?),
            host: chunk.buffer,
            offset: chunk.offset,
            bytes: mul(r.windows, g, "copy bytes")?,
        };
        if back {
            backend.copy_from_host_async(&copy, stream)?;
        } else {
            backend.copy_to_host_async(&copy, stream)?;
        }
        Ok(())
    });
    let event = queued.and_then(|()| Ok(CopyEvent::record(backend, device, stream)?));
    match event {
        Ok(e) => Ok(Fence::over(e)),
        Err(e) => Err((e, settle_stream(tier, stream))),
    }
}

/// Waits for the copies behind `fence` (none: nothing to wait for); on a failure, whether the
/// device could be proven idle after it (`Err(settled)`); the fence is kept when it could not.
pub(crate) fn wait_fence(fence: &mut Option<Arc<Fence>>) -> Result<(), (KvCacheError, bool)> {
    let Some(f) = fence.take() else {
        return Ok(());
    };
    let mut guard = f.lock();
    let Some(event) = guard.as_mut() else {
        return Ok(());
    };
    match event.wait() {
        Ok(()) => {
            guard.take();
            Ok(())
        }
        Err(e) => {
            let settled = event.settle_after_failure();
            if settled {
                guard.take();
            }
            drop(guard);
            if !settled {
                *fence = Some(f);
            }
            Err((e.into(), settled))
        }
    }
}

/// Queues the runs and waits for them: a whole copy one way (see [`queue_runs`] and
/// [`wait_fence`]). On a failure, whether the device could be proven idle after it.
pub(crate) fn copy_runs(
    host: &HostChunks,
    base: DeviceAddress,
    runs: &[Run],
    back: bool,
) -> Result<(), (KvCacheError, bool)> {
    let mut fence = Some(queue_runs(host, base, runs, back)?);
    wait_fence(&mut fence)
}

/// After a failure to queue: waits for what was queued on `stream` (an event, or the device
/// synchronized when that fails). Whether it is proven done.
fn settle_stream(tier: &HostTier, stream: StreamHandle) -> bool {
    let backend = tier.vm().backend();
    match CopyEvent::record(backend, tier.vm().device(), stream) {
        Ok(mut e) => match e.wait() {
            Ok(()) => true,
            Err(_) => e.settle_after_failure(),
        },
        Err(_) => backend.synchronize(tier.vm().device()).is_ok(),
    }
}
