//! The governor's typed errors: a refused grant ([`Refusal`]: retryable [`Backpressure`] or a
//! permanent [`NeverFits`]) and a bookkeeping bug ([`GovernorError`]).

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
    /// Bytes asked for: the whole request (a manager counts what its pool would have supplied
    /// too).
    pub needed: u64,
    /// Bytes available at the refusal, once the reclaimers gave back what they could: what
    /// the tighter of the device and process budgets leaves free (`Governor::available_bytes`
    /// at that moment). A caller that had set memory aside for the request (a manager's
    /// pooled handles) adds it, as it adds it to [`needed`](Self::needed).
    pub available: u64,
    /// When a retry is likely to succeed (see the crate docs for the estimate).
    pub retry_after: Duration,
}

/// The limit a request can never fit under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    /// The device's budget (less the bytes quarantined on it, which never come back).
    DeviceBudget,
    /// The process budget over every device (less every quarantined byte).
    ProcessBudget,
    /// The device's physical memory as the driver reports it.
    DeviceMemory,
}

impl Limit {
    /// A short stable name: `"device_budget"`, `"process_budget"`, `"device_memory"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::DeviceBudget => "device_budget",
            Limit::ProcessBudget => "process_budget",
            Limit::DeviceMemory => "device_memory",
        }
    }
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Limit::DeviceBudget => "device budget",
            Limit::ProcessBudget => "process budget",
            Limit::DeviceMemory => "device memory",
        })
    }
}

/// A request larger than a limit that no amount of freeing can raise: retrying never helps,
/// so no `retry_after` is offered. Shed the request (a server answers 4xx, not 429).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{needed} bytes can never fit on {device}: the {limit} allows at most {limit_bytes}")]
pub struct NeverFits {
    /// The device the request was for.
    pub device: DeviceId,
    /// Bytes the request needs held at once: what its requester would hold with it (for a
    /// reservation, the manager counts what it maps already plus every window it asks for,
    /// however they are supplied).
    pub needed: u64,
    /// The limit that refuses it.
    pub limit: Limit,
    /// The most that limit could ever grant (for a budget: the budget less quarantined bytes).
    pub limit_bytes: u64,
}

/// Why a grant was refused: for now ([`Backpressure`], retry after its `retry_after`) or for
/// good ([`NeverFits`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Not enough budget now, even after reclaiming; freeing can help.
    #[error(transparent)]
    Backpressure(#[from] Backpressure),
    /// Larger than a limit freeing cannot raise.
    #[error(transparent)]
    NeverFits(#[from] NeverFits),
}

impl Refusal {
    /// The backpressure, when retrying later can help.
    pub fn backpressure(&self) -> Option<&Backpressure> {
        match self {
            Refusal::Backpressure(b) => Some(b),
            Refusal::NeverFits(_) => None,
        }
    }

    /// The permanent refusal, when retrying never helps.
    pub fn never_fits(&self) -> Option<&NeverFits> {
        match self {
            Refusal::NeverFits(n) => Some(n),
            Refusal::Backpressure(_) => None,
        }
    }

    /// Bytes asked for.
    pub fn needed(&self) -> u64 {
        match self {
            Refusal::Backpressure(b) => b.needed,
            Refusal::NeverFits(n) => n.needed,
        }
    }
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
