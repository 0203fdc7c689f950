//! Prefixes across processes: the segments of a cached entry, to export to another process
//! ([`SharedDevicePrefix::export`]), and the insertion of segments another process made
//! (imported with [`SharedDevicePrefix::import`]), found by token ids like any entry.

use std::sync::Arc;

use crate::cache::records::PublishOutcome;
use crate::cache::PrefixCache;
use crate::error::KvCacheError;
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

    /// Inserts a prefix made elsewhere: `token_ids` (whole blocks), held by `segments`
    /// (sealed, of this cache's plan and manager, imported from another process or not),
    /// consecutive from window 0 to the windows of those blocks. Admissions then hit it like
    /// a prefix this cache published. An imported segment is billed where it was made, so
    /// eviction under pressure passes it by (it would free nothing here).
    ///
    /// Errors: [`KvCacheError::PlanMismatch`] when the tokens are not whole blocks or the
    /// segments do not cover exactly their windows, are of another plan or manager, or are
    /// not sealed. Nothing changes then.
    pub fn insert(
        &self,
        token_ids: Vec<u32>,
        segments: Vec<Arc<SharedDevicePrefix>>,
    ) -> Result<PublishOutcome, KvCacheError> {
        let blocks = self.check_whole_blocks(&token_ids)?;
        let end = blocks.saturating_mul(self.windows_per_block);
        let mut at = 0u64;
        for s in &segments {
            let ours = s.plan() == &self.plan && self.vm.owns_set(s.handles());
            if !ours || !s.is_sealed() || s.first_window() != at {
                return Err(mismatch(format!(
                    "segment {}..{} does not follow window {at} of a sealed prefix of this \
                     cache's plan and manager",
                    s.first_window(),
                    s.end_window()
                )));
            }
            at = s.end_window();
        }
        if at != end || segments.is_empty() {
            return Err(mismatch(format!(
                "the segments end at window {at}, the {blocks} blocks at {end}"
            )));
        }
        let hashes = self.block_hashes(&token_ids);
        let attached = segments
            .into_iter()
            .map(|prefix| AttachedSegment {
                end_window: prefix.end_window(),
                prefix,
            })
            .collect();
        Ok(self.insert_entry(token_ids, hashes, attached))
    }

    /// The whole blocks `token_ids` is made of, else a mismatch (no token at all is refused by
    /// the segments' check: they cannot end at window 0).
    fn check_whole_blocks(&self, token_ids: &[u32]) -> Result<u64, KvCacheError> {
        let n = token_ids.len() as u64;
        if !n.is_multiple_of(self.block_tokens) {
            return Err(mismatch(format!(
                "{n} tokens are not whole blocks of {}",
                self.block_tokens
            )));
        }
        Ok(n / self.block_tokens)
    }
}

fn mismatch(reason: String) -> KvCacheError {
    KvCacheError::PlanMismatch { reason }
}
