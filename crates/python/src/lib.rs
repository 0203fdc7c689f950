//! # kvvm-python: the native half of the `kvvm` Python package
//!
//! PyO3 bindings over the kvvm stack (facade, manager, governor, KV layer), built by maturin
//! as the extension module `kvvm._native` (abi3: one wheel for every CPython >= 3.11). The
//! module also makes the exception hierarchy (`exceptions.rs`), which `kvvm.errors`
//! re-exports. The pure-Python half (`python/kvvm`) re-exports these classes
//! (`kvvm.bindings`) and adds the Hugging Face transformers integration, the attention
//! kernels and the serving engine.
//!
//! | class | what it wraps |
//! |---|---|
//! | `Backend` | `kvvm::open_backend` (`auto`, `cuda`, `hip`, `host`, `sim`) |
//! | `Manager` | `VirtualMemory` + `Governor` (+ an optional `Precommitter`) |
//! | `KvGeometry`, `LayoutPlan` | the KV geometry and its layout for a granule |
//! | `Sequence` | `SequenceKv` (plain or pre-committed) |
//! | `SequenceBatch` | sequences in the slots of one strided reservation |
//! | `SharedPrefix`, `PrefixCache` | `SharedDevicePrefix`, `PrefixCache` |
//! | `TensorView` | a DLPack export of one layer's K or V (zero-copy) |
//! | `HostTier`, `SwappedKv` | `HostTier` (page-locked host memory), a sequence's swap |
//!
//! Every call that may reach the driver releases the GIL. Errors become the exceptions this
//! module makes (`errors.rs` maps every error variant to its class: backpressure with
//! `retry_after`, never-fits, unavailable, invalid argument, driver error with op and code,
//! ...); nothing panics on bad input.
//!
//! Lifetimes: a `TensorView`, and every tensor exported from it, keeps the sequences it covers
//! alive and counts as a view of each; `release` and `shrink` are refused with
//! `ViewsAliveError` while a view lives, so no tensor ever points at unmapped memory.

mod batch;
mod cell;
mod count;
mod dict;
mod errors;
mod exceptions;
mod geometry;
mod host_tier;
mod manager;
mod manager_open;
mod prefix_cache;
mod prefix_meta;
mod sequence;
mod store;
mod view;
mod views;

use pyo3::prelude::*;

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<manager::Backend>()?;
    m.add_class::<manager::Manager>()?;
    m.add_class::<manager::MemorySnapshot>()?;
    m.add_class::<geometry::PyGeometry>()?;
    m.add_class::<geometry::PyPlan>()?;
    m.add_class::<sequence::Sequence>()?;
    m.add_class::<batch::SequenceBatch>()?;
    m.add_class::<sequence::SharedPrefix>()?;
    m.add_class::<prefix_cache::PrefixCache>()?;
    m.add_class::<view::TensorView>()?;
    m.add_class::<host_tier::HostTier>()?;
    m.add_class::<host_tier::SwappedKv>()?;
    m.add("BACKEND_NAMES", kvvm::BACKEND_NAMES.to_vec())?;
    m.add("PREFIX_META_BYTES", kvvm::broker::proto::MAX_META)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    exceptions::add_to(m)
}
