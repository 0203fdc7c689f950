//! The memory policies a trace is replayed through.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use kvvm_governor::{GovernorConfig, ManualClock};
use kvvm_hal::{Access, AllocationProperties, DeviceId, VirtualMemoryBackend};
use kvvm_kv::{evaluate_prefix_shareability, KvGeometry, KvLayout, LayoutPlan, PrefixShareability};
use kvvm_vmm::{Governor, Reservation, SharedHandles, VirtualMemory, VmmConfig, VmmError};
use serde::Serialize;

use crate::driver::{classic, CountingBackend, DriverTally};
use crate::error::{add, mul, WorkloadError, WorkloadResult};
use crate::trace::Request;

/// Tokens in one block of the `paged-16` policy.
pub const PAGED_BLOCK_TOKENS: u64 = 16;

/// A memory policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(into = "String")]
pub enum PolicyKind {
    /// Preallocate the maximum context for every request at admission (`cudaMalloc` once).
    StaticMax,
    /// Allocate for the prompt (next power of two), grow by allocate-copy-free, doubling.
    ReallocCopy,
    /// vLLM-style: a pool preallocated to the budget, 16-token blocks handed to sequences.
    Paged16,
    /// kvvm: reserve the maximum context under `layout`, commit granule windows through the
    /// real manager as tokens arrive, release at the end.
    Kvvm {
        /// The physical KV layout.
        layout: KvLayout,
        /// Whether the common system prompt's whole windows are committed once and shared.
        prefix_sharing: bool,
    },
}

impl PolicyKind {
    /// Every policy, in report order.
    pub fn all() -> Vec<PolicyKind> {
        let mut v = vec![
            PolicyKind::StaticMax,
            PolicyKind::ReallocCopy,
            PolicyKind::Paged16,
        ];
        for layout in KvLayout::ALL {
            for prefix_sharing in [false, true] {
                v.push(PolicyKind::Kvvm {
                    layout,
                    prefix_sharing,
                });
            }
        }
        v
    }

    /// The policy's name in reports: `static-max`, `realloc-copy`, `paged-16`,
    /// `kvvm-<layout>` and `kvvm-<layout>+prefix`.
    pub fn name(&self) -> String {
        match self {
            PolicyKind::StaticMax => "static-max".into(),
            PolicyKind::ReallocCopy => "realloc-copy".into(),
            PolicyKind::Paged16 => "paged-16".into(),
            PolicyKind::Kvvm {
                layout,
                prefix_sharing,
            } => format!(
                "kvvm-{layout}{}",
                if *prefix_sharing { "+prefix" } else { "" }
            ),
        }
    }

    /// Whether the policy goes through the kvvm manager.
    pub fn is_kvvm(&self) -> bool {
        matches!(self, PolicyKind::Kvvm { .. })
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

impl From<PolicyKind> for String {
    fn from(p: PolicyKind) -> String {
        p.name()
    }
}

impl FromStr for PolicyKind {
    type Err = WorkloadError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::all()
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<String> = PolicyKind::all().iter().map(|p| p.name()).collect();
                WorkloadError::Config(format!(
                    "unknown policy {s:?} (expected one of: {})",
                    names.join(", ")
                ))
            })
    }
}

/// The result of asking a policy for memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Granted and done.
    Done,
    /// Refused for lack of budget (HTTP 429); the governor's `retry_after` when it gave one.
    Refused(Option<Duration>),
}

/// What a policy's driver activity came to, after everything was released.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Costs {
    pub driver_calls: u64,
    pub driver_time: Duration,
    pub measured: bool,
    pub copy_bytes: u64,
    pub kv_write_bytes: u64,
    pub shareability: Option<PrefixShareability>,
}

/// A memory policy as the replay drives it. Token counts are absolute (the KV length).
pub(crate) trait Policy {
    fn admit(&mut self, id: usize, req: &Request, tokens: u64) -> WorkloadResult<Outcome>;
    fn grow(&mut self, id: usize, tokens: u64) -> WorkloadResult<Outcome>;
    fn finish(&mut self, id: usize) -> WorkloadResult<()>;
    /// Bytes committed to sequences now (for kvvm: mapped, shared prefix included once).
    fn committed_bytes(&self) -> u64;
    /// Physical bytes held now (committed plus pools).
    fn held_bytes(&self) -> u64;
    /// Bytes of live KV data the committed memory holds (a shared prefix counted once).
    fn live_bytes(&self) -> u64;
    /// The highest committed bytes reached inside an operation (a copy's two buffers).
    fn transient_peak(&self) -> u64 {
        0
    }
    /// Moves the policy's clock (the governor's release-rate estimate) forward.
    fn advance(&mut self, _dt: Duration) {}
    /// Ends the run: everything must have been finished.
    fn close(&mut self) -> WorkloadResult<Costs>;
}

