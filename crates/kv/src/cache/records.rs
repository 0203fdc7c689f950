//! The records of the prefix cache: its configuration, its counters, what an admission and a
//! publication did. Plain data; the behaviour is `mod.rs` and `admit.rs`.

use crate::sequence::SequenceKv;

/// Configuration of a `PrefixCache`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PrefixCacheConfig {
    /// Most physical bytes of published prefixes to keep (`None`: no cap; the governor's
    /// budget and the reclaimer bound them). Beyond it, least recently used prefixes that no
    /// sequence maps are evicted at publish time.
    pub max_cached_bytes: Option<u64>,
    /// Tokens per hashed block: the hit granularity (a hit is a whole number of blocks, at
    /// least one; default [`DEFAULT_BLOCK_TOKENS`]). It is independent of the granule: the
    /// windows of a hit lying wholly before its end are mapped read-only, the rest of it is
    /// copied from the cache.
    pub block_tokens: u64,
    /// The most windows (per fragment) one handle of a segment an admission commits for
    /// publication spans (at least 1; default 1). A sharer maps handles whole, one mapping
    /// each, and the driver charges per mapping: with `k` windows per handle a hit maps about
    /// `k` times fewer handles, and its read-only part ends on a multiple of `k` windows from
    /// the segment's start (the rest of the hit is copied).
    pub handle_windows: u64,
}

/// Tokens per hashed block of a prefix cache by default: its hit granularity.
pub const DEFAULT_BLOCK_TOKENS: u64 = 16;

impl Default for PrefixCacheConfig {
    fn default() -> Self {
        PrefixCacheConfig {
            max_cached_bytes: None,
            block_tokens: DEFAULT_BLOCK_TOKENS,
            handle_windows: 1,
        }
    }
}

impl PrefixCacheConfig {
    /// Sets [`max_cached_bytes`](Self::max_cached_bytes).
    #[must_use]
    pub fn max_cached_bytes(mut self, bytes: Option<u64>) -> Self {
        self.max_cached_bytes = bytes;
        self
    }

    /// Sets [`block_tokens`](Self::block_tokens) (0 is taken as 1).
    #[must_use]
    pub fn block_tokens(mut self, tokens: u64) -> Self {
        self.block_tokens = tokens.max(1);
        self
    }

    /// Sets [`handle_windows`](Self::handle_windows) (0 is taken as 1).
    #[must_use]
    pub fn handle_windows(mut self, windows: u64) -> Self {
        self.handle_windows = windows.max(1);
        self
    }
}

/// Counters of a `PrefixCache` (`PrefixCache::stats`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct PrefixCacheStats {
    /// Tokens per hashed block: the hit granularity (`PrefixCacheConfig::block_tokens`).
    pub block_tokens: u64,
    /// Admissions looked up.
    pub lookups: u64,
    /// Admissions that attached a cached prefix (at least one block).
    pub hits: u64,
    /// Admissions that found nothing.
    pub misses: u64,
    /// Prompt tokens taken from the cache (mapped read-only or copied) instead of computed.
    pub tokens_saved: u64,
    /// Physical bytes mapped read-only instead of committed privately.
    pub bytes_saved: u64,
    /// Prefixes published.
    pub published: u64,
    /// Publications skipped because the same blocks were already cached.
    pub already_cached: u64,
    /// Prefixes in the cache now.
    pub cached_entries: u64,
    /// Physical bytes the cached prefixes hold (each shared set counted once).
    pub cached_bytes: u64,
    /// Of those, bytes only the cache holds (no live sequence maps or holds them): what
    /// eviction frees now, and what the governor counts as available.
    pub idle_bytes: u64,
    /// Of the rest, the tails of entries still in use (their bytes past their read-only
    /// windows, in memory of their own) that the cache may give back under pressure: the
    /// entry then hands on only its read-only windows' tokens.
    pub tail_bytes: u64,
    /// Prefixes evicted (by the LRU cap or the governor's reclaim).
    pub evictions: u64,
    /// Physical bytes freed by eviction.
    pub evicted_bytes: u64,
    /// Admissions whose hit was copied back from the host level (counted in `hits` too).
    pub host_hits: u64,
    /// Prompt tokens copied back from the host level (counted in `tokens_saved` too).
    pub host_tokens_saved: u64,
    /// Evicted prefixes copied to the host level.
    pub evicted_to_host: u64,
    /// Prefixes on the host level now.
    pub host_entries: u64,
    /// Host bytes (page-locked, billed to the host's budget) the host level holds now.
    pub host_bytes: u64,
    /// Host entries dropped (least recently used first: for room on the host, or cleared).
    pub host_evictions: u64,
    /// Evicted prefixes forgotten because the host's budget had no room left for them.
    pub host_forgotten: u64,
    /// Failures of the host level: a copy either way, or a commit on the way back (the
    /// prefix is forgotten, the request prefills what it could not copy).
    pub host_failed: u64,
}

