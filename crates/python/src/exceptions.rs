//! The exception hierarchy of kvvm, built by the extension module itself.
//!
//! Every class is made here when the module is imported ([`add_to`]), with its docs, its
//! bases and the attributes a caller reads; `kvvm.errors` re-exports them (their
//! `__module__` is `kvvm.errors`, the path users import them from). Several classes derive
//! from a builtin as well (`InvalidArgumentError` is a `ValueError`, `OutOfMemoryError` a
//! `MemoryError`, ...), which a `#[pyclass]` cannot (one base only, and none from the
//! exception types under the stable ABI before Python 3.12): each class is made as
//! `type(name, bases, namespace)` makes one. A class with attributes gets an `__init__`
//! written in Rust (a `functools.partialmethod` over one of the functions below, so that it
//! binds as a method and `inspect.signature` reads its signature); the others keep
//! `BaseException`'s.
//!
//! A raise indexes the classes by [`ErrorClass`], never by name.

use pyo3::exceptions::PyBaseException;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// One exception class of the hierarchy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ErrorClass {
    /// `KvvmError(Exception)`: the base of every error kvvm raises.
    Kvvm,
    /// `BackpressureError(KvvmError)`: memory is short now.
    Backpressure,
    /// `NeverFitsError(KvvmError)`: no freeing can make the request fit.
    NeverFits,
    /// `BusyError(KvvmError)`: another thread commits or gives back the window now.
    Busy,
    /// `UnavailableError(KvvmError)`: the backend cannot be used here.
    Unavailable,
    /// `InvalidArgumentError(KvvmError, ValueError)`: a bug in the caller.
    InvalidArgument,
    /// `TooManyTokensError(InvalidArgumentError)`: past a sequence's maximum.
    TooManyTokens,
    /// `DriverError(KvvmError)`: a driver call failed.
    Driver,
    /// `OutOfMemoryError(DriverError, MemoryError)`: the driver ran out of memory.
    OutOfMemory,
    /// `ViewsAliveError(KvvmError)`: tensors still view the memory.
    ViewsAlive,
    /// `GraphsAliveError(ViewsAliveError)`: a captured graph may replay into the memory.
    GraphsAlive,
    /// `ReleasedError(KvvmError)`: the object was closed for good.
    Released,
    /// `NotCommittedError(KvvmError, IndexError)`: tokens past the committed ones.
    NotCommitted,
    /// `WriteIntoSharedPrefixError(KvvmError, PermissionError)`: a write into shared memory.
    WriteIntoSharedPrefix,
    /// `NotShareableError(KvvmError)`: the prefix cannot be shared under this layout.
    NotShareable,
    /// `PrefixNotWrittenError(KvvmError)`: a prefix published before it was written.
    PrefixNotWritten,
}

/// A builtin exception a class derives from beside its kvvm parent.
#[derive(Clone, Copy)]
enum Builtin {
    Value,
    Memory,
    Index,
    Permission,
}

/// How one class is made.
struct Spec {
    class: ErrorClass,
    name: &'static str,
    /// The kvvm parent (made before this class); `None`: `Exception`.
    parent: Option<ErrorClass>,
    builtin: Option<Builtin>,
    doc: &'static str,
    /// The class's own `__init__`, when it has attributes.
    init: Option<Init>,
}

/// The `__init__` functions of the classes with attributes.
#[derive(Clone, Copy)]
enum Init {
    Backpressure,
    NeverFits,
    TooManyTokens,
    Driver,
    ViewsAlive,
    GraphsAlive,
}

