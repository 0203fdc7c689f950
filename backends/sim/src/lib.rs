//! # kvvm-sim: a simulated GPU virtual-memory driver
//!
//! [`SimBackend`] implements [`VirtualMemoryBackend`](kvvm_hal::VirtualMemoryBackend) in
//! process, reproducing the semantics the CUDA driver showed on an NVIDIA H200
//! (`docs/driver-semantics.md`, summarised in the `kvvm-hal` crate docs): the same
//! [`ErrorKind`](kvvm_hal::ErrorKind) for the same misuse, deferred free of a
//! released-but-mapped handle, unreported double unmap, access enforcement on copies, and
//! granularity rules. Where the real driver is silent about a misuse (a map that runs past the
//! end of its reservation), the simulator refuses with `InvalidValue` so that bugs in the
//! layers above surface in tests.
//!
//! It adds what tests need and a real driver cannot give:
//!
//! * **Configurable devices** ([`SimConfig`]): count, granularity (4 KiB to 1 GiB and more),
//!   physical capacity (`OutOfMemory` past it).
//! * **Byte-accurate data** behind every handle, stored only where it was written, in 64 KiB
//!   chunks, a chunk of equal bytes as one byte ([`SimBackend::stored_bytes`] counts the host
//!   memory it holds): a 64 TiB reservation or a 140 GiB device costs nothing until bytes are
//!   written, and bytes never written read as zeros. The device's memory is the host's, so
//!   a server's default budget on the simulator is bounded by the host
//!   ([`default_budget`], [`host_memory_budget`]).
//! * **Fault injection** ([`FaultRule`]): fail the Nth call of an operation, every call from the
//!   Nth on, a seeded random plan, or every synchronize. An injected fault has no side effect.
//! * **A ledger** ([`Ledger`]): the driver's truth (live reservations, handles, allocations,
//!   mappings, bytes) that tests compare with the manager's bookkeeping.
//! * **A latency model** ([`LatencyModel`]), by default the H200 fit, which charges each
//!   call for what it covers as the driver does (a handle by its size, `set_access` by its
//!   fresh mappings, `unmap` by its mappings), accounted
//!   ([`SimBackend::estimated_driver_time`]) or also spent ([`LatencyMode::Spin`]).
//! * **Probe kernels** ([`KernelProbe`](kvvm_hal::KernelProbe)): loads and stores checked
//!   against the access of the device that launches them, so a peer's read-only mapping
//!   refuses its stores. A fault is `DeviceLost`, as on a GPU, but the simulated device stays
//!   usable.
//! * **Quirks** ([`SimQuirks`]): deliberately wrong semantics, to prove the conformance suite
//!   can fail, and the ROCm multi-unmap bug, to exercise the manager's capability handling.
//!
//! ```
//! use kvvm_hal::{AccessDescriptor, AllocationProperties, DeviceId, VirtualMemoryBackend};
//! use kvvm_sim::{SimBackend, SimConfig};
//!
//! # fn main() -> Result<(), kvvm_hal::BackendError> {
//! let sim = SimBackend::new(SimConfig::single(2 << 20, 64 << 20));
//! let g = 2 << 20;
//! let va = sim.reserve(4 * g, 0, None)?;
//! let h = sim.create(g, &AllocationProperties::device(DeviceId(0)))?;
//! sim.map(va, g, h)?;
//! sim.set_access(va, g, &[AccessDescriptor::read_write(DeviceId(0))])?;
//! sim.copy_to_device(va, b"kv")?;
//! let mut back = [0u8; 2];
//! sim.copy_from_device(&mut back, va)?;
//! assert_eq!(&back, b"kv");
//! sim.unmap(va, g)?;
//! sim.release(h)?;
//! sim.free(va, 4 * g)?;
//! assert!(sim.ledger().is_empty());
//! # Ok(())
//! # }
//! ```

#![forbid(unsafe_code)]

mod backend;
mod config;
mod error;
mod faults;
mod host;
mod ledger;
mod state;
mod store;

pub use backend::SimBackend;
pub use config::{
    LatencyMode, PeerLinks, SimConfig, SimDeviceConfig, SimQuirks, GIB, H200_GRANULE,
    H200_GRANULES, MIB,
};
pub use faults::{FaultPlan, FaultRule};
pub use host::{
    bounded_by_host, default_budget, host_memory_budget, host_memory_budget_from,
    host_memory_ceiling, HOST_BUDGET_DIVISOR, HOST_BUDGET_FALLBACK,
};
/// The cost model (defined in `kvvm-hal`, re-exported where the simulator is configured).
pub use kvvm_hal::LatencyModel;
pub use ledger::{Ledger, LedgerAllocation, LedgerHandle, LedgerMapping, LedgerReservation};
/// The bytes of a chunk of simulated memory's data ([`SimBackend::stored_bytes`]).
pub use store::CHUNK as DATA_CHUNK_BYTES;
