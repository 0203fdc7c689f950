//! Making and mapping a [`SharedDevicePrefix`] with sequences: the owner's
//! `reserve_and_map_shared_prefix` / `reserve_unwritten` / `own_in` and a sharer's
//! `map_shared_prefix_readonly` / `attach_to`. The prefix itself is `prefix.rs`; the sequence `mod.rs`.

use std::sync::Arc;

use kvvm_layout::{evaluate_prefix_shareability, LayoutPlan, PrefixShareability};
use kvvm_num::mul;
use kvvm_vmm::VirtualMemory;

use crate::error::KvCacheError;
use crate::sequence::prefix::{SharedDevicePrefix, FILL_BATCH_BYTES};
use crate::sequence::SequenceKv;

impl SharedDevicePrefix {
    /// The owner's side: evaluates shareability, reserves a sequence of at most `max_tokens`,
    /// commits the windows lying entirely inside the prefix (the first
    /// `shareable_granules_per_fragment` windows of every fragment) as one shared set mapped
    /// read-write (billed here, once, as shared), commits the prefix's partial tail windows
    /// privately, writes the prefix's KV (`fill(first_token, buf)` fills the host bytes of
    /// tokens `first_token..` in the layout `[token][layer][K, V][kv_head][head_dim]`, in
    /// batches of about 32 MiB) and seals the prefix read-only.
    ///
    /// Returns the prefix (to hand to sharers) and the owner's sequence, which holds
    /// `prefix_len` committed tokens and grows privately from there.
    ///
    /// Errors: [`KvCacheError::NotShareable`] with the shareability's refusal reason; the
    /// errors of [`SequenceKv::new`], [`SequenceKv::ensure_tokens`] (backpressure) and of the
    /// copies. On error everything made here is torn down.
    pub fn reserve_and_map_shared_prefix(
        vm: &VirtualMemory,
        plan: &LayoutPlan,
        prefix_len: u64,
        max_tokens: u64,
        mut fill: impl FnMut(u64, &mut [u8]),
    ) -> Result<(Arc<SharedDevicePrefix>, SequenceKv), KvCacheError> {
        let span = tracing::debug_span!(
            "kv.reserve_and_map_shared_prefix",
            layout = plan.layout().as_str(),
            prefix_len
        );
        let _e = span.enter();
        let (prefix, mut owner) = Self::reserve_unwritten(vm, plan, prefix_len, max_tokens)?;
        let bpt = plan.geometry().bytes_per_token().max(1);
        let batch = (FILL_BATCH_BYTES / bpt).max(1);
        let mut buf = Vec::new();
        let mut t = 0u64;
        while t < prefix_len {
            let n = batch.min(prefix_len - t);
            let len = usize::try_from(mul(n, bpt, "fill batch")?)
                .map_err(|_| crate::KvError::Overflow { what: "fill batch" })?;
            buf.resize(len, 0);
            fill(t, &mut buf);
            owner.write_tokens(t, &buf)?;
            t += n;
        }
        prefix.seal();
        Ok((prefix, owner))
    }

    /// Like [`reserve_and_map_shared_prefix`](Self::reserve_and_map_shared_prefix) but writes
    /// nothing and does not seal: the owner writes the prefix through
    /// [`SequenceKv::write_tokens`] and then calls [`seal`](Self::seal) before handing the
    /// prefix to sharers (so a sharer never maps unwritten bytes).
    pub fn reserve_unwritten(
        vm: &VirtualMemory,
        plan: &LayoutPlan,
        prefix_len: u64,
        max_tokens: u64,
    ) -> Result<(Arc<SharedDevicePrefix>, SequenceKv), KvCacheError> {
        // Refused before anything is reserved.
        let verdict = Self::owner_verdict(plan, prefix_len, max_tokens)?;
        let mut owner = SequenceKv::new(vm, plan, max_tokens)?;
        let prefix = Self::own_checked(&mut owner, prefix_len, verdict)?;
        Ok((prefix, owner))
    }

    /// The shareability of a prefix of `prefix_len` tokens for an owner of at most
    /// `max_tokens`, refused with the reason when it cannot be shared.
    fn owner_verdict(
        plan: &LayoutPlan,
        prefix_len: u64,
        max_tokens: u64,
    ) -> Result<PrefixShareability, KvCacheError> {
        let verdict = evaluate_prefix_shareability(
            plan.geometry(),
            plan.layout(),
            prefix_len,
            plan.granule(),
        )?;
        if let Some(reason) = verdict.refusal_reason() {
            return Err(KvCacheError::NotShareable { reason });
        }
        if prefix_len > max_tokens {
            return Err(KvCacheError::TooManyTokens {
                tokens: prefix_len,
                max_tokens,
            });
        }
        Ok(verdict)
    }

