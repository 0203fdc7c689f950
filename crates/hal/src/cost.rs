//! [`LatencyModel`]: the modelled cost of each driver call, written once for every layer that
//! estimates driver time (the simulated driver, the workload's counting wrapper).

use std::time::Duration;

use crate::Operation;

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
            Operation::CopyToDevice | Operation::CopyFromDevice | Operation::CopyRows => {
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
