//! `kvvm.PrefixCache`: the automatic cache that finds the longest cached prompt prefix of a
//! request by token ids and maps it read-only into the request's sequence (the prefix object
//! itself, `kvvm.SharedPrefix`, lives with the sequences that own and attach it).

use std::sync::Arc;

use kvvm::kv::{PrefixCache as KvPrefixCache, PrefixCacheConfig, PublishOutcome};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::count::{Count, TokenIds};
use crate::errors;
use crate::geometry::PyPlan;
use crate::host_tier::HostTier;
use crate::manager::Manager;
use crate::sequence::{Sequence, SharedPrefix};
use crate::views::unless_viewed;

/// An automatic prefix cache: longest cached prefix by token ids, LRU, evicted by the budget
/// before it refuses.
#[pyclass(frozen, module = "kvvm._native")]
pub struct PrefixCache {
    cache: Arc<KvPrefixCache>,
}

#[pymethods]
impl PrefixCache {
    /// A cache for sequences of `plan` on `manager`, holding at most `max_cached_bytes` of
    /// idle prefixes (None: only the budget limits it). Prompts are found in whole blocks of
    /// `block_tokens` tokens (the hit granularity, whatever the granule): a hit maps read-only
    /// the windows lying wholly before its end and copies the rest of it from the cache. A
    /// published prefix is made of handles of at most `handle_windows` windows (at least 1): a
    /// hit maps one handle per mapping and its read-only part ends on a multiple of
    /// `handle_windows` windows, so a larger value means fewer mappings per hit and more
    /// bytes copied.
    #[new]
    #[pyo3(signature = (manager, plan, max_cached_bytes = None, block_tokens = Count(16),
        handle_windows = Count(1)),
        text_signature = "(manager, plan, max_cached_bytes=None, block_tokens=16, handle_windows=1)")]
    fn new(
        py: Python<'_>,
        manager: &Manager,
        plan: &PyPlan,
        max_cached_bytes: Option<u64>,
        block_tokens: Count,
        handle_windows: Count,
    ) -> PyResult<Self> {
        if block_tokens.0 == 0 || handle_windows.0 == 0 {
            return Err(errors::invalid(
                py,
                "block_tokens and handle_windows must be at least 1",
            ));
        }
        let config = PrefixCacheConfig::default()
            .max_cached_bytes(max_cached_bytes)
            .block_tokens(block_tokens.0)
            .handle_windows(handle_windows.0);
        let cache = KvPrefixCache::with_config(manager.state.vm.clone(), plan.plan, config)
            .map_err(|e| errors::kv(py, &e))?;
        Ok(PrefixCache { cache })
    }

    /// Tokens per cached block: prefixes are found in whole blocks (the hit granularity).
    #[getter]
    fn block_tokens(&self) -> u64 {
        self.cache.block_tokens()
    }

    /// Gives the cache a host level over `tier` (a :class:`HostTier` of the same manager):
    /// a prefix evicted from the device is copied there (billed to the host budget while it
    /// is there) and a later admission whose longest hit lies there copies it back instead
    /// of prefilling it. ``InvalidArgumentError`` for a tier of another manager, or when the
    /// cache has a host level already.
    fn attach_host_tier(&self, py: Python<'_>, tier: &HostTier) -> PyResult<()> {
        self.cache
            .attach_host_tier(Arc::clone(&tier.tier))
            .map_err(|e| errors::invalid(py, e.to_string()))
    }

    /// Admits a request into `sequence` (empty): gives it the longest cached prefix of
    /// `token_ids` (its whole windows mapped read-only, the rest copied), makes the sequence
    /// the owner of its new full blocks, and commits the rest of the prompt. A longer hit on
    /// the host level is copied back when it hands on at least ``host_min_tokens`` tokens more
    /// than the device's (None: never). Returns a dict with ``hit_tokens``,
    /// ``prompt_tokens``, ``owned_prefix_tokens``, ``shared_bytes``, ``copied_bytes``,
    /// ``committed_bytes``, ``host_hit_tokens`` (of ``hit_tokens``, those copied back from the
    /// host level), ``readonly_tokens`` (of ``hit_tokens``, those lying wholly in the windows
    /// mapped read-only; the rest were copied) and ``hit_origin`` (0 without a hit: two
    /// admissions of this process with the same ``hit_origin`` and ``hit_tokens`` hold the same
    /// bytes in those tokens, from one prefill; the same token ids prefilled again get
    /// another). Write tokens ``hit_tokens..prompt_tokens``, then :meth:`publish`.
    #[pyo3(
        signature = (sequence, token_ids, host_min_tokens = Some(Count(1))),
        text_signature = "($self, sequence, token_ids, host_min_tokens=1)"
    )]
    fn admit<'py>(
        &self,
        py: Python<'py>,
        sequence: &Sequence,
        token_ids: TokenIds,
        host_min_tokens: Option<Count>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let token_ids = token_ids.0;
        let cell = Arc::clone(&sequence.cell);
        let cache = Arc::clone(&self.cache);
        let min = host_min_tokens.map_or(u64::MAX, |c| c.0);
        let info = unless_viewed(
            py,
            std::slice::from_ref(&sequence.cell),
            "admit a request",
            move || cell.admission(|s| cache.admit_into_with_host(&token_ids, s, min)),
        )?;
        crate::dict::counters(
            py,
            &[
                ("hit_tokens", info.hit_tokens),
                ("prompt_tokens", info.prompt_tokens),
                ("owned_prefix_tokens", info.owned_prefix_tokens),
                ("shared_bytes", info.shared_bytes),
                ("copied_bytes", info.copied_bytes),
                ("committed_bytes", info.committed_bytes),
                ("host_hit_tokens", info.host_hit_tokens),
                ("readonly_tokens", info.readonly_tokens),
                ("hit_origin", info.hit_origin),
            ],
        )
    }

    /// Publishes the prefix `sequence` owns once its tokens are written (its tail is copied
    /// then). Returns ``"published"``, ``"already_cached"``, ``"no_memory"`` (the budget could
    /// not hold the tail now: not published) or ``"nothing"``.
    fn publish(&self, py: Python<'_>, sequence: &Sequence) -> PyResult<&'static str> {
        let cell = Arc::clone(&sequence.cell);
        let cache = Arc::clone(&self.cache);
        let out = py
            .detach(move || cell.publishing(|s| cache.publish(s)))
            .map_err(|e| errors::kv(py, &e))?;
        Ok(outcome_name(&out))
    }

    /// The shared segments of the cached prefix whose tokens are exactly ``token_ids``, in
    /// order (None: no such entry): what :meth:`SharedPrefix.publish` hands to other
    /// processes, which :meth:`insert` them into their own cache.
    fn segments(&self, token_ids: TokenIds) -> Option<Vec<SharedPrefix>> {
        self.cache
            .segments(&token_ids.0)
            .map(|v| v.into_iter().map(SharedPrefix::without_owner).collect())
    }

    /// Inserts a prefix made elsewhere (built here, or segments another process published,
    /// opened with :meth:`SharedPrefix.open`): ``token_ids`` (at least one block) held by
    /// ``segments``, in order from the first window. Admissions then hit it, in whole blocks,
    /// like a prefix this cache published. Returns ``"published"`` or ``"already_cached"``;
    /// ``InvalidArgumentError`` when the segments do not hold those tokens under this cache's
    /// plan.
    fn insert(
        &self,
        py: Python<'_>,
        token_ids: TokenIds,
        segments: Vec<PyRef<'_, SharedPrefix>>,
    ) -> PyResult<&'static str> {
        let token_ids = token_ids.0;
        let prefixes = segments.iter().map(|s| Arc::clone(&s.prefix)).collect();
        let cache = Arc::clone(&self.cache);
        let out = py
            .detach(move || cache.insert(token_ids, prefixes))
            .map_err(|e| errors::kv(py, &e))?;
        Ok(outcome_name(&out))
    }

    /// The cache's counters (a dict).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.cache.stats();
        crate::dict::counters(
            py,
            &[
                ("lookups", s.lookups),
                ("hits", s.hits),
                ("misses", s.misses),
                ("tokens_saved", s.tokens_saved),
                ("bytes_saved", s.bytes_saved),
                ("cached_entries", s.cached_entries),
                ("cached_bytes", s.cached_bytes),
                ("idle_bytes", s.idle_bytes),
                ("evictions", s.evictions),
                ("host_hits", s.host_hits),
                ("host_tokens_saved", s.host_tokens_saved),
                ("evicted_to_host", s.evicted_to_host),
                ("host_entries", s.host_entries),
                ("host_bytes", s.host_bytes),
                ("host_evictions", s.host_evictions),
                ("host_forgotten", s.host_forgotten),
                ("host_failed", s.host_failed),
            ],
        )
    }

    /// Evicts idle prefixes until `bytes` are freed (or none is idle); returns the bytes freed.
    fn evict(&self, py: Python<'_>, bytes: u64) -> u64 {
        let cache = Arc::clone(&self.cache);
        py.detach(move || cache.evict(bytes))
    }

    /// Drops every cached prefix (those still mapped by sequences live on with them).
    fn clear(&self, py: Python<'_>) -> u64 {
        let cache = Arc::clone(&self.cache);
        py.detach(move || cache.clear())
    }
}

/// A publication's outcome as Python sees it.
fn outcome_name(out: &PublishOutcome) -> &'static str {
    match out {
        PublishOutcome::Published { .. } => "published",
        PublishOutcome::AlreadyCached => "already_cached",
        PublishOutcome::NoMemory => "no_memory",
        _ => "nothing",
    }
}