/// What `PrefixCache::admit` returns: the request's sequence, with its cached prefix mapped
/// read-only and the rest of its prompt committed, and what the admission did
/// ([`AdmissionInfo`]: its fields read through this type, `admission.hit_tokens`).
#[derive(Debug)]
#[non_exhaustive]
pub struct Admission {
    /// The request's KV cache: `prompt_tokens` tokens committed; tokens `0..hit_tokens` are
    /// the cached prefix (already written: mapped read-only, then copied); the caller writes
    /// `hit_tokens..prompt_tokens` and then calls `PrefixCache::publish`.
    pub sequence: SequenceKv,
    /// What the admission did.
    pub info: AdmissionInfo,
}

impl std::ops::Deref for Admission {
    type Target = AdmissionInfo;

    fn deref(&self) -> &AdmissionInfo {
        &self.info
    }
}

/// What `PrefixCache::admit_into` did to the caller's sequence (and what
/// `PrefixCache::admit` did, beside the sequence it returns in [`Admission`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct AdmissionInfo {
    /// Prompt tokens found in the cache (a multiple of the block size).
    pub hit_tokens: u64,
    /// Prompt tokens (`token_ids.len()`).
    pub prompt_tokens: u64,
    /// Tokens of the new shared prefix segment the sequence owns, to be published once
    /// written; 0 when there is nothing new to publish.
    pub owned_prefix_tokens: u64,
    /// Physical bytes mapped read-only from the cache.
    pub shared_bytes: u64,
    /// Bytes of the hit copied from the cache into the request's own windows (the hit's
    /// bytes past its read-only windows, in every fragment).
    pub copied_bytes: u64,
    /// Physical bytes this admission committed.
    pub committed_bytes: u64,
    /// Of `hit_tokens`, 0 for a hit on the device, or all of them for a hit copied back from
    /// the prefix cache's host level.
    pub host_hit_tokens: u64,
    /// Of `hit_tokens`, those lying wholly in the windows mapped read-only (the rest of the
    /// hit was copied into the sequence's own windows).
    pub readonly_tokens: u64,
    /// Where the hit's bytes came from (0 without a hit): two admissions in one process with
    /// the same `hit_origin` and `hit_tokens` hold the same bytes in tokens `0..hit_tokens`,
    /// mapped from one physical copy or copied from it (or from a copy of it on the host
    /// level), whatever entry each hit; a prefix evicted and prefilled again, or inserted
    /// again from elsewhere, gets another origin, although its token ids are the same.
    pub hit_origin: u64,
}

/// What `PrefixCache::publish` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PublishOutcome {
    /// The prefix is in the cache now.
    Published {
        /// Tokens of the cached prefix (full blocks).
        tokens: u64,
        /// Physical bytes newly held by the cache.
        bytes: u64,
    },
    /// Another request published the same blocks first; this one's segment stays private to
    /// its sequence (it is freed when the sequence is).
    AlreadyCached,
    /// The sequence owns nothing to publish.
    NothingToPublish,
    /// The budget could not hold the prefix's tail (one window per fragment) now: not
    /// published; its segment stays private to its sequence (freed with it).
    NoMemory,
}
