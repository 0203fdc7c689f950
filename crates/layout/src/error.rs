//! Typed errors of the KV geometry and layout arithmetic.

/// Every failure of the layout arithmetic: bad input or arithmetic that would not fit in `u64`.
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

impl From<kvvm_num::Overflow> for KvError {
    fn from(o: kvvm_num::Overflow) -> Self {
        KvError::Overflow { what: o.what }
    }
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
    Ok(kvvm_num::mul(div_ceil(a, granule)?, granule, what)?)
}