    /// Refuses to attach a prefix that is not sealed or does not start at token 0.
    fn check_attachable(&self) -> Result<(), KvCacheError> {
        if !self.is_sealed() {
            return Err(KvCacheError::PrefixNotWritten {
                written: 0,
                needed: self.prefix_len,
            });
        }
        if self.first_window != 0 {
            return Err(KvCacheError::PlanMismatch {
                reason: "this shared segment does not start at token 0; attach it through its prefix cache".to_owned(),
            });
        }
        Ok(())
    }

    /// Makes `owner`, an empty sequence (fresh, or released), the owner of a new prefix of
    /// `prefix_len` tokens: commits the prefix's windows as shared handles mapped read-write
    /// (and the rest of the first `prefix_len` tokens privately). The owner writes the prefix
    /// through [`SequenceKv::write_tokens`] and then calls [`seal`](Self::seal).
    ///
    /// Errors: [`KvCacheError::NotShareable`] with the reason; [`KvCacheError::TooManyTokens`];
    /// [`KvCacheError::PlanMismatch`] when `owner` is not empty; backpressure and driver
    /// failures, after which `owner` is released again (empty).
    pub fn own_in(
        owner: &mut SequenceKv,
        prefix_len: u64,
    ) -> Result<Arc<SharedDevicePrefix>, KvCacheError> {
        let verdict = Self::owner_verdict(owner.plan(), prefix_len, owner.max_tokens())?;
        Self::own_checked(owner, prefix_len, verdict)
    }

    /// [`own_in`](Self::own_in) once the verdict is known.
    fn own_checked(
        owner: &mut SequenceKv,
        prefix_len: u64,
        verdict: PrefixShareability,
    ) -> Result<Arc<SharedDevicePrefix>, KvCacheError> {
        owner.check_empty()?;
        let k = verdict.shareable_granules_per_fragment;
        let made = owner
            .create_owned_segment(0, k, prefix_len, verdict, 0)
            .and_then(|prefix| owner.ensure_tokens(prefix_len).map(|_| prefix));
        match made {
            Ok(prefix) => Ok(prefix),
            Err(e) => {
                owner.release_after_error();
                Err(e)
            }
        }
    }

    /// The sharer's side for a sequence made by the caller: maps every window of the prefix
    /// read-only at the same offsets of `seq`, an empty sequence (fresh or released) of the
    /// prefix's plan, as [`map_shared_prefix_readonly`](Self::map_shared_prefix_readonly)
    /// does for a new one. Returns the bytes mapped (shared, not billed to `seq`).
    ///
    /// Errors: those of `map_shared_prefix_readonly`, and [`KvCacheError::PlanMismatch`] when
    /// `seq` is not empty; on a driver failure `seq` is released again (empty).
    pub fn attach_to(self: &Arc<Self>, seq: &mut SequenceKv) -> Result<u64, KvCacheError> {
        let span = tracing::debug_span!(
            "kv.attach_shared_prefix",
            windows = self.set.len(),
            prefix_len = self.prefix_len
        );
        let _e = span.enter();
        self.check_attachable()?;
        seq.check_empty()?;
        match seq.attach_readonly(self, self.end_window) {
            Ok(bytes) => {
                seq.set_attached_prefix_tokens(self.prefix_len);
                Ok(bytes)
            }
            Err(e) => {
                seq.release_after_error();
                Err(e)
            }
        }
    }

    /// The sharer's side: reserves a sequence of at most `max_tokens` under the prefix's plan
    /// and maps every window of the prefix at the same offsets with `Read` access (one map
    /// per handle of the prefix, one set-access per contiguous run, named as one range of
    /// windows per fragment). The sharer adds no physical bytes
    /// (`additional_owned_bytes() == 0`); its tokens up to the last whole token inside the
    /// shared windows are readable at once. Tokens of the prefix's partial tail windows (if
    /// any) are the sharer's own: `ensure_tokens(prefix_len)` and write them.
    ///
    /// If a map succeeds and its set access fails, the manager withdraws the mappings made
    /// and counts them down; the handles stay with the prefix. The new sequence is then torn
    /// down and the error returned.
    ///
    /// Errors: the prefix is not sealed yet ([`KvCacheError::PrefixNotWritten`]); a manager
    /// of another granule ([`KvCacheError::PlanMismatch`]); driver failures.
    pub fn map_shared_prefix_readonly(
        self: &Arc<Self>,
        vm: &VirtualMemory,
        max_tokens: u64,
    ) -> Result<SequenceKv, KvCacheError> {
        let span = tracing::debug_span!(
            "kv.map_shared_prefix_readonly",
            windows = self.set.len(),
            prefix_len = self.prefix_len
        );
        let _e = span.enter();
        self.check_attachable()?;
        let mut seq = SequenceKv::new(vm, &self.plan, max_tokens)?;
        seq.attach_readonly(self, self.end_window)?;
        seq.set_attached_prefix_tokens(self.prefix_len);
        Ok(seq)
    }
}