/// Every class, parents before children, in the order of [`ErrorClass`].
const SPECS: [Spec; 16] = [
    Spec {
        class: ErrorClass::Kvvm,
        name: "KvvmError",
        parent: None,
        builtin: None,
        doc: "Base class of every error kvvm raises.",
        init: None,
    },
    Spec {
        class: ErrorClass::Backpressure,
        name: "BackpressureError",
        parent: Some(ErrorClass::Kvvm),
        builtin: None,
        doc: "The memory budget cannot grant the request now; freeing memory can help.\n\n\
              Attributes:\n    \
              retry_after: seconds after which a retry is likely to succeed.\n    \
              needed_bytes: bytes the request asked for.\n    \
              available_bytes: bytes that could have been granted.\n    \
              device: the device ordinal.",
        init: Some(Init::Backpressure),
    },
    Spec {
        class: ErrorClass::NeverFits,
        name: "NeverFitsError",
        parent: Some(ErrorClass::Kvvm),
        builtin: None,
        doc: "The request is larger than a limit that no amount of freeing can lift.\n\n\
              Attributes:\n    \
              needed_bytes: bytes the request needs.\n    \
              limit_bytes: the most that limit could ever grant (a budget less the bytes in\n        \
              quarantine, which never come back; or the device's memory).\n    \
              limit: which limit (``\"budget\"`` or ``\"device\"``).\n    \
              limit_kind: the precise limit: ``\"device_budget\"``, ``\"process_budget\"`` or\n        \
              ``\"device_memory\"``.",
        init: Some(Init::NeverFits),
    },
    Spec {
        class: ErrorClass::Busy,
        name: "BusyError",
        parent: Some(ErrorClass::Kvvm),
        builtin: None,
        doc: "A window is being committed or given back by another thread right now (a \
              background commit in flight); nothing was done. Retry once it is done.",
        init: None,
    },
    Spec {
        class: ErrorClass::Unavailable,
        name: "UnavailableError",
        parent: Some(ErrorClass::Kvvm),
        builtin: None,
        doc: "The backend cannot be used on this machine (library, symbol or device missing).",
        init: None,
    },
    Spec {
        class: ErrorClass::InvalidArgument,
        name: "InvalidArgumentError",
        parent: Some(ErrorClass::Kvvm),
        builtin: Some(Builtin::Value),
        doc: "An argument is out of range or does not fit the object's state: a bug in the \
              caller.",
        init: None,
    },
    Spec {
        class: ErrorClass::TooManyTokens,
        name: "TooManyTokensError",
        parent: Some(ErrorClass::InvalidArgument),
        builtin: None,
        doc: "More tokens than the sequence (or the geometry) can hold.\n\n\
              Attributes:\n    \
              tokens: tokens asked for.\n    \
              max_tokens: the most the sequence holds.",
        init: Some(Init::TooManyTokens),
    },
    Spec {
        class: ErrorClass::Driver,
        name: "DriverError",
        parent: Some(ErrorClass::Kvvm),
        builtin: None,
        doc: "A driver call failed.\n\n\
              Attributes:\n    \
              op: the driver operation (``\"map\"``, ``\"create\"``, ...).\n    \
              kind: the neutral kind (``\"out of memory\"``, ``\"invalid value\"``, ...).\n    \
              code: the vendor's numeric code (0 when the backend raised it itself).\n    \
              code_name: the vendor's name for the code.",
        init: Some(Init::Driver),
    },
    Spec {
        class: ErrorClass::OutOfMemory,
        name: "OutOfMemoryError",
        parent: Some(ErrorClass::Driver),
        builtin: Some(Builtin::Memory),
        doc: "The driver itself ran out of physical memory or address space.",
        init: None,
    },
    Spec {
        class: ErrorClass::ViewsAlive,
        name: "ViewsAliveError",
        parent: Some(ErrorClass::Kvvm),
        builtin: None,
        doc: "The memory is still viewed by tensors (DLPack exports) and cannot be unmapped.\n\n\
              Attributes:\n    \
              views: live views (tensor exports and view objects) of the sequence.",
        init: Some(Init::ViewsAlive),
    },
    Spec {
        class: ErrorClass::GraphsAlive,
        name: "GraphsAliveError",
        parent: Some(ErrorClass::ViewsAlive),
        builtin: None,
        doc: "A CUDA graph captured over the memory is alive and may be replayed into it: \
              release is refused until the graph is dropped (``DecodeGraph.close()``, or the \
              graph object deleted).\n\n\
              Attributes:\n    \
              graphs: the graphs alive.",
        init: Some(Init::GraphsAlive),
    },
    Spec {
        class: ErrorClass::Released,
        name: "ReleasedError",
        parent: Some(ErrorClass::Kvvm),
        builtin: None,
        doc: "The object was closed (released for good) and cannot be used any more.",
        init: None,
    },
    Spec {
        class: ErrorClass::NotCommitted,
        name: "NotCommittedError",
        parent: Some(ErrorClass::Kvvm),
        builtin: Some(Builtin::Index),
        doc: "Tokens were read or written past the committed ones (call ``ensure`` first).",
        init: None,
    },
    Spec {
        class: ErrorClass::WriteIntoSharedPrefix,
        name: "WriteIntoSharedPrefixError",
        parent: Some(ErrorClass::Kvvm),
        builtin: Some(Builtin::Permission),
        doc: "A write into the read-only shared prefix of a sequence (no copy-on-write).",
        init: None,
    },
    Spec {
        class: ErrorClass::NotShareable,
        name: "NotShareableError",
        parent: Some(ErrorClass::Kvvm),
        builtin: None,
        doc: "The prefix cannot be shared under this layout and granule; the message says why.",
        init: None,
    },
    Spec {
        class: ErrorClass::PrefixNotWritten,
        name: "PrefixNotWrittenError",
        parent: Some(ErrorClass::Kvvm),
        builtin: None,
        doc: "A prefix was published or attached before its tokens were written and sealed.",
        init: None,
    },
];

