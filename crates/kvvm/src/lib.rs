//! # kvvm: GPU memory for LLM KV caches through the drivers' virtual-memory API
//!
//! kvvm reserves a request's KV-cache address range once, commits physical granules as the
//! cache grows (no copy, the pointer never changes), shares prompt prefixes by mapping one
//! physical allocation read-only at several addresses (billed once), and turns memory
//! exhaustion into backpressure instead of a crash. This crate is the facade: it opens a
//! backend by name and re-exports the whole stack, so one dependency gives a user everything:
//!
//! | path | crate | what |
//! |---|---|---|
//! | `kvvm::hal` (and the root) | `kvvm-hal` | the driver interface and its neutral types |
//! | `kvvm::sim`, `kvvm::cuda`, `kvvm::hip`, `kvvm::host` | the backends | the simulated driver, CUDA, HIP, the host's virtual memory |
//! | [`kvvm::governor`](governor) | `kvvm-governor` | byte budgets, grants, backpressure |
//! | [`kvvm::vmm`](vmm) | `kvvm-vmm` | the manager: reservations, commit, pool, quarantine |
//! | [`kvvm::layout`](layout) | `kvvm-layout` | KV geometry, layouts, shareability arithmetic |
//! | [`kvvm::kv`](kv) | `kvvm-kv` | sequences, shared prefixes, the prefix cache, pre-commit |
//! | [`kvvm::host_kv`](host_kv) | `kvvm-host-kv` | a paged KV cache in host RAM whose forks share pages, copied on the first write (no GPU) |
//! | [`kvvm::num`](num) | `kvvm-num` | checked arithmetic, sizes, the seeded RNG |
//! | [`kvvm::prelude`](prelude) | | the names most programs use |
//!
//! | name | backend |
//! |---|---|
//! | `"cuda"` | the CUDA driver (libcuda, loaded at run time) |
//! | `"hip"` | the HIP runtime (libamdhip64, loaded at run time; `KVVM_HIP_LIBRARY` overrides) |
//! | `"sim"` | the in-process simulated driver (one simulated H200; `KVVM_SIM_DEVICES=N` for N of them) |
//! | `"host"` | the host's own virtual memory (memfd + mmap; Linux): addressable KV bytes on the CPU |
//! | `"auto"` | CUDA if it opens, else HIP, else the simulator, with a notice saying why (never `host`: it is chosen by name) |
//!
//! ```
//! use kvvm::prelude::*;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let backend = kvvm::open_backend("sim")?;
//! let vm = VirtualMemory::new(backend, DeviceId(0), Governor::unlimited(), VmmConfig::default())?;
//! let plan = LayoutPlan::new(
//!     KvGeometry::preset("llama-3-8b", KvDtype::F16, 4096)?,
//!     KvLayout::TokenMajor,
//!     vm.granule(),
//! )?;
//! let mut seq = SequenceKv::new(&vm, &plan, 4096)?;
//! seq.ensure_tokens(100)?;
//! assert!(seq.committed_bytes() > 0);
//! # Ok(())
//! # }
//! ```
//!
//! ```
//! let opened = kvvm::open_backend_verbose("auto").unwrap();
//! // On a machine without a GPU, `auto` falls back to the simulator and says so.
//! if let Some(notice) = &opened.notice {
//!     eprintln!("{notice}");
//! }
//! let devices = opened.backend.devices().unwrap();
//! assert!(!devices.is_empty());
//! ```
//!
//! ## Why `Arc<dyn VirtualMemoryBackend>` and not an enum
//!
//! See `docs/decisions.md`: enum_dispatch needs the trait and the enum in one crate, and our
//! trait lives in `kvvm-hal` below the backends. A virtual call costs about a nanosecond; the
//! cheapest driver call (a map) costs about a microsecond.

#![forbid(unsafe_code)]

pub use kvvm_broker as broker;
pub use kvvm_cuda as cuda;
pub use kvvm_governor as governor;
pub use kvvm_hal as hal;
pub use kvvm_hal::{
    Access, AccessDescriptor, AllocationProperties, BackendError, BackendResult, Capabilities,
    DeviceAddress, DeviceId, DeviceInfo, ErrorKind, Granularity, MemoryInfo, Operation,
    PhysicalHandle, ShareableHandleType, VirtualMemoryBackend,
};
pub use kvvm_hip as hip;
pub use kvvm_host as host;
/// The host paged KV cache with copy-on-write forks (`PagedKvCache::fork`,
/// `ensure_page_for_write`): the host side of kvvm, where a fork shares every page and copies
/// one only when it writes into it while a sibling still maps it. On the device a shared
/// prefix is read-only instead ([`kv::SharedDevicePrefix`]).
pub use kvvm_host_kv as host_kv;
pub use kvvm_kv as kv;
pub use kvvm_layout as layout;
pub use kvvm_num as num;
pub use kvvm_sim as sim;
pub use kvvm_vmm as vmm;

