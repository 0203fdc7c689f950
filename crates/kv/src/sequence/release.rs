//! Giving a sequence's memory back: shrink to the live tokens, release everything, and the
//! recount after a failed unmap (the reservation's records are the truth then).

use kvvm_vmm::BlockKind;

use crate::error::KvCacheError;

use super::SequenceKv;

/// The tokens a shrink keeps, and the ranges (offset, length) past them it gives back.
type Beyond = (u64, Vec<(u64, u64)>);

impl SequenceKv {
    /// Gives back the private windows committed beyond the first `n` tokens (windows holding
    /// no byte of tokens `0..n` in any fragment), keeping the address range: what a
    /// pre-committer does with windows it committed ahead of need when memory runs short.
    /// Tokens already written are never given back (`n` is raised to
    /// [`written_tokens`](Self::written_tokens)), and neither is a shared window. Returns the
    /// bytes unmapped. Like [`release`](Self::release), it does not synchronize the device.
    pub fn shrink_committed(&mut self, n: u64) -> Result<u64, KvCacheError> {
        let Some((n, ranges)) = self.beyond(n)? else {
            return Ok(0);
        };
        self.wait_copies()?;
        let span =
            tracing::debug_span!("kv.shrink_committed", from = self.committed_tokens, to = n);
        let _e = span.enter();
        match self.reservation.release_ranges(&ranges) {
            Ok(bytes) => {
                self.committed_tokens = n;
                Ok(bytes)
            }
            Err(e) => {
                // Some windows were unmapped, others stay: count again what is really there.
                self.recount_committed(false);
                Err(e.into())
            }
        }
    }

    /// The bytes [`shrink_committed`](Self::shrink_committed)`(n)` would give back to the
    /// budget now (its owned windows wholly past what it keeps). Changes nothing.
    pub fn shrinkable_bytes(&self, n: u64) -> Result<u64, KvCacheError> {
        Ok(self.beyond(n)?.map_or(0, |(_, ranges)| {
            self.reservation.owned_bytes_inside(&ranges)
        }))
    }

    /// What [`shrink_committed`](Self::shrink_committed)`(n)` keeps and gives back: `n`
    /// raised to the tokens never given back (written, a prefix, forgotten), and in each
    /// fragment the range (offset, length) past the window holding its last kept byte and
    /// past the protected windows; None when nothing lies past the kept tokens.
    fn beyond(&self, n: u64) -> Result<Option<Beyond>, KvCacheError> {
        let n = n
            .max(self.written_tokens)
            .max(self.prefix_tokens)
            .max(self.forgotten_tokens);
        if n >= self.committed_tokens {
            return Ok(None);
        }
        let g = self.plan.granule();
        let mut ranges = Vec::with_capacity(self.fragments.len());
        for f in &self.fragments {
            let live = f.live_bytes(n)?;
            let keep_end = live.end.div_ceil(g).saturating_mul(g).max(
                self.protected_windows()
                    .saturating_mul(g)
                    .saturating_add(f.offset),
            );
            let end = f.offset.saturating_add(f.reserved_bytes);
            if keep_end < end {
                ranges.push((keep_end, end - keep_end));
            }
        }
        Ok(Some((n, ranges)))
    }

    /// Sets the committed count from the reservation after a failed unmap: the most tokens
    /// (at most the count before) whose windows are all mapped in every fragment (and, with
    /// `writable_only`, mapped writable: after a failed release the sequence no longer knows
    /// a read-only prefix).
    pub(super) fn recount_committed(&mut self, writable_only: bool) {
        let g = self.plan.granule();
        let all_mapped = |n: u64| {
            self.fragments.iter().all(|f| {
                self.kept_bytes(f, n).is_ok_and(|live| {
                    let (first, last) = (live.start / g, live.end.div_ceil(g));
                    (first..last).all(
                        |w| match self.reservation.window_kind(w.saturating_mul(g)) {
                            None => false,
                            Some(BlockKind::Shared { writable: false }) => !writable_only,
                            Some(_) => true,
                        },
                    )
                })
            })
        };
        // The predicate is monotone in n: binary search for the largest n that holds.
        let (mut lo, mut hi) = (0u64, self.committed_tokens);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if all_mapped(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        tracing::warn!(
            before = self.committed_tokens,
            now = lo,
            "committed tokens recounted after a failed unmap"
        );
        self.committed_tokens = lo;
        self.written_tokens = self.written_tokens.min(lo);
    }

    /// Unmaps everything (private windows go to the pool or the driver; shared mappings only
    /// drop their reference), detaches from any shared prefix and keeps the address range.
    /// Returns the bytes unmapped. The sequence can grow again (privately) afterwards.
    ///
    /// Does not synchronize the device (see
    /// [`Reservation::release`](kvvm_vmm::Reservation::release)): device work on the
    /// sequence's memory must be finished first. Dropping the sequence synchronizes.
    pub fn release(&mut self) -> Result<u64, KvCacheError> {
        let span = tracing::debug_span!("kv.release", tokens = self.committed_tokens);
        let _e = span.enter();
        self.wait_copies()?;
        let bytes = match self.reservation.release() {
            Ok(bytes) => bytes,
            Err(e) => {
                // What could not be unmapped stays recorded in the reservation; the sequence
                // forgets its prefixes as on success and counts its tokens again.
                self.readonly.clear();
                self.readonly_windows = 0;
                self.owned = None;
                self.pending = None;
                self.prefix_tokens = 0;
                self.recount_committed(true);
                return Err(e.into());
            }
        };
        self.committed_tokens = 0;
        self.written_tokens = 0;
        self.prefix_tokens = 0;
        self.forgotten_tokens = 0;
        self.readonly.clear();
        self.readonly_windows = 0;
        self.owned = None;
        self.pending = None;
        Ok(bytes)
    }

    /// Whether nothing is mapped and no prefix is attached or owned: what a fresh or released
    /// sequence looks like.
    pub fn is_empty(&self) -> bool {
        self.reservation.committed_bytes() == 0
            && self.readonly.is_empty()
            && self.owned.is_none()
            && self.committed_tokens == 0
    }

    // ---- crate-internal: shared prefix plumbing ----

    /// Refuses a sequence that is not [empty](Self::is_empty).
    pub(crate) fn check_empty(&self) -> Result<(), KvCacheError> {
        if self.is_empty() {
            return Ok(());
        }
        Err(KvCacheError::InUse {
            committed_tokens: self.committed_tokens,
            mapped_bytes: self.reservation.committed_bytes(),
        })
    }

    /// Undoes a half-made admission: releases everything; a release that fails leaves what it
    /// could not unmap recorded in the reservation (it is still mapped), as `release` does.
    pub(crate) fn release_after_error(&mut self) {
        if let Err(e) = self.release() {
            tracing::warn!(error = %e, "release after a failed admission failed");
        }
    }
}
