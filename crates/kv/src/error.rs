//! Typed errors of the device-side KV cache. The arithmetic's [`KvError`] is `kvvm-layout`'s.

use kvvm_layout::KvError;

/// Every failure of the device-side KV cache ([`SequenceKv`](crate::SequenceKv),
/// [`SharedDevicePrefix`](crate::SharedDevicePrefix), [`PrefixCache`](crate::PrefixCache),
/// the decode loop).
///
/// What a caller can act on:
///
/// * [`Backpressure`](Self::Backpressure): the governor refused the memory (even after asking
///   the prefix cache and the handle pool to free some). Retry after
///   [`retry_after`](Self::retry_after) or shed load (a server answers 429 + `Retry-After`).
///   Nothing was committed by the refused call.
/// * [`NeverFits`](Self::NeverFits): the request is larger than a limit no freeing can raise
///   (the budget less its quarantine, the device's memory); retrying never helps, so no
///   `retry_after` is offered (a server answers 4xx, not 429).
/// * [`NotShareable`](Self::NotShareable): the prefix cannot be shared under this layout and
///   granule; the reason is the one of
///   [`PrefixShareability::refusal_reason`](crate::PrefixShareability::refusal_reason).
/// * [`WriteIntoSharedPrefix`](Self::WriteIntoSharedPrefix), [`NotCommitted`](Self::NotCommitted),
///   [`BadLength`](Self::BadLength), [`Layout`](Self::Layout), [`PlanMismatch`](Self::PlanMismatch),
///   [`InUse`](Self::InUse), [`OtherManager`](Self::OtherManager), [`Forgotten`](Self::Forgotten),
///   [`PrefixNotWritten`](Self::PrefixNotWritten): caller bugs, refused before any driver call.
/// * [`Vmm`](Self::Vmm), [`Backend`](Self::Backend): the manager or a copy failed; the
///   manager's books still equal the driver's truth (see `kvvm-vmm`).
/// * [`Verification`](Self::Verification): the decode loop read back a byte it did not write.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KvCacheError {
    /// The governor refused the grant: retry after `retry_after` or shed load.
    #[error(transparent)]
    Backpressure(#[from] kvvm_governor::Backpressure),
    /// The request is larger than a limit no freeing can raise (a budget less its
    /// quarantine, or the device's memory): retrying never helps. Nothing was committed.
    #[error(transparent)]
    NeverFits(#[from] kvvm_governor::NeverFits),
    /// A manager operation failed (other than backpressure).
    #[error(transparent)]
    Vmm(kvvm_vmm::VmmError),
    /// A copy between host and device failed.
    #[error(transparent)]
    Backend(#[from] kvvm_hal::BackendError),
    /// Layout arithmetic refused the request (token out of range, overflow, ...).
    #[error(transparent)]
    Layout(#[from] KvError),
    /// The prefix cannot be shared; `reason` is the shareability verdict's refusal reason.
    #[error("{reason}")]
    NotShareable {
        /// Why (with the numbers).
        reason: String,
    },
    /// A write touched a token whose bytes lie in a read-only shared prefix window. There is
    /// no copy-on-write on the device: the shared prefix is read-only for its whole life.
    #[error(
        "write of token {token} refused: the first {shared_tokens} tokens lie in a read-only shared prefix (no copy-on-write on the device)"
    )]
    WriteIntoSharedPrefix {
        /// The first refused token.
        token: u64,
        /// Tokens whose bytes all lie in shared windows.
        shared_tokens: u64,
    },
    /// A read or write touched a token that is not committed yet (`ensure_tokens` first).
    #[error("tokens {first}..{end} are not all committed: {committed} tokens are")]
    NotCommitted {
        /// First token of the access.
        first: u64,
        /// One past the last token of the access.
        end: u64,
        /// Tokens committed.
        committed: u64,
    },
    /// A read or write touched a token a sliding window forgot
    /// ([`SequenceKv::forget_tokens_before`](crate::SequenceKv::forget_tokens_before)): its
    /// window may be given back already.
    #[error(
        "token {token} was forgotten: the tokens before {forgotten} lie behind the sliding window"
    )]
    Forgotten {
        /// The first token of the access.
        token: u64,
        /// Tokens before this one are forgotten.
        forgotten: u64,
    },
    /// More tokens were asked for than the sequence may hold.
    #[error("{tokens} tokens asked for, the sequence holds at most {max_tokens}")]
    TooManyTokens {
        /// Tokens asked for.
        tokens: u64,
        /// The sequence's limit.
        max_tokens: u64,
    },
    /// A host buffer does not have the size the access needs.
    #[error("host buffer of {got} bytes, {expected} expected")]
    BadLength {
        /// Bytes expected (`tokens x bytes_per_token`).
        expected: u64,
        /// Bytes given.
        got: u64,
    },
    /// A plan, manager or prefix does not fit the operation (another granule, geometry, ...).
    #[error("plan mismatch: {reason}")]
    PlanMismatch {
        /// Why.
        reason: String,
    },
    /// The operation needs an empty sequence (fresh or released) and this one is in use.
    #[error(
        "the sequence is in use ({committed_tokens} tokens committed, {mapped_bytes} bytes mapped): release it first"
    )]
    InUse {
        /// Tokens it has committed.
        committed_tokens: u64,
        /// Bytes mapped in its reservation.
        mapped_bytes: u64,
    },
    /// The sequence belongs to another manager than the object it is handed to (a prefix
    /// cache of one manager is given a sequence of another).
    #[error("the sequence belongs to another manager than the {what}'s")]
    OtherManager {
        /// What refused it (`prefix cache`, `shared prefix`).
        what: &'static str,
    },
    /// `publish` was called before the owner wrote the prefix it would publish.
    #[error("prefix not written: {written} tokens written, {needed} needed before publishing")]
    PrefixNotWritten {
        /// Tokens written so far (contiguously from token 0).
        written: u64,
        /// Tokens the prefix holds.
        needed: u64,
    },
    /// The decode loop read back a byte that differs from what was written.
    #[error(
        "verification failed: sequence {sequence}, token {token}, byte {byte}: expected {expected:#04x}, read {got:#04x}"
    )]
    Verification {
        /// The sequence.
        sequence: u64,
        /// The token.
        token: u64,
        /// Byte index inside the token's host layout.
        byte: u64,
        /// Expected value.
        expected: u8,
        /// Value read.
        got: u8,
    },
    /// The pre-commit worker thread could not be started.
    #[error("cannot start the pre-commit worker: {reason}")]
    Worker {
        /// The operating system's reason.
        reason: String,
    },
}

