//! A sequence's windows moved to the host tier and back ([`SwappedKv`]): its memory given
//! back to the device's budget while it waits, its bytes and its address kept.
//!
//! What moves: every window holding a byte of the tokens `forgotten..tokens` in every
//! fragment, past the read-only windows of the shared prefixes it maps. Those prefixes stay
//! on the device (billed once, as before), held by the swap so that they are not evicted
//! meanwhile, and are mapped read-only again on the way back; a segment the sequence owns
//! moves with its private windows (and comes back private: its publication is dropped).
//!
//! The steps, each with its failure:
//!
//! | step | what | on failure |
//! |---|---|---|
//! | [`SequenceKv::swap_out`] | chunks taken on the host's budget; copies queued device -> host on the tier's stream (after `after`'s work); an event | nothing changed (chunks given back once what was queued is done) |
//! | [`SequenceKv::finish_swap_out`] | the copies waited for; the sequence released (its memory back to the budget) | a failed copy: the host bytes are dropped, the sequence keeps its memory: compute it again or keep it |
//! | [`SequenceKv::swap_in`] | the prefixes mapped again, the windows committed in the same offsets, copies queued host -> device, an event | backpressure: nothing changed, the swap waits on the host; any other failure: the swap fails, the sequence is empty again |
//! | [`SequenceKv::finish_swap_in`] | the copies waited for; the chunks given back | the sequence is released, the swap fails: compute it again |
//!
//! While copies are in flight the sequence keeps them in its fence: releasing, shrinking or
//! forgetting it first waits for them, so no copy ever touches a window unmapped under it.
//! Reading or writing the sequence meanwhile is the caller's to avoid (a serving engine keeps
//! such a request out of its steps).

use std::sync::Arc;

use kvvm_hal::{DeviceAddress, StreamHandle};
use kvvm_num::{add, mul};

use crate::error::KvCacheError;
use crate::host_tier::{queue_runs, runs, wait_fence, CopyEvent, Fence, HostChunks, HostTier, Run};
use crate::sequence::{AttachedSegment, SequenceKv};

/// Where a [`SwappedKv`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SwapPhase {
    /// Copies to the host are queued; the sequence still holds its memory.
    CopyingOut,
    /// The bytes are on the host; the sequence's device memory was given back.
    OnHost,
    /// Copies back to the device are queued; the sequence holds its memory again.
    CopyingIn,
    /// Back on the device; the host's chunks were given back.
    Done,
    /// A step failed: the host's copy is gone (the request is computed again).
    Failed,
}

impl SwapPhase {
    /// A short lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            SwapPhase::CopyingOut => "copying_out",
            SwapPhase::OnHost => "on_host",
            SwapPhase::CopyingIn => "copying_in",
            SwapPhase::Done => "done",
            SwapPhase::Failed => "failed",
        }
    }
}

/// A sequence's tokens on their way to the host tier, there, or on their way back (see the
/// module's documentation). Dropping it waits for copies still in flight, then gives its
/// chunks back.
pub struct SwappedKv {
    pub(crate) phase: SwapPhase,
    /// Copies in flight; dropped (waited for) before the chunks.
    pub(crate) fence: Option<Arc<Fence>>,
    pub(crate) host: Option<HostChunks>,
    runs: Vec<Run>,
    pub(crate) tokens: u64,
    pub(crate) written: u64,
    pub(crate) forgotten: u64,
    pub(crate) readonly: Vec<AttachedSegment>,
    pub(crate) readonly_windows: u64,
    pub(crate) prefix_tokens: u64,
    pub(crate) base: DeviceAddress,
}

impl std::fmt::Debug for SwappedKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwappedKv")
            .field("phase", &self.phase)
            .field("tokens", &self.tokens)
            .field("bytes", &self.bytes())
            .field("base", &self.base)
            .finish()
    }
}

impl SwappedKv {
    /// Where it is.
    pub fn phase(&self) -> SwapPhase {
        self.phase
    }

    /// Tokens it holds (the sequence's first `tokens` tokens).
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Bytes of host memory it holds (whole windows; 0 once done or failed).
    pub fn bytes(&self) -> u64 {
        self.host.as_ref().map_or(0, HostChunks::bytes)
    }

