//! [`VmmConfig`]: how a `VirtualMemory` pools, parks and maps.

use kvvm_hal::{AccessDescriptor, LatencyModel, ShareableHandleType};

/// Which of the driver's granularities the manager uses as its granule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GranularityChoice {
    /// The minimum granularity (finest commits).
    Minimum,
    /// The recommended granularity (what the driver says performs best); falls back to the
    /// minimum if the recommended one is not a multiple of it.
    #[default]
    Recommended,
}

/// The default [`VmmConfig::max_handle_bytes`]: 512 MiB (on the H200, 8 such handles commit
/// 4 GiB in 550 us against 73 ms as 2 MiB handles, and a 512 MiB handle can still be pooled).
pub const DEFAULT_MAX_HANDLE_BYTES: u64 = 512 << 20;

/// Configuration of a [`VirtualMemory`](crate::VirtualMemory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmmConfig {
    /// Most bytes of released handles kept for reuse (0: no pool).
    pub pool_cap_bytes: u64,
    /// Which granularity to use.
    pub granularity: GranularityChoice,
    /// The access set on every commit (empty: read-write for the manager's device).
    pub access: Vec<AccessDescriptor>,
    /// The shareable handle type of created handles.
    pub handle_type: ShareableHandleType,
    /// Park released windows instead of unmapping them: `Reservation::release` and
    /// `Reservation::truncate` keep the windows mapped (access set) as pooled memory of
    /// their reservation, within the pool cap, and a later commit of the same windows in the
    /// same reservation reuses them with no driver call at all. Parked windows are pooled
    /// bytes for the governor and are unmapped and released when it needs memory, when the
    /// pool is trimmed, when a shared mapping needs their place, and at teardown. Off by
    /// default. This is what recycling a sequence's reservation for the next request wants:
    /// on the H200 a remap costs about 30 us a window, a parked hit nothing.
    pub park_released: bool,
    /// Largest physical handle a commit creates, in bytes. A commit maps each contiguous run
    /// of missing windows with as few handles as the run allows: largest first, each a
    /// power-of-two number of granules aligned to its own size from the reservation's base
    /// (buddy style, so that a later release at an aligned boundary frees whole handles), none
    /// larger than this. The driver's cost is per mapping, not per byte (on the H200 a 512 MiB
    /// region costs 143 us as one handle, 7.6 ms as 256 granules), so larger is faster; but a
    /// handle is mapped and released whole, so a window inside a multi-window handle is
    /// given back only with the whole handle. Default 512 MiB; the granule (or 0) gives one
    /// handle per granule.
    pub max_handle_bytes: u64,
    /// The driver costs a commit chooses its handles by: where the pool holds no handle of
    /// exactly a piece's size but smaller ones that tile it, the commit maps those `k` pooled
    /// handles only if `k` re-mappings (`map` + a fresh mapping's `set_access`) cost no more
    /// than creating one handle of the piece's size and mapping it; otherwise it creates one
    /// and leaves the pool as it is. A handle of exactly the size is always taken (it saves
    /// the create). Default [`LatencyModel::h200`] (the H200 fit: a create of 7 us + 37 ns a
    /// MiB against 21.7 us a mapping, so a piece of up to 256 MiB is never served by two
    /// pooled handles, one of 512 MiB by at most two). A platform whose `cuMemCreate` is
    /// slower (about 190 us measured on an A100) wants its own figures: more pooled handles
    /// then beat one fresh one. See `docs/manager.md`, "How a commit uses the pool".
    pub commit_cost: LatencyModel,
}

impl Default for VmmConfig {
    /// A 1 GiB pool, the recommended granularity, read-write access for the device, handles
    /// that are not exportable, handles of at most 512 MiB, the H200's costs.
    fn default() -> Self {
        VmmConfig {
            pool_cap_bytes: 1 << 30,
            granularity: GranularityChoice::Recommended,
            access: Vec::new(),
            handle_type: ShareableHandleType::None,
            park_released: false,
            max_handle_bytes: DEFAULT_MAX_HANDLE_BYTES,
            commit_cost: LatencyModel::h200(),
        }
    }
}

impl VmmConfig {
    /// Sets the pool cap in bytes.
    #[must_use]
    pub fn pool_cap_bytes(mut self, bytes: u64) -> Self {
        self.pool_cap_bytes = bytes;
        self
    }

    /// Sets the granularity choice.
    #[must_use]
    pub fn granularity(mut self, choice: GranularityChoice) -> Self {
        self.granularity = choice;
        self
    }

    /// Parks released windows instead of unmapping them (see
    /// [`park_released`](Self::park_released)).
    #[must_use]
    pub fn park_released(mut self, park: bool) -> Self {
        self.park_released = park;
        self
    }

    /// Sets the largest handle a commit creates (see
    /// [`max_handle_bytes`](Self::max_handle_bytes)); the granule gives one handle per window.
    #[must_use]
    pub fn max_handle_bytes(mut self, bytes: u64) -> Self {
        self.max_handle_bytes = bytes;
        self
    }

    /// Sets the driver costs a commit chooses between pooled and fresh handles by (see
    /// [`commit_cost`](Self::commit_cost)).
    #[must_use]
    pub fn commit_cost(mut self, model: LatencyModel) -> Self {
        self.commit_cost = model;
        self
    }
}
