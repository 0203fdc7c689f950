//! [`PrecommittedSequence`]: the decode path's handle on a sequence the pre-committer grows.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{lock, Cell, Ensured, Inner};
use crate::error::KvCacheError;
use crate::sequence::SequenceKv;

/// A [`SequenceKv`] whose windows a [`Precommitter`](super::Precommitter) commits ahead of need.
pub struct PrecommittedSequence {
    pub(super) cell: Arc<Cell>,
    pub(super) inner: Arc<Inner>,
}

impl std::fmt::Debug for PrecommittedSequence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrecommittedSequence")
            .field("ready", &self.cell.ready.load(Ordering::Relaxed))
            .field("live", &self.cell.live.load(Ordering::Relaxed))
            .finish()
    }
}

impl PrecommittedSequence {
    /// Makes the first `n` tokens committed. The hot path (tokens already committed by the
    /// worker) takes no lock, makes no driver call and no system call; otherwise the commit is
    /// made inline and the worker is woken.
    pub fn ensure_tokens(&self, n: u64) -> Result<Ensured, KvCacheError> {
        let cell = &self.cell;
        let c = &self.inner.counters;
        if cell.dormant.load(Ordering::Relaxed) {
            cell.dormant.store(false, Ordering::Release);
        }
        // Claim first, read second (see `Cell`): a shrink either sees this claim or is seen.
        let claimed = cell.live.fetch_max(n, Ordering::SeqCst);
        let ready = cell.ready.load(Ordering::SeqCst);
        if n <= ready {
            if n > claimed {
                // Live tokens moved into pre-committed windows: less is ahead now.
                self.inner
                    .set_ahead(cell, Inner::ahead_bytes(&cell.plan, n, ready));
            }
            c.ready.fetch_add(1, Ordering::Relaxed);
            return Ok(Ensured::Ready);
        }
        let bytes = {
            let mut seq = cell.lock_settled();
            let result = seq.ensure_tokens(n);
            if result.is_ok() {
                // Claim the tokens again before anyone else may take the lock: while this
                // call waited for it, a release or `with_sequence` may have lowered `live`
                // below the claim made above, and the reclaimer would then give back the
                // windows this call is about to promise.
                cell.live.fetch_max(n, Ordering::SeqCst);
            }
            cell.ready.store(seq.committed_tokens(), Ordering::SeqCst);
            let bytes = result?;
            self.inner.set_ahead(cell, 0);
            bytes
        };
        c.inline_commits.fetch_add(1, Ordering::Relaxed);
        // The worker is behind: ask for a scan now.
        self.inner.kick();
        Ok(Ensured::Inline(bytes))
    }

    /// Runs `f` on the sequence (to write or read tokens, get pointers, shrink, attach a
    /// prefix, ...), under its lock. Afterwards the committed count the hot path reads is
    /// set from the sequence again, so that whatever `f` unmapped is never answered
    /// [`Ensured::Ready`].
    ///
    /// `f` may unmap windows, so the hot path answers no `Ready` while it runs (its calls
    /// commit inline, after `f`), and `f` waits for a background commit in flight to finish.
    /// To write or read committed tokens, [`write_tokens`](Self::write_tokens) and
    /// [`read_tokens`](Self::read_tokens) do neither.
    pub fn with_sequence<R>(&self, f: impl FnOnce(&mut SequenceKv) -> R) -> R {
        self.run_locked(f, false)
    }

    /// Runs `f` as [`with_sequence`](Self::with_sequence) does, for a step that may release
    /// the whole sequence (a swap's end): when the sequence is empty afterwards, the worker
    /// grows it no more until tokens are asked for again, as after
    /// [`release`](Self::release). Decided before the lock is let go, so the worker never
    /// commits windows ahead into a sequence whose tokens went to the host.
    pub fn with_sequence_releasing<R>(&self, f: impl FnOnce(&mut SequenceKv) -> R) -> R {
        self.run_locked(f, true)
    }

    fn run_locked<R>(&self, f: impl FnOnce(&mut SequenceKv) -> R, dormant_if_empty: bool) -> R {
        let mut seq = self.cell.lock_settled();
        self.cell.ready.store(0, Ordering::SeqCst);
        let out = f(&mut seq);
        if dormant_if_empty && seq.is_empty() {
            self.cell.dormant.store(true, Ordering::Release);
        }
        let committed = seq.committed_tokens();
        self.cell.ready.store(committed, Ordering::SeqCst);
        let live = self
            .cell
            .live
            .fetch_min(committed, Ordering::AcqRel)
            .min(committed);
        drop(seq);
        self.inner.set_ahead(
            &self.cell,
            Inner::ahead_bytes(&self.cell.plan, live, committed),
        );
        out
    }

    /// Writes tokens `first..` (see [`SequenceKv::write_tokens`]) without waiting for a
    /// background commit in flight: only committed tokens are written.
    pub fn write_tokens(&self, first: u64, src: &[u8]) -> Result<(), KvCacheError> {
        lock(&self.cell.seq).write_tokens(first, src)
    }

    /// Reads tokens `first..` (see [`SequenceKv::read_tokens`]) without waiting for a
    /// background commit in flight.
    pub fn read_tokens(&self, first: u64, out: &mut [u8]) -> Result<(), KvCacheError> {
        lock(&self.cell.seq).read_tokens(first, out)
    }

    /// Tokens committed right now.
    pub fn committed_tokens(&self) -> u64 {
        self.cell.ready.load(Ordering::Acquire)
    }

    /// Releases the sequence's windows (keeping its address range), like
    /// [`SequenceKv::release`].
    pub fn release(&self) -> Result<u64, KvCacheError> {
        let mut seq = self.cell.lock_settled();
        // The worker grows it no more (until tokens are asked for again)...
        self.cell.dormant.store(true, Ordering::Release);
        // ... and nothing is answered `Ready` from here on, before anything is unmapped.
        self.cell.ready.store(0, Ordering::SeqCst);
        let result = seq.release();
        self.cell
            .ready
            .store(seq.committed_tokens(), Ordering::SeqCst);
        self.cell
            .live
            .store(seq.committed_tokens(), Ordering::SeqCst);
        self.inner.set_ahead(&self.cell, 0);
        result
    }
}

impl Drop for PrecommittedSequence {
    fn drop(&mut self) {
        self.inner.set_ahead(&self.cell, 0);
    }
}
