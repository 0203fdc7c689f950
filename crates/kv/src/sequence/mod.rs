//! [`SequenceKv`]: one request's KV cache on the device, reserved once at its maximum length
//! and committed window by window as it grows, and the [`SharedDevicePrefix`] it may map or
//! own. The two refer to each other (a sequence holds the prefixes it maps; a prefix is made,
//! owned and attached through a sequence), so they share this folder.
//!
//! Invariants a sequence keeps:
//! * its base address never changes (the reservation's);
//! * every window holding a live byte of its tokens `forgotten_tokens..committed_tokens` is
//!   mapped, in every fragment, and `committed_tokens <= max_tokens`; a write or read lands
//!   only in those tokens (a sliding window's forgotten tokens are never touched again);
//! * the windows of the prefixes it maps read-only are never written, released or truncated
//!   by it: a write into them is refused before any driver call;
//! * a prefix it owns is mapped read-write by it until the prefix is sealed.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | [`SequenceKv`]: construction, pointers, `ensure_tokens` and commit jobs |
//! | `release.rs` | shrink to the live tokens, release, the recount after a failed unmap |
//! | `forget.rs` | a sliding window's oldest tokens forgotten: the windows behind it unmapped |
//! | `copy.rs` | host <-> device copies of tokens (`write_tokens`, `read_tokens`) |
//! | `share.rs` | attaching shared segments read-only, owning a new one |
//! | `prefix.rs` | [`SharedDevicePrefix`]: the set, its windows, its tail, seal |
//! | `prefix_home.rs` | a prefix's home view (what copies read from) and its tail's capture |
//! | `prefix_setup.rs` | making a prefix, sealing it, mapping it into sequences |
//! | `prefix_copy.rs` | a sharer's side: the read-only windows it may map, the bytes it copies |
//! | `prefix_export.rs` | a prefix handed to another process: export as descriptors, import |
//! | `lineage.rs` | where a prefix's bytes came from: the origin that identifies a hit's bytes |
//! | `swap.rs` | the sequence's windows moved to the host tier ([`SwappedKv`](swap::SwappedKv)) |
//! | `swap_back.rs` | the steps after: its memory given back, and the way back to the same offsets |

mod copy;
mod forget;
pub(crate) mod lineage;
pub(crate) mod prefix;
mod prefix_copy;
pub(crate) mod prefix_export;
pub(crate) mod prefix_home;
mod prefix_setup;
mod release;
mod share;
pub(crate) mod swap;
mod swap_back;

use std::fmt;
use std::sync::Arc;

use kvvm_hal::DeviceAddress;
use kvvm_vmm::{BlockKind, Reservation, VirtualMemory};

use crate::error::KvCacheError;
use kvvm_layout::{Fragment, KvKind, LayoutPlan, LayoutStrides};
use prefix::SharedDevicePrefix;

/// Largest host staging buffer one copy uses (bigger runs are split into several copies).
pub(crate) const MAX_COPY_BYTES: usize = 64 << 20;

/// Device pointers of one layer of a [`SequenceKv`], for a kernel.
///
/// Element `(head, token)` of the K cache starts at `key + head x strides.head + token x
/// strides.token` (the same for `value`); its `head_dim` elements follow contiguously.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayerPointers {
    /// The layer.
    pub layer: u32,
    /// Address of `(layer, K, head 0, token 0)`.
    pub key: DeviceAddress,
    /// Address of `(layer, V, head 0, token 0)`.
    pub value: DeviceAddress,
    /// Byte strides of the layout (`head` and `token` are the ones a kernel needs).
    pub strides: LayoutStrides,
}

/// A read-only part of a shared prefix attached to a sequence: windows
/// `[prefix.first_window(), end_window)` of every fragment.
#[derive(Debug, Clone)]
pub(crate) struct AttachedSegment {
    pub(crate) prefix: Arc<SharedDevicePrefix>,
    pub(crate) end_window: u64,
}