    /// The address of the sequence it came from.
    pub fn address(&self) -> DeviceAddress {
        self.base
    }

    /// Copies queued in one call each (adjacent windows in one copy).
    pub fn copies(&self) -> usize {
        self.runs.len()
    }

    /// Whether the copies of the phase are done (true when none is in flight), without
    /// waiting. An error is their failure: finishing the phase then fails it.
    pub fn is_done(&self) -> Result<bool, KvCacheError> {
        match &self.fence {
            Some(f) => match f.lock().as_mut() {
                Some(e) => Ok(e.query()?),
                None => Ok(true),
            },
            None => Ok(true),
        }
    }

    /// Makes the work queued on `stream` from now on wait, on the device, for the copies in
    /// flight (a step that will read the sequence once it is back, without the host
    /// waiting).
    pub fn order_before(&self, stream: StreamHandle) -> Result<(), KvCacheError> {
        if let Some(f) = &self.fence {
            if let Some(e) = f.lock().as_ref() {
                e.order_before(stream)?;
            }
        }
        Ok(())
    }

    pub(crate) fn check_phase(
        &self,
        want: SwapPhase,
        base: DeviceAddress,
    ) -> Result<(), KvCacheError> {
        if self.phase != want {
            return Err(KvCacheError::Swap {
                reason: format!("the swap is {}, not {}", self.phase.as_str(), want.as_str()),
            });
        }
        if want != SwapPhase::OnHost && base != self.base {
            return Err(KvCacheError::Swap {
                reason: format!(
                    "the swap belongs to the sequence at {}, not {base}",
                    self.base
                ),
            });
        }
        Ok(())
    }

    /// Fails the swap: its chunks go back (or into quarantine when the copies that touched
    /// them cannot be proven done: `settled` false), its prefixes are let go.
    pub(crate) fn fail(&mut self, settled: bool) {
        self.phase = SwapPhase::Failed;
        self.fence = None;
        self.readonly.clear();
        if let Some(host) = self.host.take() {
            host.tier().counters().failed += 1;
            if settled {
                drop(host);
            } else {
                host.quarantine();
            }
        }
    }

    /// Waits for the copies in flight; on a failure, whether the device could be proven idle
    /// after it (`Err(settled)`).
    pub(crate) fn wait(&mut self) -> Result<(), (KvCacheError, bool)> {
        wait_fence(&mut self.fence)
    }

    /// Queues the copies of every run, host -> device when `back`, else device -> host, on
    /// the tier's stream, then records their event. On an error, waits for what was queued
    /// (returns whether that could be proven done).
    pub(crate) fn queue(
        &self,
        base: DeviceAddress,
        back: bool,
    ) -> Result<Arc<Fence>, (KvCacheError, bool)> {
        let Some(host) = &self.host else {
            return Err((
                KvCacheError::Swap {
                    reason: "the swap holds no host memory".to_owned(),
                },
                true,
            ));
        };
        queue_runs(host, base, &self.runs, back)
    }
}

impl Drop for SwappedKv {
    /// Copies still in flight are waited for before the chunks go back; chunks whose copies
    /// cannot be proven done are quarantined.
    fn drop(&mut self) {
        if let Err((e, settled)) = self.wait() {
            tracing::warn!(error = %e, "a swap's copies failed at drop");
            if !settled {
                if let Some(host) = self.host.take() {
                    host.quarantine();
                }
            }
        }
    }
}

