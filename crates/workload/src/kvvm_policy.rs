//! The kvvm policies: every request a `SequenceKv` of the real manager on the backend, with or
//! without prefix sharing, under the governor's budget.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use kvvm_governor::{GovernorConfig, ManualClock};
use kvvm_hal::{DeviceId, VirtualMemoryBackend};
use kvvm_kv::{KvCacheError, SequenceKv, SharedDevicePrefix};
use kvvm_layout::{evaluate_prefix_shareability, KvLayout, LayoutPlan, PrefixShareability};
use kvvm_num::{add, mul};
use kvvm_vmm::{Governor, VirtualMemory, VmmConfig, VmmError};

use crate::driver::{CountingBackend, DriverTally};
use crate::error::{WorkloadError, WorkloadResult};
use crate::policy::{take_seq, Costs, Outcome, Policy, Shape};
use crate::trace::Request;

/// One sequence under a kvvm policy: a [`SequenceKv`] of the KV layer.
#[derive(Debug)]
struct KvSeq {
    kv: SequenceKv,
    /// Windows per fragment holding live bytes (committed, shared or private).
    windows: u64,
    /// Physical bytes this sequence owns privately (its shared windows are billed to the
    /// prefix).
    private: u64,
    tokens: u64,
    /// Tokens whose KV bytes were written to the device (real GPUs only).
    written: u64,
    /// Maps (or owns) the shared prefix.
    sharer: bool,
}

/// The shared prefix: the system prompt's whole windows, committed once by its first sharer
/// (the owner) and mapped read-only by the others.
#[derive(Debug)]
struct Prefix {
    prefix: Arc<SharedDevicePrefix>,
    sharers: usize,
}

/// A kvvm policy: sequences of the KV layer ([`SequenceKv`], [`SharedDevicePrefix`]) over
/// [`VirtualMemory`] with the governor's budget.
pub(crate) struct KvvmPolicy {
    plan: LayoutPlan,
    shape: Shape,
    vm: VirtualMemory,
    clock: Arc<ManualClock>,
    counting: Arc<CountingBackend>,
    measured: bool,
    write_kv: bool,
    /// Length of the system prompt shared (0: no sharing).
    prefix_len: u64,
    /// Shared windows per fragment (0: no sharing).
    share_windows: u64,
    shareability: Option<PrefixShareability>,
    seqs: HashMap<usize, KvSeq>,
    prefix: Option<Prefix>,
    committed: u64,
    live: u64,
}

impl fmt::Debug for KvvmPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvvmPolicy")
            .field("layout", &self.plan.layout())
            .field("share_windows", &self.share_windows)
            .field("committed", &self.committed)
            .finish()
    }
}

/// A KV-layer error as a refusal when retrying may help or the request can never fit (the
/// replay rejects a request that stays refused when nothing else holds memory), as an error
/// otherwise.
fn refusal(e: KvCacheError) -> WorkloadResult<Outcome> {
    if let Some(bp) = e.backpressure() {
        return Ok(Outcome::Refused(Some(bp.retry_after)));
    }
    if e.is_retryable() || e.never_fits().is_some() {
        return Ok(Outcome::Refused(None));
    }
    Err(e.into())
}

impl KvvmPolicy {
    pub fn new(
        backend: Arc<dyn VirtualMemoryBackend>,
        device: DeviceId,
        layout: KvLayout,
        prefix_sharing: bool,
        system_prompt_tokens: u64,
        shape: Shape,
        write_kv: bool,
    ) -> WorkloadResult<Self> {
        let clock = Arc::new(ManualClock::new());
        let governor = Governor::new(
            GovernorConfig::default()
                .default_device_budget(shape.budget)
                .clock(clock.clone()),
        );
        let counting = Arc::new(CountingBackend::new(backend.clone()));
        let vm = VirtualMemory::new(
            counting.clone() as Arc<dyn VirtualMemoryBackend>,
            device,
            governor,
            VmmConfig::default(),
        )?;
        let plan = LayoutPlan::new(shape.geometry, layout, vm.granule())?;
        let (share_windows, shareability) = if prefix_sharing && system_prompt_tokens > 0 {
            let v = evaluate_prefix_shareability(
                &shape.geometry,
                layout,
                system_prompt_tokens,
                vm.granule(),
            )?;
            (v.shareable_granules_per_fragment, Some(v))
        } else {
            (0, None)
        };
        Ok(KvvmPolicy {
            plan,
            shape,
            vm,
            clock,
            counting,
            measured: backend.name() != "sim",
            write_kv,
            prefix_len: if share_windows > 0 {
                system_prompt_tokens
            } else {
                0
            },
            share_windows,
            shareability,
            seqs: HashMap::new(),
            prefix: None,
            committed: 0,
            live: 0,
        })
    }

