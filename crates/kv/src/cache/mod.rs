//! [`PrefixCache`]: automatic prefix sharing by a chained hash over token blocks, with an LRU
//! of published prefixes that the governor can evict under pressure.
//!
//! Invariants it keeps: an entry holds only sealed prefixes whose tokens were written; a hit
//! maps read-only only windows lying wholly before its end, ending where no handle of its
//! segments is cut (handles are mapped whole), and copies the rest; an entry is evicted only
//! when nothing but the cache holds its segments' memory (eviction frees it).
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | the cache, its hash chain, publish, eviction, the reclaimer |
//! | `admit.rs` | admission: the longest hit, the owned rest, the counts |
//! | `host_level.rs` | the host level: evicted prefixes copied to a host tier and back at a hit |
//! | `imported.rs` | prefixes across processes: an entry's segments to export, inserting imported ones |
//! | `records.rs` | what admission and publication report (plain data) |
//! | `tests.rs` | unit tests of the block size rule and the hash chain |

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use kvvm_governor::Reclaimer;
use kvvm_hal::DeviceId;
use kvvm_vmm::VirtualMemory;

use kvvm_layout::KvError;

mod admit;
mod host_level;
mod imported;
pub(crate) mod records;

use crate::error::KvCacheError;
use crate::host_tier::HostTier;
use crate::sequence::lineage::Lineage;
use crate::sequence::prefix::SharedDevicePrefix;
use crate::sequence::{check_plan_granule, AttachedSegment, SequenceKv};
use kvvm_layout::LayoutPlan;
use records::{PrefixCacheConfig, PrefixCacheStats, PublishOutcome};

static NEXT_CACHE_ID: AtomicUsize = AtomicUsize::new(1);

struct Entry {
    tokens: Vec<u32>,
    hashes: Vec<u64>,
    segments: Vec<AttachedSegment>,
    lineage: Lineage,
    last_used: u64,
}

#[derive(Default)]
struct State {
    entries: HashMap<u64, Entry>,
    index: HashMap<u64, Vec<u64>>,
    next_id: u64,
    tick: u64,
    stats: PrefixCacheStats,
    host: host_level::HostLevel,
}

/// The automatic prefix cache: given a request's token ids, finds the longest cached prefix,
/// gives it to the request's new [`SequenceKv`] and commits the rest.
///
/// * **Blocks**: prompts are cut into blocks of [`block_tokens`](Self::block_tokens) tokens
///   (16 by default, [`PrefixCacheConfig::block_tokens`]), the hit granularity, whatever the
///   granule: a hit of `h` tokens maps read-only the windows lying wholly before token `h`
///   (cut down to whole handles) and copies the rest of the `h` tokens from the cache into the
///   request's own windows, so a short system prompt of a small model (2048 tokens to a
///   window at 1 KiB a token) hits too, as a copy, instead of being computed again.
/// * **Hashing**: `h_0 = seed`, `h_i = H(h_{i-1}, token ids of block i)` (FNV-1a 64 over the
///   little-endian ids with a final avalanche). The longest `i` whose `h_i` is cached and
///   whose stored token ids equal the request's is the hit (collisions are checked, never
///   trusted).
/// * **Publishing**: a request whose full blocks go beyond its hit owns a new shared segment
///   for them (its whole windows, then a tail copied when it is sealed); it is published to
///   the cache by [`publish`](Self::publish) only after its prompt KV has been written, so no
///   sharer ever maps or copies unwritten bytes.
/// * **LRU and billing**: a cached prefix outlives its owner; it is billed once (as shared);
///   [`PrefixCacheConfig::max_cached_bytes`] caps the cache.
/// * **Eviction under pressure**: the cache registers itself with the governor as a
///   [`Reclaimer`]; before a grant is refused, least recently used prefixes that no sequence
///   maps are evicted. A prefix still mapped by live sequences is kept: evicting it would
///   free nothing now and make the next identical request pay for a second copy.
pub struct PrefixCache {
    vm: VirtualMemory,
    plan: LayoutPlan,
    block_tokens: u64,
    config: PrefixCacheConfig,
    id: usize,
    state: Mutex<State>,
    tier: OnceLock<Arc<HostTier>>,
}

impl fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefixCache")
            .field("layout", &self.plan.layout())
            .field("block_tokens", &self.block_tokens)
            .field("stats", &self.stats())
            .finish()
    }
}