/// What a sequence that owns a new shared prefix segment must publish to a prefix cache.
#[derive(Debug, Clone)]
pub(crate) struct PendingPublish {
    /// Chained hashes of the full blocks, one per block.
    pub(crate) hashes: Vec<u64>,
    /// The token ids of those blocks.
    pub(crate) tokens: Vec<u32>,
    /// The segments covering the blocks (read-only attached ones, then the owned one).
    pub(crate) segments: Vec<AttachedSegment>,
    /// Identity of the cache that admitted the sequence.
    pub(crate) cache_id: usize,
    /// Where the blocks' bytes came from: the hit's runs, then the sequence's own prefill
    /// (set once the admission knows its hit).
    pub(crate) lineage: lineage::Lineage,
}

/// A commit of a sequence's next windows begun by [`SequenceKv::begin_ensure`]: run it with
/// no lock held, then hand it back to [`SequenceKv::finish_ensure`]. Dropped unfinished, it
/// undoes its commit.
#[derive(Debug)]
pub struct EnsureJob {
    job: kvvm_vmm::CommitJob,
    tokens: u64,
}

impl EnsureJob {
    /// Runs the commit's driver calls (see [`kvvm_vmm::CommitJob::run`]).
    pub fn run(&mut self) {
        self.job.run();
    }

    /// Whether the run committed every window (`None` before it ran); see
    /// [`kvvm_vmm::CommitJob::succeeded`].
    pub fn succeeded(&self) -> Option<bool> {
        self.job.succeeded()
    }

    /// The token count the sequence will have committed once the job is finished.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Bytes of the windows the job commits.
    pub fn bytes(&self) -> u64 {
        self.job.bytes()
    }
}

/// One request's KV cache on the device.
///
/// Reserved at `max_tokens` under a [`LayoutPlan`] (whose every fragment starts on a granule
/// boundary), it commits physical memory as it grows: [`ensure_tokens`](Self::ensure_tokens)
/// commits, as one transaction through the governor, the unmapped windows holding live bytes
/// of the first `n` tokens of every fragment. The base address never changes.
///
/// A sequence may map a [`SharedDevicePrefix`] read-only at the start of every fragment (a
/// *sharer*), or own one (the *owner*: mapped read-write until the prefix is sealed). Writes
/// into the read-only shared part are refused with
/// [`KvCacheError::WriteIntoSharedPrefix`] before any driver call: there is no copy-on-write
/// on the device.
///
/// Host-side layout of a token's KV (what [`write_tokens`](Self::write_tokens) takes and
/// [`read_tokens`](Self::read_tokens) gives, `copy.rs`): `[layer][K, V][kv_head][head_dim]` elements of
/// `dtype_bytes` bytes, `bytes_per_token` bytes per token, tokens one after the other. The
/// bytes are scattered to the layout's offsets with one copy per contiguous device run (one
/// per fragment for a range of tokens; one in all for token-major).
pub struct SequenceKv {
    pub(crate) vm: VirtualMemory,
    pub(crate) plan: LayoutPlan,
    pub(crate) fragments: Vec<Fragment>,
    pub(crate) reservation: Reservation,
    pub(crate) max_tokens: u64,
    pub(crate) committed_tokens: u64,
    pub(crate) written_tokens: u64,
    pub(crate) prefix_tokens: u64,
    pub(crate) readonly: Vec<AttachedSegment>,
    pub(crate) readonly_windows: u64,
    pub(crate) owned: Option<Arc<SharedDevicePrefix>>,
    pub(crate) pending: Option<PendingPublish>,
    /// Tokens before this one were forgotten (`forget.rs`): their windows are given back and
    /// they are never read or written again.
    pub(crate) forgotten_tokens: u64,
    /// Copies of a swap in flight over its windows (`swap.rs`): waited for before any of them
    /// is unmapped.
    pub(crate) fence: Option<std::sync::Arc<crate::host_tier::Fence>>,
}

impl fmt::Debug for SequenceKv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SequenceKv")
            .field("address", &self.reservation.address())
            .field("layout", &self.plan.layout())
            .field("max_tokens", &self.max_tokens)
            .field("committed_tokens", &self.committed_tokens)
            .field("shared_tokens", &self.shared_tokens())
            .field("committed_bytes", &self.committed_bytes())
            .finish()
    }
}

