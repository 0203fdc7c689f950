//! Typed errors of the manager.

use kvvm_governor::{Backpressure, GovernorError, NeverFits, Refusal};
use kvvm_hal::{BackendError, DeviceId, ErrorKind};

/// An error of a manager operation.
///
/// Err does not mean nothing happened: after a failed commit the blocks this commit mapped
/// have been unmapped (or, where an unmap failed, are still recorded in the reservation); after
/// a failed release the blocks that could not be unmapped are still recorded. Either way the
/// manager's books equal the driver's truth.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VmmError {
    /// The governor refused the grant for now: retry after `retry_after` or shed load.
    #[error(transparent)]
    Backpressure(#[from] Backpressure),
    /// The request is larger than a limit no freeing can raise (a budget less its quarantine,
    /// or the device's memory): retrying never helps. Nothing was done.
    #[error(transparent)]
    NeverFits(#[from] NeverFits),
    /// A driver call failed (the operation was rolled back or its remains recorded).
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A commit would run past the end of its reservation (the driver would not check).
    #[error(
        "commit of {requested} bytes at offset {offset} runs past the reservation of {reserved} bytes"
    )]
    OutOfBounds {
        /// Offset of the first byte the commit would map.
        offset: u64,
        /// Bytes the commit would map.
        requested: u64,
        /// Bytes reserved.
        reserved: u64,
    },
    /// A size computation overflowed `u64`.
    #[error("size overflow: {what}")]
    SizeOverflow {
        /// What was being computed.
        what: &'static str,
    },
    /// A reservation of zero bytes was asked for.
    #[error("a reservation must hold at least one byte")]
    ZeroSize,
    /// The driver reported a granularity the manager cannot use.
    #[error(
        "{device} reports an unusable granularity (minimum {minimum}, recommended {recommended})"
    )]
    BadGranularity {
        /// The device.
        device: DeviceId,
        /// Minimum granularity reported.
        minimum: u64,
        /// Recommended granularity reported.
        recommended: u64,
    },
    /// A grant given to a commit does not fit it (another device or governor, too small, or
    /// not a whole number of granules).
    #[error("grant does not fit this commit: {reason}")]
    GrantMismatch {
        /// Why.
        reason: String,
    },
    /// A window is already mapped in this reservation (mapping over it would be refused by
    /// the driver; a shared window may not be committed over).
    #[error("the granule window at offset {offset} is already mapped")]
    AlreadyMapped {
        /// Offset of the window in the reservation.
        offset: u64,
    },
    /// The arguments do not describe a valid request (overlapping ranges, nothing to do where
    /// something must be done); `reason` says what is wrong. Nothing was done.
    #[error("invalid argument: {reason}")]
    InvalidArgument {
        /// What is wrong, with the numbers.
        reason: String,
    },
    /// A window is being committed or given back by another thread right now (a background
    /// commit in flight, a parked window being unmapped); retry once it is done. Nothing was
    /// done.
    #[error("the granule window at offset {offset} is busy: a commit or unmap is in flight")]
    Busy {
        /// Offset of the window in the reservation.
        offset: u64,
    },
    /// The governor's books refused an update: a bug in the manager.
    #[error(transparent)]
    Accounting(#[from] GovernorError),
}

impl VmmError {
    /// Whether retrying later may succeed: backpressure, or the driver ran out of memory.
    /// [`VmmError::NeverFits`] is not retryable.
    pub fn is_retryable(&self) -> bool {
        match self {
            VmmError::Backpressure(_) | VmmError::Busy { .. } => true,
            VmmError::Backend(e) => e.kind == ErrorKind::OutOfMemory,
            _ => false,
        }
    }

    /// The backend error, if this is one.
    pub fn backend_error(&self) -> Option<&BackendError> {
        match self {
            VmmError::Backend(e) => Some(e),
            _ => None,
        }
    }
}

impl From<Refusal> for VmmError {
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::Backpressure(b) => VmmError::Backpressure(b),
            Refusal::NeverFits(n) => VmmError::NeverFits(n),
        }
    }
}

/// Result type of the manager.
pub type VmmResult<T> = Result<T, VmmError>;