/// The class objects, indexed by `ErrorClass as usize` (`SPECS`' order).
static CLASSES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

impl ErrorClass {
    /// The class object (made with the module; made now if it was not).
    pub(crate) fn type_object<'py>(self, py: Python<'py>) -> PyResult<Bound<'py, PyType>> {
        let classes = CLASSES.get_or_try_init(py, || build(py))?;
        match classes.get(self as usize) {
            Some(class) => Ok(class.bind(py).clone()),
            // `build` makes one class per spec, in the order of the variants.
            None => Err(pyo3::exceptions::PySystemError::new_err(format!(
                "kvvm: the exception class {self:?} was not made"
            ))),
        }
    }
}

/// Makes every class (once) and adds it to the module `m`.
pub(crate) fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    for spec in &SPECS {
        m.add(spec.name, spec.class.type_object(py)?)?;
    }
    Ok(())
}

/// Makes the classes of `SPECS`, parents first.
fn build(py: Python<'_>) -> PyResult<Vec<Py<PyType>>> {
    let partialmethod = py.import("functools")?.getattr("partialmethod")?;
    let type_type = py.get_type::<PyType>();
    let mut made: Vec<Py<PyType>> = Vec::with_capacity(SPECS.len());
    for (i, spec) in SPECS.iter().enumerate() {
        if spec.class as usize != i {
            return Err(pyo3::exceptions::PySystemError::new_err(
                "kvvm: the exception specs are out of order",
            ));
        }
        let mut bases = vec![match spec.parent {
            Some(parent) => made
                .get(parent as usize)
                .map(|c| c.bind(py).clone().into_any())
                .ok_or_else(|| {
                    pyo3::exceptions::PySystemError::new_err("kvvm: a parent class comes later")
                })?,
            None => py.get_type::<pyo3::exceptions::PyException>().into_any(),
        }];
        if let Some(builtin) = spec.builtin {
            bases.push(builtin_type(py, builtin).into_any());
        }
        let namespace = PyDict::new(py);
        namespace.set_item("__module__", "kvvm.errors")?;
        namespace.set_item("__qualname__", spec.name)?;
        namespace.set_item("__doc__", spec.doc)?;
        if let Some(init) = spec.init {
            namespace.set_item(
                "__init__",
                partialmethod.call1((init_function(py, init)?,))?,
            )?;
        }
        let class = type_type.call1((spec.name, PyTuple::new(py, bases)?, namespace))?;
        made.push(class.cast_into::<PyType>()?.unbind());
    }
    Ok(made)
}

