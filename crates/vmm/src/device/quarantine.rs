//! Quarantine: memory the manager will never reuse nor advertise as free.
//!
//! An entry is made when memory cannot be proven idle (teardown could not synchronize), or
//! when the driver refused to take something back (an unmap, a release or a free failed). The
//! entry's bytes are in the governor's quarantined bucket; the memory stays with the driver
//! until the context is destroyed. A certain leak beats an uncertain corruption.

use std::sync::Mutex;

use kvvm_hal::{BackendError, DeviceAddress, PhysicalHandle};

use crate::mapping::MappedBlock;
use kvvm_hal::sync::lock;

/// Why memory was quarantined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuarantineReason {
    /// Teardown could not synchronize the device: the memory cannot be proven idle, so nothing
    /// was unmapped, released or freed.
    TeardownSyncFailed,
    /// Teardown could not unmap these blocks; they and their address range stay.
    UnmapFailed,
    /// A handle was unmapped but its release failed.
    ReleaseFailed,
    /// The address range could not be freed (it holds no physical memory).
    FreeFailed,
}

/// Memory the manager will never reuse nor advertise as free. It stays with the driver until
/// the context is destroyed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuarantineEntry {
    /// Why.
    pub reason: QuarantineReason,
    /// The address range left reserved, if any.
    pub range: Option<(DeviceAddress, u64)>,
    /// Mappings left in place (each owns its handle).
    pub mappings: Vec<MappedBlock>,
    /// Unmapped handles left unreleased.
    pub handles: Vec<PhysicalHandle>,
    /// Physical bytes held (counted in the governor's quarantined bucket).
    pub bytes: u64,
    /// The error that caused it.
    pub error: BackendError,
}

impl QuarantineEntry {
    /// An unmapped handle of `bytes` whose release failed.
    pub(crate) fn release_failed(handle: PhysicalHandle, bytes: u64, error: BackendError) -> Self {
        QuarantineEntry {
            reason: QuarantineReason::ReleaseFailed,
            range: None,
            mappings: Vec::new(),
            handles: vec![handle],
            bytes,
            error,
        }
    }

    /// An address range (holding no physical memory) whose free failed.
    pub(crate) fn free_failed(base: DeviceAddress, size: u64, error: BackendError) -> Self {
        QuarantineEntry {
            reason: QuarantineReason::FreeFailed,
            range: Some((base, size)),
            mappings: Vec::new(),
            handles: Vec::new(),
            bytes: 0,
            error,
        }
    }

    /// One mapping left in place outside any reservation's records (an unfinished commit job
    /// whose undo could not unmap it).
    pub(crate) fn mapped_block(
        reason: QuarantineReason,
        block: MappedBlock,
        error: BackendError,
    ) -> Self {
        QuarantineEntry {
            reason,
            range: None,
            bytes: block.size,
            mappings: vec![block],
            handles: Vec::new(),
            error,
        }
    }

    /// A reservation's range with the mappings left in it (`bytes` of them owned by it).
    pub(crate) fn mapped_range(
        reason: QuarantineReason,
        base: DeviceAddress,
        size: u64,
        mappings: Vec<MappedBlock>,
        bytes: u64,
        error: BackendError,
    ) -> Self {
        QuarantineEntry {
            reason,
            range: Some((base, size)),
            mappings,
            handles: Vec::new(),
            bytes,
            error,
        }
    }
}

/// The quarantine of one device's manager.
#[derive(Debug, Default)]
pub(crate) struct Quarantine {
    entries: Mutex<Vec<QuarantineEntry>>,
}

impl Quarantine {
    /// Records an entry (its bytes were moved to the quarantined bucket by the caller).
    pub(crate) fn add(&self, entry: QuarantineEntry) {
        lock(&self.entries).push(entry);
    }

    /// Every entry.
    pub(crate) fn entries(&self) -> Vec<QuarantineEntry> {
        lock(&self.entries).clone()
    }

    /// Physical bytes in quarantine.
    pub(crate) fn bytes(&self) -> u64 {
        lock(&self.entries)
            .iter()
            .map(|q| q.bytes)
            .fold(0u64, u64::saturating_add)
    }
}
