//! Admission into a [`PrefixCache`]: reserve the request's sequence, attach the longest
//! cached prefix read-only, make the rest of the prompt's whole blocks a segment the request
//! owns (published once written), commit the prompt, count the hit or miss; undo all of it on
//! an error.

use std::sync::Arc;

use kvvm_layout::evaluate_prefix_shareability;

use crate::error::KvCacheError;
use crate::sequence::prefix_home::TailPins;
use crate::sequence::{AttachedSegment, PendingPublish, SequenceKv};

use super::host_level::HostHit;
use super::records::{Admission, AdmissionInfo};
use super::PrefixCache;
use crate::sequence::lineage::Lineage;

impl PrefixCache {
    /// Admits a request: reserves its sequence (at most `max_tokens` tokens), maps the
    /// longest cached prefix of `token_ids` read-only, makes the request the owner of a new
    /// shared segment for its full blocks past the hit, and commits the rest of the prompt
    /// (`token_ids.len()` tokens). The caller then writes tokens
    /// `hit_tokens..prompt_tokens` and calls [`publish`](Self::publish).
    ///
    /// Errors: [`KvCacheError::Backpressure`] when the governor refuses the memory even after
    /// evicting (a server answers 429 with `retry_after`); [`KvCacheError::TooManyTokens`];
    /// driver failures. On error nothing of the request is left.
    pub fn admit(&self, token_ids: &[u32], max_tokens: u64) -> Result<Admission, KvCacheError> {
        let prompt = token_ids.len() as u64;
        if prompt > max_tokens {
            return Err(KvCacheError::TooManyTokens {
                tokens: prompt,
                max_tokens,
            });
        }
        let mut seq = SequenceKv::new(&self.vm, &self.plan, max_tokens)?;
        let a = self.admit_into(token_ids, &mut seq)?;
        Ok(Admission {
            sequence: seq,
            info: a,
        })
    }

    /// Like [`admit`](Self::admit), into `seq`: an empty sequence (fresh or released) of this
    /// cache's plan made by the caller, for example one slot of a strided batch. Returns what
    /// `admit` returns beside the sequence. On error `seq` is released again (empty) and the
    /// cache is unchanged; a sequence of another manager ([`KvCacheError::OtherManager`]) or
    /// in use ([`KvCacheError::InUse`]) is refused untouched. A longer hit on the host level
    /// is always taken ([`admit_into_with_host`](Self::admit_into_with_host) with 1).
    pub fn admit_into(
        &self,
        token_ids: &[u32],
        seq: &mut SequenceKv,
    ) -> Result<AdmissionInfo, KvCacheError> {
        self.admit_into_with_host(token_ids, seq, 1)
    }

    /// Like [`admit_into`](Self::admit_into), taking a hit on the host level (copied back
    /// instead of prefilled) only when it hands on at least `min_host_tokens` tokens more than
    /// the device's hit (`u64::MAX`: never; what a caller decides by the costs of a copy and
    /// of a prefill). When the way back fails (a copy, a commit), the host entry is dropped
    /// and the request is admitted with the device's hit alone: the rest is prefilled.
    pub fn admit_into_with_host(
        &self,
        token_ids: &[u32],
        seq: &mut SequenceKv,
        min_host_tokens: u64,
    ) -> Result<AdmissionInfo, KvCacheError> {
        let prompt = token_ids.len() as u64;
        let max_tokens = seq.max_tokens();
        let span = tracing::debug_span!("kv.admit", prompt, max_tokens);
        let _e = span.enter();
        if prompt > max_tokens {
            return Err(KvCacheError::TooManyTokens {
                tokens: prompt,
                max_tokens,
            });
        }
        if !seq.vm().same_manager(&self.vm) {
            return Err(KvCacheError::OtherManager {
                what: "prefix cache",
            });
        }
        if seq.plan() != &self.plan {
            return Err(KvCacheError::PlanMismatch {
                reason: "the sequence was laid out under another plan than the cache's".to_owned(),
            });
        }
        seq.check_empty()?;
        match self.admit_attempt(token_ids, seq, min_host_tokens) {
            Ok(info) => Ok(info),
            Err((e, Some(id)))
                if e.backpressure().is_none()
                    && e.never_fits().is_none()
                    && !seq.has_copies_in_flight()
                    && seq.check_empty().is_ok() =>
            {
                tracing::warn!(error = %e, "a prefix's way back from the host failed; prefilled");
                self.drop_host_entry(id);
                self.admit_attempt(token_ids, seq, u64::MAX)
                    .map_err(|(e, _)| e)
            }
            Err((e, _)) => Err(e),
        }
    }