/// Geometry shared by all policies of a run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub geometry: KvGeometry,
    pub bytes_per_token: u64,
    pub max_context: u64,
    pub budget: u64,
}

// ---------------------------------------------------------------------------------------------
// static-max, realloc-copy, paged-16

#[derive(Debug, Clone, Copy)]
struct ClassicSeq {
    tokens: u64,
    capacity_tokens: u64,
}

/// The three policies that do not use the virtual-memory API, accounted by formula.
#[derive(Debug)]
pub(crate) struct ClassicPolicy {
    kind: PolicyKind,
    shape: Shape,
    seqs: HashMap<usize, ClassicSeq>,
    committed: u64,
    live: u64,
    transient_peak: u64,
    calls: u64,
    time: Duration,
    copy_bytes: u64,
}

impl ClassicPolicy {
    pub fn new(kind: PolicyKind, shape: Shape) -> Self {
        ClassicPolicy {
            kind,
            shape,
            seqs: HashMap::new(),
            committed: 0,
            live: 0,
            transient_peak: 0,
            calls: 0,
            time: Duration::ZERO,
            copy_bytes: 0,
        }
    }

    fn capacity_for(&self, tokens: u64, current: u64) -> u64 {
        let max = self.shape.max_context;
        match self.kind {
            PolicyKind::StaticMax => max,
            PolicyKind::Paged16 => tokens
                .div_ceil(PAGED_BLOCK_TOKENS)
                .saturating_mul(PAGED_BLOCK_TOKENS),
            _ => {
                if current == 0 {
                    tokens
                        .max(16)
                        .checked_next_power_of_two()
                        .unwrap_or(max)
                        .min(max)
                } else {
                    current.saturating_mul(2).max(tokens).min(max)
                }
            }
        }
    }

    fn pool_bytes(&self) -> u64 {
        let block = self
            .shape
            .bytes_per_token
            .saturating_mul(PAGED_BLOCK_TOKENS);
        if block == 0 {
            return 0;
        }
        (self.shape.budget / block).saturating_mul(block)
    }

    fn limit(&self) -> u64 {
        match self.kind {
            PolicyKind::Paged16 => self.pool_bytes(),
            _ => self.shape.budget,
        }
    }

    fn set_tokens(&mut self, id: usize, old: u64, tokens: u64) -> WorkloadResult<()> {
        let bpt = self.shape.bytes_per_token;
        self.live = add(
            self.live.saturating_sub(mul(old, bpt, "live bytes")?),
            mul(tokens, bpt, "live bytes")?,
            "live bytes",
        )?;
        if let Some(s) = self.seqs.get_mut(&id) {
            s.tokens = tokens;
        }
        Ok(())
    }
}

impl Policy for ClassicPolicy {
    fn admit(&mut self, id: usize, _req: &Request, tokens: u64) -> WorkloadResult<Outcome> {
        let cap = self.capacity_for(tokens, 0);
        let bytes = mul(cap, self.shape.bytes_per_token, "allocation bytes")?;
        if add(self.committed, bytes, "committed bytes")? > self.limit() {
            return Ok(Outcome::Refused(None));
        }
        self.committed = add(self.committed, bytes, "committed bytes")?;
        if self.kind != PolicyKind::Paged16 {
            self.calls = self.calls.saturating_add(1);
            self.time = self.time.saturating_add(classic::ALLOC);
        }
        self.seqs.insert(
            id,
            ClassicSeq {
                tokens: 0,
                capacity_tokens: cap,
            },
        );
        self.set_tokens(id, 0, tokens)?;
        Ok(Outcome::Done)
    }

