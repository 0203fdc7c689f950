//! [`Reclaimer`]: a holder of reclaimable memory that the governor asks before refusing.

use kvvm_hal::DeviceId;

/// Something that holds reclaimable device memory (a handle pool, a prefix cache) and can free
/// some of it when the governor is about to refuse a grant.
pub trait Reclaimer: Send + Sync {
    /// Frees up to `bytes` of physical memory on `device` (giving the bytes back through
    /// `Governor::free`) and returns how many bytes were freed. Called without any governor
    /// lock held; it may call the governor.
    fn reclaim(&self, device: DeviceId, bytes: u64) -> u64;

    /// Bytes on `device` that [`reclaim`](Self::reclaim) would give back now if asked for
    /// everything (a pool's handles, the idle prefixes of a cache, the windows a
    /// pre-committer holds ahead of the live ends): part of what
    /// `Governor::available_bytes` reports. The default is 0 (nothing counted ahead).
    fn reclaimable(&self, device: DeviceId) -> u64 {
        let _ = device;
        0
    }
}
