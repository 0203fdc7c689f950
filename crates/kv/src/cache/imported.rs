//! Prefixes across processes: the segments of a cached entry, to export to another process
//! ([`SharedDevicePrefix::export`]), and the insertion of segments another process made
//! (imported with [`SharedDevicePrefix::import`]), found by token ids like any entry.

use std::sync::Arc;

use crate::cache::records::PublishOutcome;
use crate::cache::PrefixCache;
use crate::error::KvCacheError;
use crate::sequence::lineage::Lineage;
use crate::sequence::prefix::SharedDevicePrefix;
use crate::sequence::AttachedSegment;

impl PrefixCache {
    /// The segments of the cached entry whose tokens are exactly `token_ids`, in order (each
    /// starts where the previous ends): what another process imports, under the same keys,
    /// to [`insert`](Self::insert) the same prefix. `None` when no entry has those tokens.
    pub fn segments(&self, token_ids: &[u32]) -> Option<Vec<Arc<SharedDevicePrefix>>> {
        let hashes = self.block_hashes(token_ids);
        let st = self.lock();
        let ids = st.index.get(hashes.last()?)?;
        let entry = ids
            .iter()
            .filter_map(|id| st.entries.get(id))
            .find(|e| e.tokens == token_ids)?;
        Some(
            entry
                .segments
                .iter()
                .map(|s| Arc::clone(&s.prefix))
                .collect(),
        )
    }

    /// Inserts a prefix made elsewhere: `token_ids` held by `segments` (sealed, of this
    /// cache's plan and manager, imported from another process or not), in order from window
    /// 0, each starting at or before the end of the previous one (the previous one is then
    /// taken up to that window, which must end on one of its handles), the last one handing
    /// on at least `token_ids.len()` tokens and reached by them. Admissions then hit it, in
    /// whole blocks, like a
    /// prefix this cache published. An imported segment is billed where it was made, so
    /// eviction under pressure passes it by (it would free nothing here).
    ///
    /// Errors: [`KvCacheError::PlanMismatch`] when the tokens fill no block, or the segments
    /// do not chain from window 0 or hand on fewer tokens, are of another plan or manager, or
    /// are not sealed. Nothing changes then.
    pub fn insert(
        &self,
        token_ids: Vec<u32>,
        segments: Vec<Arc<SharedDevicePrefix>>,
    ) -> Result<PublishOutcome, KvCacheError> {
        let n = token_ids.len() as u64;
        if n < self.block_tokens {
            return Err(mismatch(format!(
                "{n} tokens fill no block of {}",
                self.block_tokens
            )));
        }
        let chained = self.chain(segments)?;
        let held = chained.last().map_or(0, |s| {
            if s.end_window >= s.prefix.end_window() {
                s.prefix.tokens()
            } else {
                0
            }
        });
        if held < n {
            return Err(mismatch(format!(
                "the segments hand on {held} tokens, not the {n} given"
            )));
        }
        let last_first = chained.last().map_or(0, |s| s.prefix.first_window());
        let reach = n.saturating_mul(self.plan.fragment_bytes_per_token());
        if reach <= last_first.saturating_mul(self.plan.granule()) {
            return Err(mismatch(format!(
                "{n} tokens end before the last segment (window {last_first}): a segment no \
                 token needs"
            )));
        }
        let hashes = self.block_hashes(&token_ids);
        // Bytes written elsewhere: an origin of their own.
        let lineage = Lineage::fresh(n);
        Ok(self.insert_entry(token_ids, hashes, chained, lineage))
    }

    /// `segments` as a chain from window 0: each taken up to the next one's first window.
    fn chain(
        &self,
        segments: Vec<Arc<SharedDevicePrefix>>,
    ) -> Result<Vec<AttachedSegment>, KvCacheError> {
        let mut out: Vec<AttachedSegment> = Vec::with_capacity(segments.len());
        for s in segments {
            let ours = s.plan() == &self.plan && self.vm.owns_set(s.handles());
            let at = out.last().map_or(0, |p| p.prefix.end_window());
            let first = s.first_window();
            let follows = match out.last_mut() {
                None => first == 0,
                Some(prev) => {
                    let ok = first >= prev.prefix.first_window()
                        && first <= at
                        && prev.prefix.can_end_at(first);
                    prev.end_window = first;
                    ok
                }
            };
            if !ours || !s.is_sealed() || !follows {
                return Err(mismatch(format!(
                    "segment {}..{} does not follow window {at} of a sealed prefix of this \
                     cache's plan and manager",
                    first,
                    s.end_window()
                )));
            }
            out.push(AttachedSegment {
                end_window: s.end_window(),
                prefix: s,
            });
        }
        if out.is_empty() {
            return Err(mismatch("no segment".to_owned()));
        }
        Ok(out)
    }
}

fn mismatch(reason: String) -> KvCacheError {
    KvCacheError::PlanMismatch { reason }
}
