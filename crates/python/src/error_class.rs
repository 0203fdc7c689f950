//! The exception classes of `kvvm.errors`, as a typed enum and a cache of the class objects.
//!
//! The hierarchy is written in Python (`kvvm/errors.py`: several classes also derive from a
//! builtin such as `ValueError` or `MemoryError`, and carry attributes set by `__init__`, which
//! a class made in Rust cannot express). The module is imported once, on the first error, and
//! every class object is kept; a raise indexes the cache by [`ErrorClass`], never by name.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// One exception class of `kvvm.errors`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ErrorClass {
    Kvvm,
    Backpressure,
    NeverFits,
    Busy,
    Unavailable,
    InvalidArgument,
    TooManyTokens,
    Driver,
    OutOfMemory,
    ViewsAlive,
    NotCommitted,
    WriteIntoSharedPrefix,
    NotShareable,
    PrefixNotWritten,
}

impl ErrorClass {
    /// Every class, in the order of the cache.
    const ALL: [ErrorClass; 14] = [
        ErrorClass::Kvvm,
        ErrorClass::Backpressure,
        ErrorClass::NeverFits,
        ErrorClass::Busy,
        ErrorClass::Unavailable,
        ErrorClass::InvalidArgument,
        ErrorClass::TooManyTokens,
        ErrorClass::Driver,
        ErrorClass::OutOfMemory,
        ErrorClass::ViewsAlive,
        ErrorClass::NotCommitted,
        ErrorClass::WriteIntoSharedPrefix,
        ErrorClass::NotShareable,
        ErrorClass::PrefixNotWritten,
    ];

    /// The class's name in `kvvm.errors` (read once, when the cache is filled).
    const fn python_name(self) -> &'static str {
        match self {
            ErrorClass::Kvvm => "KvvmError",
            ErrorClass::Backpressure => "BackpressureError",
            ErrorClass::NeverFits => "NeverFitsError",
            ErrorClass::Busy => "BusyError",
            ErrorClass::Unavailable => "UnavailableError",
            ErrorClass::InvalidArgument => "InvalidArgumentError",
            ErrorClass::TooManyTokens => "TooManyTokensError",
            ErrorClass::Driver => "DriverError",
            ErrorClass::OutOfMemory => "OutOfMemoryError",
            ErrorClass::ViewsAlive => "ViewsAliveError",
            ErrorClass::NotCommitted => "NotCommittedError",
            ErrorClass::WriteIntoSharedPrefix => "WriteIntoSharedPrefixError",
            ErrorClass::NotShareable => "NotShareableError",
            ErrorClass::PrefixNotWritten => "PrefixNotWrittenError",
        }
    }

    /// The class object, from the cache (filled on first use).
    pub(crate) fn type_object<'py>(self, py: Python<'py>) -> PyResult<&'py Bound<'py, PyType>> {
        let classes = CLASSES.get_or_try_init(py, || load(py))?;
        // `ALL` lists every variant once, in declaration order: the index is always found.
        classes
            .get(self as usize)
            .map(|c| c.bind(py))
            .ok_or_else(|| {
                PyRuntimeError::new_err(format!("kvvm.errors: no {}", self.python_name()))
            })
    }
}

/// The class objects of `kvvm.errors`, indexed by `ErrorClass as usize`.
static CLASSES: PyOnceLock<[Py<PyType>; 14]> = PyOnceLock::new();

/// Imports `kvvm.errors` and takes every class of [`ErrorClass::ALL`] from it.
fn load(py: Python<'_>) -> PyResult<[Py<PyType>; 14]> {
    let module = py.import("kvvm.errors")?;
    let mut classes = Vec::with_capacity(ErrorClass::ALL.len());
    for class in ErrorClass::ALL {
        let object = module.getattr(class.python_name())?;
        classes.push(object.cast_into::<PyType>()?.unbind());
    }
    classes
        .try_into()
        .map_err(|_: Vec<Py<PyType>>| PyRuntimeError::new_err("kvvm.errors: classes missing"))
}
