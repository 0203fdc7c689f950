//! # kvvm-vmm: the device virtual-memory manager
//!
//! Written once over [`VirtualMemoryBackend`](kvvm_hal::VirtualMemoryBackend) (no backend-specific
//! code), this crate turns the driver's seven VMM calls into a KV-cache friendly object:
//! reserve an address range once for the maximum size, commit physical granules as the cache
//! grows, release without ever moving data or changing the pointer.
//!
//! * [`VirtualMemory`]: one per device (`Send + Sync`, cheap to clone). It knows the
//!   granule (queried from the driver, never hard-coded), owns the handle pool and the
//!   quarantine, and charges a [`Governor`].
//! * [`Reservation`]: a reserved range whose base address never changes (invariant 5).
//!
//! ## Commit is a transaction
//!
//! [`Reservation::commit`] maps whole granules after the committed end, never beyond the
//! reservation (the driver does not check; the manager does, with checked arithmetic):
//!
//! 1. take handles from the pool where it pays: a handle of exactly a piece's size skips a
//!    create; smaller pooled handles tiling a piece serve it only when mapping them costs no
//!    more than creating one handle and mapping it, by [`VmmConfig::commit_cost`] (the cost
//!    of a commit is per mapping, so the pool never turns one mapping into many that cost
//!    more);
//! 2. **grant first**: ask the governor for the bytes the pool cannot supply
//!    ([`Reservation::commit_with_grant`] takes a grant obtained earlier). No grant, no commit:
//!    a refusal is [`VmmError::Backpressure`] with a `retry_after` when freeing can help, and
//!    [`VmmError::NeverFits`] (no retry time) when the reservation would then hold more than
//!    the device or than the budget less its quarantine: what it maps already plus every
//!    window it asks for, pooled or not (a pooled handle is inside the budget already, so it is
//!    no discount). That check is made once, before anything else, at a cost per mapping
//!    of the reservation, never per window.
//!    Nothing of a commit is listed or checked per window: its windows are sorted runs
//!    (`windows/spans.rs`), so that besides the driver calls it costs per run and per handle;
//! 3. each contiguous run of windows is cut into as few handles as it allows (largest first,
//!    power-of-two numbers of granules aligned to their size from the base, at most
//!    [`VmmConfig::max_handle_bytes`]); each handle is created (unless the pool serves it,
//!    step 1) and mapped whole. No over-commit: exactly the windows asked for;
//! 4. set access **once** over each contiguous run (the driver's cost is per mapping), retrying
//!    [`Capabilities::set_access_retries`](kvvm_hal::Capabilities) extra times.
//!
//! If any step fails, the blocks this commit mapped are unmapped one by one in reverse order
//! and their handles returned to the pool (or released when the pool is full); the grant is
//! rolled back. If an unmap itself fails, that block stays recorded in the reservation (it
//! *is* still mapped) and its bytes stay accounted as committed; [`Reservation::release`]
//! retries it later. Err does not mean nothing happened, but the manager's books always equal
//! the driver's truth.
//!
//! ## Release keeps the address
//!
//! [`Reservation::release`] (and [`Reservation::truncate`]) unmap blocks (one unmap over each
//! run of adjacent blocks where
//! [`Capabilities::unmap_spans_mappings`](kvvm_hal::Capabilities), one per mapping otherwise,
//! e.g. on HIP where a multi-mapping unmap breaks the later free), return the handles to the
//! pool or release them, and keep the address range for later commits.
//!
//! ## Teardown and quarantine
//!
//! Dropping a [`Reservation`] that still holds blocks first synchronizes the device. If that
//! fails, the memory cannot be proven idle: a warning is logged through `tracing` and
//! **nothing** is unmapped, released or freed. The blocks and the range move to quarantine
//! ([`VirtualMemory::quarantine`]): counted by the governor as quarantined (neither used by
//! anyone nor free) and never reused. A certain leak is better than an uncertain corruption.
//! On success the blocks are unmapped, the handles returned or released, and the range freed;
//! whatever fails on that path (an unmap, a release, the free) is logged and quarantined,
//! never forgotten.
//!
//! ## Handle pool
//!
//! Released handles are kept for reuse, by size, up to
//! [`VmmConfig::pool_cap_bytes`]. Pooled bytes are physical memory held, reported as *pooled*
//! in the governor's snapshot and charged to the budget. The pool registers itself as a
//! [`Reclaimer`](kvvm_governor::Reclaimer): before refusing a grant the governor asks it to
//! release handles ("evict before refusing"). [`VirtualMemory::trim_pool`] trims it on demand;
//! the pool is released when the last clone of the manager and the last reservation are gone.
//!
//! ## Accounting (invariants 1-3)
//!
//! * committed bytes of a reservation = granule x committed windows
//!   ([`Reservation::committed_bytes`]). A multi-window handle straddling a release boundary
//!   stays mapped whole and its windows committed until a release covers all of it (see
//!   `docs/manager.md`, the partial-release rule): mapped memory is never reported free;
//! * governor used = committed + pooled + shared + quarantined = physical bytes the process
//!   holds on the device (what the simulated driver's ledger reports);
//! * after any error, every recorded block is a live driver mapping and vice versa; every
//!   handle is in exactly one place (a block, the pool, or quarantine).
//!
//! The tests (`tests/`) check these after every injected fault at every driver-call position.
//!
//! ## Shared handles
//!
//! [`Reservation::commit_shared`] commits windows as a [`SharedHandles`] set, billed once as
//! *shared*, mapped read-write by its owner; [`Reservation::map_shared`] maps windows of a set
//! at the same offsets of another reservation, read-only for sharers. Blocks carry a
//! [`BlockKind`]: unmapping a shared block drops one reference; the set's handles are released
//! only when its last holder (a mapping, the owner's handle on it, a prefix cache) is gone, so
//! never before the owner and every sharer unmapped them. If a sharer's map succeeds and its set
//! access fails, the mapping is withdrawn and counted down while the handles stay with the set.
//! [`Reservation::commit_range`] commits the unmapped windows of any ranges (not only after the
//! committed end), which is what a KV layout whose live bytes are spread over many fragments
//! needs.
//!
//! ## Where each part lives
//!
//! A type whose methods need several files has a folder named after it; its `mod.rs` says
//! what it is and the invariants it keeps, and no type's `impl` blocks leave its folder.
//!
//! | folder / file | what |
//! |---|---|
//! | `manager.rs`, `config.rs` | [`VirtualMemory`] and [`VmmConfig`] |
//! | `reservation/` | [`Reservation`]: its records and reads, bounds checks, which windows a commit takes, [`CommitJob`], shared mappings, release, teardown |
//! | `transaction/` | the commit transaction, step by step (parked windows, plan and pool, grant, create and map, set access, settle), each step's undo beside it |
//! | `device/` | the per-device state every reservation and shared set holds (the reclaimer), the device context, the handle pool, parked windows, the quarantine ([`QuarantineEntry`]) |
//! | `windows/` | sets of windows as sorted runs, so that a commit costs per run and per handle; how runs are cut into handles |
//! | `block.rs` | one mapping of a reservation as recorded |
//! | `shared.rs` | the [`SharedHandles`] set |
//! | `strided.rs` | the driver range shared by strided reservations (`reserve_strided`) |
//! | `mapping.rs`, `error.rs` | reported records ([`MappedBlock`], [`Commit`]) and [`VmmError`] |
//!
//! The imports go `sync, config, error, mapping -> windows -> device -> shared, strided,
//! block -> transaction -> reservation -> manager`.
//!
//! ## Example
//!
//! ```
//! use std::sync::Arc;
//! use kvvm_hal::DeviceId;
//! use kvvm_sim::{SimBackend, SimConfig};
//! use kvvm_vmm::{VirtualMemory, VmmConfig};
//! use kvvm_governor::Governor;
//!
//! # fn main() -> Result<(), kvvm_vmm::VmmError> {
//! let g = 2 << 20;
//! let sim = Arc::new(SimBackend::new(SimConfig::single(g, 64 * g)));
//! let vm = VirtualMemory::new(sim.clone(), DeviceId(0), Governor::with_device_budget(16 * g),
//!                             VmmConfig::default())?;
//! let mut kv = vm.reserve(1 << 30)?;          // 1 GiB of address space, no memory
//! let base = kv.address();
//! kv.commit(3 * g)?;                          // prefill: three granules
//! kv.ensure_committed(5 * g)?;                // decode grows: two more, same pointer
//! assert_eq!((kv.address(), kv.committed_bytes()), (base, 5 * g));
//! let mut other = vm.reserve(1 << 30)?;
//! other.commit(8 * g)?;                       // another sequence holds 8 of the 16
//! assert!(kv.commit(6 * g).unwrap_err().is_retryable()); // over what is free: backpressure
//! // 5 held + 12 more is over the budget whatever the others free: never fits.
//! assert!(matches!(kv.commit(12 * g), Err(kvvm_vmm::VmmError::NeverFits(_))));
//! kv.release()?;                              // handles go to the pool, address kept
//! drop(kv);
//! drop(other);
//! drop(vm);
//! assert!(sim.ledger().is_empty());
//! # Ok(())
//! # }
//! ```

#![forbid(unsafe_code)]

mod block;
mod config;
mod device;
mod error;
mod manager;
mod mapping;
mod reservation;
mod shared;
mod strided;
mod transaction;
mod windows;

pub use config::{GranularityChoice, VmmConfig, DEFAULT_MAX_HANDLE_BYTES};
pub use device::quarantine::{QuarantineEntry, QuarantineReason};
pub use error::{VmmError, VmmResult};
pub use manager::VirtualMemory;
pub use mapping::{BlockKind, Commit, MappedBlock};
pub use reservation::job::CommitJob;
pub use reservation::Reservation;
pub use shared::{SharedHandles, SharedPiece};
pub use windows::cut::{buddy_windows_at, commit_pieces, max_handle_windows, shared_commit_pieces};

pub use kvvm_governor::{Backpressure, Governor, GovernorSnapshot, MappedGrowthGrant};
