//! The `kvvm.SharedPrefix` object itself (its methods are in `prefix.rs`): what a sequence
//! that owns a prefix hands out, without `sequence.rs` and `prefix.rs` importing each other.

use std::sync::Arc;

use kvvm_kv::SharedDevicePrefix;
use pyo3::prelude::*;

/// A prefix one sequence owns (read-write until sealed) and others map read-only.
#[pyclass(frozen, module = "kvvm._native")]
pub struct SharedPrefix {
    pub(crate) prefix: Arc<SharedDevicePrefix>,
}
