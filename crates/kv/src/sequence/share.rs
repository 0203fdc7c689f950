//! How a [`SequenceKv`] takes part in sharing: it attaches read-only segments of shared
//! prefixes at the start of its fragments, and it commits the segment after them as a new
//! shared set that it owns (read-write) and others may attach.

use std::sync::Arc;

use kvvm_hal::Access;
use kvvm_num::{add, mul};

use crate::error::KvCacheError;
use crate::sequence::prefix::SharedDevicePrefix;
use crate::sequence::{AttachedSegment, SequenceKv};

impl SequenceKv {
    /// Maps windows `[prefix.first_window(), end_window)` of every fragment of `prefix`
    /// read-only; they must continue the read-only part already attached.
    pub(crate) fn attach_readonly(
        &mut self,
        prefix: &Arc<SharedDevicePrefix>,
        end_window: u64,
    ) -> Result<u64, KvCacheError> {
        if prefix.plan() != &self.plan {
            return Err(KvCacheError::PlanMismatch {
                reason: "the shared prefix was laid out under another plan".to_owned(),
            });
        }
        if prefix.first_window() != self.readonly_windows || self.owned.is_some() {
            return Err(KvCacheError::PlanMismatch {
                reason: format!(
                    "a shared segment starting at window {} cannot follow {} attached windows",
                    prefix.first_window(),
                    self.readonly_windows
                ),
            });
        }
        let end_window = end_window.min(prefix.end_window());
        let windows = prefix.window_ranges(end_window)?;
        let bytes = self
            .reservation
            .map_shared_ranges(prefix.handles(), &windows, Access::Read)?;
        self.readonly.push(AttachedSegment {
            prefix: Arc::clone(prefix),
            end_window,
        });
        self.readonly_windows = end_window;
        self.note_mapped_prefix(end_window);
        Ok(bytes)
    }

    /// After windows `[0, end_window)` of every fragment are mapped: those tokens count as
    /// committed and (being a written prefix or about to be written by the owner) as prefix.
    fn note_mapped_prefix(&mut self, end_window: u64) {
        let g = self.plan.granule();
        let whole = end_window.saturating_mul(g) / self.plan.fragment_bytes_per_token().max(1);
        let whole = whole.min(self.max_tokens);
        self.committed_tokens = self.committed_tokens.max(whole);
    }

    /// Records that the read-only attached prefix holds `tokens` written prefix tokens.
    pub(crate) fn set_attached_prefix_tokens(&mut self, tokens: u64) {
        self.prefix_tokens = self.prefix_tokens.max(tokens);
        self.written_tokens = self.written_tokens.max(tokens.min(self.committed_tokens));
    }

    /// Commits windows `[first_window, end_window)` of every fragment as a new shared set
    /// owned (read-write) by this sequence (none when `end_window == first_window`: the
    /// segment is then only its tail); `prefix_len` is the prefix's length in tokens.
    /// The set is made of as few handles as each fragment's run allows; with `block_windows`
    /// non-zero, no handle crosses a multiple of `block_windows` windows from
    /// `first_window` (a prefix cache's blocks: a shorter hit can then map whole handles).
    pub(crate) fn create_owned_segment(
        &mut self,
        first_window: u64,
        end_window: u64,
        prefix_len: u64,
        shareability: crate::PrefixShareability,
        block_windows: u64,
    ) -> Result<Arc<SharedDevicePrefix>, KvCacheError> {
        if self.owned.is_some() || first_window != self.readonly_windows {
            return Err(KvCacheError::PlanMismatch {
                reason: "an owned shared segment must follow the read-only part directly"
                    .to_owned(),
            });
        }
        let g = self.plan.granule();
        let start = mul(first_window, g, "segment start")?;
        let len = mul(end_window.saturating_sub(first_window), g, "segment bytes")?;
        let step = if block_windows == 0 {
            len.max(1)
        } else {
            mul(block_windows, g, "block bytes")?
        };
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for f in &self.fragments {
            let at = add(f.offset, start, "segment offset")?;
            let mut done = 0u64;
            while done < len {
                let n = step.min(len - done);
                ranges.push((add(at, done, "segment offset")?, n));
                done = done.saturating_add(n);
            }
        }
        // A segment whose prefix bytes end before its first whole window has no read-only
        // window: an empty set (its tail is made when it is sealed).
        let set = if ranges.is_empty() {
            self.vm.empty_shared()
        } else {
            self.reservation.commit_shared(&ranges)?
        };
        let prefix = Arc::new(SharedDevicePrefix::new(
            set,
            self.plan,
            first_window,
            end_window,
            prefix_len,
            shareability,
        ));
        self.owned = Some(Arc::clone(&prefix));
        self.prefix_tokens = self.prefix_tokens.max(prefix_len);
        self.note_mapped_prefix(end_window);
        Ok(prefix)
    }

    /// Physical bytes that [`release`](Self::release) would give back now: its private
    /// windows, and every shared prefix it maps or owns that nothing else holds (no other
    /// sequence, no prefix cache, no caller's handle). A shared prefix still held elsewhere
    /// stays mapped there and is not counted.
    pub fn releasable_bytes(&self) -> u64 {
        // Every reference this sequence holds, per prefix (a prefix may appear as attached,
        // owned and pending at once).
        let mut held: Vec<(&Arc<SharedDevicePrefix>, usize)> = Vec::new();
        let pending = self.pending.iter().flat_map(|p| p.segments.iter());
        let refs = self
            .readonly
            .iter()
            .chain(pending)
            .map(|s| &s.prefix)
            .chain(self.owned.iter());
        for p in refs {
            match held.iter_mut().find(|(q, _)| Arc::ptr_eq(q, p)) {
                Some((_, n)) => *n += 1,
                None => held.push((p, 1)),
            }
        }
        held.iter()
            .filter(|(p, n)| Arc::strong_count(p) == *n)
            .map(|(p, _)| p.bytes())
            .fold(self.additional_owned_bytes(), u64::saturating_add)
    }
}
