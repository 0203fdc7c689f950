//! The prefix caches of a service: one for anonymous clients (and for every key when the
//! cache is shared), else one per API key, made on the key's first prompt with token ids, so
//! that no key's prompts hit (or reveal) another key's prefixes.

use kvvm::hal::sync::Unpoison;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvvm::kv::{LayoutPlan, PrefixCache, PrefixCacheConfig, PrefixCacheStats};
use kvvm::vmm::VirtualMemory;

use crate::auth::Owner;
use crate::error::ServiceError;

#[derive(Debug)]
pub(crate) struct PrefixCaches {
    /// The cache of [`Owner::ANONYMOUS`], also every key's when `shared`.
    default: Option<Arc<PrefixCache>>,
    per_key: Mutex<HashMap<Owner, Arc<PrefixCache>>>,
    shared: bool,
}

impl PrefixCaches {
    pub(crate) fn new(default: Option<Arc<PrefixCache>>, shared: bool) -> Self {
        PrefixCaches {
            default,
            per_key: Mutex::new(HashMap::new()),
            shared,
        }
    }

    /// The default cache (`None` when the cache is off).
    pub(crate) fn default_cache(&self) -> Option<&Arc<PrefixCache>> {
        self.default.as_ref()
    }

    /// The cache `owner`'s prompts go through (`None` when the cache is off).
    pub(crate) fn for_owner(
        &self,
        owner: Owner,
        vm: &VirtualMemory,
        plan: &LayoutPlan,
    ) -> Result<Option<Arc<PrefixCache>>, ServiceError> {
        let Some(default) = &self.default else {
            return Ok(None);
        };
        if owner == Owner::ANONYMOUS || self.shared {
            return Ok(Some(default.clone()));
        }
        let mut caches = self.per_key.lock().unpoisoned();
        if let Some(c) = caches.get(&owner) {
            return Ok(Some(c.clone()));
        }
        let c = window_block_cache(vm, plan)
            .map_err(|e| ServiceError::Internal(format!("prefix cache: {e}")))?;
        caches.insert(owner, c.clone());
        Ok(Some(c))
    }

    /// Every cache.
    pub(crate) fn all(&self) -> Vec<Arc<PrefixCache>> {
        let mut all: Vec<_> = self.default.iter().cloned().collect();
        let keys = self.per_key.lock().unpoisoned();
        all.extend(keys.values().cloned());
        all
    }

    /// Every cache's counters and sizes summed (`None` when the cache is off).
    pub(crate) fn stats(&self) -> Option<PrefixCacheStats> {
        self.default.as_ref()?;
        let mut sum = PrefixCacheStats::default();
        for c in self.all() {
            let s = c.stats();
            sum.block_tokens = s.block_tokens;
            sum.lookups += s.lookups;
            sum.hits += s.hits;
            sum.misses += s.misses;
            sum.tokens_saved += s.tokens_saved;
            sum.bytes_saved += s.bytes_saved;
            sum.published += s.published;
            sum.already_cached += s.already_cached;
            sum.cached_entries += s.cached_entries;
            sum.cached_bytes += s.cached_bytes;
            sum.idle_bytes += s.idle_bytes;
            sum.evictions += s.evictions;
            sum.evicted_bytes += s.evicted_bytes;
        }
        Some(sum)
    }
}

/// A prefix cache whose blocks fill whole windows ([`PrefixCache::window_block_tokens`]):
/// every hit is mapped whole, nothing copied, and the placeholder the server writes for a
/// block (one value) fills whole windows, which the simulator stores as next to nothing.
pub(crate) fn window_block_cache(
    vm: &VirtualMemory,
    plan: &LayoutPlan,
) -> Result<Arc<PrefixCache>, kvvm::kv::KvCacheError> {
    let blocks = PrefixCache::window_block_tokens(plan)?;
    PrefixCache::with_config(
        vm.clone(),
        *plan,
        PrefixCacheConfig::default().block_tokens(blocks),
    )
}
