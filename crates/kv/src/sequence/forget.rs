//! A sliding window's oldest tokens forgotten: the windows that hold only tokens before the
//! window are unmapped (their handles go to the pool or the driver, the governor credited),
//! the address range and every pointer stay, and a read or write of a forgotten token is
//! refused before any driver call.
//!
//! A layer that attends to the last `W` tokens only never reads a token again once `W` newer
//! ones follow it; a sequence holding only such layers can give back what lies behind, so that
//! its memory is bounded by the window (plus the rounding to whole windows) however long it
//! grows. After [`SequenceKv::forget_tokens_before`]`(t)`:
//!
//! * committed bytes = granule x the windows holding at least one byte of the tokens
//!   `t..committed_tokens` (a window holding bytes of token `t - 1` and of token `t` stays);
//! * [`ensure_tokens`](SequenceKv::ensure_tokens) commits from the window of token `t` on,
//!   never a window behind it again;
//! * a multi-window handle is unmapped whole or not at all, so a sequence that forgets asks
//!   for one handle per window first ([`SequenceKv::use_window_handles`]).

use std::ops::Range;

use kvvm_layout::Fragment;
use kvvm_num::{add, mul};

use crate::error::KvCacheError;

use super::SequenceKv;

impl SequenceKv {
    /// Tokens before this one were forgotten ([`forget_tokens_before`](Self::forget_tokens_before)):
    /// 0 for a sequence that never forgot, and again after a release.
    pub fn forgotten_tokens(&self) -> u64 {
        self.forgotten_tokens
    }

    /// Makes every later commit map one handle per window (the manager's larger handles are
    /// for sequences that only grow: a handle is unmapped whole), so that
    /// [`forget_tokens_before`](Self::forget_tokens_before) gives back each window as soon as
    /// the tokens it holds are all forgotten. Windows already mapped keep their handles.
    pub fn use_window_handles(&mut self) {
        self.reservation.set_max_handle_windows(1);
    }

    /// Forgets the tokens before `t`: every window of every fragment holding no byte of the
    /// committed tokens from `t` on is unmapped (its handle goes back to the pool or the
    /// driver and the governor is credited), and those tokens are never read or written
    /// again ([`KvCacheError::Forgotten`]). A window holding a byte of a committed token from
    /// `t` on stays mapped, and so does a multi-window handle reaching past the windows behind
    /// (see [`use_window_handles`](Self::use_window_handles)). Returns the bytes unmapped;
    /// `t` at or below [`forgotten_tokens`](Self::forgotten_tokens) does nothing.
    ///
    /// Like [`release`](Self::release), it does not synchronize the device: work reading the
    /// forgotten tokens must be finished first.
    ///
    /// Errors, before any driver call: [`KvCacheError::NotCommitted`] when `t` is past the
    /// committed tokens; [`KvCacheError::NotShareable`] when the sequence maps, owns or is
    /// about to publish a shared prefix (its windows are the prefix's, shared by other
    /// sequences). A failed unmap ([`KvCacheError::Vmm`]) leaves the windows it could not
    /// unmap recorded and mapped, and the tokens forgotten all the same: the next forget or
    /// the release unmaps them.
    pub fn forget_tokens_before(&mut self, t: u64) -> Result<u64, KvCacheError> {
        if t <= self.forgotten_tokens {
            return Ok(0);
        }
        if t > self.committed_tokens {
            return Err(KvCacheError::NotCommitted {
                first: 0,
                end: t,
                committed: self.committed_tokens,
            });
        }
        if !self.readonly.is_empty() || self.owned.is_some() || self.pending.is_some() {
            return Err(KvCacheError::NotShareable {
                reason: format!(
                    "a sequence that maps or owns a shared prefix ({} prefix tokens) cannot \
                     forget its oldest tokens: their windows are the prefix's",
                    self.prefix_tokens
                ),
            });
        }
        let g = self.plan.granule();
        // Every token forgotten: the window of token `t`'s first bytes holds none kept.
        let all = t == self.committed_tokens;
        let mut ranges = Vec::with_capacity(self.fragments.len());
        for f in &self.fragments {
            let bytes = mul(t, f.bytes_per_token, "forgotten bytes")?;
            let behind = if all { bytes.div_ceil(g) } else { bytes / g };
            // From the fragment's start: windows a failed unmap left behind go this time.
            ranges.push((f.offset, mul(behind, g, "forgotten bytes")?));
        }
        let span = tracing::debug_span!("kv.forget", from = self.forgotten_tokens, to = t);
        let _e = span.enter();
        let result = self.reservation.release_ranges(&ranges);
        // Forgotten whatever the driver said: the caller reads them no more, and windows the
        // unmap left mapped stay recorded (the next forget or the release retries them).
        self.forgotten_tokens = t;
        Ok(result?)
    }

    /// Makes an empty sequence start at token `first`: the tokens before it are forgotten from
    /// the start (nothing is mapped for them, and reading or writing them is refused), as the
    /// layers of a sliding window that takes only the last tokens of a prefix
    /// ([`SharedDevicePrefix::attach_from`](crate::SharedDevicePrefix::attach_from)).
    ///
    /// Errors: [`KvCacheError::InUse`] when the sequence is not empty;
    /// [`KvCacheError::TooManyTokens`] past its maximum.
    pub(crate) fn start_at(&mut self, first: u64) -> Result<(), KvCacheError> {
        self.check_empty()?;
        if first > self.max_tokens {
            return Err(KvCacheError::TooManyTokens {
                tokens: first,
                max_tokens: self.max_tokens,
            });
        }
        self.forgotten_tokens = first;
        self.committed_tokens = first;
        self.written_tokens = first;
        Ok(())
    }

    /// Fragment `f`'s bytes of the tokens `forgotten_tokens..n`, widened at the start to the
    /// window of the first one: what must be mapped for those tokens (empty when `n` is not
    /// past the forgotten tokens).
    pub(crate) fn kept_bytes(&self, f: &Fragment, n: u64) -> Result<Range<u64>, KvCacheError> {
        let live = f.live_bytes(n)?;
        let g = self.plan.granule();
        let behind = mul(self.forgotten_tokens, f.bytes_per_token, "forgotten bytes")? / g;
        let start = add(f.offset, mul(behind, g, "forgotten bytes")?, "kept start")?;
        Ok(start.min(live.end)..live.end)
    }

    /// Refuses an access to tokens starting at `first` when some of them were forgotten.
    pub(crate) fn check_not_forgotten(&self, first: u64) -> Result<(), KvCacheError> {
        if first < self.forgotten_tokens {
            return Err(KvCacheError::Forgotten {
                token: first,
                forgotten: self.forgotten_tokens,
            });
        }
        Ok(())
    }
}
