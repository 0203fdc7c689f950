//! One live sequence's KV cache: a [`SequenceKv`] reserved once under the service's
//! [`LayoutPlan`], admitted through the [`PrefixCache`] when the client sends token ids.
//!
//! This is the only module that calls the KV layer; the `KvService` owns
//! the table of these, the plan and the cache.

use kvvm::kv::{KvCacheError, LayoutPlan, PrefixCache, PublishOutcome, SequenceKv};
use kvvm::vmm::VirtualMemory;

use crate::error::ServiceError;

/// Largest host buffer used to write placeholder prompt KV (see [`LiveSequence::admit`]).
const WRITE_CHUNK_BYTES: u64 = 8 << 20;

/// A live sequence.
#[derive(Debug)]
pub(crate) struct LiveSequence {
    kv: SequenceKv,
    hit_tokens: u64,
    /// Bytes its requests committed (what its owner's committed-bytes limit counts).
    billed_bytes: u64,
}

/// A growth of a sequence: its live tokens afterwards and the bytes it needs committed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Growth {
    /// Live tokens after the growth.
    pub(crate) tokens: u64,
    /// Bytes of the windows that newly hold live bytes.
    pub(crate) needed: u64,
}

/// What opening a sequence did, beyond the sequence itself.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Opened {
    /// Bytes this request committed (private windows and a new owned prefix segment).
    pub(crate) committed_bytes: u64,
    /// Tokens of a prefix this request published to the cache.
    pub(crate) published_tokens: u64,
}

impl LiveSequence {
    /// Reserves a sequence of at most `max_tokens` tokens and commits its first `tokens`
    /// tokens (`needed` bytes, as the caller computed them from the plan), without looking
    /// for a shared prefix. On error nothing is left.
    pub(crate) fn open(
        vm: &VirtualMemory,
        plan: &LayoutPlan,
        max_tokens: u64,
        (tokens, needed): (u64, u64),
    ) -> Result<(Self, Opened), ServiceError> {
        let mut kv = SequenceKv::new(vm, plan, max_tokens).map_err(|e| kv_error(vm, e, needed))?;
        // On error `kv` is dropped: its reservation is freed (nothing was committed).
        let committed = kv
            .ensure_tokens(tokens)
            .map_err(|e| kv_error(vm, e, needed))?;
        let seq = LiveSequence {
            kv,
            hit_tokens: 0,
            billed_bytes: committed,
        };
        Ok((
            seq,
            Opened {
                committed_bytes: committed,
                published_tokens: 0,
            },
        ))
    }

    /// Admits a prompt of `token_ids` through the prefix cache: the longest cached prefix is
    /// mapped read-only (a hit: not committed again), the rest committed. When the prompt's
    /// full blocks go beyond the hit, this request owns a new shared prefix segment: the
    /// server, which has no model, stands in for prefill by writing placeholder KV for those
    /// tokens (bytes derived from the token ids), then publishes it so later requests with the
    /// same prefix hit it. `needed`: the bytes the whole prompt commits without a hit, as the
    /// caller computed them from the plan. On error nothing is left.
    pub(crate) fn admit(
        vm: &VirtualMemory,
        cache: &PrefixCache,
        token_ids: &[u32],
        max_tokens: u64,
        needed: u64,
    ) -> Result<(Self, Opened), ServiceError> {
        let admission = cache
            .admit(token_ids, max_tokens)
            .map_err(|e| kv_error(vm, e, needed))?;
        let (mut kv, admission) = (admission.sequence, admission.info);
        let mut published_tokens = 0;
        if admission.owned_prefix_tokens > 0 {
            let first = admission.hit_tokens;
            let end = first.saturating_add(admission.owned_prefix_tokens);
            write_placeholder(&mut kv, cache, token_ids, first, end)
                .map_err(|e| kv_error(vm, e, 0))?;
            if let PublishOutcome::Published { tokens, .. } =
                cache.publish(&mut kv).map_err(|e| kv_error(vm, e, 0))?
            {
                published_tokens = tokens;
            }
        }
        let seq = LiveSequence {
            kv,
            hit_tokens: admission.hit_tokens,
            billed_bytes: admission.committed_bytes,
        };
        Ok((
            seq,
            Opened {
                committed_bytes: admission.committed_bytes,
                published_tokens,
            },
        ))
    }