    fn g(&self) -> u64 {
        self.plan.granule()
    }

    /// Bytes of the shared windows (all of them prefix data), counted once.
    fn shared_bytes(&self) -> u64 {
        self.share_windows
            .saturating_mul(self.g())
            .saturating_mul(self.plan.slice_count())
    }

    /// Whether `req` opens with the whole system prompt (and the layout can share it).
    fn uses_prefix(&self, req: &Request) -> bool {
        self.prefix_len > 0 && req.shared_prefix_tokens >= self.prefix_len
    }

    /// Asks the governor whether `new_bytes` more can be committed (the pool supplies what it
    /// holds first), before any driver call. `Some(refusal)` when not.
    fn precheck(&self, new_bytes: u64) -> WorkloadResult<Option<Outcome>> {
        let short = new_bytes.saturating_sub(self.vm.pooled_bytes());
        if short == 0 {
            return Ok(None);
        }
        match self.vm.try_grant(short) {
            Ok(grant) => {
                grant.rollback();
                Ok(None)
            }
            Err(VmmError::Backpressure(bp)) => Ok(Some(Outcome::Refused(Some(bp.retry_after)))),
            // Larger than the budget: refused with no retry time; the replay rejects a request
            // that stays refused when nothing else holds memory.
            Err(VmmError::NeverFits(_)) => Ok(Some(Outcome::Refused(None))),
            Err(e) if e.is_retryable() => Ok(Some(Outcome::Refused(None))),
            Err(e) => Err(e.into()),
        }
    }

    fn live_of(&self, tokens: u64, sharer: bool) -> WorkloadResult<u64> {
        let b = mul(tokens, self.shape.bytes_per_token, "live bytes")?;
        Ok(if sharer {
            b.saturating_sub(self.shared_bytes())
        } else {
            b
        })
    }

    /// Writes the KV bytes of tokens `from..to` (real GPUs only), skipping the tokens that lie
    /// in read-only shared windows, in batches of about 32 MiB.
    fn write(&self, kv: &mut SequenceKv, id: usize, from: u64, to: u64) -> WorkloadResult<()> {
        if !self.write_kv {
            return Ok(());
        }
        let bpt = self.shape.bytes_per_token.max(1);
        let batch = ((32u64 << 20) / bpt).max(1);
        let mut t = from.max(kv.shared_tokens());
        while t < to {
            let n = batch.min(to - t);
            let len = usize::try_from(mul(n, bpt, "write bytes")?)
                .map_err(|_| WorkloadError::Overflow("write bytes"))?;
            let data = vec![(id % 251) as u8 + 1; len];
            kv.write_tokens(t, &data)?;
            t = add(t, n, "token")?;
        }
        Ok(())
    }

    /// Releases a sequence and, with the last sharer, the shared prefix.
    fn release(&mut self, mut seq: KvSeq) -> WorkloadResult<()> {
        seq.kv.release()?;
        self.committed = self.committed.saturating_sub(seq.private);
        if seq.sharer {
            if let Some(p) = self.prefix.as_mut() {
                p.sharers = p.sharers.saturating_sub(1);
            }
        }
        drop(seq);
        if self.prefix.as_ref().is_some_and(|p| p.sharers == 0) {
            if let Some(p) = self.prefix.take() {
                // The last reference: the handles go back to the pool or the driver.
                self.committed = self.committed.saturating_sub(p.prefix.bytes());
                self.live = self.live.saturating_sub(self.shared_bytes());
            }
        }
        Ok(())
    }

    /// Opens the sequence of an admitted request: plain, as the owner of the shared prefix,
    /// or mapping it read-only.
    fn open(&mut self, sharer: bool) -> Result<SequenceKv, KvCacheError> {
        let max = self.shape.max_context;
        if !sharer {
            return SequenceKv::new(&self.vm, &self.plan, max);
        }
        if let Some(p) = &self.prefix {
            return p.prefix.map_shared_prefix_readonly(&self.vm, max);
        }
        // The owner writes the prefix (on a GPU) and seals it before anyone maps it.
        let (prefix, owner) =
            SharedDevicePrefix::reserve_unwritten(&self.vm, &self.plan, self.prefix_len, max)?;
        self.prefix = Some(Prefix { prefix, sharers: 0 });
        Ok(owner)
    }
}