impl SequenceKv {
    /// Reserves the address range of a sequence of at most `max_tokens` tokens under `plan`
    /// (the reservation is `plan.reservation_bytes()`, so that every sequence of a plan has
    /// its fragments at the same offsets and a shared prefix maps at the same offsets of
    /// each). Commits nothing.
    ///
    /// Errors: [`KvCacheError::PlanMismatch`] when the manager's granule is not the plan's;
    /// [`KvCacheError::TooManyTokens`] when `max_tokens` exceeds the plan's capacity; a
    /// failed reservation.
    pub fn new(
        vm: &VirtualMemory,
        plan: &LayoutPlan,
        max_tokens: u64,
    ) -> Result<SequenceKv, KvCacheError> {
        Self::check_new(vm, plan, max_tokens)?;
        let span = tracing::debug_span!(
            "kv.sequence_new",
            layout = plan.layout().as_str(),
            max_tokens,
            bytes = plan.reservation_bytes()
        );
        let _e = span.enter();
        let reservation = vm.reserve(plan.reservation_bytes())?;
        Self::in_reservation(vm, plan, max_tokens, reservation)
    }

    /// A sequence in a reservation made by the caller, for example one slot of
    /// [`VirtualMemory::reserve_strided`] (so that a batch of sequences sits at a constant
    /// stride and one layer of all of them is one strided array). The reservation must be of
    /// the manager `vm`, hold nothing yet, and be at least `plan.reservation_bytes()` long.
    ///
    /// Errors: those of [`new`](Self::new), and [`KvCacheError::PlanMismatch`] when the
    /// reservation is too small, of another granule, or already holds mappings.
    pub fn in_reservation(
        vm: &VirtualMemory,
        plan: &LayoutPlan,
        max_tokens: u64,
        reservation: Reservation,
    ) -> Result<SequenceKv, KvCacheError> {
        Self::check_new(vm, plan, max_tokens)?;
        if reservation.size() < plan.reservation_bytes()
            || reservation.granule() != plan.granule()
            || reservation.committed_bytes() != 0
            || !reservation.parked().is_empty()
        {
            return Err(KvCacheError::PlanMismatch {
                reason: format!(
                    "the reservation ({} B, granule {} B, {} B committed) cannot hold a fresh \
                     sequence of the plan ({} B, granule {} B)",
                    reservation.size(),
                    reservation.granule(),
                    reservation.committed_bytes(),
                    plan.reservation_bytes(),
                    plan.granule()
                ),
            });
        }
        Ok(SequenceKv {
            vm: vm.clone(),
            plan: *plan,
            fragments: plan.fragments()?,
            reservation,
            max_tokens,
            committed_tokens: 0,
            written_tokens: 0,
            prefix_tokens: 0,
            readonly: Vec::new(),
            readonly_windows: 0,
            owned: None,
            pending: None,
            forgotten_tokens: 0,
            fence: None,
        })
    }

    fn check_new(
        vm: &VirtualMemory,
        plan: &LayoutPlan,
        max_tokens: u64,
    ) -> Result<(), KvCacheError> {
        check_plan_granule(vm, plan)?;
        let capacity = plan.geometry().max_tokens();
        if max_tokens > capacity {
            return Err(KvCacheError::TooManyTokens {
                tokens: max_tokens,
                max_tokens: capacity,
            });
        }
        Ok(())
    }

    /// The plan.
    pub fn plan(&self) -> &LayoutPlan {
        &self.plan
    }

    /// The manager.
    pub fn vm(&self) -> &VirtualMemory {
        &self.vm
    }

    /// Base address of the reservation; it never changes.
    pub fn address(&self) -> DeviceAddress {
        self.reservation.address()
    }

    /// The reservation (its mappings, committed bytes, ...).
    pub fn reservation(&self) -> &Reservation {
        &self.reservation
    }

    /// Most tokens this sequence may hold.
    pub fn max_tokens(&self) -> u64 {
        self.max_tokens
    }

    /// Tokens whose windows are all mapped (read-only shared or committed).
    pub fn committed_tokens(&self) -> u64 {
        self.committed_tokens
    }

