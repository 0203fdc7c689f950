//! Typed errors of the KV geometry and layout arithmetic.

/// Every failure of `kvvm-kv`: bad input or arithmetic that would not fit in `u64`.
///
/// All variants are caller bugs or impossible requests (none is transient): fix the input,
/// choose another layout or granule, or give up on the operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    /// A geometry dimension was zero.
    #[error("invalid KV geometry: {field} must be greater than zero")]
    ZeroDimension {
        /// The offending field (`"layers"`, `"kv_heads"`, `"head_dim"`, `"dtype_bytes"`,
        /// `"max_tokens"`).
        field: &'static str,
    },
    /// Size arithmetic overflowed `u64`; the geometry or layout is too large to address.
    #[error("size arithmetic overflowed u64 while computing {what}")]
    Overflow {
        /// What was being computed.
        what: &'static str,
    },
    /// [`KvGeometry::preset`](crate::KvGeometry::preset) got a name it does not know.
    #[error("unknown model preset {name:?}; known presets: {known}")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The known names, comma-separated.
        known: String,
    },
    /// A dtype name could not be parsed.
    #[error("unknown KV dtype {name:?}; expected one of fp16, bf16, fp8, fp32")]
    UnknownDtype {
        /// The name given.
        name: String,
    },
    /// A layout name could not be parsed.
    #[error("unknown KV layout {name:?}; expected one of head-major, seq-major, token-major")]
    UnknownLayout {
        /// The name given.
        name: String,
    },
    /// The mapping granule was zero.
    #[error("mapping granule must be greater than zero")]
    ZeroGranule,
    /// A token index was not below `max_tokens`.
    #[error("token index {token} out of range: the geometry holds {max_tokens} tokens")]
    TokenOutOfRange {
        /// The index given.
        token: u64,
        /// The geometry's capacity.
        max_tokens: u64,
    },
    /// A token count (live tokens, prefix length) was above `max_tokens`.
    #[error("token count {tokens} exceeds the geometry's max_tokens {max_tokens}")]
    TooManyTokens {
        /// The count given.
        tokens: u64,
        /// The geometry's capacity.
        max_tokens: u64,
    },
    /// A layer index was not below the number of layers.
    #[error("layer {layer} out of range: the geometry has {layers} layers")]
    LayerOutOfRange {
        /// The index given.
        layer: u32,
        /// The number of layers.
        layers: u32,
    },
    /// A KV-head index was not below the number of KV heads.
    #[error("KV head {head} out of range: the geometry has {kv_heads} KV heads")]
    HeadOutOfRange {
        /// The index given.
        head: u32,
        /// The number of KV heads.
        kv_heads: u32,
    },
}

/// `a * b`, or [`KvError::Overflow`] naming `what`.
pub(crate) fn mul(a: u64, b: u64, what: &'static str) -> Result<u64, KvError> {
    a.checked_mul(b).ok_or(KvError::Overflow { what })
}

/// `a + b`, or [`KvError::Overflow`] naming `what`.
pub(crate) fn add(a: u64, b: u64, what: &'static str) -> Result<u64, KvError> {
    a.checked_add(b).ok_or(KvError::Overflow { what })
}

/// `ceil(a / b)` for `b > 0`, or [`KvError::ZeroGranule`] when `b == 0`.
pub(crate) fn div_ceil(a: u64, b: u64) -> Result<u64, KvError> {
    if b == 0 {
        return Err(KvError::ZeroGranule);
    }
    Ok(a.div_ceil(b))
}

/// `a` rounded up to a multiple of `granule`, checked.
pub(crate) fn round_up(a: u64, granule: u64, what: &'static str) -> Result<u64, KvError> {
    mul(div_ceil(a, granule)?, granule, what)
}

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
/// * [`NotShareable`](Self::NotShareable): the prefix cannot be shared under this layout and
///   granule; the reason is the one of
///   [`PrefixShareability::refusal_reason`](crate::PrefixShareability::refusal_reason).
/// * [`WriteIntoSharedPrefix`](Self::WriteIntoSharedPrefix), [`NotCommitted`](Self::NotCommitted),
///   [`BadLength`](Self::BadLength), [`Layout`](Self::Layout), [`PlanMismatch`](Self::PlanMismatch),
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
            other => KvCacheError::Vmm(other),
        }
    }
}

impl KvCacheError {
    /// The governor's refusal, if this is backpressure.
    pub fn backpressure(&self) -> Option<&kvvm_governor::Backpressure> {
        match self {
            KvCacheError::Backpressure(b) => Some(b),
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
