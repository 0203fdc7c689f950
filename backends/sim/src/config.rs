//! Configuration of the simulated driver: devices, quirks and the latency model.

use std::time::Duration;

use kvvm_hal::{Granularity, Operation};

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

/// Modelled cost of each driver call.
///
/// The defaults ([`LatencyModel::h200`]) are the medians measured on an NVIDIA H200 (driver
/// 580.159.04, CUDA 13.0, 2026-11-29; `docs/driver-semantics.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatencyModel {
    /// `reserve` (2-25 us measured; 10 us modelled).
    pub reserve: Duration,
    /// `free` (not measured separately; modelled like `reserve`).
    pub free: Duration,
    /// `create` of one handle (11.8 us).
    pub create: Duration,
    /// `release` of one handle (14.0 us).
    pub release: Duration,
    /// `map` of one handle (1.1 us).
    pub map: Duration,
    /// `set_access` base cost of one call (29.4 us for one granule).
    pub set_access: Duration,
    /// `set_access` cost of each further 2 MiB granule in the same call (0.24 us).
    pub set_access_per_extra_granule: Duration,
    /// `unmap` of each mapping in the call (22.4 us; a multi-mapping unmap is no cheaper).
    pub unmap_per_mapping: Duration,
    /// `synchronize` of an idle device.
    pub synchronize: Duration,
    /// Fixed cost of one copy.
    pub copy_base: Duration,
    /// Copy bandwidth in bytes per microsecond (PCIe Gen5-like: 50,000 B/us).
    pub copy_bytes_per_us: u64,
    /// Any other call (queries, export, import).
    pub other: Duration,
}

impl LatencyModel {
    /// The H200 medians (`docs/driver-semantics.md`).
    pub fn h200() -> Self {
        LatencyModel {
            reserve: Duration::from_micros(10),
            free: Duration::from_micros(10),
            create: Duration::from_nanos(11_800),
            release: Duration::from_nanos(14_000),
            map: Duration::from_nanos(1_100),
            set_access: Duration::from_nanos(29_400),
            set_access_per_extra_granule: Duration::from_nanos(240),
            unmap_per_mapping: Duration::from_nanos(22_400),
            synchronize: Duration::from_micros(5),
            copy_base: Duration::from_micros(8),
            copy_bytes_per_us: 50_000,
            other: Duration::from_micros(1),
        }
    }

    /// A model where every call is free.
    pub fn zero() -> Self {
        LatencyModel {
            reserve: Duration::ZERO,
            free: Duration::ZERO,
            create: Duration::ZERO,
            release: Duration::ZERO,
            map: Duration::ZERO,
            set_access: Duration::ZERO,
            set_access_per_extra_granule: Duration::ZERO,
            unmap_per_mapping: Duration::ZERO,
            synchronize: Duration::ZERO,
            copy_base: Duration::ZERO,
            copy_bytes_per_us: u64::MAX,
            other: Duration::ZERO,
        }
    }

    /// The modelled cost of one call of `op`; `units` is the number of granules for
    /// `set_access`, of mappings for `unmap`, and of bytes for copies.
    pub fn cost(&self, op: Operation, units: u64) -> Duration {
        match op {
            Operation::Reserve => self.reserve,
            Operation::Free => self.free,
            Operation::Create => self.create,
            Operation::Release => self.release,
            Operation::Map => self.map,
            Operation::SetAccess => self.set_access.saturating_add(
                self.set_access_per_extra_granule
                    .saturating_mul(u32::try_from(units.saturating_sub(1)).unwrap_or(u32::MAX)),
            ),
            Operation::Unmap => self
                .unmap_per_mapping
                .saturating_mul(u32::try_from(units.max(1)).unwrap_or(u32::MAX)),
            Operation::Synchronize => self.synchronize,
            Operation::CopyToDevice | Operation::CopyFromDevice => {
                let bw = self.copy_bytes_per_us.max(1);
                self.copy_base
                    .saturating_add(Duration::from_nanos(units.saturating_mul(1000) / bw))
            }
            _ => self.other,
        }
    }
}

impl Default for LatencyModel {
    fn default() -> Self {
        LatencyModel::h200()
    }
}

/// Full configuration of a [`SimBackend`](crate::SimBackend).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    /// The devices, in ordinal order (at least one).
    pub devices: Vec<SimDeviceConfig>,
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
            address_space: 1 << 47,
            quirks: SimQuirks::default(),
            latency: LatencyModel::h200(),
            latency_mode: LatencyMode::Account,
        }
    }
}
