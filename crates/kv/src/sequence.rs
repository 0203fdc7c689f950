//! [`SequenceKv`]: one request's KV cache on the device, reserved once at its maximum length
//! and committed window by window as it grows.

use std::fmt;
use std::sync::Arc;

use kvvm_hal::{Access, DeviceAddress, VirtualMemoryBackend};
use kvvm_vmm::{BlockKind, Reservation, VirtualMemory};

use kvvm_num::{add, mul, to_usize};

use crate::error::KvCacheError;
use crate::prefix::SharedDevicePrefix;
use kvvm_layout::{Fragment, KvKind, LayoutPlan, LayoutStrides};

/// Largest host staging buffer one copy uses (bigger runs are split into several copies).
const MAX_COPY_BYTES: usize = 64 << 20;

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
/// [`read_tokens`](Self::read_tokens) gives): `[layer][K, V][kv_head][head_dim]` elements of
/// `dtype_bytes` bytes, `bytes_per_token` bytes per token, tokens one after the other. The
/// bytes are scattered to the layout's offsets with one copy per contiguous device run (one
/// per fragment for a range of tokens; one in all for token-major).
pub struct SequenceKv {
    vm: VirtualMemory,
    plan: LayoutPlan,
    fragments: Vec<Fragment>,
    reservation: Reservation,
    max_tokens: u64,
    committed_tokens: u64,
    written_tokens: u64,
    prefix_tokens: u64,
    readonly: Vec<AttachedSegment>,
    readonly_windows: u64,
    owned: Option<Arc<SharedDevicePrefix>>,
    pub(crate) pending: Option<PendingPublish>,
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
        if vm.granule() != plan.granule() {
            return Err(KvCacheError::PlanMismatch {
                reason: format!(
                    "the manager's granule is {} B, the plan's {} B",
                    vm.granule(),
                    plan.granule()
                ),
            });
        }
        let capacity = plan.geometry().max_tokens();
        if max_tokens > capacity {
            return Err(KvCacheError::TooManyTokens {
                tokens: max_tokens,
                max_tokens: capacity,
            });
        }
        let span = tracing::debug_span!(
            "kv.sequence_new",
            layout = plan.layout().as_str(),
            max_tokens,
            bytes = plan.reservation_bytes()
        );
        let _e = span.enter();
        let reservation = vm.reserve(plan.reservation_bytes())?;
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
        })
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
        let g = self.plan.granule();
        let owned = self
            .reservation
            .mappings()
            .iter()
            .filter(|b| b.kind == BlockKind::Owned)
            .count() as u64;
        owned.saturating_mul(g)
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
        let mut ranges = Vec::with_capacity(self.fragments.len());
        for f in &self.fragments {
            let live = f.live_bytes(n)?;
            ranges.push((live.start, live.end.saturating_sub(live.start)));
        }
        let commit = self.reservation.commit_ranges(&ranges)?;
        self.committed_tokens = n;
        Ok(commit.map_or(0, |c| c.bytes))
    }

    fn check_access(&self, first: u64, len: usize) -> Result<(u64, u64), KvCacheError> {
        let bpt = self.plan.geometry().bytes_per_token();
        let len = len as u64;
        if bpt == 0 || !len.is_multiple_of(bpt) {
            return Err(KvCacheError::BadLength {
                expected: len.div_ceil(bpt.max(1)).saturating_mul(bpt),
                got: len,
            });
        }
        let n = len / bpt;
        let end = add(first, n, "token range end")?;
        if end > self.committed_tokens {
            return Err(KvCacheError::NotCommitted {
                first,
                end,
                committed: self.committed_tokens,
            });
        }
        Ok((n, end))
    }

    /// Writes one token's KV (`bytes_per_token` bytes, host layout
    /// `[layer][K, V][kv_head][head_dim]`) at the layout's offsets.
    pub fn write_token(&mut self, token: u64, bytes: &[u8]) -> Result<(), KvCacheError> {
        self.write_tokens(token, bytes)
    }

    /// Writes tokens `first..first + n` (`src.len() = n x bytes_per_token`, host layout per
    /// token `[layer][K, V][kv_head][head_dim]`) at the layout's offsets: one copy per
    /// contiguous device run (per fragment; adjacent runs are merged).
    ///
    /// Refused before any driver call: tokens not committed ([`KvCacheError::NotCommitted`]);
    /// a token whose bytes lie in the read-only shared prefix
    /// ([`KvCacheError::WriteIntoSharedPrefix`]). A prefix token that straddles the end of
    /// the shared windows (possible when the prefix does not end on a window boundary) has
    /// its shared bytes already (identical, written by the owner): only its private bytes
    /// are written.
    pub fn write_tokens(&mut self, first: u64, src: &[u8]) -> Result<(), KvCacheError> {
        let (n, end) = self.check_access(first, src.len())?;
        if n == 0 {
            return Ok(());
        }
        let g = self.plan.granule();
        let bpt_f = self.plan.fragment_bytes_per_token();
        let protected = mul(self.protected_windows(), g, "protected bytes")?;
        let shared_tokens = protected / bpt_f.max(1);
        if first < shared_tokens {
            return Err(KvCacheError::WriteIntoSharedPrefix {
                token: first,
                shared_tokens,
            });
        }
        let first_bytes = mul(first, bpt_f, "token offset")?;
        if first_bytes < protected && first >= self.prefix_tokens {
            return Err(KvCacheError::WriteIntoSharedPrefix {
                token: first,
                shared_tokens,
            });
        }
        let span = tracing::debug_span!("kv.write_tokens", first, n);
        let _e = span.enter();
        self.transfer(first, end, protected, Dir::Write(src))?;
        if first <= self.written_tokens {
            self.written_tokens = self.written_tokens.max(end);
        }
        Ok(())
    }

    /// Reads one token's KV into `out` (`bytes_per_token` bytes, host layout as for
    /// [`write_token`](Self::write_token)).
    pub fn read_token(&self, token: u64, out: &mut [u8]) -> Result<(), KvCacheError> {
        self.read_tokens(token, out)
    }

    /// Reads tokens `first..first + n` into `out` (`n x bytes_per_token` bytes), shared
    /// prefix included, with one copy per contiguous device run.
    pub fn read_tokens(&self, first: u64, out: &mut [u8]) -> Result<(), KvCacheError> {
        let (n, end) = self.check_access(first, out.len())?;
        if n == 0 {
            return Ok(());
        }
        let span = tracing::debug_span!("kv.read_tokens", first, n);
        let _e = span.enter();
        self.transfer(first, end, 0, Dir::Read(out))
    }

    /// Moves the bytes of tokens `first..end` between the host buffer and the device, skipping
    /// the first `clip` bytes of every fragment (the protected shared part).
    fn transfer(
        &self,
        first: u64,
        end: u64,
        clip: u64,
        mut dir: Dir<'_>,
    ) -> Result<(), KvCacheError> {
        let backend: &Arc<dyn VirtualMemoryBackend> = self.vm.backend();
        let base = self.reservation.address();
        let bpt = self.plan.geometry().bytes_per_token();
        let bpt_f = self.plan.fragment_bytes_per_token();
        let lo = mul(first, bpt_f, "device range")?.max(clip);
        let hi = mul(end, bpt_f, "device range")?;
        if lo >= hi {
            return Ok(());
        }
        // Token-major with one fragment: host and device orders coincide.
        if self.fragments.len() == 1 {
            let f = &self.fragments[0];
            let skip = to_usize(lo - mul(first, bpt_f, "device range")?, "usize")?;
            let mut dev = add(f.offset, lo, "device offset")?;
            let total = to_usize(hi - lo, "usize")?;
            let mut done = 0usize;
            while done < total {
                let len = (total - done).min(MAX_COPY_BYTES);
                let addr = base.checked_add(dev).ok_or(crate::KvError::Overflow {
                    what: "device address",
                })?;
                match &mut dir {
                    Dir::Write(src) => {
                        backend.copy_to_device(addr, &src[skip + done..skip + done + len])?
                    }
                    Dir::Read(out) => {
                        backend.copy_from_device(&mut out[skip + done..skip + done + len], addr)?
                    }
                }
                done += len;
                dev = add(dev, len as u64, "device offset")?;
            }
            return Ok(());
        }
        // Runs of adjacent device bytes, each a list of (fragment, device lo, device hi).
        let mut staging: Vec<u8> = Vec::new();
        let mut run: Vec<(usize, u64, u64)> = Vec::new();
        let mut run_start = 0u64;
        let mut run_end = 0u64;
        let mut run_bytes = 0u64;
        for (i, f) in self.fragments.iter().enumerate() {
            let start = add(f.offset, lo, "device offset")?;
            let stop = add(f.offset, hi, "device offset")?;
            let len = stop - start;
            let adjacent = !run.is_empty() && start == run_end;
            if !run.is_empty()
                && (!adjacent || run_bytes.saturating_add(len) > MAX_COPY_BYTES as u64)
            {
                self.flush(
                    backend,
                    base,
                    run_start,
                    &run,
                    first,
                    bpt,
                    bpt_f,
                    &mut staging,
                    &mut dir,
                )?;
                run.clear();
                run_bytes = 0;
            }
            if run.is_empty() {
                run_start = start;
            }
            run.push((i, lo, hi));
            run_end = stop;
            run_bytes = run_bytes.saturating_add(len);
        }
        if !run.is_empty() {
            self.flush(
                backend,
                base,
                run_start,
                &run,
                first,
                bpt,
                bpt_f,
                &mut staging,
                &mut dir,
            )?;
        }
        Ok(())
    }

    /// One copy of a run: gather (write) or scatter (read) through `staging`.
    #[allow(clippy::too_many_arguments)]
    fn flush(
        &self,
        backend: &Arc<dyn VirtualMemoryBackend>,
        base: DeviceAddress,
        run_start: u64,
        run: &[(usize, u64, u64)],
        first: u64,
        bpt: u64,
        bpt_f: u64,
        staging: &mut Vec<u8>,
        dir: &mut Dir<'_>,
    ) -> Result<(), KvCacheError> {
        let addr = base
            .checked_add(run_start)
            .ok_or(crate::KvError::Overflow {
                what: "device address",
            })?;
        let total: u64 = run.iter().map(|&(_, lo, hi)| hi - lo).sum();
        staging.clear();
        staging.resize(to_usize(total, "usize")?, 0);
        // (host offset, staging offset, len) of every piece, in device order.
        let pieces = |f: usize,
                      lo: u64,
                      hi: u64,
                      mut at: usize,
                      cb: &mut dyn FnMut(usize, usize, usize)|
         -> Result<usize, KvCacheError> {
            let frag_in_token = mul(f as u64, bpt_f, "host offset")?;
            let mut x = lo;
            while x < hi {
                let t = x / bpt_f;
                let within = x % bpt_f;
                let piece_end = (mul(t + 1, bpt_f, "piece end")?).min(hi);
                let len = to_usize(piece_end - x, "usize")?;
                let host = add(
                    mul(t - first, bpt, "host offset")?,
                    add(frag_in_token, within, "host offset")?,
                    "host offset",
                )?;
                cb(to_usize(host, "usize")?, at, len);
                at += len;
                x = piece_end;
            }
            Ok(at)
        };
        match dir {
            Dir::Write(src) => {
                let mut at = 0usize;
                for &(f, lo, hi) in run {
                    let st = &mut *staging;
                    at = pieces(f, lo, hi, at, &mut |h, s, l| {
                        st[s..s + l].copy_from_slice(&src[h..h + l]);
                    })?;
                }
                backend.copy_to_device(addr, staging)?;
            }
            Dir::Read(out) => {
                backend.copy_from_device(staging, addr)?;
                let mut at = 0usize;
                for &(f, lo, hi) in run {
                    let st = &*staging;
                    let o = &mut **out;
                    at = pieces(f, lo, hi, at, &mut |h, s, l| {
                        o[h..h + l].copy_from_slice(&st[s..s + l]);
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Gives back the private windows committed beyond the first `n` tokens (windows holding
    /// no byte of tokens `0..n` in any fragment), keeping the address range: what a
    /// pre-committer does with windows it committed ahead of need when memory runs short.
    /// Tokens already written are never given back (`n` is raised to
    /// [`written_tokens`](Self::written_tokens)), and neither is a shared window. Returns the
    /// bytes unmapped.
    pub fn shrink_committed(&mut self, n: u64) -> Result<u64, KvCacheError> {
        let n = n.max(self.written_tokens).max(self.prefix_tokens);
        if n >= self.committed_tokens {
            return Ok(0);
        }
        let g = self.plan.granule();
        let mut ranges = Vec::with_capacity(self.fragments.len());
        for f in &self.fragments {
            let live = f.live_bytes(n)?;
            let keep_end = live.end.div_ceil(g).saturating_mul(g).max(
                self.protected_windows()
                    .saturating_mul(g)
                    .saturating_add(f.offset),
            );
            let end = f.offset.saturating_add(f.reserved_bytes);
            if keep_end < end {
                ranges.push((keep_end, end - keep_end));
            }
        }
        let span =
            tracing::debug_span!("kv.shrink_committed", from = self.committed_tokens, to = n);
        let _e = span.enter();
        let bytes = self.reservation.release_ranges(&ranges)?;
        self.committed_tokens = n;
        Ok(bytes)
    }

    /// Unmaps everything (private windows go to the pool or the driver; shared mappings only
    /// drop their reference), detaches from any shared prefix and keeps the address range.
    /// Returns the bytes unmapped. The sequence can grow again (privately) afterwards.
    pub fn release(&mut self) -> Result<u64, KvCacheError> {
        let span = tracing::debug_span!("kv.release", tokens = self.committed_tokens);
        let _e = span.enter();
        let bytes = self.reservation.release()?;
        self.committed_tokens = 0;
        self.written_tokens = 0;
        self.prefix_tokens = 0;
        self.readonly.clear();
        self.readonly_windows = 0;
        self.owned = None;
        self.pending = None;
        Ok(bytes)
    }

    // ---- crate-internal: shared prefix plumbing ----

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
        let indices = prefix.window_indices(end_window)?;
        let bytes = self
            .reservation
            .map_shared(prefix.handles(), &indices, Access::Read)?;
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
    /// owned (read-write) by this sequence; `prefix_len` is the prefix's length in tokens.
    pub(crate) fn create_owned_segment(
        &mut self,
        first_window: u64,
        end_window: u64,
        prefix_len: u64,
        shareability: crate::PrefixShareability,
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
        let ranges: Vec<(u64, u64)> = self
            .fragments
            .iter()
            .map(|f| Ok((add(f.offset, start, "segment offset")?, len)))
            .collect::<Result<_, KvCacheError>>()?;
        let set = self.reservation.commit_shared(&ranges)?;
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
}

enum Dir<'a> {
    Write(&'a [u8]),
    Read(&'a mut [u8]),
}
