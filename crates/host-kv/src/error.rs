//! Typed errors of the host paged KV cache.

use kvvm_layout::KvError;

/// Every failure of `kvvm-host-kv`. Nothing in this crate panics on bad input.
///
/// * Caller bugs: [`TokenOutOfRange`](Self::TokenOutOfRange),
///   [`LogicalPageOutOfRange`](Self::LogicalPageOutOfRange),
///   [`WrongTokenBytes`](Self::WrongTokenBytes), [`GeometryMismatch`](Self::GeometryMismatch),
///   [`PageShared`](Self::PageShared) (call
///   [`ensure_page_for_write`](crate::PagedKvCache::ensure_page_for_write) first),
///   [`Geometry`](Self::Geometry) (a bad layer index or geometry).
/// * Capacity: [`CapacityExceeded`](Self::CapacityExceeded) (the sequence is at `max_tokens`),
///   [`StoreExhausted`](Self::StoreExhausted) (the store's page limit; retry after other
///   sequences drop), [`AllocationFailed`](Self::AllocationFailed) (the allocator refused).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HostKvError {
    /// Geometry arithmetic or an index rejected by `kvvm-layout`.
    #[error(transparent)]
    Geometry(#[from] KvError),
    /// `tokens_per_page` was zero.
    #[error("tokens_per_page must be greater than zero")]
    ZeroTokensPerPage,
    /// Size arithmetic overflowed (`u64` or the platform's `usize`).
    #[error("size arithmetic overflowed while computing {what}")]
    Overflow {
        /// What was being computed.
        what: &'static str,
    },
    /// The cache's geometry does not have the store's per-token shape.
    #[error(
        "geometry mismatch: the store's pages hold (layers, kv_heads, head_dim, dtype_bytes) = \
         {store:?} per token, the cache asked for {cache:?}"
    )]
    GeometryMismatch {
        /// The store's `(layers, kv_heads, head_dim, dtype_bytes)`.
        store: (u32, u32, u32, u32),
        /// The cache's `(layers, kv_heads, head_dim, dtype_bytes)`.
        cache: (u32, u32, u32, u32),
    },
    /// A page was handed to a store it does not come from.
    #[error("the page belongs to another host page store")]
    StoreMismatch,
    /// A token index was not below the sequence length.
    #[error("token {token} out of range: the sequence holds {len} tokens")]
    TokenOutOfRange {
        /// The index given.
        token: u64,
        /// The sequence length.
        len: u64,
    },
    /// A logical page index was not below the number of pages.
    #[error("logical page {page} out of range: the sequence has {pages} pages")]
    LogicalPageOutOfRange {
        /// The index given.
        page: usize,
        /// The number of pages.
        pages: usize,
    },
    /// A token's bytes did not have the expected length.
    #[error("wrong token byte length: expected {expected} bytes, got {got}")]
    WrongTokenBytes {
        /// Bytes expected (one token, or one layer's K or V of one token, or a whole number
        /// of tokens).
        expected: u64,
        /// Bytes given.
        got: u64,
    },
    /// Appending would exceed the geometry's `max_tokens`.
    #[error("sequence is full: {len} tokens, capacity {max_tokens}")]
    CapacityExceeded {
        /// Tokens the sequence holds.
        len: u64,
        /// The geometry's `max_tokens`.
        max_tokens: u64,
    },
    /// The store reached its page limit.
    #[error("host page store exhausted: {limit} pages live")]
    StoreExhausted {
        /// The store's page limit.
        limit: usize,
    },
    /// The allocator could not provide a page buffer.
    #[error("could not allocate a host page of {bytes} bytes")]
    AllocationFailed {
        /// The page size.
        bytes: usize,
    },
    /// A write into a page that other forks still share; call `ensure_page_for_write` first.
    #[error(
        "logical page {logical_page} is shared by {ref_count} forks; call \
         ensure_page_for_write before writing"
    )]
    PageShared {
        /// The logical page written.
        logical_page: usize,
        /// Its reference count at the time.
        ref_count: usize,
    },
}

impl From<kvvm_num::Overflow> for HostKvError {
    fn from(o: kvvm_num::Overflow) -> Self {
        HostKvError::Overflow { what: o.what }
    }
}
