//! The prefix cache's host level: an entry evicted from the device is copied, window by
//! window, into chunks of a [`HostTier`] (billed to the host's budget while it is there), and
//! a later admission whose longest hit lies there copies it back into the request's own
//! windows, committed as for a miss, instead of prefilling it; the request then publishes it
//! again, so that it is shared read-only on the device like any published prefix.
//!
//! The copies are the tier's own (`host_tier/copy.rs`). Which windows: in every fragment, those
//! holding a byte of the entry's first `tokens` tokens (whole blocks), read from each segment's
//! home view (the read-only windows, then the last segment's tail). On the way back only the
//! windows past the read-only windows the request maps from a shorter device hit are copied
//! (no write ever lands in a read-only window).
//!
//! | step | on failure |
//! |---|---|
//! | chunks taken on the host's budget | least recently used host entries dropped, then taken again; none left: the prefix is forgotten |
//! | copies device -> host, waited for | the chunks given back, the prefix forgotten (the device could not be proven idle: the chunks quarantined) |
//! | copies host -> device into the admitted request, waited for | the host entry dropped, the hit handed on from the device as without a host level (the rest prefilled); the device not proven idle: the admission fails, the sequence keeps the copies in its fence (nothing unmapped under them), the chunks are kept until a clear proves the device idle |
//! | the request's commit (an admission's, as for a miss) | backpressure: nothing changed, the host entry kept; anything else: the host entry dropped, the request admitted again with the device's hit alone |
//!
//! The host level is also a reclaimer of the host's bytes (`PrefixCache`'s
//! [`Reclaimer`](kvvm_governor::Reclaimer) on [`DeviceId::HOST`](kvvm_hal::DeviceId::HOST)):
//! a swap that needs them drops the least recently used host entries first.

use std::collections::HashMap;
use std::sync::Arc;

use kvvm_hal::DeviceAddress;
use kvvm_num::{add, mul};

use super::{PrefixCache, State};
use crate::error::KvCacheError;
use crate::host_tier::{copy_runs, queue_runs, runs, wait_fence, HostChunks, HostTier};
use crate::sequence::lineage::Lineage;
use crate::sequence::prefix_home::TailPins;
use crate::sequence::{AttachedSegment, SequenceKv};

/// A prefix on the host: its tokens (whole blocks), their block hashes, and one chunk per
/// window (`windows[i]`: the offset in a sequence of the window chunk `i` holds).
pub(crate) struct HostEntry {
    tokens: Vec<u32>,
    hashes: Vec<u64>,
    lineage: Lineage,
    chunks: Arc<HostChunks>,
    windows: Vec<u64>,
    last_used: u64,
}

/// The host level's entries and their index by block hash.
#[derive(Default)]
pub(crate) struct HostLevel {
    entries: HashMap<u64, HostEntry>,
    index: HashMap<u64, Vec<u64>>,
    next_id: u64,
    /// Chunks whose copies back could not be proven done: not handed on until the device is
    /// proven idle (at a clear).
    pub(crate) stuck_chunks: Vec<Arc<HostChunks>>,
}

impl HostLevel {
    /// Entries and the bytes their chunks hold (with the chunks kept for copies that could
    /// not be proven done).
    pub(crate) fn held(&self) -> (u64, u64) {
        let bytes = self
            .entries
            .values()
            .map(|e| &e.chunks)
            .chain(&self.stuck_chunks)
            .map(|c| c.bytes())
            .fold(0u64, u64::saturating_add);
        (self.entries.len() as u64, bytes)
    }

    fn insert(&mut self, entry: HostEntry) {
        let id = self.next_id;
        self.next_id += 1;
        for h in &entry.hashes {
            self.index.entry(*h).or_default().push(id);
        }
        self.entries.insert(id, entry);
    }

    fn remove(&mut self, id: u64) -> Option<HostEntry> {
        let e = self.entries.remove(&id)?;
        for h in &e.hashes {
            if let Some(ids) = self.index.get_mut(h) {
                ids.retain(|x| *x != id);
                if ids.is_empty() {
                    self.index.remove(h);
                }
            }
        }
        Some(e)
    }

