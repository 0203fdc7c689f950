//! [`Reclaimer`]: a holder of reclaimable memory that the governor asks before refusing.

use kvvm_hal::DeviceId;

/// Something that holds reclaimable device memory (a handle pool, a prefix cache) and can free
/// some of it when the governor is about to refuse a grant.
pub trait Reclaimer: Send + Sync {
    /// Frees up to `bytes` of physical memory on `device` (giving the bytes back through
    /// `Governor::free`) and returns how many bytes were freed. Called without any governor
    /// lock held; it may call the governor.
    fn reclaim(&self, device: DeviceId, bytes: u64) -> u64;
}
