//! [`traced`]: the one tracing span every backend opens per driver call.

use crate::BackendResult;

/// Runs `f`, one driver call, inside `span` (named after the backend, with the driver
/// operation, the device, the bytes and the addresses as fields) and records its outcome as
/// an event of that span: `ok = true`, or `ok = false` with the error.
pub fn traced<T>(span: tracing::Span, f: impl FnOnce() -> BackendResult<T>) -> BackendResult<T> {
    let _entered = span.enter();
    let result = f();
    match &result {
        Ok(_) => tracing::debug!(ok = true),
        Err(e) => tracing::debug!(ok = false, error = %e),
    }
    result
}
