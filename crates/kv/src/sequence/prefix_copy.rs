//! A sharer's side of shared prefixes: which windows of a chain of shared segments it may map
//! read-only, and the copy of the rest of the tokens it takes.
//!
//! The rule that keeps every write out of read-only memory, for any geometry: a sequence that
//! takes the first `t` tokens of a prefix writes tokens `t..` only, so it maps read-only only
//! the windows lying wholly before token `t`'s first byte in every fragment,
//! `floor(t x fragment_bytes_per_token / granule)` (cut down to whole handles, which are mapped
//! whole), and receives the bytes from there to token `t` by a device copy into its own
//! windows. Bytes per token need not divide a window: the token that straddles the end of the
//! read-only windows is copied, never written.

use kvvm_hal::{DeviceAddress, RowCopy};
use kvvm_num::{add, mul};

use crate::device_copy::copy_rows;
use crate::error::KvCacheError;
use crate::sequence::{AttachedSegment, SequenceKv};

impl SequenceKv {
    /// Tokens the chain `segments` (consecutive from window 0, as a prefix cache's entry holds
    /// them) hands on from token 0: up to its last segment's end window, and that segment's
    /// tail when it has one.
    pub(crate) fn chain_tokens(&self, segments: &[AttachedSegment]) -> u64 {
        let Some(last) = segments.last() else {
            return 0;
        };
        let p = &last.prefix;
        if last.end_window >= p.end_window() {
            p.tokens()
        } else {
            let g = self.plan.granule();
            last.end_window.saturating_mul(g) / self.plan.fragment_bytes_per_token().max(1)
        }
    }

    /// The read-only windows (per fragment, from window 0) a sequence taking the first
    /// `tokens` tokens of `segments` maps: those lying wholly before token `tokens`, within the
    /// segments' windows, ending where no handle of a segment is cut.
    pub(crate) fn readonly_end(&self, segments: &[AttachedSegment], tokens: u64) -> u64 {
        let g = self.plan.granule().max(1);
        let before = tokens.saturating_mul(self.plan.fragment_bytes_per_token()) / g;
        let mut end = before.min(segments.last().map_or(0, |s| s.end_window));
        while end > 0
            && !segments
                .iter()
                .filter(|s| s.prefix.first_window() < end)
                .all(|s| s.prefix.can_end_at(end.min(s.end_window)))
        {
            end -= 1;
        }
        end
    }

    /// Maps read-only the windows `[0, end)` of the chain `segments` (every segment starting
    /// before `end`, up to `end`). Returns the bytes mapped.
    pub(crate) fn attach_chain(
        &mut self,
        segments: &[AttachedSegment],
        end: u64,
    ) -> Result<u64, KvCacheError> {
        let mut bytes = 0u64;
        for s in segments.iter().filter(|s| s.prefix.first_window() < end) {
            let mapped = self.attach_readonly(&s.prefix, end.min(s.end_window))?;
            bytes = bytes.saturating_add(mapped);
        }
        Ok(bytes)
    }

    /// Copies the chain's bytes from this sequence's read-only end to token `tokens`, in every
    /// fragment, from each segment's home view into this sequence's own windows (committed by
    /// the caller), and records the tokens as the sequence's written prefix. Returns the bytes
    /// copied.
    ///
    /// Errors: [`KvCacheError::PrefixNotWritten`] when the chain hands on fewer tokens;
    /// [`KvCacheError::NotCommitted`] when the sequence has not committed them; driver
    /// failures of the copy.
    pub(crate) fn copy_chain(
        &mut self,
        segments: &[AttachedSegment],
        tokens: u64,
    ) -> Result<u64, KvCacheError> {
        let held = self.chain_tokens(segments);
        if tokens > held {
            return Err(KvCacheError::PrefixNotWritten {
                written: held,
                needed: tokens,
            });
        }
        if tokens > self.committed_tokens {
            return Err(KvCacheError::NotCommitted {
                first: 0,
                end: tokens,
                committed: self.committed_tokens,
            });
        }
        let bytes = self.copy_segments(segments, tokens)?;
        self.set_attached_prefix_tokens(tokens);
        Ok(bytes)
    }

    /// The copies of [`copy_chain`](Self::copy_chain): per segment, the bytes of
    /// `[readonly end, tokens)` that segment holds (its windows; the last one's tail too), one
    /// row per fragment, from its home view with the view's lock held. Returns the bytes
    /// copied.
    fn copy_segments(
        &self,
        segments: &[AttachedSegment],
        tokens: u64,
    ) -> Result<u64, KvCacheError> {
        let g = self.plan.granule();
        let b = self.plan.fragment_bytes_per_token();
        let want_end = mul(tokens, b, "prefix bytes")?;
        // From the end of the read-only windows, or the first token kept when it forgot some.
        let mut from = mul(self.readonly_windows, g, "read-only bytes")?.max(mul(
            self.forgotten_tokens,
            b,
            "forgotten bytes",
        )?);
        let mut bytes = 0u64;
        for (i, s) in segments.iter().enumerate() {
            let last = i + 1 == segments.len();
            let held_end = if last {
                want_end
            } else {
                mul(s.end_window, g, "segment end")?
            };
            let to = held_end.min(want_end);
            if to <= from {
                continue;
            }
            let in_windows = from < mul(s.prefix.end_window(), g, "segment end")?;
            let dst = add(self.address().0, from, "copy destination")?;
            let copied = s.prefix.with_home(&self.vm, in_windows, |home| {
                let row = RowCopy {
                    dst: DeviceAddress(dst),
                    dst_pitch: self.plan.slice_stride(),
                    src: DeviceAddress(add(home.0, from, "copy source")?),
                    src_pitch: self.plan.slice_stride(),
                    width: to - from,
                    rows: self.plan.slice_count(),
                };
                copy_rows(&self.vm, &[row])
            })?;
            bytes = bytes.saturating_add(copied);
            from = to;
        }
        Ok(bytes)
    }
}