    /// Removes the entries holding a strict prefix of `tokens` (whose block hashes are
    /// `hashes`, blocks of `block_tokens`): a new entry of `tokens` hands on all they do.
    /// Returns them (dropped by the caller, unlocked).
    fn remove_prefixes_of(
        &mut self,
        tokens: &[u32],
        hashes: &[u64],
        block_tokens: u64,
    ) -> Vec<HostEntry> {
        let bt = usize::try_from(block_tokens).unwrap_or(usize::MAX);
        let mut ids = Vec::new();
        for (i, h) in hashes.iter().enumerate() {
            let n = (i + 1).saturating_mul(bt);
            if n >= tokens.len() {
                break;
            }
            for id in self.index.get(h).into_iter().flatten() {
                if self
                    .entries
                    .get(id)
                    .is_some_and(|e| e.tokens == tokens[..n])
                {
                    ids.push(*id);
                }
            }
        }
        ids.into_iter().filter_map(|id| self.remove(id)).collect()
    }

    /// The least recently used entry's id.
    fn oldest(&self) -> Option<u64> {
        self.entries
            .iter()
            .min_by_key(|(_, e)| e.last_used)
            .map(|(id, _)| *id)
    }

    /// Drops every entry (their chunks go back once no copy holds them).
    pub(crate) fn clear(&mut self) -> u64 {
        self.index.clear();
        let n = self.entries.len() as u64;
        self.entries.clear();
        n
    }
}

/// A host hit chosen at admission: the entry, the tokens it hands on (and where their bytes
/// came from), what to copy.
pub(crate) struct HostHit {
    pub(crate) id: u64,
    pub(crate) tokens: u64,
    pub(crate) lineage: Lineage,
    chunks: Arc<HostChunks>,
    windows: Vec<u64>,
}

impl PrefixCache {
    /// Gives the cache a host level over `tier` (of the cache's manager): evicted prefixes
    /// are copied there and found by admissions (see
    /// [`admit_into_with_host`](Self::admit_into_with_host)).
    ///
    /// Errors: [`KvCacheError::OtherManager`] for a tier of another manager;
    /// [`KvCacheError::Swap`] when the cache has a host level already.
    pub fn attach_host_tier(&self, tier: Arc<HostTier>) -> Result<(), KvCacheError> {
        if !tier.vm().same_manager(&self.vm) {
            return Err(KvCacheError::OtherManager { what: "host tier" });
        }
        self.tier.set(tier).map_err(|_| KvCacheError::Swap {
            reason: "the prefix cache has a host level already".to_owned(),
        })
    }

    /// The host level's tier, if any.
    pub fn host_tier(&self) -> Option<&Arc<HostTier>> {
        self.tier.get()
    }

