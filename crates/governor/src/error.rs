//! The governor's typed errors: a refused grant ([`Backpressure`]) and a bookkeeping bug
//! ([`GovernorError`]).

use std::time::Duration;

use kvvm_hal::DeviceId;

/// A grant was refused: not enough budget, even after reclaiming.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "backpressure on {device}: {needed} bytes needed, {available} available; retry after {retry_after:?}"
)]
pub struct Backpressure {
    /// The device the grant was asked for.
    pub device: DeviceId,
    /// Bytes asked for.
    pub needed: u64,
    /// Bytes that could have been granted (the tighter of the device and process budgets).
    pub available: u64,
    /// When a retry is likely to succeed (see the crate docs for the estimate).
    pub retry_after: Duration,
}

/// An accounting operation that does not fit the governor's books: a bug in the caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GovernorError {
    /// More bytes were taken out of a bucket than it holds.
    #[error("accounting underflow on {device}: {bytes} bytes out of {bucket}, which holds {held}")]
    Underflow {
        /// The device.
        device: DeviceId,
        /// The bucket.
        bucket: &'static str,
        /// Bytes asked.
        bytes: u64,
        /// Bytes held.
        held: u64,
    },
    /// A byte count overflowed `u64`.
    #[error("accounting overflow on {device}")]
    Overflow {
        /// The device.
        device: DeviceId,
    },
}