impl From<kvvm_vmm::VmmError> for KvCacheError {
    fn from(e: kvvm_vmm::VmmError) -> Self {
        match e {
            kvvm_vmm::VmmError::Backpressure(b) => KvCacheError::Backpressure(b),
            kvvm_vmm::VmmError::NeverFits(n) => KvCacheError::NeverFits(n),
            other => KvCacheError::Vmm(other),
        }
    }
}

impl KvCacheError {
    /// A backpressure refusal of one step of a larger operation, restated for the whole
    /// operation: `needed` bytes (at least what the step asked for) against what was
    /// available plus `undone`, what the operation's earlier steps held and gave back. The
    /// shortfall, and so `retry_after`, is the step's. Any other error is returned as it is.
    pub(crate) fn restated(self, needed: u64, undone: u64) -> Self {
        let KvCacheError::Backpressure(mut b) = self else {
            return self;
        };
        b.needed = b.needed.max(needed);
        b.available = b.available.saturating_add(undone);
        KvCacheError::Backpressure(b)
    }

    /// The governor's refusal, if this is backpressure.
    pub fn backpressure(&self) -> Option<&kvvm_governor::Backpressure> {
        match self {
            KvCacheError::Backpressure(b) => Some(b),
            _ => None,
        }
    }

    /// The permanent refusal, if the request can never fit.
    pub fn never_fits(&self) -> Option<&kvvm_governor::NeverFits> {
        match self {
            KvCacheError::NeverFits(n) => Some(n),
            _ => None,
        }
    }

    /// When a retry is likely to succeed, if this is backpressure (a server's `Retry-After`).
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        self.backpressure().map(|b| b.retry_after)
    }

    /// Bytes the refused grant needed, if this is backpressure.
    pub fn needed(&self) -> Option<u64> {
        self.backpressure().map(|b| b.needed)
    }

    /// Bytes that were available, if this is backpressure.
    pub fn available(&self) -> Option<u64> {
        self.backpressure().map(|b| b.available)
    }

    /// Whether retrying later may succeed: backpressure, or the driver ran out of memory.
    pub fn is_retryable(&self) -> bool {
        match self {
            KvCacheError::Backpressure(_) => true,
            KvCacheError::Vmm(e) => e.is_retryable(),
            KvCacheError::Backend(e) => e.kind == kvvm_hal::ErrorKind::OutOfMemory,
            _ => false,
        }
    }
}

impl From<kvvm_num::Overflow> for KvCacheError {
    fn from(o: kvvm_num::Overflow) -> Self {
        KvCacheError::Layout(KvError::from(o))
    }
}