    /// One admission of `token_ids` into the empty `seq`; on error `seq` released again and
    /// the error restated, with the host entry the attempt took (if any).
    fn admit_attempt(
        &self,
        token_ids: &[u32],
        seq: &mut SequenceKv,
        min_host_tokens: u64,
    ) -> Result<AdmissionInfo, (KvCacheError, Option<u64>)> {
        let prompt = token_ids.len() as u64;
        let mut attempt = Attempt::default();
        match self.admit_empty(token_ids, seq, &mut attempt, min_host_tokens) {
            Ok(info) => Ok(info),
            Err(e) => {
                // A refusal names what the whole admission needed (the prompt's windows
                // less the hit), against what was available with what it had committed
                // before the refusal given back.
                let undone = seq.releasable_bytes();
                seq.release_after_error();
                let needed = self
                    .plan
                    .committed_bytes_for_tokens(prompt)
                    .map_or(0, |b| b.saturating_sub(attempt.hit_bytes));
                Err((e.restated(needed, undone), attempt.host))
            }
        }
    }

    /// Admits `token_ids` into the empty `seq`: maps the read-only windows of the longest
    /// cached prefix on the device, makes the rest of the prompt's whole blocks a segment
    /// `seq` owns (published later), commits the prompt, copies the cached tokens past the
    /// read-only windows from the cache (or a longer hit from the host level), and counts
    /// the hit or miss.
    fn admit_empty(
        &self,
        token_ids: &[u32],
        seq: &mut SequenceKv,
        attempt: &mut Attempt,
        min_host_tokens: u64,
    ) -> Result<AdmissionInfo, KvCacheError> {
        let prompt = token_ids.len() as u64;
        let hashes = self.block_hashes(token_ids);
        let blocks = hashes.len() as u64;
        let (hit_tokens, segments, device_lineage) = self.longest_hit(token_ids, &hashes);
        // The tails copied from are not given back under pressure until the copy is done.
        let _pins = TailPins::new(segments.iter().map(|s| &s.prefix));
        let hit_tokens = hit_tokens.min(seq.chain_tokens(&segments));
        let host = match min_host_tokens {
            u64::MAX => None,
            m => self.longest_host_hit(token_ids, &hashes, hit_tokens.saturating_add(m.max(1))),
        };
        attempt.host = host.as_ref().map(|h| h.id);
        let readonly_end = seq.readonly_end(&segments, hit_tokens);
        let shared_bytes = seq.attach_chain(&segments, readonly_end)?;
        attempt.hit_bytes = shared_bytes;
        let end_tokens = blocks.saturating_mul(self.block_tokens);
        let mut owned_prefix_tokens = 0;
        if end_tokens > hit_tokens {
            let kept = restrict(&segments, readonly_end);
            self.own_the_rest(token_ids, hashes, kept, seq, end_tokens)?;
            owned_prefix_tokens = end_tokens - hit_tokens;
        }
        seq.ensure_tokens(prompt)?;
        let device_hit = |seq: &mut SequenceKv| -> Result<_, KvCacheError> {
            let bytes = seq.copy_chain(&segments, hit_tokens)?;
            Ok((hit_tokens, bytes, 0, device_lineage.truncated(hit_tokens)))
        };
        let (hit_tokens, copied_bytes, host_hit_tokens, lineage) = match host {
            Some(h) => match self.copy_from_host(seq, &h) {
                Ok(bytes) => {
                    let lineage = self.host_hit_lineage(&device_lineage, &h, readonly_end);
                    (h.tokens, bytes, h.tokens, lineage)
                }
                Err((e, false)) => return Err(e),
                Err((e, true)) => {
                    tracing::warn!(error = %e, "a prefix's copy back failed; prefilled");
                    device_hit(seq)?
                }
            },
            None => device_hit(seq)?,
        };
        if let Some(pending) = seq.pending.as_mut() {
            pending.lineage = lineage.extended(end_tokens);
        }
        let readonly_tokens = self.tokens_before_window(readonly_end).min(hit_tokens);
        let committed_bytes = seq.committed_bytes().saturating_sub(shared_bytes);
        self.count_admission(hit_tokens, shared_bytes, host_hit_tokens);
        tracing::debug!(
            hit_tokens,
            host_hit_tokens,
            owned_prefix_tokens,
            shared_bytes,
            copied_bytes,
            "admitted"
        );
        Ok(AdmissionInfo {
            hit_tokens,
            prompt_tokens: prompt,
            owned_prefix_tokens,
            shared_bytes,
            copied_bytes,
            committed_bytes,
            host_hit_tokens,
            readonly_tokens,
            hit_origin: lineage.origin_at(hit_tokens),
        })
    }

    /// Tokens lying wholly before window `w` in every fragment.
    fn tokens_before_window(&self, w: u64) -> u64 {
        w.saturating_mul(self.plan.granule()) / self.plan.fragment_bytes_per_token().max(1)
    }

