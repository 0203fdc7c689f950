//! The steps of a swap after its copies to the host were queued (`swap.rs` has the type and
//! the first step): the sequence's memory given back once they are done, and the way back
//! into the same offsets.

use kvvm_hal::StreamHandle;

use crate::error::KvCacheError;
use crate::sequence::swap::{SwapPhase, SwappedKv};
use crate::sequence::SequenceKv;

impl SequenceKv {
    /// Finishes a swap out: waits for its copies, then releases the sequence (its memory goes
    /// back to the device's budget; its address stays, empty). Returns the bytes released.
    ///
    /// Errors: a failed copy (the swap fails: its host bytes are dropped; the sequence keeps
    /// its memory and its tokens: compute it again or keep it); a failed release (the swap
    /// is on the host, the sequence keeps what it could not unmap); [`KvCacheError::Swap`]
    /// for a swap of another sequence or in another phase.
    pub fn finish_swap_out(&mut self, swap: &mut SwappedKv) -> Result<u64, KvCacheError> {
        swap.check_phase(SwapPhase::CopyingOut, self.address())?;
        let span = tracing::debug_span!("kv.finish_swap_out", tokens = swap.tokens);
        let _e = span.enter();
        self.settle_swap(swap, false)?;
        swap.phase = SwapPhase::OnHost;
        if let Some(host) = &swap.host {
            let mut c = host.tier().counters();
            c.swaps_out = c.swaps_out.saturating_add(1);
            c.bytes_out = c.bytes_out.saturating_add(host.bytes());
        }
        self.release()
    }

    /// Begins bringing `swap` back into this sequence (empty, of the plan it came from; its
    /// own sequence keeps its address): maps the prefixes it kept read-only again, commits
    /// its windows at the same offsets (one transaction through the governor) and queues the
    /// copies host -> device on the tier's stream. The sequence must not be read until
    /// [`finish_swap_in`](Self::finish_swap_in) (or a stream made to wait with
    /// [`SwappedKv::order_before`]).
    ///
    /// Errors: [`KvCacheError::Backpressure`] when the budget cannot hold it now (nothing
    /// changed: the swap waits on the host; try again later); any other failure (a commit,
    /// a copy, a prefix that cannot be mapped, [`KvCacheError::NeverFits`]) fails the swap,
    /// the sequence empty again (compute the request again); [`KvCacheError::InUse`] for a
    /// sequence that is not empty, [`KvCacheError::Swap`] for a swap in another phase.
    pub fn swap_in(&mut self, swap: &mut SwappedKv) -> Result<(), KvCacheError> {
        swap.check_phase(SwapPhase::OnHost, self.address())?;
        self.check_empty()?;
        if !swap
            .host
            .as_ref()
            .is_some_and(|h| h.tier().vm().same_manager(&self.vm))
        {
            return Err(KvCacheError::OtherManager { what: "host tier" });
        }
        if swap.tokens > self.max_tokens {
            return Err(KvCacheError::TooManyTokens {
                tokens: swap.tokens,
                max_tokens: self.max_tokens,
            });
        }
        let span = tracing::debug_span!("kv.swap_in", tokens = swap.tokens);
        let _e = span.enter();
        if let Err(e) = self.recommit(swap) {
            self.release_after_error();
            if e.backpressure().is_none() {
                swap.fail(true);
            }
            return Err(e);
        }
        match swap.queue(self.address(), true) {
            Ok(fence) => {
                self.fence = Some(std::sync::Arc::clone(&fence));
                swap.fence = Some(fence);
                swap.phase = SwapPhase::CopyingIn;
                swap.base = self.address();
                Ok(())
            }
            Err((e, settled)) => {
                if settled {
                    self.release_after_error();
                }
                swap.fail(settled);
                Err(e)
            }
        }
    }

    /// The prefixes `swap` kept mapped read-only again, the tokens forgotten before it
    /// skipped, and its tokens committed.
    fn recommit(&mut self, swap: &SwappedKv) -> Result<(), KvCacheError> {
        if swap.forgotten > 0 {
            self.start_at(swap.forgotten)?;
        }
        if !swap.readonly.is_empty() {
            self.attach_chain(&swap.readonly, swap.readonly_windows)?;
            self.set_attached_prefix_tokens(swap.prefix_tokens);
        }
        self.ensure_tokens(swap.tokens)?;
        Ok(())
    }

    /// Finishes a swap in: waits for its copies and gives the host's chunks back; the
    /// sequence holds its tokens again, at its address. Returns the bytes copied back.
    ///
    /// Errors: a failed copy (the sequence is released, the swap fails: compute the request
    /// again; when the device cannot be proven idle nothing is unmapped and the chunks are
    /// quarantined); [`KvCacheError::Swap`] for a swap of another sequence or phase.
    pub fn finish_swap_in(&mut self, swap: &mut SwappedKv) -> Result<u64, KvCacheError> {
        swap.check_phase(SwapPhase::CopyingIn, self.address())?;
        let span = tracing::debug_span!("kv.finish_swap_in", tokens = swap.tokens);
        let _e = span.enter();
        self.settle_swap(swap, true)?;
        self.written_tokens = swap.written.min(self.committed_tokens);
        swap.phase = SwapPhase::Done;
        swap.readonly.clear();
        let bytes = swap.bytes();
        if let Some(host) = swap.host.take() {
            let mut c = host.tier().counters();
            c.swaps_in = c.swaps_in.saturating_add(1);
            c.bytes_in = c.bytes_in.saturating_add(bytes);
        }
        Ok(bytes)
    }

    /// Waits for the copies of `swap` (the wait both finishes share); the sequence no longer
    /// has copies in flight once they settled. A failed copy fails the swap and is returned;
    /// when its copies settled all the same, the sequence is also released with
    /// `release_on_failure` (a swap in whose tokens did not all come back).
    fn settle_swap(
        &mut self,
        swap: &mut SwappedKv,
        release_on_failure: bool,
    ) -> Result<(), KvCacheError> {
        if let Err((e, settled)) = swap.wait() {
            if settled {
                self.fence = None;
                if release_on_failure {
                    self.release_after_error();
                }
            }
            swap.fail(settled);
            return Err(e);
        }
        self.fence = None;
        Ok(())
    }

    /// Whether copies of a swap are in flight over this sequence's windows.
    pub fn has_copies_in_flight(&self) -> bool {
        self.fence.is_some()
    }

    /// Makes the work queued on `stream` from now on wait, on the device, for the copies in
    /// flight over this sequence (none: nothing to do).
    pub fn order_copies_before(&self, stream: StreamHandle) -> Result<(), KvCacheError> {
        if let Some(f) = &self.fence {
            if let Some(e) = f.lock().as_ref() {
                e.order_before(stream)?;
            }
        }
        Ok(())
    }
}
