//! Configuration of the simulated driver: devices, quirks and the latency model.

use kvvm_hal::{Granularity, LatencyModel};

/// One MiB.
pub const MIB: u64 = 1 << 20;
/// One GiB.
pub const GIB: u64 = 1 << 30;

/// Granule of the H200 (minimum = recommended = 2 MiB, measured).
pub const H200_GRANULE: u64 = 2 * MIB;
/// Granules the H200 could create before `CUDA_ERROR_OUT_OF_MEMORY` (measured).
pub const H200_GRANULES: u64 = 71_313;

/// One simulated device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimDeviceConfig {
    /// The device's name as `devices()` reports it.
    pub name: String,
    /// The granularity the device reports.
    pub granularity: Granularity,
    /// Physical capacity in bytes; a create past it fails with `OutOfMemory`.
    pub capacity: u64,
    /// Whether allocations can be exported as POSIX file descriptors.
    pub posix_fd: bool,
}

impl SimDeviceConfig {
    /// A device with `granule` as both minimum and recommended granularity.
    pub fn new(name: impl Into<String>, granule: u64, capacity: u64) -> Self {
        SimDeviceConfig {
            name: name.into(),
            granularity: Granularity {
                minimum: granule,
                recommended: granule,
            },
            capacity,
            posix_fd: true,
        }
    }

    /// The H200 as measured: 2 MiB granule, 71,313 granules of capacity.
    pub fn h200() -> Self {
        SimDeviceConfig::new(
            "Simulated NVIDIA H200",
            H200_GRANULE,
            H200_GRANULE * H200_GRANULES,
        )
    }
}

/// Deliberate departures from real driver semantics.
///
/// Every field is `false` by default, which is the faithful simulator. They exist so that
/// tests can show the conformance suite *fails* on a wrong driver, and so that the manager can
/// be exercised against known vendor bugs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SimQuirks {
    /// WRONG: releasing a mapped handle frees its memory at once (data is lost, capacity
    /// returns) instead of deferring the free until the last unmap.
    pub release_frees_mapped: bool,
    /// WRONG: unmapping a range with no mapping fails with `InvalidValue`.
    pub report_double_unmap: bool,
    /// WRONG: writes through a `Read` mapping succeed.
    pub ignore_read_only: bool,
    /// Vendor bug (ROCR-Runtime #285): one unmap over several mappings succeeds, but the later
    /// free of the enclosing reservation fails with `InvalidValue`. Also makes the backend
    /// report `unmap_spans_mappings = false`, as the HIP backend does.
    pub multi_unmap_breaks_free: bool,
}

/// How the latency model is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LatencyMode {
    /// Only add each call's modelled cost to [`SimBackend::estimated_driver_time`](crate::SimBackend::estimated_driver_time).
    #[default]
    Account,
    /// Also busy-wait for the modelled cost in the calling thread (outside the simulator's
    /// lock), so that wall-clock measurements see driver-like latency.
    Spin,
}

/// Full configuration of a [`SimBackend`](crate::SimBackend).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    /// The devices, in ordinal order (at least one).
    pub devices: Vec<SimDeviceConfig>,
    /// Which devices can be given access to each other's memory.
    pub peers: PeerLinks,
    /// Size of the virtual address space; a reservation that does not fit is `OutOfMemory`.
    /// Default 2^47 (a 2^46 = 64 TiB reservation succeeds, 2^48 fails, as on the H200).
    pub address_space: u64,
    /// Deliberate departures from real semantics (all off by default).
    pub quirks: SimQuirks,
    /// Per-call cost model (defaults to the H200 medians).
    pub latency: LatencyModel,
    /// Whether the latency is only accounted or also spent.
    pub latency_mode: LatencyMode,
}

impl SimConfig {
    /// `devices` devices of `granule` granularity and `capacity` bytes each.
    pub fn uniform(devices: u32, granule: u64, capacity: u64) -> Self {
        SimConfig {
            devices: (0..devices.max(1))
                .map(|i| SimDeviceConfig::new(format!("Simulated GPU {i}"), granule, capacity))
                .collect(),
            ..SimConfig::default()
        }
    }

    /// One device of `granule` granularity and `capacity` bytes.
    pub fn single(granule: u64, capacity: u64) -> Self {
        SimConfig::uniform(1, granule, capacity)
    }

    /// Replaces the peer links.
    #[must_use]
    pub fn with_peers(mut self, peers: PeerLinks) -> Self {
        self.peers = peers;
        self
    }

    /// Replaces the quirks.
    #[must_use]
    pub fn with_quirks(mut self, quirks: SimQuirks) -> Self {
        self.quirks = quirks;
        self
    }

    /// Replaces the latency model and mode.
    #[must_use]
    pub fn with_latency(mut self, latency: LatencyModel, mode: LatencyMode) -> Self {
        self.latency = latency;
        self.latency_mode = mode;
        self
    }
}

impl Default for SimConfig {
    /// One simulated H200.
    fn default() -> Self {
        SimConfig {
            devices: vec![SimDeviceConfig::h200()],
            peers: PeerLinks::AllToAll,
            address_space: 1 << 47,
            quirks: SimQuirks::default(),
            latency: LatencyModel::h200(),
            latency_mode: LatencyMode::Account,
        }
    }
}

/// The peer links of a simulated node: which devices may be given access to memory of which
/// (both ways). A device always reaches its own memory.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PeerLinks {
    /// Every device reaches every other (an NVLink or xGMI node).
    #[default]
    AllToAll,
    /// No device reaches another's memory.
    None,
    /// Only these pairs of device ordinals reach each other.
    Pairs(Vec<(u32, u32)>),
}

impl PeerLinks {
    /// Whether `a` and `b` reach each other's memory.
    pub fn linked(&self, a: u32, b: u32) -> bool {
        a == b
            || match self {
                PeerLinks::AllToAll => true,
                PeerLinks::None => false,
                PeerLinks::Pairs(p) => p.iter().any(|&(x, y)| (x, y) == (a, b) || (x, y) == (b, a)),
            }
    }
}
