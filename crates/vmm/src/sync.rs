//! Locking that survives a poisoned mutex.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, taking the data of a poisoned mutex as it is: every critical section of the
/// manager is a few pushes and pops that cannot be left half-done.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