    /// Live tokens: the tokens the sequence has committed (asked of the KV layer, not
    /// counted twice).
    pub(crate) fn tokens(&self) -> u64 {
        self.kv.committed_tokens()
    }

    /// The most tokens this sequence may hold.
    pub(crate) fn max_tokens(&self) -> u64 {
        self.kv.max_tokens()
    }

    /// Bytes mapped in the sequence's reservation: its own windows and the shared prefix
    /// windows it maps.
    pub(crate) fn mapped_bytes(&self) -> u64 {
        self.kv.committed_bytes()
    }

    /// Its committed bytes, as the governor counts them: the physical bytes of its own
    /// windows (shared prefix windows are counted once, as shared, whoever maps them).
    pub(crate) fn committed_bytes(&self) -> u64 {
        self.kv.additional_owned_bytes()
    }

    /// Bytes of shared prefix windows mapped in its range (read-only from the prefix cache,
    /// or a prefix segment it published): mapped, not committed for it.
    pub(crate) fn shared_bytes(&self) -> u64 {
        self.mapped_bytes().saturating_sub(self.committed_bytes())
    }

    /// Physical bytes its release would give back now: its own windows and any shared
    /// prefix nothing else holds.
    pub(crate) fn releasable_bytes(&self) -> u64 {
        self.kv.releasable_bytes()
    }

    /// Prompt tokens found in the prefix cache.
    pub(crate) fn hit_tokens(&self) -> u64 {
        self.hit_tokens
    }

    /// Reserved bytes of address space.
    pub(crate) fn reserved_bytes(&self) -> u64 {
        self.kv.reservation().size()
    }

    /// The base device address (never changes while the sequence lives).
    pub(crate) fn address(&self) -> u64 {
        self.kv.address().0
    }

    /// What growing to `tokens` live tokens needs: the bytes of the windows that would newly
    /// hold live bytes (the one computation of them; [`grow`](Self::grow) commits them).
    pub(crate) fn growth_to(&self, tokens: u64) -> Result<Growth, ServiceError> {
        let target = self.kv.plan().committed_bytes_for_tokens(tokens)?;
        Ok(Growth {
            tokens,
            needed: target.saturating_sub(self.mapped_bytes()),
        })
    }

    /// Grows by `growth` ([`growth_to`](Self::growth_to)), committing the windows that now
    /// hold live bytes, as one transaction: on error the sequence is unchanged. Returns the
    /// bytes committed.
    pub(crate) fn grow(&mut self, vm: &VirtualMemory, growth: Growth) -> Result<u64, ServiceError> {
        let added = self
            .kv
            .ensure_tokens(growth.tokens)
            .map_err(|e| kv_error(vm, e, growth.needed))?;
        self.billed_bytes = self.billed_bytes.saturating_add(added);
        Ok(added)
    }

    /// Bytes its requests committed.
    pub(crate) fn billed_bytes(&self) -> u64 {
        self.billed_bytes
    }

    /// Unmaps every window (private ones go to the pool or the driver, shared ones drop a
    /// reference) and frees the address range; returns the bytes given back
    /// ([`releasable_bytes`](Self::releasable_bytes) before the release).
    pub(crate) fn close(mut self) -> Result<u64, ServiceError> {
        let freed = self.releasable_bytes();
        let released = self.kv.release().map(|_| freed);
        // Dropping the sequence frees the range (or quarantines what cannot be proven idle):
        // the manager never forgets memory.
        drop(self);
        released.map_err(|e| ServiceError::Internal(format!("release: {e}")))
    }
}