    /// Tokens written (or attached from a written shared prefix) contiguously from token 0.
    pub fn written_tokens(&self) -> u64 {
        self.written_tokens
    }

    /// Tokens of the prefix this sequence shares or owns (content identical to the other
    /// sequences of the prefix).
    pub fn prefix_tokens(&self) -> u64 {
        self.prefix_tokens
    }

    /// Bytes mapped in this sequence's reservation: `granule x mapped windows`, shared
    /// windows included.
    pub fn committed_bytes(&self) -> u64 {
        self.reservation.committed_bytes()
    }

    /// Physical bytes this sequence owns on its own: its private windows. A sharer's
    /// read-only prefix windows add 0 (they are billed once, to the prefix), and so do the
    /// owner's shared windows (billed to the [`SharedDevicePrefix`]).
    pub fn additional_owned_bytes(&self) -> u64 {
        self.reservation
            .mappings()
            .iter()
            .filter(|b| b.kind == BlockKind::Owned)
            .map(|b| b.size)
            .fold(0u64, u64::saturating_add)
    }

    /// Windows per fragment (from the start of each fragment) that are shared and may not
    /// be written: the read-only attached ones, and the owned prefix's once it is sealed.
    pub fn protected_windows(&self) -> u64 {
        let mut w = self.readonly_windows;
        if let Some(o) = &self.owned {
            if o.is_sealed() {
                w = w.max(o.end_window());
            }
        }
        w
    }

    /// Tokens whose bytes all lie in protected shared windows: writing them is refused.
    pub fn shared_tokens(&self) -> u64 {
        let bytes = self.protected_windows().saturating_mul(self.plan.granule());
        bytes / self.plan.fragment_bytes_per_token().max(1)
    }

    /// The shared prefixes this sequence maps read-only.
    pub fn attached_prefixes(&self) -> Vec<Arc<SharedDevicePrefix>> {
        self.readonly
            .iter()
            .map(|s| Arc::clone(&s.prefix))
            .collect()
    }

    /// The shared prefix this sequence owns, if any.
    pub fn owned_prefix(&self) -> Option<&Arc<SharedDevicePrefix>> {
        self.owned.as_ref()
    }

    /// Whether this sequence owns a prefix segment not yet published to a prefix cache.
    pub fn has_pending_publish(&self) -> bool {
        self.pending.is_some()
    }

    /// Device pointers of `layer`'s K and V and the layout's strides, for kernels.
    pub fn layer_pointers(&self, layer: u32) -> Result<LayerPointers, KvCacheError> {
        let base = self.reservation.address();
        let k = self.plan.offset(layer, KvKind::Key, 0, 0)?;
        let v = self.plan.offset(layer, KvKind::Value, 0, 0)?;
        let key = base
            .checked_add(k)
            .ok_or(crate::KvError::Overflow { what: "K pointer" })?;
        let value = base
            .checked_add(v)
            .ok_or(crate::KvError::Overflow { what: "V pointer" })?;
        Ok(LayerPointers {
            layer,
            key,
            value,
            strides: self.plan.strides(),
        })
    }

    /// Device pointers of every layer.
    pub fn all_layer_pointers(&self) -> Result<Vec<LayerPointers>, KvCacheError> {
        (0..self.plan.geometry().layers())
            .map(|l| self.layer_pointers(l))
            .collect()
    }

    /// Makes the first `n` tokens committed: commits every unmapped window holding live bytes
    /// of the first `n` tokens of each fragment (`commit_ranges` of each fragment's live
    /// range), as one transaction through the governor; shared windows already mapped are
    /// skipped. Returns the bytes newly committed (0 when nothing was missing).
    ///
    /// Errors: [`KvCacheError::TooManyTokens`] past `max_tokens`;
    /// [`KvCacheError::Backpressure`] (with `retry_after`) when the governor refuses: nothing
    /// was committed; a driver failure (rolled back by the manager).
    pub fn ensure_tokens(&mut self, n: u64) -> Result<u64, KvCacheError> {
        if n > self.max_tokens {
            return Err(KvCacheError::TooManyTokens {
                tokens: n,
                max_tokens: self.max_tokens,
            });
        }
        if n <= self.committed_tokens {
            return Ok(0);
        }
        let span = tracing::debug_span!("kv.ensure_tokens", from = self.committed_tokens, to = n);
        let _e = span.enter();
        let ranges = self.live_ranges(n)?;
        let commit = self.reservation.commit_ranges(&ranges)?;
        self.committed_tokens = n;
        Ok(commit.map_or(0, |c| c.bytes))
    }