impl Policy for KvvmPolicy {
    fn admit(&mut self, id: usize, req: &Request, tokens: u64) -> WorkloadResult<Outcome> {
        let sharer = self.uses_prefix(req);
        let mut new_bytes = self.plan.committed_bytes_for_tokens(tokens)?;
        if sharer && self.prefix.is_some() {
            new_bytes = new_bytes.saturating_sub(self.shared_bytes());
        }
        if let Some(refused) = self.precheck(new_bytes)? {
            return Ok(refused);
        }
        let had_prefix = self.prefix.is_some();
        let mut kv = match self.open(sharer) {
            Ok(kv) => kv,
            Err(e) => return refusal(e),
        };
        let owner = sharer && !had_prefix;
        if owner {
            self.write(&mut kv, id, 0, self.prefix_len)?;
            kv.seal_prefix()?;
            if let Some(p) = &self.prefix {
                let bytes = p.prefix.bytes();
                self.committed = add(self.committed, bytes, "committed")?;
                self.live = add(self.live, self.shared_bytes(), "live bytes")?;
            }
        }
        if sharer {
            if let Some(p) = self.prefix.as_mut() {
                p.sharers = p.sharers.saturating_add(1);
            }
        }
        // The owner's private tail of the prefix, if any, is committed already.
        let mut private = kv.additional_owned_bytes();
        match kv.ensure_tokens(tokens) {
            Ok(bytes) => private = add(private, bytes, "committed")?,
            Err(e) => {
                self.committed = add(self.committed, private, "committed")?;
                let seq = KvSeq {
                    kv,
                    windows: 0,
                    private,
                    tokens: 0,
                    written: 0,
                    sharer,
                };
                self.release(seq)?;
                return refusal(e);
            }
        }
        self.committed = add(self.committed, private, "committed")?;
        // A sharer's tokens in the read-only windows are skipped by `write`.
        let written = if owner {
            self.prefix_len.min(tokens)
        } else {
            0
        };
        self.write(&mut kv, id, written, tokens)?;
        self.live = add(self.live, self.live_of(tokens, sharer)?, "live bytes")?;
        self.seqs.insert(
            id,
            KvSeq {
                kv,
                windows: self.plan.windows_per_fragment(tokens)?,
                private,
                tokens,
                written: tokens,
                sharer,
            },
        );
        Ok(Outcome::Done)
    }

    fn grow(&mut self, id: usize, tokens: u64) -> WorkloadResult<Outcome> {
        let mut seq = take_seq(&mut self.seqs, "grow", id)?;
        // Only a token that needs a new window goes to the KV layer (the common case of a
        // decode step is arithmetic).
        let windows = self.plan.windows_per_fragment(tokens)?;
        let result = if windows <= seq.windows {
            Ok(Outcome::Done)
        } else {
            match seq.kv.ensure_tokens(tokens) {
                Ok(bytes) => {
                    seq.windows = windows;
                    seq.private = add(seq.private, bytes, "committed")?;
                    self.committed = add(self.committed, bytes, "committed")?;
                    // Write what was decoded since the last write (batched at commits).
                    let (from, id_) = (seq.written, id);
                    self.write(&mut seq.kv, id_, from, tokens)?;
                    seq.written = tokens;
                    Ok(Outcome::Done)
                }
                Err(e) => refusal(e),
            }
        };
        if result.as_ref().is_ok_and(|o| *o == Outcome::Done) {
            self.live = add(
                self.live
                    .saturating_sub(self.live_of(seq.tokens, seq.sharer)?),
                self.live_of(tokens, seq.sharer)?,
                "live bytes",
            )?;
            seq.tokens = tokens;
        }
        self.seqs.insert(id, seq);
        result
    }

    fn finish(&mut self, id: usize) -> WorkloadResult<()> {
        let mut seq = take_seq(&mut self.seqs, "finish", id)?;
        let (from, to) = (seq.written, seq.tokens);
        if self.write_kv && to > from {
            // The window is committed; the KV layer's token count catches up.
            seq.kv.ensure_tokens(to)?;
            self.write(&mut seq.kv, id, from, to)?;
        }
        self.live = self
            .live
            .saturating_sub(self.live_of(seq.tokens, seq.sharer)?);
        self.release(seq)
    }

    fn committed_bytes(&self) -> u64 {
        self.committed
    }

    fn held_bytes(&self) -> u64 {
        self.committed.saturating_add(self.vm.pooled_bytes())
    }

    fn live_bytes(&self) -> u64 {
        self.live
    }

    fn advance(&mut self, dt: Duration) {
        self.clock.advance(dt);
    }

    fn close(&mut self) -> WorkloadResult<Costs> {
        let ids: Vec<usize> = self.seqs.keys().copied().collect();
        for id in ids {
            self.finish(id)?;
        }
        self.prefix = None;
        self.vm.trim_pool(0);
        let t: DriverTally = self.counting.tally();
        Ok(Costs {
            driver_calls: t.calls,
            mappings: t.mappings,
            handles: t.handles,
            peak_mappings: t.peak_mappings,
            driver_time: if self.measured {
                t.measured
            } else {
                t.modelled
            },
            measured: self.measured,
            copy_bytes: 0,
            kv_write_bytes: t.kv_copy_bytes,
            shareability: self.shareability.clone(),
            block_prefix_bytes: None,
        })
    }
}