    /// Where the bytes of a host hit `h` copied back past the `readonly_end` windows a shorter
    /// device hit (of `device` runs) maps came from: the host entry's runs when the device's
    /// agree with them on every token with a byte in those windows; otherwise (another
    /// prefill's bytes before, the host's after) the device's runs of the tokens lying wholly
    /// in them, then an origin of their own.
    fn host_hit_lineage(&self, device: &Lineage, h: &HostHit, readonly_end: u64) -> Lineage {
        let bpt = self.plan.fragment_bytes_per_token().max(1);
        let touched = readonly_end
            .saturating_mul(self.plan.granule())
            .div_ceil(bpt)
            .min(h.tokens);
        if device.agrees(&h.lineage, touched) {
            h.lineage.truncated(h.tokens)
        } else {
            device
                .truncated(self.tokens_before_window(readonly_end).min(h.tokens))
                .extended(h.tokens)
        }
    }

    /// The longest cached prefix of `token_ids` (`hashes` its block hashes), in whole blocks:
    /// its tokens, the segments of the entry holding it and where their bytes came from (none
    /// on a miss). Marks the entry used.
    fn longest_hit(
        &self,
        token_ids: &[u32],
        hashes: &[u64],
    ) -> (u64, Vec<AttachedSegment>, Lineage) {
        let bt = usize::try_from(self.block_tokens).unwrap_or(usize::MAX);
        let mut st = self.lock();
        st.stats.lookups += 1;
        st.tick += 1;
        let tick = st.tick;
        let mut found: Option<(u64, usize)> = None;
        'outer: for i in (1..=hashes.len()).rev() {
            if let Some(ids) = st.index.get(&hashes[i - 1]) {
                for id in ids.iter().rev() {
                    if let Some(e) = st.entries.get(id) {
                        let n = i.saturating_mul(bt);
                        if e.tokens.len() >= n && e.tokens[..n] == token_ids[..n] {
                            found = Some((*id, n));
                            break 'outer;
                        }
                    }
                }
            }
        }
        let Some((id, n)) = found else {
            return (0, Vec::new(), Lineage::default());
        };
        match st.entries.get_mut(&id) {
            Some(e) => {
                e.last_used = tick;
                (n as u64, e.segments.clone(), e.lineage.truncated(n as u64))
            }
            None => (0, Vec::new(), Lineage::default()),
        }
    }

    /// Makes the prompt's blocks up to `end_tokens`, past the read-only windows `seq` maps
    /// (the segments `kept`), a segment `seq` owns, and records what to publish once it is
    /// written: the hashes, the tokens and every segment (the attached ones and the owned one).
    fn own_the_rest(
        &self,
        token_ids: &[u32],
        hashes: Vec<u64>,
        kept: Vec<AttachedSegment>,
        seq: &mut SequenceKv,
        end_tokens: u64,
    ) -> Result<(), KvCacheError> {
        let verdict = evaluate_prefix_shareability(
            self.plan.geometry(),
            self.plan.layout(),
            end_tokens,
            self.plan.granule(),
        )?;
        let first = seq.readonly_windows;
        let end = verdict.shareable_granules_per_fragment.max(first);
        let owned = seq.create_owned_segment(
            first,
            end,
            end_tokens,
            verdict,
            self.config.handle_windows.max(1),
        )?;
        owned.mark_cache_tail();
        let mut all = kept;
        all.push(AttachedSegment {
            end_window: owned.end_window(),
            prefix: owned,
        });
        let n = usize::try_from(end_tokens).unwrap_or(usize::MAX);
        seq.pending = Some(PendingPublish {
            hashes,
            tokens: token_ids[..n.min(token_ids.len())].to_vec(),
            segments: all,
            cache_id: self.id,
            lineage: Lineage::default(),
        });
        Ok(())
    }

    /// Counts an admission: a hit of `hit_tokens` mapping `shared_bytes` read-only (`host`
    /// of them copied back from the host level), or a miss.
    fn count_admission(&self, hit_tokens: u64, shared_bytes: u64, host: u64) {
        let mut st = self.lock();
        if host > 0 {
            st.stats.host_hits += 1;
            st.stats.host_tokens_saved = st.stats.host_tokens_saved.saturating_add(host);
        }
        if hit_tokens > 0 {
            st.stats.hits += 1;
            st.stats.tokens_saved = st.stats.tokens_saved.saturating_add(hit_tokens);
            st.stats.bytes_saved = st.stats.bytes_saved.saturating_add(shared_bytes);
        } else {
            st.stats.misses += 1;
        }
    }
}

/// What an admission's attempt took: the bytes its hit mapped, the host entry it chose.
#[derive(Default)]
struct Attempt {
    hit_bytes: u64,
    host: Option<u64>,
}

/// The segments restricted to windows `[0, end_window)`.
pub(super) fn restrict(segments: &[AttachedSegment], end_window: u64) -> Vec<AttachedSegment> {
    segments
        .iter()
        .filter(|s| s.prefix.first_window() < end_window)
        .map(|s| AttachedSegment {
            prefix: Arc::clone(&s.prefix),
            end_window: s.end_window.min(end_window),
        })
        .collect()
}
