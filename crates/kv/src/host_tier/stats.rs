//! The tier's configuration and its figures (plain data).

use kvvm_hal::StreamHandle;

/// Configuration of a [`HostTier`](crate::HostTier).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct HostTierConfig {
    /// Chunks (windows) of one page-locked allocation at least (default 16: 32 MiB at a 2 MiB
    /// granule); a swap that needs more takes one allocation of its size, so that its windows
    /// lie in one buffer and adjacent windows move in one copy.
    pub slab_windows: u64,
    /// Free page-locked bytes kept for reuse after a swap gives its chunks back (`None`: all
    /// of them until the governor asks for the host's bytes; pinning memory is slow).
    pub keep_pooled_bytes: Option<u64>,
    /// The stream copies are queued on (`None`: the backend's own copy stream, which
    /// overlaps the work of other streams).
    pub stream: Option<StreamHandle>,
    /// The most bytes one copy moves (whole windows, one at least; `None`: a run of adjacent
    /// windows in one copy however long; default [`DEFAULT_MAX_COPY_BYTES`]). Copies of a
    /// bounded size slow a decode running beside them less than one long copy of the same
    /// bytes (docs/host-tier.md has the figures).
    pub max_copy_bytes: Option<u64>,
}

/// The default [`HostTierConfig::max_copy_bytes`]: 64 MiB (about 1.2 ms of a PCIe 5 link),
/// the size that slowed a decode beside back-to-back swaps least of those measured.
pub const DEFAULT_MAX_COPY_BYTES: u64 = 64 << 20;

impl Default for HostTierConfig {
    fn default() -> Self {
        HostTierConfig {
            slab_windows: 16,
            keep_pooled_bytes: None,
            stream: None,
            max_copy_bytes: Some(DEFAULT_MAX_COPY_BYTES),
        }
    }
}

impl HostTierConfig {
    /// Sets [`slab_windows`](Self::slab_windows) (0 is taken as 1).
    #[must_use]
    pub fn slab_windows(mut self, windows: u64) -> Self {
        self.slab_windows = windows.max(1);
        self
    }

    /// Sets [`keep_pooled_bytes`](Self::keep_pooled_bytes).
    #[must_use]
    pub fn keep_pooled_bytes(mut self, bytes: Option<u64>) -> Self {
        self.keep_pooled_bytes = bytes;
        self
    }

    /// Sets [`max_copy_bytes`](Self::max_copy_bytes).
    #[must_use]
    pub fn max_copy_bytes(mut self, bytes: Option<u64>) -> Self {
        self.max_copy_bytes = bytes;
        self
    }

    /// Sets [`stream`](Self::stream).
    #[must_use]
    pub fn stream(mut self, stream: Option<StreamHandle>) -> Self {
        self.stream = stream;
        self
    }
}

/// What a [`HostTier`](crate::HostTier) holds and did (`HostTier::stats`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct HostTierStats {
    /// Bytes of a chunk (one window).
    pub chunk_bytes: u64,
    /// Page-locked allocations alive.
    pub slabs: u64,
    /// Bytes of chunks holding a window (the host's committed bytes).
    pub held_bytes: u64,
    /// Bytes of free chunks (the host's pooled bytes).
    pub pooled_bytes: u64,
    /// Of those, bytes of slabs wholly free: what trimming gives back.
    pub idle_bytes: u64,
    /// Bytes of chunks whose copies could not be proven done (freed with the tier).
    pub quarantined_bytes: u64,
    /// Swaps whose copies to the host completed.
    pub swaps_out: u64,
    /// Swaps whose copies back to the device completed.
    pub swaps_in: u64,
    /// Bytes copied to the host.
    pub bytes_out: u64,
    /// Bytes copied back to the device.
    pub bytes_in: u64,
    /// Swaps that failed (a copy, a host grant, a commit on the way back): their request
    /// is computed again.
    pub failed: u64,
}

/// The counters a tier keeps behind its lock.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Counters {
    pub(crate) swaps_out: u64,
    pub(crate) swaps_in: u64,
    pub(crate) bytes_out: u64,
    pub(crate) bytes_in: u64,
    pub(crate) failed: u64,
}