    fn grow(&mut self, id: usize, tokens: u64) -> WorkloadResult<Outcome> {
        let seq = *self
            .seqs
            .get(&id)
            .ok_or_else(|| WorkloadError::Config(format!("grow of unknown sequence {id}")))?;
        if tokens > seq.capacity_tokens {
            let bpt = self.shape.bytes_per_token;
            let cap = self.capacity_for(tokens, seq.capacity_tokens);
            let old_bytes = mul(seq.capacity_tokens, bpt, "allocation bytes")?;
            let new_bytes = mul(cap, bpt, "allocation bytes")?;
            match self.kind {
                PolicyKind::ReallocCopy => {
                    // Allocate the new buffer while the old one is still held, copy, free.
                    let during = add(self.committed, new_bytes, "committed bytes")?;
                    if during > self.limit() {
                        return Ok(Outcome::Refused(None));
                    }
                    self.transient_peak = self.transient_peak.max(during);
                    self.calls = self.calls.saturating_add(3);
                    self.time = self.time.saturating_add(classic::growth(new_bytes));
                    self.copy_bytes = add(
                        self.copy_bytes,
                        mul(seq.tokens, bpt, "copy bytes")?,
                        "copy bytes",
                    )?;
                }
                _ => {
                    let extra = new_bytes.saturating_sub(old_bytes);
                    if add(self.committed, extra, "committed bytes")? > self.limit() {
                        return Ok(Outcome::Refused(None));
                    }
                }
            }
            self.committed = add(
                self.committed.saturating_sub(old_bytes),
                new_bytes,
                "committed",
            )?;
            if let Some(s) = self.seqs.get_mut(&id) {
                s.capacity_tokens = cap;
            }
        }
        self.set_tokens(id, seq.tokens, tokens)?;
        Ok(Outcome::Done)
    }

    fn finish(&mut self, id: usize) -> WorkloadResult<()> {
        let seq = self
            .seqs
            .remove(&id)
            .ok_or_else(|| WorkloadError::Config(format!("finish of unknown sequence {id}")))?;
        let bpt = self.shape.bytes_per_token;
        self.committed =
            self.committed
                .saturating_sub(mul(seq.capacity_tokens, bpt, "allocation bytes")?);
        self.live = self
            .live
            .saturating_sub(mul(seq.tokens, bpt, "live bytes")?);
        if self.kind != PolicyKind::Paged16 {
            self.calls = self.calls.saturating_add(1);
            self.time = self.time.saturating_add(classic::FREE);
        }
        Ok(())
    }

    fn committed_bytes(&self) -> u64 {
        self.committed
    }

    fn held_bytes(&self) -> u64 {
        match self.kind {
            PolicyKind::Paged16 => self.pool_bytes(),
            _ => self.committed,
        }
    }

    fn live_bytes(&self) -> u64 {
        self.live
    }

    fn transient_peak(&self) -> u64 {
        self.transient_peak
    }

    fn close(&mut self) -> WorkloadResult<Costs> {
        if self.kind == PolicyKind::Paged16 {
            // One allocation of the whole pool at start, one free at the end.
            self.calls = self.calls.saturating_add(2);
            self.time = self
                .time
                .saturating_add(classic::ALLOC)
                .saturating_add(classic::FREE);
        }
        Ok(Costs {
            driver_calls: self.calls,
            driver_time: self.time,
            measured: false,
            copy_bytes: self.copy_bytes,
            ..Costs::default()
        })
    }
}

// ---------------------------------------------------------------------------------------------
// kvvm through the real manager

/// One sequence under a kvvm policy: one reservation of the layout's size.
#[derive(Debug)]
struct KvSeq {
    res: Reservation,
    /// Windows per fragment that hold live bytes (shared ones included for a sharer).
    windows: u64,
    tokens: u64,
    /// Tokens whose KV bytes were written to the device (real GPUs only).
    written: u64,
    /// Maps the shared prefix (its first `share_windows` windows of each fragment).
    sharer: bool,
    /// Committed the shared prefix (read-write) for everyone.
    owner: bool,
}

/// The shared prefix: the handles of the system prompt's whole windows, committed once by
/// its first sharer (the owner) and mapped read-only by the others.
#[derive(Debug)]
struct Prefix {
    set: Arc<SharedHandles>,
    sharers: usize,
}

/// A kvvm policy: reservations, commits, shared-prefix mappings and releases through
/// [`VirtualMemory`] with the governor's budget.
pub(crate) struct KvvmPolicy {
    plan: LayoutPlan,
    shape: Shape,
    vm: VirtualMemory,
    counting: Arc<CountingBackend>,
    clock: Arc<ManualClock>,
    measured: bool,
    write_kv: bool,
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
        let props = AllocationProperties::device(device);
        let granule = backend.granularity(&props)?;
        // The counting wrapper converts sizes to granules; the manager queries its own.
        let counting = Arc::new(CountingBackend::new(
            backend.clone(),
            granule.recommended.max(granule.minimum),
        ));
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
            counting,
            clock,
            measured: backend.name() != "sim",
            write_kv,
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