    /// Begins making the first `n` tokens committed, like [`ensure_tokens`](Self::ensure_tokens),
    /// as an [`EnsureJob`] whose driver calls ([`EnsureJob::run`]) need no borrow of the
    /// sequence: a background committer releases its lock on the sequence while they run and
    /// then calls [`finish_ensure`](Self::finish_ensure). Meanwhile the tokens already
    /// committed may be written and read; the job's windows are in flight (another commit of
    /// them is refused as busy). `None` when nothing is missing (the count is then raised).
    pub fn begin_ensure(&mut self, n: u64) -> Result<Option<EnsureJob>, KvCacheError> {
        if n > self.max_tokens {
            return Err(KvCacheError::TooManyTokens {
                tokens: n,
                max_tokens: self.max_tokens,
            });
        }
        if n <= self.committed_tokens {
            return Ok(None);
        }
        let ranges = self.live_ranges(n)?;
        match self.reservation.begin_commit_ranges(&ranges)? {
            Some(job) => Ok(Some(EnsureJob { job, tokens: n })),
            None => {
                self.committed_tokens = n;
                Ok(None)
            }
        }
    }

    /// Finishes a job of [`begin_ensure`](Self::begin_ensure): records its windows and, on
    /// success, raises the committed count to the job's tokens. Returns the bytes committed.
    pub fn finish_ensure(&mut self, job: EnsureJob) -> Result<u64, KvCacheError> {
        let tokens = job.tokens;
        let commit = self.reservation.finish_commit(job.job)?;
        self.committed_tokens = self.committed_tokens.max(tokens);
        Ok(commit.bytes)
    }

    /// Undoes a job of [`begin_ensure`](Self::begin_ensure): its windows are recorded, then
    /// released (see [`Reservation::abort_commit`](kvvm_vmm::Reservation::abort_commit)); the
    /// committed count does not change. Returns the bytes unmapped.
    pub fn abort_ensure(&mut self, job: EnsureJob) -> Result<u64, KvCacheError> {
        let result = self.reservation.abort_commit(job.job);
        if result.is_err() {
            self.recount_committed(false);
        }
        Ok(result?)
    }

    /// Lowers the committed count to `n` (at most the count now) without unmapping anything:
    /// the windows stay mapped, only fewer tokens are promised (a transaction over several
    /// sequences undoing one's growth).
    pub(crate) fn lower_committed(&mut self, n: u64) {
        self.committed_tokens = self.committed_tokens.min(n);
    }

    /// Whether an [`EnsureJob`] begun on this sequence is not finished yet.
    pub fn has_commit_in_flight(&self) -> bool {
        self.reservation.has_commit_in_flight()
    }

    /// Each fragment's live range of the first `n` tokens, as `(offset, len)`: from the
    /// window of its first token not forgotten.
    fn live_ranges(&self, n: u64) -> Result<Vec<(u64, u64)>, KvCacheError> {
        let mut ranges = Vec::with_capacity(self.fragments.len());
        for f in &self.fragments {
            let live = self.kept_bytes(f, n)?;
            ranges.push((live.start, live.end.saturating_sub(live.start)));
        }
        Ok(ranges)
    }
}

/// [`KvCacheError::PlanMismatch`] unless the manager's granule is the plan's.
pub(crate) fn check_plan_granule(
    vm: &VirtualMemory,
    plan: &LayoutPlan,
) -> Result<(), KvCacheError> {
    if vm.granule() != plan.granule() {
        return Err(KvCacheError::PlanMismatch {
            reason: format!(
                "the manager's granule is {} B, the plan's {} B",
                vm.granule(),
                plan.granule()
            ),
        });
    }
    Ok(())
}
