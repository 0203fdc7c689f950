//! Making and mapping a [`SharedDevicePrefix`] with sequences: the owner's
//! `reserve_and_map_shared_prefix` / `reserve_unwritten` / `own_in` / `seal_prefix` and a
//! sharer's `map_shared_prefix_readonly` / `attach_to`. The prefix itself is `prefix.rs`; the
//! sequence `mod.rs`; what a sharer maps and copies `prefix_copy.rs`.

use std::sync::Arc;

use kvvm_layout::{evaluate_prefix_shareability, LayoutPlan, PrefixShareability};
use kvvm_num::mul;
use kvvm_vmm::VirtualMemory;

use crate::error::KvCacheError;
use crate::sequence::prefix::{SharedDevicePrefix, FILL_BATCH_BYTES};
use crate::sequence::{AttachedSegment, SequenceKv};

impl SharedDevicePrefix {
    /// The owner's side: reserves a sequence of at most `max_tokens`, commits the windows
    /// lying entirely inside the prefix (the first `shareable_granules_per_fragment` windows
    /// of every fragment) as one shared set mapped read-write (billed here, once, as shared),
    /// commits the prefix's partial tail windows privately, writes the prefix's KV
    /// (`fill(first_token, buf)` fills the host bytes of tokens `first_token..` in the layout
    /// `[token][layer][K, V][kv_head][head_dim]`, in batches of about 32 MiB) and seals the
    /// prefix read-only ([`SequenceKv::seal_prefix`]: its tail is copied then).
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
        owner.seal_prefix()?;
        Ok((prefix, owner))
    }

    /// Like [`reserve_and_map_shared_prefix`](Self::reserve_and_map_shared_prefix) but writes
    /// nothing and does not seal: the owner writes the prefix through
    /// [`SequenceKv::write_tokens`] (or a model writes it through a tensor view) and then
    /// calls [`SequenceKv::seal_prefix`] before handing the prefix to sharers (so a sharer
    /// never maps unwritten bytes).
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
    /// `max_tokens`. A prefix shorter than a window is made too (it has no read-only window:
    /// sharers receive it by copy); an empty one is refused.
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
        if prefix_len == 0 {
            return Err(KvCacheError::NotShareable {
                reason: "an empty prefix has nothing to share".to_owned(),
            });
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
    /// `prefix_len` tokens: commits the prefix's whole windows as shared handles mapped
    /// read-write (and the rest of the first `prefix_len` tokens privately). The owner writes
    /// the prefix through [`SequenceKv::write_tokens`] (or a tensor view) and then calls
    /// [`SequenceKv::seal_prefix`].
    ///
    /// Errors: [`KvCacheError::NotShareable`] for an empty prefix; [`KvCacheError::TooManyTokens`];
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

    /// The sharer's side for a sequence made by the caller: gives `seq`, an empty sequence
    /// (fresh or released) of the prefix's plan, the prefix's [`tokens`](Self::tokens): maps
    /// read-only the windows lying wholly before its last token's end (see `prefix_copy.rs`:
    /// one map per handle, one set-access per contiguous run), commits the rest of them
    /// privately and copies their bytes from the prefix. `seq` then holds the prefix's tokens,
    /// written, and writes its own tokens after them in its own memory only. Returns the bytes
    /// mapped read-only (shared, not billed to `seq`).
    ///
    /// Errors: those of [`map_shared_prefix_readonly`](Self::map_shared_prefix_readonly), and
    /// [`KvCacheError::PlanMismatch`] when `seq` is not empty; on a failure `seq` is released
    /// again (empty).
    pub fn attach_to(self: &Arc<Self>, seq: &mut SequenceKv) -> Result<u64, KvCacheError> {
        let span = tracing::debug_span!(
            "kv.attach_shared_prefix",
            windows = self.set.len(),
            prefix_len = self.prefix_len
        );
        let _e = span.enter();
        self.check_attachable()?;
        seq.check_empty()?;
        match self.attach_whole(seq) {
            Ok(bytes) => Ok(bytes),
            Err(e) => {
                seq.release_after_error();
                Err(e)
            }
        }
    }

    /// The sharer's side for a sequence that keeps only the prefix's tokens from `first` on
    /// (the layers of a sliding window, which read only the last tokens and give their oldest
    /// windows back as they grow): nothing is mapped read-only; `seq`, an empty sequence of the
    /// prefix's plan, forgets the tokens before `first` from the start, commits the rest of the
    /// prefix's [`tokens`](Self::tokens) and copies them from the prefix. Returns the bytes
    /// copied (in every fragment).
    ///
    /// Errors: those of [`attach_to`](Self::attach_to); [`KvCacheError::TooManyTokens`] when
    /// `first` is past the prefix. On a failure `seq` is released again (empty).
    pub fn attach_from(
        self: &Arc<Self>,
        seq: &mut SequenceKv,
        first: u64,
    ) -> Result<u64, KvCacheError> {
        self.check_attachable()?;
        let tokens = self.tokens();
        if first > tokens {
            return Err(KvCacheError::TooManyTokens {
                tokens: first,
                max_tokens: tokens,
            });
        }
        seq.check_empty()?;
        let chain = [AttachedSegment {
            prefix: Arc::clone(self),
            end_window: self.end_window,
        }];
        let copied = seq
            .start_at(first)
            .and_then(|()| seq.ensure_tokens(tokens))
            .and_then(|_| seq.copy_chain(&chain, tokens));
        if copied.is_err() {
            seq.release_after_error();
        }
        copied
    }

    /// [`attach_to`](Self::attach_to) once checked: map, commit, copy.
    fn attach_whole(self: &Arc<Self>, seq: &mut SequenceKv) -> Result<u64, KvCacheError> {
        let chain = [AttachedSegment {
            prefix: Arc::clone(self),
            end_window: self.end_window,
        }];
        let tokens = self.tokens();
        let end = seq.readonly_end(&chain, tokens);
        let bytes = seq.attach_chain(&chain, end)?;
        seq.ensure_tokens(tokens)?;
        seq.copy_chain(&chain, tokens)?;
        Ok(bytes)
    }

    /// The sharer's side: reserves a sequence of at most `max_tokens` under the prefix's plan
    /// and gives it the prefix as [`attach_to`](Self::attach_to) does. The sharer owns only
    /// the windows it copied into (none when the prefix ends on a window boundary and its
    /// handles are mapped whole): `additional_owned_bytes()` counts them.
    ///
    /// If a map succeeds and its set access fails, the manager withdraws the mappings made
    /// and counts them down; the handles stay with the prefix. The new sequence is then torn
    /// down and the error returned.
    ///
    /// Errors: the prefix is not sealed yet ([`KvCacheError::PrefixNotWritten`]); a manager
    /// of another granule ([`KvCacheError::PlanMismatch`]); backpressure for the copied
    /// windows; driver failures.
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
        self.attach_whole(&mut seq)?;
        Ok(seq)
    }
}

impl SequenceKv {
    /// Seals the prefix this sequence owns once it wrote it: copies the prefix's tail (its
    /// bytes past the last whole window, when it does not end on a window boundary) into the
    /// prefix's own handles, then marks it read-only for everyone. Sharers then receive every
    /// prefix token. A prefix sealed already is left as it is.
    ///
    /// Errors: [`KvCacheError::PlanMismatch`] when the sequence owns no prefix; backpressure
    /// for the tail's windows (one per fragment) or a failed copy: the prefix stays unsealed.
    pub fn seal_prefix(&mut self) -> Result<(), KvCacheError> {
        let Some(prefix) = self.owned.clone() else {
            return Err(KvCacheError::PlanMismatch {
                reason: "this sequence owns no shared prefix to seal".to_owned(),
            });
        };
        if prefix.is_sealed() {
            return Ok(());
        }
        prefix.capture_tail(self)?;
        prefix.seal();
        Ok(())
    }
}