/// `h_i = H(h_{i-1}, block)`: FNV-1a 64 with a final avalanche (splitmix64's finalizer).
fn chain_hash(prev: u64, block: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ prev;
    for id in block {
        for b in id.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    kvvm_num::mix64(h)
}

/// Seed of the hash chain.
const HASH_SEED: u64 = 0x6b76_766d_5f6b_7631;

impl PrefixCache {
    /// A cache over `vm` for sequences laid out under `plan`, registered with `vm`'s governor
    /// as a reclaimer.
    pub fn new(vm: VirtualMemory, plan: LayoutPlan) -> Result<Arc<PrefixCache>, KvCacheError> {
        Self::with_config(vm, plan, PrefixCacheConfig::default())
    }

    /// Like [`new`](Self::new) with a configuration.
    ///
    /// Errors: [`KvCacheError::PlanMismatch`] when the manager's granule is not the plan's.
    pub fn with_config(
        vm: VirtualMemory,
        plan: LayoutPlan,
        config: PrefixCacheConfig,
    ) -> Result<Arc<PrefixCache>, KvCacheError> {
        check_plan_granule(&vm, &plan)?;
        if plan.fragment_bytes_per_token() == 0 {
            return Err(KvError::ZeroGranule.into());
        }
        let block_tokens = config.block_tokens.max(1);
        let cache = Arc::new(PrefixCache {
            vm,
            plan,
            block_tokens,
            config,
            id: NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed),
            state: Mutex::new(State {
                stats: PrefixCacheStats {
                    block_tokens,
                    ..PrefixCacheStats::default()
                },
                ..State::default()
            }),
            tier: OnceLock::new(),
        });
        let arc: Arc<dyn Reclaimer> = cache.clone();
        let weak: Weak<dyn Reclaimer> = Arc::downgrade(&arc);
        cache.vm.governor().register_reclaimer(weak);
        Ok(cache)
    }

    /// The fewest tokens whose bytes fill whole windows in every fragment of `plan`,
    /// `granule / gcd(granule, fragment_bytes_per_token)`: with blocks of this size
    /// ([`PrefixCacheConfig::block_tokens`]) every hit ends on a window boundary and is mapped
    /// whole, nothing copied (coarser hits: 16 tokens for llama-3-8b token-major at 2 MiB,
    /// 512 for Qwen2.5-0.5B, 2048 at 1 KiB a token). What a server with no model, which writes
    /// one placeholder value per block, uses.
    pub fn window_block_tokens(plan: &LayoutPlan) -> Result<u64, KvError> {
        let (mut a, mut b) = (plan.granule(), plan.fragment_bytes_per_token());
        if a == 0 || b == 0 {
            return Err(KvError::ZeroGranule);
        }
        let g = a;
        while b != 0 {
            (a, b) = (b, a % b);
        }
        Ok(g / a)
    }

    /// Tokens per hashed block.
    pub fn block_tokens(&self) -> u64 {
        self.block_tokens
    }

    /// The manager.
    pub fn vm(&self) -> &VirtualMemory {
        &self.vm
    }

    /// The plan every sequence of this cache is laid out under.
    pub fn plan(&self) -> &LayoutPlan {
        &self.plan
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Chained hashes of the full blocks of `token_ids`.
    pub fn block_hashes(&self, token_ids: &[u32]) -> Vec<u64> {
        let b = usize::try_from(self.block_tokens).unwrap_or(usize::MAX);
        let mut h = HASH_SEED;
        token_ids
            .chunks_exact(b.max(1))
            .map(|block| {
                h = chain_hash(h, block);
                h
            })
            .collect()
    }

    /// Publishes the prefix segment `sequence` owns (from [`admit`](Self::admit)) once its
    /// prompt KV has been written: seals it read-only and inserts it into the cache. Then
    /// enforces [`PrefixCacheConfig::max_cached_bytes`].
    ///
    /// Errors: [`KvCacheError::PrefixNotWritten`] when the sequence has not written its
    /// prefix tokens yet (nothing changes; call again after writing);
    /// [`KvCacheError::PlanMismatch`] when the sequence was admitted by another cache;
    /// [`KvCacheError::OtherManager`] when it is another manager's.
    pub fn publish(&self, sequence: &mut SequenceKv) -> Result<PublishOutcome, KvCacheError> {
        if !sequence.vm().same_manager(&self.vm) {
            return Err(KvCacheError::OtherManager {
                what: "prefix cache",
            });
        }
        let Some(pending) = sequence.pending.take() else {
            return Ok(PublishOutcome::NothingToPublish);
        };
        if pending.cache_id != self.id {
            sequence.pending = Some(pending);
            return Err(KvCacheError::PlanMismatch {
                reason: "the sequence was admitted by another prefix cache".to_owned(),
            });
        }
        let needed = pending.tokens.len() as u64;
        if sequence.written_tokens() < needed {
            let written = sequence.written_tokens();
            sequence.pending = Some(pending);
            return Err(KvCacheError::PrefixNotWritten { written, needed });
        }
        let span = tracing::debug_span!("kv.publish", tokens = needed);
        let _e = span.enter();
        match sequence.seal_prefix() {
            Ok(()) => {}
            Err(e) if e.backpressure().is_some() || matches!(e, KvCacheError::NeverFits(_)) => {
                tracing::debug!(error = %e, "no memory for the prefix's tail: not published");
                return Ok(PublishOutcome::NoMemory);
            }
            Err(e) => return Err(e),
        }
        Ok(self.insert_entry(
            pending.tokens,
            pending.hashes,
            pending.segments,
            pending.lineage,
        ))
    }

    /// Inserts an entry of `tokens` (with their block `hashes`) held by `segments`, whose
    /// bytes came from `lineage`, unless an entry of the same tokens is cached; then enforces
    /// [`PrefixCacheConfig::max_cached_bytes`].
    fn insert_entry(
        &self,
        tokens: Vec<u32>,
        hashes: Vec<u64>,
        segments: Vec<AttachedSegment>,
        lineage: Lineage,
    ) -> PublishOutcome {
        let needed = tokens.len() as u64;
        let bytes = segments.last().map_or(0, |s| s.prefix.bytes());
        let outcome = {
            let mut st = self.lock();
            let exists = hashes.last().is_some_and(|h| {
                st.index.get(h).is_some_and(|ids| {
                    ids.iter()
                        .any(|id| st.entries.get(id).is_some_and(|e| e.tokens == tokens))
                })
            });
            if exists {
                st.stats.already_cached += 1;
                PublishOutcome::AlreadyCached
            } else {
                st.tick += 1;
                let id = st.next_id;
                st.next_id += 1;
                for h in &hashes {
                    st.index.entry(*h).or_default().push(id);
                }
                let tick = st.tick;
                st.entries.insert(
                    id,
                    Entry {
                        tokens,
                        hashes,
                        segments,
                        lineage,
                        last_used: tick,
                    },
                );
                st.stats.published += 1;
                PublishOutcome::Published {
                    tokens: needed,
                    bytes,
                }
            }
        };
        if let Some(cap) = self.config.max_cached_bytes {
            let held = self.stats().cached_bytes;
            if held > cap {
                self.evict(held - cap);
            }
        }
        outcome
    }

    /// Counters and sizes.
    pub fn stats(&self) -> PrefixCacheStats {
        let st = self.lock();
        let mut out = st.stats;
        let mut seen = HashSet::new();
        let mut cached = 0u64;
        for e in st.entries.values() {
            for s in &e.segments {
                if seen.insert(Arc::as_ptr(&s.prefix) as usize) {
                    cached = cached.saturating_add(s.prefix.bytes());
                }
            }
        }
        out.cached_entries = st.entries.len() as u64;
        (out.host_entries, out.host_bytes) = st.host.held();
        out.cached_bytes = cached;
        let idle = cache_only(&st);
        out.idle_bytes = idle.values().fold(0u64, |a, b| a.saturating_add(*b));
        out.tail_bytes = in_use(&st, &idle)
            .iter()
            .map(|p| p.releasable_tail_bytes())
            .fold(0u64, u64::saturating_add);
        out
    }

    /// Evicts least recently used prefixes that no sequence maps until `bytes` physical bytes
    /// were freed (or none is left to evict). Returns the bytes freed.
    pub fn evict(&self, bytes: u64) -> u64 {
        self.evict_inner(bytes)
    }

    /// Evicts every prefix (those still mapped stay alive until their sequences end, but are
    /// no longer found). Returns the bytes freed now.
    pub fn clear(&self) -> u64 {
        let device = self.vm.device();
        let before = self.vm.governor().snapshot().device(device).used();
        let pooled = self.vm.pooled_bytes();
        let (victims, stuck): (Vec<Entry>, _) = {
            let mut st = self.lock();
            st.index.clear();
            let n = st.entries.len() as u64;
            st.stats.evictions += n;
            let on_host = st.host.clear();
            st.stats.host_evictions += on_host;
            let stuck = host_level::settle_stuck(self, &mut st);
            (st.entries.drain().map(|(_, e)| e).collect(), stuck)
        };
        drop((victims, stuck));
        if let Some(tier) = self.tier.get() {
            tier.trim(0);
        }
        self.vm.trim_pool(pooled);
        let after = self.vm.governor().snapshot().device(device).used();
        let freed = before.saturating_sub(after);
        self.lock().stats.evicted_bytes += freed;
        freed
    }

    fn evict_inner(&self, bytes: u64) -> u64 {
        let device = self.vm.device();
        let span = tracing::debug_span!("kv.prefix_cache_evict", bytes);
        let _e = span.enter();
        let before = self.vm.governor().snapshot().device(device).used();
        let pooled = self.vm.pooled_bytes();
        let mut freed = 0u64;
        while freed < bytes {
            // The least recently used entry whose removal frees something now.
            let victim = {
                let mut st = self.lock();
                let mut best: Option<(u64, u64)> = None;
                let idle = cache_only(&st);
                for (id, e) in &st.entries {
                    // It holds a segment that only entries hold: evicting it and the others
                    // that hold that segment frees it.
                    let frees = e
                        .segments
                        .iter()
                        .any(|s| idle.contains_key(&(Arc::as_ptr(&s.prefix) as usize)));
                    if frees && best.is_none_or(|(_, t)| e.last_used < t) {
                        best = Some((*id, e.last_used));
                    }
                }
                match best {
                    Some((id, _)) => {
                        let e = st.entries.remove(&id);
                        if let Some(e) = &e {
                            for h in &e.hashes {
                                if let Some(ids) = st.index.get_mut(h) {
                                    ids.retain(|x| *x != id);
                                    if ids.is_empty() {
                                        st.index.remove(h);
                                    }
                                }
                            }
                        }
                        st.stats.evictions += 1;
                        e
                    }
                    None => None,
                }
            };
            let Some(victim) = victim else { break };
            self.to_host(
                &victim.tokens,
                &victim.hashes,
                &victim.segments,
                &victim.lineage,
            );
            drop(victim);
            self.vm.trim_pool(pooled);
            let after = self.vm.governor().snapshot().device(device).used();
            freed = before.saturating_sub(after);
        }
        if freed < bytes {
            freed = freed.saturating_add(self.release_tails(bytes - freed, pooled));
        }
        self.lock().stats.evicted_bytes += freed;
        tracing::debug!(freed, "prefix cache evicted");
        freed
    }
}

impl PrefixCache {
    /// Gives back the tails of entries still in use, least recently used first, until `bytes`
    /// were freed (their entries then hand on their read-only windows' tokens only). Returns
    /// the bytes freed, measured on the governor.
    fn release_tails(&self, bytes: u64, pooled: u64) -> u64 {
        let device = self.vm.device();
        let before = self.vm.governor().snapshot().device(device).used();
        let prefixes: Vec<Arc<SharedDevicePrefix>> = {
            let st = self.lock();
            let idle = cache_only(&st);
            in_use(&st, &idle)
        };
        let mut freed = 0u64;
        for p in prefixes {
            if freed >= bytes {
                break;
            }
            if p.release_tail() > 0 {
                self.vm.trim_pool(pooled);
                let after = self.vm.governor().snapshot().device(device).used();
                freed = before.saturating_sub(after);
            }
        }
        freed
    }
}

/// The segments of entries still in use (not idle: `idle` is [`cache_only`]'s), least recently
/// used entry first, each once.
fn in_use(st: &State, idle: &HashMap<usize, u64>) -> Vec<Arc<SharedDevicePrefix>> {
    let mut entries: Vec<&Entry> = st.entries.values().collect();
    entries.sort_by_key(|e| e.last_used);
    let mut seen = HashSet::new();
    entries
        .iter()
        .flat_map(|e| e.segments.iter())
        .filter(|s| {
            let key = Arc::as_ptr(&s.prefix) as usize;
            !idle.contains_key(&key) && seen.insert(key)
        })
        .map(|s| Arc::clone(&s.prefix))
        .collect()
}

/// The segments only cache entries hold (no sequence maps or holds them, no caller keeps a
/// handle of them), by address, with their bytes: what evicting every entry holding them
/// frees.
fn cache_only(st: &State) -> HashMap<usize, u64> {
    let mut refs: HashMap<usize, (usize, &Arc<SharedDevicePrefix>)> = HashMap::new();
    for e in st.entries.values() {
        for s in &e.segments {
            refs.entry(Arc::as_ptr(&s.prefix) as usize)
                .or_insert((0, &s.prefix))
                .0 += 1;
        }
    }
    refs.into_iter()
        .filter(|(_, (n, p))| {
            // An imported segment is billed where it was made: evicting it frees nothing here.
            !p.handles().is_imported() && Arc::strong_count(p) == *n && p.held_only_here()
        })
        .map(|(k, (_, p))| (k, p.bytes()))
        .collect()
}

impl Reclaimer for PrefixCache {
    fn reclaim(&self, device: DeviceId, bytes: u64) -> u64 {
        if bytes == 0 {
            return 0;
        }
        if device == DeviceId::HOST {
            return self.reclaim_host(bytes);
        }
        if device != self.vm.device() {
            return 0;
        }
        self.evict_inner(bytes)
    }

    /// The idle prefixes' bytes and the tails the cache may give back
    /// ([`PrefixCacheStats::idle_bytes`], [`PrefixCacheStats::tail_bytes`]): what eviction
    /// gives back.
    fn reclaimable(&self, device: DeviceId) -> u64 {
        if device == DeviceId::HOST {
            return self.host_held_bytes();
        }
        if device != self.vm.device() {
            return 0;
        }
        let s = self.stats();
        s.idle_bytes.saturating_add(s.tail_bytes)
    }
}

#[cfg(test)]
mod tests;
