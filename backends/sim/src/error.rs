//! The simulator's errors: the neutral kinds with the CUDA driver's numbers for the same
//! condition, so that logs read alike.

use kvvm_hal::{BackendError, ErrorKind, Operation};

/// The code and name the simulator reports for `kind` (the CUDA driver's numbers).
pub(crate) fn code_for(kind: ErrorKind) -> (i64, &'static str) {
    match kind {
        ErrorKind::OutOfMemory => (2, "SIM_ERROR_OUT_OF_MEMORY"),
        ErrorKind::InvalidValue => (1, "SIM_ERROR_INVALID_VALUE"),
        ErrorKind::NotSupported => (801, "SIM_ERROR_NOT_SUPPORTED"),
        ErrorKind::Unavailable => (100, "SIM_ERROR_NO_DEVICE"),
        ErrorKind::DeviceLost => (700, "SIM_ERROR_ILLEGAL_ADDRESS"),
        ErrorKind::Other => (999, "SIM_ERROR_UNKNOWN"),
    }
}

/// A simulator error of `kind` in `op`, with `detail`.
pub(crate) fn sim_error(op: Operation, kind: ErrorKind, detail: impl Into<String>) -> BackendError {
    let (code, name) = code_for(kind);
    BackendError::new(op, kind, code, name).with_detail(detail)
}

/// An error an injected fault makes (it has no side effect).
pub(crate) fn injected(op: Operation, kind: ErrorKind) -> BackendError {
    sim_error(op, kind, "injected fault")
}