/// The names most programs use: open a backend, make a manager, plan a layout, hold
/// sequences and shared prefixes.
pub mod prelude {
    pub use crate::{open_backend, open_backend_verbose};
    pub use kvvm_governor::{Backpressure, Governor, GovernorConfig};
    pub use kvvm_hal::{BackendError, DeviceAddress, DeviceId, ErrorKind, VirtualMemoryBackend};
    pub use kvvm_kv::{KvCacheError, PrefixCache, SequenceKv, SharedDevicePrefix};
    pub use kvvm_layout::{
        evaluate_prefix_shareability, KvDtype, KvGeometry, KvLayout, LayoutPlan,
    };
    pub use kvvm_vmm::{Reservation, VirtualMemory, VmmConfig, VmmError};
}

use std::sync::Arc;

/// The README's Rust examples, compiled and run as doc tests (`cargo test -p kvvm --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;

/// The names [`open_backend`] accepts.
pub const BACKEND_NAMES: [&str; 5] = ["auto", "cuda", "hip", "sim", "host"];

/// Why a backend could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The name is not one of [`BACKEND_NAMES`].
    #[error("unknown backend {0:?} (expected one of: auto, cuda, hip, sim, host)")]
    UnknownBackend(String),
    /// The backend exists but cannot be used here (library, symbol or device missing, ...).
    #[error("backend {name} is unavailable: {source}")]
    Backend {
        /// The backend's name.
        name: String,
        /// The backend's error (kind [`ErrorKind::Unavailable`] in most cases).
        #[source]
        source: BackendError,
    },
}

impl OpenError {
    /// The backend error, when the backend itself refused.
    pub fn backend_error(&self) -> Option<&BackendError> {
        match self {
            OpenError::Backend { source, .. } => Some(source),
            OpenError::UnknownBackend(_) => None,
        }
    }
}

/// A backend that was opened, with a notice when `auto` had to fall back.
pub struct OpenedBackend {
    /// The backend.
    pub backend: Arc<dyn VirtualMemoryBackend>,
    /// For `auto`: why the better backends were not chosen, when the choice fell back.
    pub notice: Option<String>,
    /// For `auto`: the backends tried before the one chosen and why each could not be
    /// opened, in the order tried (empty when the first choice opened).
    pub passed_over: Vec<OpenError>,
}

impl std::fmt::Debug for OpenedBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenedBackend")
            .field("backend", &self.backend.name())
            .field("notice", &self.notice)
            .field("passed_over", &self.passed_over)
            .finish()
    }
}

/// The backend `opened` shared, or its error as backend `name`'s refusal.
fn shared<B: VirtualMemoryBackend + 'static>(
    name: &str,
    opened: Result<B, BackendError>,
) -> Result<Arc<dyn VirtualMemoryBackend>, OpenError> {
    opened
        .map(|b| Arc::new(b) as Arc<dyn VirtualMemoryBackend>)
        .map_err(|source| OpenError::Backend {
            name: name.into(),
            source,
        })
}

fn open_cuda() -> Result<Arc<dyn VirtualMemoryBackend>, OpenError> {
    shared("cuda", kvvm_cuda::CudaBackend::open())
}

fn open_hip() -> Result<Arc<dyn VirtualMemoryBackend>, OpenError> {
    shared("hip", kvvm_hip::HipBackend::open())
}

/// The environment variable giving the number of simulated H200s that `"sim"`, and `"auto"`
/// without a GPU, open (1 to 8, default 1), all linked to each other: how the peer cases and
/// multi-device commands run on a machine without GPUs.
pub const SIM_DEVICES_ENV: &str = "KVVM_SIM_DEVICES";

fn open_sim() -> Result<Arc<dyn VirtualMemoryBackend>, OpenError> {
    let devices = match std::env::var(SIM_DEVICES_ENV) {
        Err(_) => 1,
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n @ 1..=8) => n,
            _ => {
                return Err(OpenError::Backend {
                    name: "sim".into(),
                    source: BackendError::raised(
                        Operation::Load,
                        ErrorKind::InvalidValue,
                        format!(
                            "{SIM_DEVICES_ENV}={v:?}: a number of devices from 1 to 8 expected"
                        ),
                    ),
                })
            }
        },
    };
    let config = kvvm_sim::SimConfig {
        devices: vec![kvvm_sim::SimDeviceConfig::h200(); devices],
        ..kvvm_sim::SimConfig::default()
    };
    Ok(Arc::new(kvvm_sim::SimBackend::new(config)))
}

