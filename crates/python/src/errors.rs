//! Rust errors as the Python exceptions of `kvvm.errors`.
//!
//! The exception classes are written in Python (`kvvm/errors.py`, with their attributes and
//! docs) and cached once (`error_class.rs`); this module picks the class that says what the
//! caller can do and fills its attributes. Nothing here panics: if the module cannot be
//! imported, a `RuntimeError` with the same message is raised instead.

use kvvm::governor::{Backpressure, Limit, NeverFits};
use kvvm::hal::{BackendError, ErrorKind};
use kvvm::kv::{KvCacheError, KvError};
use kvvm::vmm::VmmError;
use kvvm::OpenError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

pub(crate) use crate::error_class::ErrorClass;

/// An attribute value of an exception.
pub(crate) enum Attr {
    Int(u64),
    Float(f64),
    Str(String),
}

/// Builds `class(message, **attrs)` as a Python exception.
pub(crate) fn raise(
    py: Python<'_>,
    class: ErrorClass,
    message: String,
    attrs: &[(&str, Attr)],
) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let cls = class.type_object(py)?;
        let kwargs = PyDict::new(py);
        for (k, v) in attrs {
            match v {
                Attr::Int(i) => kwargs.set_item(*k, *i)?,
                Attr::Float(f) => kwargs.set_item(*k, *f)?,
                Attr::Str(s) => kwargs.set_item(*k, s.as_str())?,
            }
        }
        let value = cls.call((message.clone(),), Some(&kwargs))?;
        Ok(PyErr::from_value(value))
    };
    match build() {
        Ok(e) => e,
        Err(_) => PyRuntimeError::new_err(message),
    }
}

/// `kvvm.errors.InvalidArgumentError(message)`.
pub(crate) fn invalid(py: Python<'_>, message: impl Into<String>) -> PyErr {
    raise(py, ErrorClass::InvalidArgument, message.into(), &[])
}

/// A refusal for good: no freeing can make the request fit.
pub(crate) fn never_fits(py: Python<'_>, n: &NeverFits) -> PyErr {
    let limit = match n.limit {
        Limit::DeviceBudget | Limit::ProcessBudget => "budget",
        Limit::DeviceMemory => "device",
    };
    raise(
        py,
        ErrorClass::NeverFits,
        format!("{n}: it can never fit"),
        &[
            ("needed_bytes", Attr::Int(n.needed)),
            ("limit_bytes", Attr::Int(n.limit_bytes)),
            ("limit", Attr::Str(limit.to_owned())),
            ("limit_kind", Attr::Str(n.limit.as_str().to_owned())),
        ],
    )
}

/// A refusal for now: retry after `retry_after`.
pub(crate) fn backpressure(py: Python<'_>, b: &Backpressure) -> PyErr {
    raise(
        py,
        ErrorClass::Backpressure,
        b.to_string(),
        &[
            ("retry_after", Attr::Float(b.retry_after.as_secs_f64())),
            ("needed_bytes", Attr::Int(b.needed)),
            ("available_bytes", Attr::Int(b.available)),
            ("device", Attr::Int(u64::from(b.device.0))),
        ],
    )
}

/// A driver error by its kind.
pub(crate) fn backend(py: Python<'_>, e: &BackendError) -> PyErr {
    let class = match e.kind {
        ErrorKind::Unavailable => return raise(py, ErrorClass::Unavailable, e.to_string(), &[]),
        ErrorKind::OutOfMemory => ErrorClass::OutOfMemory,
        _ => ErrorClass::Driver,
    };
    raise(
        py,
        class,
        e.to_string(),
        &[
            ("op", Attr::Str(e.op.as_str().to_owned())),
            ("kind", Attr::Str(e.kind.as_str().to_owned())),
            ("code", Attr::Int(e.code.unsigned_abs())),
            ("code_name", Attr::Str(e.code_name.clone())),
        ],
    )
}

/// A manager error.
pub(crate) fn vmm(py: Python<'_>, e: &VmmError) -> PyErr {
    match e {
        VmmError::Backpressure(b) => backpressure(py, b),
        VmmError::NeverFits(n) => never_fits(py, n),
        VmmError::Backend(b) => backend(py, b),
        VmmError::OutOfBounds { .. }
        | VmmError::SizeOverflow { .. }
        | VmmError::ZeroSize
        | VmmError::GrantMismatch { .. }
        | VmmError::AlreadyMapped { .. }
        | VmmError::InvalidArgument { .. } => invalid(py, e.to_string()),
        VmmError::Busy { .. } => raise(py, ErrorClass::Busy, e.to_string(), &[]),
        VmmError::BadGranularity { .. } | VmmError::Accounting(_) => {
            raise(py, ErrorClass::Kvvm, e.to_string(), &[])
        }
    }
}

/// A layout error (bad geometry, overflow, unknown names).
pub(crate) fn layout(py: Python<'_>, e: &KvError) -> PyErr {
    invalid(py, e.to_string())
}

/// A KV-layer error.
pub(crate) fn kv(py: Python<'_>, e: &KvCacheError) -> PyErr {
    match e {
        KvCacheError::Backpressure(b) => backpressure(py, b),
        KvCacheError::NeverFits(n) => never_fits(py, n),
        KvCacheError::Vmm(v) => vmm(py, v),
        KvCacheError::Backend(b) => backend(py, b),
        KvCacheError::Layout(l) => layout(py, l),
        KvCacheError::NotShareable { .. } => {
            raise(py, ErrorClass::NotShareable, e.to_string(), &[])
        }
        KvCacheError::WriteIntoSharedPrefix { .. } => {
            raise(py, ErrorClass::WriteIntoSharedPrefix, e.to_string(), &[])
        }
        KvCacheError::NotCommitted { .. } | KvCacheError::Forgotten { .. } => {
            raise(py, ErrorClass::NotCommitted, e.to_string(), &[])
        }
        KvCacheError::TooManyTokens { tokens, max_tokens } => raise(
            py,
            ErrorClass::TooManyTokens,
            e.to_string(),
            &[
                ("tokens", Attr::Int(*tokens)),
                ("max_tokens", Attr::Int(*max_tokens)),
            ],
        ),
        KvCacheError::BadLength { .. }
        | KvCacheError::PlanMismatch { .. }
        | KvCacheError::InUse { .. }
        | KvCacheError::OtherManager { .. } => invalid(py, e.to_string()),
        KvCacheError::PrefixNotWritten { .. } => {
            raise(py, ErrorClass::PrefixNotWritten, e.to_string(), &[])
        }
        _ => raise(py, ErrorClass::Kvvm, e.to_string(), &[]),
    }
}

/// A backend that could not be opened.
pub(crate) fn open(py: Python<'_>, e: &OpenError) -> PyErr {
    match e {
        OpenError::UnknownBackend(_) => invalid(py, e.to_string()),
        OpenError::Backend { source, .. } if source.kind == ErrorKind::Unavailable => {
            raise(py, ErrorClass::Unavailable, e.to_string(), &[])
        }
        OpenError::Backend { source, .. } => backend(py, source),
    }
}