impl SequenceKv {
    /// Begins moving the first `tokens` tokens of this sequence to `tier`: takes host chunks
    /// on the host's budget and queues the copies of its windows on the tier's stream, after
    /// the work queued on `after` (the stream of the steps that wrote them; `None`: the
    /// caller has made sure they are done). The sequence keeps its memory until
    /// [`finish_swap_out`](Self::finish_swap_out); it must not be written meanwhile.
    ///
    /// Errors, with nothing changed: the host budget's refusal
    /// ([`KvCacheError::Backpressure`] or [`KvCacheError::NeverFits`] on
    /// [`DeviceId::HOST`](kvvm_hal::DeviceId::HOST)), a failed allocation or copy,
    /// [`KvCacheError::NotCommitted`] past the committed tokens, [`KvCacheError::Swap`] for a
    /// sequence with copies in flight or a commit in flight, [`KvCacheError::OtherManager`].
    pub fn swap_out(
        &mut self,
        tier: &Arc<HostTier>,
        tokens: u64,
        after: Option<StreamHandle>,
    ) -> Result<SwappedKv, KvCacheError> {
        self.check_swappable(tier, tokens)?;
        let span = tracing::debug_span!("kv.swap_out", tokens);
        let _e = span.enter();
        let windows = self.swap_windows(tokens)?;
        let host = tier.take(windows.len() as u64)?;
        let runs = runs(windows.iter().copied().zip(0..), &host, tier.chunk_bytes());
        if let Some(s) = after {
            let e = CopyEvent::record(self.vm.backend(), self.vm.device(), s)?;
            e.order_before(tier.stream())?;
            e.forget();
        }
        let readonly = self.readonly.clone();
        let mut swap = SwappedKv {
            phase: SwapPhase::CopyingOut,
            fence: None,
            host: Some(host),
            runs,
            tokens,
            written: self.written_tokens.min(tokens),
            forgotten: self.forgotten_tokens,
            readonly,
            readonly_windows: self.readonly_windows,
            prefix_tokens: self.swap_prefix_tokens(),
            base: self.address(),
        };
        match swap.queue(self.address(), false) {
            Ok(fence) => {
                self.fence = Some(Arc::clone(&fence));
                swap.fence = Some(fence);
                Ok(swap)
            }
            Err((e, settled)) => {
                swap.fail(settled);
                Err(e)
            }
        }
    }

    /// Refuses a swap out of `tokens` tokens to `tier` that cannot be made (see
    /// [`swap_out`](Self::swap_out)).
    fn check_swappable(&self, tier: &HostTier, tokens: u64) -> Result<(), KvCacheError> {
        if !self.vm.same_manager(tier.vm()) {
            return Err(KvCacheError::OtherManager { what: "host tier" });
        }
        if tokens > self.committed_tokens {
            return Err(KvCacheError::NotCommitted {
                first: 0,
                end: tokens,
                committed: self.committed_tokens,
            });
        }
        if self.fence.is_some() || self.has_commit_in_flight() {
            return Err(KvCacheError::Swap {
                reason: "the sequence has copies or a commit in flight".to_owned(),
            });
        }
        Ok(())
    }
}

impl SequenceKv {
    /// The offsets of the windows a swap of the first `tokens` tokens moves: in every
    /// fragment, those holding a byte of the tokens kept (`forgotten..tokens`) past the
    /// read-only windows, each mapped.
    fn swap_windows(&self, tokens: u64) -> Result<Vec<u64>, KvCacheError> {
        let g = self.plan.granule();
        let mut out = Vec::new();
        for f in &self.fragments {
            let kept = self.kept_bytes(f, tokens)?;
            if kept.is_empty() {
                continue;
            }
            let shared_end = add(
                f.offset,
                mul(self.readonly_windows, g, "read-only")?,
                "read-only",
            )?;
            let first = (kept.start / g).max(shared_end / g);
            for w in first..kept.end.div_ceil(g) {
                let offset = mul(w, g, "window")?;
                if !self.reservation.is_mapped(offset) {
                    return Err(KvCacheError::NotCommitted {
                        first: 0,
                        end: tokens,
                        committed: self.committed_tokens,
                    });
                }
                out.push(offset);
            }
        }
        Ok(out)
    }

    /// The prefix tokens the sequence has once swapped back: those of the read-only prefixes
    /// it maps (a segment it owns comes back private).
    fn swap_prefix_tokens(&self) -> u64 {
        if self.owned.is_none() {
            return self.prefix_tokens;
        }
        let bytes = self.readonly_windows.saturating_mul(self.plan.granule());
        (bytes / self.plan.fragment_bytes_per_token().max(1)).min(self.prefix_tokens)
    }

    /// Waits for copies in flight over the sequence's windows (a swap's): what releasing,
    /// shrinking or forgetting does first. An error means they cannot be proven done (the
    /// device is lost): nothing is unmapped then.
    pub(crate) fn wait_copies(&mut self) -> Result<(), KvCacheError> {
        if let Some(f) = &self.fence {
            f.wait()?;
        }
        self.fence = None;
        Ok(())
    }
}