/// Writes placeholder KV for tokens `first..end`, whole blocks of the prefix cache, in chunks
/// of at most [`WRITE_CHUNK_BYTES`]. Every byte of a block's tokens is the top byte of the
/// block's chained hash (its token ids and all before them), so the same prefix gives the
/// same bytes, as a real prefill of it would; and each block fills its windows with one value,
/// which a device that keeps only what differs stores as next to nothing (the simulator
/// keeps a 64 KiB chunk of equal bytes as one byte: a served placeholder costs the host no
/// memory).
fn write_placeholder(
    kv: &mut SequenceKv,
    cache: &PrefixCache,
    token_ids: &[u32],
    first: u64,
    end: u64,
) -> Result<(), KvCacheError> {
    let hashes = cache.block_hashes(token_ids);
    let block_tokens = cache.block_tokens().max(1);
    let bpt = kv.plan().geometry().bytes_per_token().max(1);
    let chunk_tokens = (WRITE_CHUNK_BYTES / bpt).max(1);
    let bpt_usize = usize::try_from(bpt).unwrap_or(usize::MAX);
    let most = chunk_tokens
        .min(end.saturating_sub(first))
        .saturating_mul(bpt);
    // `vec!` of zeros is one zeroed allocation (no per-byte loop, even unoptimized).
    let most = usize::try_from(most).unwrap_or(usize::MAX);
    let mut buf = vec![0u8; most];
    let mut t = first;
    while t < end {
        let n = chunk_tokens.min(end - t);
        let len = usize::try_from(n.saturating_mul(bpt)).unwrap_or(usize::MAX);
        let buf = &mut buf[..len.min(most)];
        for (i, token) in buf.chunks_mut(bpt_usize).enumerate() {
            let block = (t + i as u64) / block_tokens;
            let hash = usize::try_from(block)
                .ok()
                .and_then(|b| hashes.get(b))
                .copied()
                .unwrap_or(0);
            token.fill(hash.to_le_bytes()[7]);
        }
        kv.write_tokens(t, buf)?;
        t += n;
    }
    Ok(())
}

/// The server's backpressure for `needed` bytes of which `available` are: its `Retry-After`,
/// computed once here, is estimated from what sequences really released during the last
/// window (their own windows, most of which go to the handle pool), not from what the
/// governor saw freed, which also counts the evictions and pool trims that ran for this very
/// request and still left it short.
fn backpressure(vm: &VirtualMemory, needed: u64, available: u64) -> ServiceError {
    ServiceError::Backpressure {
        needed_bytes: needed,
        available_bytes: available,
        retry_after: vm
            .governor()
            .estimate_retry_after_released(vm.device(), needed.saturating_sub(available)),
    }
}

/// Maps a KV-layer error with what this operation needed: backpressure and driver
/// out-of-memory become [`ServiceError::Backpressure`]; token counts out of range are the
/// client's; anything else is internal.
fn kv_error(vm: &VirtualMemory, e: KvCacheError, needed: u64) -> ServiceError {
    if let Some(n) = e.never_fits() {
        return ServiceError::NeverFits {
            needed_bytes: n.needed,
            limit_bytes: n.limit_bytes,
            limit: n.limit.as_str(),
        };
    }
    if let Some(bp) = e.backpressure() {
        return backpressure(vm, bp.needed, bp.available);
    }
    if e.is_retryable() {
        // The governor granted it but the driver ran out: the manager says what is left.
        let bp = vm.backpressure(needed);
        if bp.available >= needed {
            // Memory is not what is short: the driver refused the address range (live
            // reservations use it up). Releasing sequences gives it back.
            return ServiceError::LimitReached {
                limit: "device_address_space",
                used: 0,
                requested: needed,
                limit_value: 0,
                retry_after: vm
                    .governor()
                    .estimate_retry_after_released(vm.device(), needed.max(1)),
            };
        }
        return backpressure(vm, bp.needed, bp.available);
    }
    match e {
        KvCacheError::TooManyTokens { .. } => ServiceError::InvalidRequest(e.to_string()),
        KvCacheError::Layout(k) => k.into(),
        other => ServiceError::Internal(other.to_string()),
    }
}