    /// Copies an entry being evicted (its `tokens`, `hashes`, `segments` and `lineage`) to
    /// the host level, when the cache has one; see the module's documentation for each
    /// failure.
    pub(super) fn to_host(
        &self,
        tokens: &[u32],
        hashes: &[u64],
        segments: &[AttachedSegment],
        lineage: &Lineage,
    ) {
        let Some(tier) = self.tier.get() else {
            return;
        };
        let span = tracing::debug_span!("kv.prefix_to_host", tokens = tokens.len());
        let _e = span.enter();
        // Pinned first: a tail counted below is not given back before it is copied.
        let _pins = TailPins::new(segments.iter().map(|s| &s.prefix));
        let n = self.host_tokens(tokens.len() as u64, segments);
        let kept = usize::try_from(n).map_or(tokens.len(), |k| k.min(tokens.len()));
        let hashes = &hashes
            [..(kept / usize::try_from(self.block_tokens).unwrap_or(1).max(1)).min(hashes.len())];
        if kept == 0 || self.longest_host_hit(&tokens[..kept], hashes, n).is_some() {
            // Already on the host (those tokens or more): marked used.
            return;
        }
        let (windows, sources) = match self.host_windows(n, segments) {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "a prefix's windows cannot be read; it is forgotten");
                self.lock().stats.host_failed += 1;
                return;
            }
        };
        let Some(chunks) = self.take_on_host(tier, windows.len() as u64) else {
            self.lock().stats.host_forgotten += 1;
            return;
        };
        let runs = runs(
            sources.iter().copied().zip(0..),
            &chunks,
            tier.chunk_bytes(),
        );
        if let Err((e, settled)) = copy_runs(&chunks, DeviceAddress(0), &runs, false) {
            tracing::warn!(error = %e, "a prefix's copy to the host failed; it is forgotten");
            tier.counters().failed += 1;
            self.lock().stats.host_failed += 1;
            if !settled {
                // The copies may still write the chunks: never handed on. They only read the
                // prefix's memory, which is let go as eviction does (a device that cannot be
                // synchronized is lost).
                chunks.quarantine();
            }
            return;
        }
        let subsumed = {
            let mut st = self.lock();
            st.tick += 1;
            let tick = st.tick;
            st.stats.evicted_to_host += 1;
            let subsumed = st
                .host
                .remove_prefixes_of(&tokens[..kept], hashes, self.block_tokens);
            st.host.insert(HostEntry {
                tokens: tokens[..kept].to_vec(),
                hashes: hashes.to_vec(),
                lineage: lineage.truncated(kept as u64),
                chunks: Arc::new(chunks),
                windows,
                last_used: tick,
            });
            subsumed
        };
        drop(subsumed);
    }

    /// Tokens of an entry of `tokens` tokens held by `segments` that go to the host: what the
    /// chain hands on, in whole blocks.
    fn host_tokens(&self, tokens: u64, segments: &[AttachedSegment]) -> u64 {
        let Some(last) = segments.last() else {
            return 0;
        };
        let p = &last.prefix;
        let held = if last.end_window >= p.end_window() {
            p.tokens()
        } else {
            last.end_window.saturating_mul(self.plan.granule())
                / self.plan.fragment_bytes_per_token().max(1)
        };
        let n = held.min(tokens);
        n - n % self.block_tokens.max(1)
    }

    /// The windows holding a byte of the first `n` tokens in every fragment: their offsets in
    /// a sequence, and where each lies on the device now (its segment's home view).
    fn host_windows(
        &self,
        n: u64,
        segments: &[AttachedSegment],
    ) -> Result<(Vec<u64>, Vec<u64>), KvCacheError> {
        let g = self.plan.granule();
        let end = mul(n, self.plan.fragment_bytes_per_token(), "prefix bytes")?.div_ceil(g);
        let mut bases = Vec::with_capacity(segments.len());
        for s in segments {
            bases.push(s.prefix.with_home(&self.vm, true, Ok)?);
        }
        let (mut windows, mut sources) = (Vec::new(), Vec::new());
        for f in self.plan.fragments()? {
            for w in 0..end {
                let i = segments
                    .iter()
                    .rposition(|s| s.prefix.first_window() <= w)
                    .ok_or(KvCacheError::Swap {
                        reason: "a window of the prefix lies in none of its segments".to_owned(),
                    })?;
                let offset = add(f.offset, mul(w, g, "window")?, "window")?;
                windows.push(offset);
                sources.push(add(bases[i].0, offset, "window")?);
            }
        }
        Ok((windows, sources))
    }

    /// `n` chunks of `tier`, dropping least recently used host entries while the host's
    /// budget refuses them. None: refused with no entry left to drop, or the allocation
    /// failed.
    fn take_on_host(&self, tier: &Arc<HostTier>, n: u64) -> Option<HostChunks> {
        loop {
            match tier.take(n) {
                Ok(chunks) => return Some(chunks),
                Err(e) if e.backpressure().is_some() || e.never_fits().is_some() => {
                    let dropped = {
                        let mut st = self.lock();
                        let id = st.host.oldest()?;
                        st.stats.host_evictions += 1;
                        st.host.remove(id)
                    };
                    drop(dropped);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "no host memory for a prefix; it is forgotten");
                    return None;
                }
            }
        }
    }

    /// The longest prefix of `token_ids` on the host (whole blocks; `hashes` its block
    /// hashes), if longer than `at_least` tokens. Marks the entry used.
    pub(super) fn longest_host_hit(
        &self,
        token_ids: &[u32],
        hashes: &[u64],
        at_least: u64,
    ) -> Option<HostHit> {
        self.tier.get()?;
        let bt = usize::try_from(self.block_tokens).unwrap_or(usize::MAX);
        let mut st = self.lock();
        st.tick += 1;
        let tick = st.tick;
        for i in (1..=hashes.len()).rev() {
            let n = i.saturating_mul(bt);
            if (n as u64) < at_least {
                return None;
            }
            let Some(ids) = st.host.index.get(&hashes[i - 1]).cloned() else {
                continue;
            };
            for id in ids.into_iter().rev() {
                let Some(e) = st.host.entries.get_mut(&id) else {
                    continue;
                };
                if e.tokens.len() >= n && e.tokens[..n] == token_ids[..n] {
                    e.last_used = tick;
                    return Some(HostHit {
                        id,
                        tokens: n as u64,
                        lineage: e.lineage.truncated(n as u64),
                        chunks: Arc::clone(&e.chunks),
                        windows: e.windows.clone(),
                    });
                }
            }
        }
        None
    }

    /// Copies `hit` from the host into `seq` (its tokens committed, its read-only windows
    /// skipped) and waits for the copies; records the tokens as the sequence's written
    /// prefix. Returns the bytes copied. On a failure the host entry is dropped; the error
    /// says whether the device could be proven idle after it (`false`: the copies stay in the
    /// sequence's fence, so that nothing is unmapped under them).
    pub(super) fn copy_from_host(
        &self,
        seq: &mut SequenceKv,
        hit: &HostHit,
    ) -> Result<u64, (KvCacheError, bool)> {
        let picked = self.windows_back(seq, hit).map_err(|e| (e, true))?;
        let runs = runs(picked.iter().copied(), &hit.chunks, self.plan.granule());
        let result = queue_runs(&hit.chunks, seq.address(), &runs, true).and_then(|fence| {
            seq.fence = Some(Arc::clone(&fence));
            let r = wait_fence(&mut Some(fence));
            if !matches!(r, Err((_, false))) {
                seq.fence = None;
            }
            r
        });
        if let Err((e, settled)) = result {
            hit.chunks.tier().counters().failed += 1;
            let dropped = {
                let mut st = self.lock();
                st.stats.host_failed += 1;
                if !settled {
                    // Copies that may still run into the sequence: the chunks are not handed
                    // on before the device is proven idle.
                    st.host.stuck_chunks.push(Arc::clone(&hit.chunks));
                }
                st.host.remove(hit.id)
            };
            drop(dropped);
            return Err((e, settled));
        }
        seq.set_attached_prefix_tokens(hit.tokens);
        Ok((picked.len() as u64).saturating_mul(self.plan.granule()))
    }

    /// The windows of `hit` to copy into `seq`, as (offset, chunk): in every fragment, those
    /// holding a byte of the hit's tokens past the read-only windows `seq` maps.
    fn windows_back(
        &self,
        seq: &SequenceKv,
        hit: &HostHit,
    ) -> Result<Vec<(u64, usize)>, KvCacheError> {
        let g = self.plan.granule();
        let end = mul(
            hit.tokens,
            self.plan.fragment_bytes_per_token(),
            "hit bytes",
        )?
        .div_ceil(g);
        let first = seq.readonly_windows;
        let fragments = self.plan.fragments()?;
        let mut out = Vec::new();
        for (i, &o) in hit.windows.iter().enumerate() {
            let Some(f) = fragments.iter().rev().find(|f| f.offset <= o) else {
                continue;
            };
            let w = (o - f.offset) / g;
            if w >= first && w < end {
                out.push((o, i));
            }
        }
        Ok(out)
    }

    /// Drops the host entry `id` (a failed commit on its way back), if it is still there.
    pub(super) fn drop_host_entry(&self, id: u64) {
        let dropped = {
            let mut st = self.lock();
            let e = st.host.remove(id);
            if e.is_some() {
                st.stats.host_failed += 1;
            }
            e
        };
        drop(dropped);
    }

    /// Drops least recently used host entries until `bytes` of their chunks were let go (or
    /// none is left), then gives the tier's idle page-locked memory back down to what is
    /// still wanted. Returns the bytes given back to the host's budget.
    pub(super) fn reclaim_host(&self, bytes: u64) -> u64 {
        let Some(tier) = self.tier.get() else {
            return 0;
        };
        let mut let_go = 0u64;
        let mut dropped = Vec::new();
        {
            let mut st = self.lock();
            while let_go < bytes {
                let Some(id) = st.host.oldest() else { break };
                if let Some(e) = st.host.remove(id) {
                    let_go = let_go.saturating_add(e.chunks.bytes());
                    st.stats.host_evictions += 1;
                    dropped.push(e);
                }
            }
        }
        drop(dropped);
        let pooled = tier.stats().pooled_bytes;
        tier.trim(pooled.saturating_sub(bytes))
    }

    /// Host bytes the host level holds (what [`reclaim_host`](Self::reclaim_host) may let go).
    pub(super) fn host_held_bytes(&self) -> u64 {
        self.lock().host.held().1
    }
}

/// Lets the chunks kept for copies that could not be proven done go once the device is proven
/// idle now (a clear); none while it cannot be. Returns them (dropped by the caller, unlocked).
pub(super) fn settle_stuck(cache: &PrefixCache, st: &mut State) -> Vec<Arc<HostChunks>> {
    if st.host.stuck_chunks.is_empty() {
        return Vec::new();
    }
    match cache.vm.backend().synchronize(cache.vm.device()) {
        Ok(()) => std::mem::take(&mut st.host.stuck_chunks),
        Err(_) => Vec::new(),
    }
}