fn open_host() -> Result<Arc<dyn VirtualMemoryBackend>, OpenError> {
    shared("host", kvvm_host::HostBackend::open())
}

/// Opens the backend called `name` (see [`BACKEND_NAMES`]).
///
/// `"auto"` picks CUDA when it opens, else HIP, else the simulator; the fallback is logged
/// with `tracing::warn!`. Use [`open_backend_verbose`] to get the notice as a value.
pub fn open_backend(name: &str) -> Result<Arc<dyn VirtualMemoryBackend>, OpenError> {
    open_backend_verbose(name).map(|o| o.backend)
}

/// Like [`open_backend`], also returning the notice of an `auto` fallback.
pub fn open_backend_verbose(name: &str) -> Result<OpenedBackend, OpenError> {
    let plain = |backend| OpenedBackend {
        backend,
        notice: None,
        passed_over: Vec::new(),
    };
    match name {
        "sim" => open_sim().map(plain),
        "cuda" => open_cuda().map(plain),
        "hip" => open_hip().map(plain),
        "host" => open_host().map(plain),
        "auto" => {
            let cuda = match open_cuda() {
                Ok(b) => return Ok(plain(b)),
                Err(e) => e,
            };
            let hip = match open_hip() {
                Ok(b) => {
                    return Ok(OpenedBackend {
                        backend: b,
                        notice: Some(format!("auto: using hip ({cuda})")),
                        passed_over: vec![cuda],
                    })
                }
                Err(e) => e,
            };
            let notice = format!(
                "auto: no GPU backend available, using the simulated driver (sim). {cuda}. {hip}."
            );
            tracing::warn!("{notice}");
            Ok(OpenedBackend {
                backend: open_sim()?,
                notice: Some(notice),
                passed_over: vec![cuda, hip],
            })
        }
        other => Err(OpenError::UnknownBackend(other.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sim_opens() {
        let b = open_backend("sim").unwrap();
        assert_eq!(b.name(), "sim");
    }

    #[test]
    fn unknown_name_is_a_typed_error() {
        let e = open_backend("metal").unwrap_err();
        assert!(matches!(e, OpenError::UnknownBackend(_)));
        assert!(e.to_string().contains("auto, cuda, hip, sim, host"));
    }

    #[test]
    fn host_opens_by_name_and_never_through_auto() {
        match open_backend("host") {
            Ok(b) => assert_eq!(b.name(), "host"),
            Err(e) => {
                assert_eq!(
                    e.backend_error().map(|b| b.kind),
                    Some(ErrorKind::Unavailable)
                );
                println!("skipped: no host backend here ({e})");
            }
        }
        let auto = open_backend("auto").unwrap();
        assert_ne!(auto.name(), "host");
    }

    #[test]
    fn auto_always_opens_something_and_prefers_cuda() {
        let o = open_backend_verbose("auto").unwrap();
        if open_backend("cuda").is_ok() {
            assert_eq!(
                o.backend.name(),
                "cuda",
                "auto must pick CUDA when it is present"
            );
            assert!(o.notice.is_none());
        } else if o.backend.name() == "sim" {
            let notice = o.notice.unwrap();
            assert!(
                notice.contains("cuda") && notice.contains("hip"),
                "{notice}"
            );
            let names: Vec<&str> = o
                .passed_over
                .iter()
                .map(|e| match e {
                    OpenError::Backend { name, .. } => name.as_str(),
                    OpenError::UnknownBackend(n) => n.as_str(),
                })
                .collect();
            assert_eq!(names, ["cuda", "hip"]);
            println!("skipped: no CUDA driver (auto fell back: {notice})");
        }
    }

    #[test]
    fn cuda_is_unavailable_or_works_and_never_panics() {
        match open_backend("cuda") {
            Ok(b) => assert_eq!(b.name(), "cuda"),
            Err(e) => {
                let be = e.backend_error().unwrap();
                assert_eq!(be.kind, ErrorKind::Unavailable);
                assert!(be.detail.as_deref().is_some_and(|d| !d.is_empty()));
                println!("skipped: no CUDA driver ({e})");
            }
        }
    }
}