fn builtin_type(py: Python<'_>, builtin: Builtin) -> Bound<'_, PyType> {
    use pyo3::exceptions::{PyIndexError, PyMemoryError, PyPermissionError, PyValueError};
    match builtin {
        Builtin::Value => py.get_type::<PyValueError>(),
        Builtin::Memory => py.get_type::<PyMemoryError>(),
        Builtin::Index => py.get_type::<PyIndexError>(),
        Builtin::Permission => py.get_type::<PyPermissionError>(),
    }
}

fn init_function(py: Python<'_>, init: Init) -> PyResult<Bound<'_, PyAny>> {
    let f = match init {
        Init::Backpressure => wrap_pyfunction!(backpressure_init, py)?,
        Init::NeverFits => wrap_pyfunction!(never_fits_init, py)?,
        Init::TooManyTokens => wrap_pyfunction!(too_many_tokens_init, py)?,
        Init::Driver => wrap_pyfunction!(driver_init, py)?,
        Init::ViewsAlive => wrap_pyfunction!(views_alive_init, py)?,
        Init::GraphsAlive => wrap_pyfunction!(graphs_alive_init, py)?,
    };
    Ok(f.into_any())
}

/// `BaseException.__init__(slf, message)`, then each attribute set.
fn init<'py>(
    slf: &Bound<'py, PyAny>,
    message: &Bound<'py, PyAny>,
    attrs: &[(&str, Bound<'py, PyAny>)],
) -> PyResult<()> {
    let py = slf.py();
    py.get_type::<PyBaseException>()
        .getattr("__init__")?
        .call1((slf, message))?;
    for (name, value) in attrs {
        slf.setattr(*name, value)?;
    }
    Ok(())
}

/// `BackpressureError.__init__`.
#[pyfunction]
#[pyo3(
    signature = (slf, message, retry_after=0.0, needed_bytes=0, available_bytes=0, device=0),
    text_signature = "(self, message, retry_after=0.0, needed_bytes=0, available_bytes=0, device=0)"
)]
fn backpressure_init(
    slf: &Bound<'_, PyAny>,
    message: &Bound<'_, PyAny>,
    retry_after: f64,
    needed_bytes: u64,
    available_bytes: u64,
    device: u32,
) -> PyResult<()> {
    let py = slf.py();
    init(
        slf,
        message,
        &[
            ("retry_after", retry_after.into_pyobject(py)?.into_any()),
            ("needed_bytes", needed_bytes.into_pyobject(py)?.into_any()),
            (
                "available_bytes",
                available_bytes.into_pyobject(py)?.into_any(),
            ),
            ("device", device.into_pyobject(py)?.into_any()),
        ],
    )
}

/// `NeverFitsError.__init__`.
#[pyfunction]
#[pyo3(
    signature = (slf, message, needed_bytes=0, limit_bytes=0, limit="budget", limit_kind="device_budget"),
    text_signature = "(self, message, needed_bytes=0, limit_bytes=0, limit='budget', limit_kind='device_budget')"
)]
fn never_fits_init(
    slf: &Bound<'_, PyAny>,
    message: &Bound<'_, PyAny>,
    needed_bytes: u64,
    limit_bytes: u64,
    limit: &str,
    limit_kind: &str,
) -> PyResult<()> {
    let py = slf.py();
    init(
        slf,
        message,
        &[
            ("needed_bytes", needed_bytes.into_pyobject(py)?.into_any()),
            ("limit_bytes", limit_bytes.into_pyobject(py)?.into_any()),
            ("limit", limit.into_pyobject(py)?.into_any()),
            ("limit_kind", limit_kind.into_pyobject(py)?.into_any()),
        ],
    )
}

/// `TooManyTokensError.__init__`.
#[pyfunction]
#[pyo3(
    signature = (slf, message, tokens=0, max_tokens=0),
    text_signature = "(self, message, tokens=0, max_tokens=0)"
)]
fn too_many_tokens_init(
    slf: &Bound<'_, PyAny>,
    message: &Bound<'_, PyAny>,
    tokens: u64,
    max_tokens: u64,
) -> PyResult<()> {
    let py = slf.py();
    init(
        slf,
        message,
        &[
            ("tokens", tokens.into_pyobject(py)?.into_any()),
            ("max_tokens", max_tokens.into_pyobject(py)?.into_any()),
        ],
    )
}

/// `DriverError.__init__` (and `OutOfMemoryError`'s).
#[pyfunction]
#[pyo3(
    signature = (slf, message, op="", kind="", code=0, code_name=""),
    text_signature = "(self, message, op='', kind='', code=0, code_name='')"
)]
fn driver_init(
    slf: &Bound<'_, PyAny>,
    message: &Bound<'_, PyAny>,
    op: &str,
    kind: &str,
    code: i64,
    code_name: &str,
) -> PyResult<()> {
    let py = slf.py();
    init(
        slf,
        message,
        &[
            ("op", op.into_pyobject(py)?.into_any()),
            ("kind", kind.into_pyobject(py)?.into_any()),
            ("code", code.into_pyobject(py)?.into_any()),
            ("code_name", code_name.into_pyobject(py)?.into_any()),
        ],
    )
}

/// `ViewsAliveError.__init__`.
#[pyfunction]
#[pyo3(signature = (slf, message, views=0), text_signature = "(self, message, views=0)")]
fn views_alive_init(
    slf: &Bound<'_, PyAny>,
    message: &Bound<'_, PyAny>,
    views: u64,
) -> PyResult<()> {
    let py = slf.py();
    init(
        slf,
        message,
        &[("views", views.into_pyobject(py)?.into_any())],
    )
}

/// `GraphsAliveError.__init__`: no tensor view counted, `graphs` graphs alive.
#[pyfunction]
#[pyo3(signature = (slf, message, graphs=0), text_signature = "(self, message, graphs=0)")]
fn graphs_alive_init(
    slf: &Bound<'_, PyAny>,
    message: &Bound<'_, PyAny>,
    graphs: u64,
) -> PyResult<()> {
    let py = slf.py();
    init(
        slf,
        message,
        &[
            ("views", 0u64.into_pyobject(py)?.into_any()),
            ("graphs", graphs.into_pyobject(py)?.into_any()),
        ],
    )
}