    fn fragments(&self) -> u64 {
        self.plan.slice_count()
    }

    /// Bytes of the shared windows (all of them prefix data), counted once.
    fn shared_bytes(&self) -> u64 {
        self.share_windows
            .saturating_mul(self.g())
            .saturating_mul(self.fragments())
    }

    fn uses_prefix(&self, req: &Request) -> bool {
        self.share_windows > 0
            && req
                .shared_prefix_tokens
                .saturating_mul(self.plan.fragment_bytes_per_token())
                >= self.share_windows.saturating_mul(self.g())
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
            Err(e) => refusal(e).map(Some),
        }
    }

    /// The byte ranges of windows `from..to` of every fragment.
    fn ranges(&self, from: u64, to: u64) -> WorkloadResult<Vec<(u64, u64)>> {
        if to <= from {
            return Ok(Vec::new());
        }
        let g = self.g();
        let stride = self.plan.slice_stride();
        let len = mul(to - from, g, "range bytes")?;
        (0..self.fragments())
            .map(|i| {
                let start = add(
                    mul(i, stride, "fragment offset")?,
                    mul(from, g, "window")?,
                    "range",
                )?;
                Ok((start, len))
            })
            .collect()
    }

    fn live_of(&self, tokens: u64, sharer: bool) -> WorkloadResult<u64> {
        let b = mul(tokens, self.shape.bytes_per_token, "live bytes")?;
        Ok(if sharer {
            b.saturating_sub(self.shared_bytes())
        } else {
            b
        })
    }

    /// Private bytes committed for a sequence with `windows` windows per fragment.
    fn private_bytes(&self, windows: u64, sharer: bool) -> WorkloadResult<u64> {
        let w = if sharer {
            windows.saturating_sub(self.share_windows)
        } else {
            windows
        };
        mul(
            mul(w, self.fragments(), "windows")?,
            self.g(),
            "committed bytes",
        )
    }

    /// Writes the KV bytes of tokens `from..to` of every fragment of `seq` (real GPUs only);
    /// a sharer that does not own the prefix never writes its read-only windows.
    fn write_tokens(&self, seq: &KvSeq, id: usize, from: u64, to: u64) -> WorkloadResult<()> {
        if !self.write_kv || to <= from {
            return Ok(());
        }
        let per = self.plan.fragment_bytes_per_token();
        let skip = if seq.sharer && !seq.owner {
            self.share_windows.saturating_mul(self.g())
        } else {
            0
        };
        let start = mul(from, per, "write offset")?.max(skip);
        let end = mul(to, per, "write offset")?;
        if end <= start {
            return Ok(());
        }
        let len =
            usize::try_from(end - start).map_err(|_| WorkloadError::Overflow("write length"))?;
        let data = vec![(id % 251) as u8 + 1; len];
        let stride = self.plan.slice_stride();
        for i in 0..self.fragments() {
            let offset = add(mul(i, stride, "fragment offset")?, start, "write offset")?;
            let dst = seq
                .res
                .address()
                .checked_add(offset)
                .ok_or(WorkloadError::Overflow("write address"))?;
            self.counting.copy_to_device(dst, &data)?;
        }
        Ok(())
    }

    fn drop_prefix_if_unused(&mut self) {
        if self.prefix.as_ref().is_some_and(|p| p.sharers == 0) {
            // The last reference: the set's handles go back to the pool or the driver.
            self.prefix = None;
            self.live = self.live.saturating_sub(self.shared_bytes());
            self.committed = self.committed.saturating_sub(self.shared_bytes());
        }
    }

    fn release(&mut self, mut seq: KvSeq) -> WorkloadResult<()> {
        seq.res.release()?;
        let private = self.private_bytes(seq.windows, seq.sharer)?;
        self.committed = self.committed.saturating_sub(private);
        if seq.sharer {
            if let Some(p) = self.prefix.as_mut() {
                p.sharers = p.sharers.saturating_sub(1);
            }
        }
        drop(seq);
        self.drop_prefix_if_unused();
        Ok(())
    }
}

/// A manager error as a refusal when retrying may help, as an error otherwise.
fn refusal(e: VmmError) -> WorkloadResult<Outcome> {
    match e {
        VmmError::Backpressure(bp) => Ok(Outcome::Refused(Some(bp.retry_after))),
        e if e.is_retryable() => Ok(Outcome::Refused(None)),
        e => Err(e.into()),
    }
}

