//! [`SharedDevicePrefix`]: one physical copy of a prefix's KV, mapped read-write by its owner
//! and read-only by any number of sharers, billed once.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvvm_vmm::{SharedHandles, VirtualMemory};

use kvvm_num::mul;

use crate::error::KvCacheError;
use crate::sequence::SequenceKv;
use kvvm_layout::LayoutPlan;
use kvvm_layout::{evaluate_prefix_shareability, PrefixShareability};

/// Host bytes written per copy batch when filling a prefix.
const FILL_BATCH_BYTES: u64 = 32 << 20;

/// A shared prefix on the device: the granule windows `[first_window, end_window)` of every
/// fragment of a [`LayoutPlan`], backed by one set of physical handles
/// ([`SharedHandles`]) that every sequence of the prefix maps at the same offsets of its own
/// reservation.
///
/// * **Billed once**: the handles are granted and accounted once, as *shared*, however many
///   sequences map them; a sharer's [`SequenceKv::additional_owned_bytes`] is 0 right after
///   [`map_shared_prefix_readonly`](Self::map_shared_prefix_readonly).
/// * **Lifetime is the union**: each mapping and each `Arc` of this prefix (the owner's and
///   the sharers' sequences, a prefix cache) keeps the handles alive; they are released only
///   when the last is gone. The owner may finish first.
/// * **Reference count per handle**: [`mapped_count`](Self::mapped_count) is the number of
///   live window mappings (`note_shared_map` / `note_unmapped` in the seed's words).
/// * **Read-only**: the owner writes the prefix through its read-write mapping and seals it;
///   after that nobody writes it (sharers map it with `Read` access, and a write into it is
///   refused with [`KvCacheError::WriteIntoSharedPrefix`] before any driver call). There is
///   no copy-on-write on the device.
/// * **Only whole windows are shared**: per fragment, the first
///   `floor(prefix_len x fragment_bytes_per_token / granule)` windows
///   ([`PrefixShareability::shareable_granules_per_fragment`]). The partial window at the end
///   of each fragment's prefix is private to each sequence: a sharer commits it and writes
///   those prefix tokens itself.
pub struct SharedDevicePrefix {
    set: Arc<SharedHandles>,
    plan: LayoutPlan,
    first_window: u64,
    end_window: u64,
    prefix_len: u64,
    shareability: PrefixShareability,
    sealed: AtomicBool,
}

impl fmt::Debug for SharedDevicePrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedDevicePrefix")
            .field("layout", &self.plan.layout())
            .field("windows", &(self.first_window..self.end_window))
            .field("prefix_len", &self.prefix_len)
            .field("bytes", &self.bytes())
            .field("mapped_count", &self.mapped_count())
            .field("sealed", &self.is_sealed())
            .finish()
    }
}

impl SharedDevicePrefix {
    pub(crate) fn new(
        set: Arc<SharedHandles>,
        plan: LayoutPlan,
        first_window: u64,
        end_window: u64,
        prefix_len: u64,
        shareability: PrefixShareability,
    ) -> Self {
        SharedDevicePrefix {
            set,
            plan,
            first_window,
            end_window,
            prefix_len,
            shareability,
            sealed: AtomicBool::new(false),
        }
    }

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
        let k = verdict.shareable_granules_per_fragment;
        let mut owner = SequenceKv::new(vm, plan, max_tokens)?;
        let prefix = owner.create_owned_segment(0, k, prefix_len, verdict)?;
        owner.ensure_tokens(prefix_len)?;
        Ok((prefix, owner))
    }

    /// The sharer's side: reserves a sequence of at most `max_tokens` under the prefix's plan
    /// and maps every window of the prefix at the same offsets with `Read` access (one map
    /// per window, one set-access per contiguous run). The sharer adds no physical bytes
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
        let mut seq = SequenceKv::new(vm, &self.plan, max_tokens)?;
        seq.attach_readonly(self, self.end_window)?;
        seq.set_attached_prefix_tokens(self.prefix_len);
        Ok(seq)
    }

    /// Marks the prefix written: from now on it is read-only for everyone, owner included.
    pub fn seal(&self) {
        self.sealed.store(true, Ordering::Release);
    }

    /// Whether the prefix was sealed (written and read-only).
    pub fn is_sealed(&self) -> bool {
        self.sealed.load(Ordering::Acquire)
    }

    /// The plan the prefix is laid out under.
    pub fn plan(&self) -> &LayoutPlan {
        &self.plan
    }

    /// The shareability verdict the prefix was made under.
    pub fn shareability(&self) -> &PrefixShareability {
        &self.shareability
    }

    /// Prefix length in tokens (its content is identical for every sequence of the prefix).
    pub fn prefix_len(&self) -> u64 {
        self.prefix_len
    }

    /// First shared window of every fragment (0 for a prefix that starts at token 0).
    pub fn first_window(&self) -> u64 {
        self.first_window
    }

    /// One past the last shared window of every fragment.
    pub fn end_window(&self) -> u64 {
        self.end_window
    }

    /// Shared windows per fragment.
    pub fn windows_per_fragment(&self) -> u64 {
        self.end_window.saturating_sub(self.first_window)
    }

    /// Tokens whose bytes lie entirely in the shared windows (from token 0 to the end window).
    pub fn shared_tokens(&self) -> u64 {
        self.end_window.saturating_mul(self.plan.granule())
            / self.plan.fragment_bytes_per_token().max(1)
    }

    /// Physical bytes of the prefix (billed once).
    pub fn bytes(&self) -> u64 {
        self.set.bytes()
    }

    /// Live window mappings of the prefix's handles (owner's and sharers'), counted per
    /// window: the pool's reference count (`note_shared_map` / `note_unmapped`).
    pub fn mapped_count(&self) -> u64 {
        self.set.mapped_count()
    }

    /// The physical handles.
    pub fn handles(&self) -> &Arc<SharedHandles> {
        &self.set
    }

    /// Set indices of windows `[first_window, end_window)` of every fragment.
    pub(crate) fn window_indices(&self, end_window: u64) -> Result<Vec<usize>, KvCacheError> {
        let k = self.windows_per_fragment();
        let take = end_window
            .min(self.end_window)
            .saturating_sub(self.first_window);
        let fragments = self.plan.slice_count();
        let mut out = Vec::new();
        for f in 0..fragments {
            for w in 0..take {
                let i =
                    mul(f, k, "window index")?
                        .checked_add(w)
                        .ok_or(crate::KvError::Overflow {
                            what: "window index",
                        })?;
                out.push(usize::try_from(i).map_err(|_| crate::KvError::Overflow {
                    what: "window index",
                })?);
            }
        }
        Ok(out)
    }
}