impl Policy for KvvmPolicy {
    fn admit(&mut self, id: usize, req: &Request, tokens: u64) -> WorkloadResult<Outcome> {
        let sharer = self.uses_prefix(req);
        let owner = sharer && self.prefix.is_none();
        let windows = self.plan.windows_per_fragment(tokens)?.max(if sharer {
            self.share_windows
        } else {
            0
        });
        let mut new_bytes = self.private_bytes(windows, sharer)?;
        if owner {
            new_bytes = add(new_bytes, self.shared_bytes(), "commit bytes")?;
        }
        if let Some(refused) = self.precheck(new_bytes)? {
            return Ok(refused);
        }
        let mut res = self.vm.reserve(self.plan.reservation_bytes())?;
        let k = if sharer { self.share_windows } else { 0 };
        if owner {
            let ranges = self.ranges(0, k)?;
            let set = match res.commit_shared(&ranges) {
                Ok(set) => set,
                Err(e) => return refusal(e),
            };
            self.prefix = Some(Prefix { set, sharers: 0 });
            self.committed = add(self.committed, self.shared_bytes(), "committed")?;
            self.live = add(self.live, self.shared_bytes(), "live bytes")?;
        } else if sharer {
            let Some(p) = self.prefix.as_ref() else {
                return Err(WorkloadError::Config("shared prefix vanished".into()));
            };
            let all: Vec<usize> = (0..p.set.len()).collect();
            if let Err(e) = res.map_shared(&p.set, &all, Access::Read) {
                return refusal(e);
            }
        }
        if sharer {
            if let Some(p) = self.prefix.as_mut() {
                p.sharers = p.sharers.saturating_add(1);
            }
        }
        let ranges = self.ranges(k, windows)?;
        if let Err(e) = res.commit_ranges(&ranges) {
            let seq = KvSeq {
                res,
                windows: k,
                tokens: 0,
                written: 0,
                sharer,
                owner,
            };
            self.release(seq)?;
            return refusal(e);
        }
        self.committed = add(
            self.committed,
            self.private_bytes(windows, sharer)?,
            "committed",
        )?;
        let seq = KvSeq {
            res,
            windows,
            tokens,
            written: 0,
            sharer,
            owner,
        };
        self.write_tokens(&seq, id, 0, tokens)?;
        self.live = add(self.live, self.live_of(tokens, sharer)?, "live bytes")?;
        self.seqs.insert(
            id,
            KvSeq {
                written: tokens,
                ..seq
            },
        );
        Ok(Outcome::Done)
    }

    fn grow(&mut self, id: usize, tokens: u64) -> WorkloadResult<Outcome> {
        let (old_tokens, old_windows, sharer) = match self.seqs.get(&id) {
            Some(s) => (s.tokens, s.windows, s.sharer),
            None => {
                return Err(WorkloadError::Config(format!(
                    "grow of unknown sequence {id}"
                )))
            }
        };
        let windows = self.plan.windows_per_fragment(tokens)?.max(old_windows);
        if windows > old_windows {
            let ranges = self.ranges(old_windows, windows)?;
            let added = mul(
                mul(windows - old_windows, self.fragments(), "windows")?,
                self.g(),
                "bytes",
            )?;
            let Some(seq) = self.seqs.get_mut(&id) else {
                return Err(WorkloadError::Config(format!(
                    "grow of unknown sequence {id}"
                )));
            };
            if let Err(e) = seq.res.commit_ranges(&ranges) {
                return refusal(e);
            }
            seq.windows = windows;
            self.committed = add(self.committed, added, "committed")?;
            // Write what was decoded since the last write (batched at commits).
            if let Some(seq) = self.seqs.get(&id) {
                self.write_tokens(seq, id, seq.written, tokens)?;
            }
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.written = tokens;
            }
        }
        self.live = add(
            self.live.saturating_sub(self.live_of(old_tokens, sharer)?),
            self.live_of(tokens, sharer)?,
            "live bytes",
        )?;
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.tokens = tokens;
        }
        Ok(Outcome::Done)
    }

    fn finish(&mut self, id: usize) -> WorkloadResult<()> {
        let seq = self
            .seqs
            .remove(&id)
            .ok_or_else(|| WorkloadError::Config(format!("finish of unknown sequence {id}")))?;
        self.write_tokens(&seq, id, seq.written, seq.tokens)?;
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
            driver_time: if self.measured {
                t.measured
            } else {
                t.modelled
            },
            measured: self.measured,
            copy_bytes: 0,
            kv_write_bytes: t.kv_copy_bytes,
            shareability: self.shareability.clone(),
        })
    }
}
