//! The server's core: [`KvService`] owns the backend, the manager, the governor and the table
//! of live sequences, and is the only place that calls the KV layer. The HTTP layer
//! (`router.rs`) only parses, calls one method here and renders the result.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvvm::{DeviceId, VirtualMemoryBackend};
use kvvm_governor::{Governor, GovernorConfig};
use kvvm_kv::{KvDtype, KvGeometry, KvLayout, LayoutPlan, PrefixCache};
use kvvm_vmm::{VirtualMemory, VmmConfig};

use crate::api::{
    AppendTokens, Counters, CreateSequence, MetricsSnapshot, Released, SequenceInfo, ShutdownReport,
};
use crate::error::{ServeError, ServiceError};
use crate::sequence::LiveSequence;

/// How a [`KvService`] is set up.
#[derive(Clone)]
pub struct ServiceConfig {
    /// The driver backend (see [`kvvm::open_backend`]).
    pub backend: Arc<dyn VirtualMemoryBackend>,
    /// The device whose memory is served.
    pub device: DeviceId,
    /// The memory budget in bytes; `None`: the device's free memory when the service starts
    /// (unlimited if the driver cannot say).
    pub budget_bytes: Option<u64>,
    /// The model preset (see [`KvGeometry::preset`]).
    pub model: String,
    /// The KV element type.
    pub dtype: KvDtype,
    /// The physical KV layout.
    pub layout: KvLayout,
    /// The model's context limit: the largest `max_tokens` a sequence may ask for.
    pub max_tokens: u64,
    /// Most bytes of released handles kept for reuse (`None`: the manager's default).
    pub pool_cap_bytes: Option<u64>,
    /// Whether prompts sent with `token_ids` go through the prefix cache (shared prefixes
    /// found automatically and mapped read-only).
    pub prefix_cache: bool,
}

impl std::fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceConfig")
            .field("backend", &self.backend.name())
            .field("device", &self.device)
            .field("budget_bytes", &self.budget_bytes)
            .field("model", &self.model)
            .field("dtype", &self.dtype)
            .field("layout", &self.layout)
            .field("max_tokens", &self.max_tokens)
            .field("pool_cap_bytes", &self.pool_cap_bytes)
            .field("prefix_cache", &self.prefix_cache)
            .finish()
    }
}

impl ServiceConfig {
    /// Defaults for `backend`: device 0, llama-3-8b in fp16, seq-major, 8192 tokens, the
    /// device's free memory as the budget, the prefix cache on.
    pub fn new(backend: Arc<dyn VirtualMemoryBackend>) -> Self {
        ServiceConfig {
            backend,
            device: DeviceId(0),
            budget_bytes: None,
            model: "llama-3-8b".into(),
            dtype: KvDtype::F16,
            layout: KvLayout::SeqMajor,
            max_tokens: 8192,
            pool_cap_bytes: None,
            prefix_cache: true,
        }
    }
}

#[derive(Debug, Default)]
struct AtomicCounters {
    sequences_created: AtomicU64,
    sequences_released: AtomicU64,
    appends: AtomicU64,
    grants_refused: AtomicU64,
    bad_requests: AtomicU64,
    internal_errors: AtomicU64,
    prefix_hits: AtomicU64,
    prefix_hit_tokens: AtomicU64,
    prefixes_published: AtomicU64,
}

fn bump(c: &AtomicU64, by: u64) {
    c.fetch_add(by, Ordering::Relaxed);
}

#[derive(Debug)]
struct State {
    sequences: BTreeMap<u64, Arc<Slot>>,
    next_id: u64,
    closed: bool,
}

/// A table entry: the sequence behind its own lock (`None` once released), so that driver
/// calls on different sequences do not wait for each other.
type Slot = Mutex<Option<LiveSequence>>;

fn lock_slot(slot: &Slot) -> MutexGuard<'_, Option<LiveSequence>> {
    // Every update of a slot is a single assignment: a poisoned lock is still consistent.
    slot.lock().unwrap_or_else(|p| p.into_inner())
}

/// The server's core: backend, manager, governor, layout plan, prefix cache and the table of
/// live sequences.
///
/// Every method is synchronous (driver calls); the HTTP layer calls them on a blocking
/// thread. The table's lock is held only to look up, insert or remove; each sequence has its
/// own lock, held across its driver calls, so operations on different sequences run in
/// parallel and operations on one sequence one after the other. Each operation is
/// all-or-nothing: an error leaves the table and the books as they were.
///
/// The service keeps one set of books: what the manager knows (backend, device, governor,
/// granule) is asked of the manager, what the plan knows (layout, the model's token limit) of
/// the plan, sequence releases are recorded with the governor. It keeps only the table of
/// live sequences, its counters, and the names it serves (model preset, element type).
pub struct KvService {
    vm: VirtualMemory,
    plan: LayoutPlan,
    cache: Option<Arc<PrefixCache>>,
    model: String,
    dtype: KvDtype,
    state: Mutex<State>,
    counters: AtomicCounters,
    /// Live tokens over all sequences.
    live_tokens: AtomicU64,
}

impl std::fmt::Debug for KvService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvService")
            .field("backend", &self.backend_name())
            .field("device", &self.vm.device())
            .field("model", &self.model)
            .field("layout", &self.layout())
            .field("max_tokens", &self.max_tokens())
            .finish_non_exhaustive()
    }
}

impl KvService {
    /// Validates `config` and creates the governor and the manager on the device.
    pub fn new(config: ServiceConfig) -> Result<Self, ServeError> {
        let ServiceConfig {
            backend,
            device,
            budget_bytes,
            model,
            dtype,
            layout,
            max_tokens,
            pool_cap_bytes,
            prefix_cache,
        } = config;
        // Validate the model and the limit once, up front.
        let geometry = KvGeometry::preset(&model, dtype, max_tokens)
            .map_err(|e| ServeError::Config(e.to_string()))?;
        let budget = match budget_bytes {
            Some(b) => Some(b),
            None => backend.memory_info(device).ok().map(|m| m.free),
        };
        let governor = match budget {
            Some(b) => Governor::new(GovernorConfig::default().device_budget(device, b)),
            None => Governor::unlimited(),
        };
        let mut vmm_config = VmmConfig::default();
        if let Some(cap) = pool_cap_bytes {
            vmm_config = vmm_config.pool_cap_bytes(cap);
        }
        let vm = VirtualMemory::new(backend, device, governor, vmm_config)?;
        let plan = LayoutPlan::new(geometry, layout, vm.granule())
            .map_err(|e| ServeError::Config(e.to_string()))?;
        let cache = if prefix_cache {
            Some(
                PrefixCache::new(vm.clone(), plan)
                    .map_err(|e| ServeError::Config(format!("prefix cache: {e}")))?,
            )
        } else {
            None
        };
        Ok(KvService {
            vm,
            plan,
            cache,
            model,
            dtype,
            state: Mutex::new(State {
                sequences: BTreeMap::new(),
                next_id: 1,
                closed: false,
            }),
            counters: AtomicCounters::default(),
            live_tokens: AtomicU64::new(0),
        })
    }

    /// Records `bytes` released by a sequence now (with the governor).
    fn note_release(&self, bytes: u64) {
        self.vm.governor().note_released(self.vm.device(), bytes);
    }

    /// The governor's `RetryPolicy` applied to the bytes released by sequences during the
    /// last window (whether their handles went back to the driver or to the pool, they are
    /// available to the next sequence).
    fn release_estimate(&self, shortfall: u64) -> Duration {
        self.vm
            .governor()
            .estimate_retry_after_released(self.vm.device(), shortfall)
    }

    /// Backpressure suggests the sooner of the governor's estimate (bytes given back to the
    /// driver) and [`release_estimate`](Self::release_estimate) (bytes released by sequences,
    /// most of which go to the handle pool and are not seen by the governor's estimate).
    fn refine(&self, e: ServiceError) -> ServiceError {
        match e {
            ServiceError::Backpressure {
                needed_bytes,
                available_bytes,
                retry_after,
            } => ServiceError::Backpressure {
                needed_bytes,
                available_bytes,
                retry_after: retry_after
                    .min(self.release_estimate(needed_bytes.saturating_sub(available_bytes))),
            },
            other => other,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the table half-updated (every update
        // is a single insert or remove), so a poisoned lock is still usable. The table lock
        // is never held across a driver call.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The slot of live sequence `id`.
    fn slot(&self, id: u64) -> Result<Arc<Slot>, ServiceError> {
        let state = self.lock();
        if state.closed {
            return Err(ServiceError::ShuttingDown);
        }
        state
            .sequences
            .get(&id)
            .cloned()
            .ok_or(ServiceError::UnknownSequence(id))
    }

    /// Closes a sequence that was released from the table, counting it.
    fn close(&self, seq: LiveSequence) -> Result<u64, ServiceError> {
        self.live_tokens.fetch_sub(seq.tokens(), Ordering::Relaxed);
        bump(&self.counters.sequences_released, 1);
        seq.close()
    }

    /// Gives back what the service still holds after every sequence is gone: the prefix
    /// cache's entries and the handle pool.
    fn drain(&self) {
        if let Some(cache) = &self.cache {
            cache.clear();
        }
        self.vm.trim_pool(0);
    }

    /// The backend's name.
    pub fn backend_name(&self) -> &str {
        self.vm.backend().name()
    }

    /// The model preset served.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The KV element type served.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// The layout served.
    pub fn layout(&self) -> KvLayout {
        self.plan.layout()
    }

    /// The model's context limit.
    pub fn max_tokens(&self) -> u64 {
        self.plan.geometry().max_tokens()
    }

    /// The governor (budget and books).
    pub fn governor(&self) -> &Governor {
        self.vm.governor()
    }

    /// The manager.
    pub fn manager(&self) -> &VirtualMemory {
        &self.vm
    }

    /// The layout plan every sequence is reserved under (at the model's limit).
    pub fn plan(&self) -> &LayoutPlan {
        &self.plan
    }

    /// The prefix cache, when it is on.
    pub fn prefix_cache(&self) -> Option<&Arc<PrefixCache>> {
        self.cache.as_ref()
    }

    /// Number of live sequences.
    pub fn live_sequences(&self) -> usize {
        self.lock().sequences.len()
    }

    /// Records the outcome of a request in the counters (429s, 4xx, 5xx).
    pub fn note_error(&self, e: &ServiceError) {
        let c = &self.counters;
        match e.status() {
            429 => bump(&c.grants_refused, 1),
            400..=499 => bump(&c.bad_requests, 1),
            _ => bump(&c.internal_errors, 1),
        }
    }

    /// Opens a sequence: checks the numbers, reserves its address space and commits the
    /// prompt. On error nothing changed.
    pub fn create(&self, req: &CreateSequence) -> Result<SequenceInfo, ServiceError> {
        let prompt = match (req.prompt_tokens, &req.token_ids) {
            (Some(n), Some(ids)) if u64::try_from(ids.len()).ok() != Some(n) => {
                return Err(ServiceError::InvalidRequest(format!(
                    "prompt_tokens is {n} but token_ids holds {} ids",
                    ids.len()
                )))
            }
            (Some(n), _) => n,
            (None, Some(ids)) => u64::try_from(ids.len())
                .map_err(|_| ServiceError::InvalidRequest("too many token_ids".into()))?,
            (None, None) => {
                return Err(ServiceError::InvalidRequest(
                    "prompt_tokens (or token_ids) is required".into(),
                ))
            }
        };
        let limit = self.max_tokens();
        let max = req.max_tokens.unwrap_or(limit);
        if max == 0 {
            return Err(ServiceError::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        if max > limit {
            return Err(ServiceError::InvalidRequest(format!(
                "max_tokens {max} exceeds the model's limit of {limit} tokens"
            )));
        }
        if prompt > max {
            return Err(ServiceError::InvalidRequest(format!(
                "prompt_tokens {prompt} exceeds max_tokens {max}"
            )));
        }
        if self.lock().closed {
            return Err(ServiceError::ShuttingDown);
        }
        // The driver calls run without the table lock: other sequences proceed meanwhile.
        let opened = match (&self.cache, &req.token_ids) {
            (Some(cache), Some(ids)) => LiveSequence::admit(&self.vm, cache, ids, max),
            _ => LiveSequence::open(&self.vm, &self.plan, max, prompt),
        };
        let (seq, opened) = opened.map_err(|e| self.refine(e))?;
        let mut state = self.lock();
        if state.closed {
            // Shutdown started meanwhile (a request whose client went away): give back what
            // this one took, as shutdown did for the others.
            drop(state);
            if let Err(e) = seq.close() {
                tracing::warn!(error = %e, "release of a sequence opened during shutdown failed");
            }
            self.drain();
            return Err(ServiceError::ShuttingDown);
        }
        self.live_tokens.fetch_add(seq.tokens(), Ordering::Relaxed);
        let id = state.next_id;
        state.next_id = id.saturating_add(1);
        let info = info(id, &seq, opened.committed_bytes);
        state.sequences.insert(id, Arc::new(Mutex::new(Some(seq))));
        drop(state);
        let c = &self.counters;
        bump(&c.sequences_created, 1);
        if info.prefix_hit_tokens > 0 {
            bump(&c.prefix_hits, 1);
            bump(&c.prefix_hit_tokens, info.prefix_hit_tokens);
        }
        if opened.published_tokens > 0 {
            bump(&c.prefixes_published, 1);
        }
        Ok(info)
    }

    /// Grows sequence `id` by `req.tokens` tokens. On error nothing changed.
    pub fn append(&self, id: u64, req: &AppendTokens) -> Result<SequenceInfo, ServiceError> {
        if req.tokens == 0 {
            return Err(ServiceError::InvalidRequest(
                "tokens must be at least 1".into(),
            ));
        }
        let slot = self.slot(id)?;
        let mut guard = lock_slot(&slot);
        // Released while this request waited for the slot.
        let seq = guard.as_mut().ok_or(ServiceError::UnknownSequence(id))?;
        let before = seq.tokens();
        let target = before
            .checked_add(req.tokens)
            .filter(|t| *t <= seq.max_tokens())
            .ok_or_else(|| {
                ServiceError::InvalidRequest(format!(
                    "appending {} tokens to {before} would exceed the sequence's max_tokens {}",
                    req.tokens,
                    seq.max_tokens()
                ))
            })?;
        let added = match seq.grow_to(&self.vm, target) {
            Ok(added) => added,
            Err(e) => {
                drop(guard);
                return Err(self.refine(e));
            }
        };
        self.live_tokens.fetch_add(req.tokens, Ordering::Relaxed);
        let info = info(id, seq, added);
        drop(guard);
        bump(&self.counters.appends, 1);
        Ok(info)
    }

    /// The sequence `id`.
    pub fn get(&self, id: u64) -> Result<SequenceInfo, ServiceError> {
        let slot = self.slot(id)?;
        let guard = lock_slot(&slot);
        let seq = guard.as_ref().ok_or(ServiceError::UnknownSequence(id))?;
        Ok(info(id, seq, 0))
    }

    /// Releases sequence `id` (its memory and its address range).
    pub fn release(&self, id: u64) -> Result<Released, ServiceError> {
        let slot = self
            .lock()
            .sequences
            .remove(&id)
            .ok_or(ServiceError::UnknownSequence(id))?;
        // Waits for an operation in progress on this sequence, then takes it.
        let seq = lock_slot(&slot)
            .take()
            .ok_or(ServiceError::UnknownSequence(id))?;
        let tokens = seq.tokens();
        // Once out of the table the sequence is gone whatever happens: a failed release is
        // quarantined by the manager, never forgotten.
        let released_bytes = self.close(seq)?;
        self.note_release(released_bytes);
        Ok(Released {
            id,
            tokens,
            released_bytes,
        })
    }

    /// Refuses new work and releases every sequence, then empties the prefix cache and the
    /// manager's handle pool: afterwards the service holds no device memory (quarantine
    /// aside).
    pub fn shutdown(&self) -> ShutdownReport {
        let sequences = {
            let mut state = self.lock();
            state.closed = true;
            std::mem::take(&mut state.sequences)
        };
        let mut report = ShutdownReport::default();
        for (id, slot) in sequences {
            // Waits for an operation in progress on this sequence.
            let Some(seq) = lock_slot(&slot).take() else {
                continue;
            };
            report.sequences += 1;
            match self.close(seq) {
                Ok(bytes) => report.released_bytes = report.released_bytes.saturating_add(bytes),
                Err(e) => {
                    report.failures += 1;
                    tracing::warn!(id, error = %e, "release at shutdown failed");
                }
            }
        }
        self.drain();
        report
    }

    /// Whether [`shutdown`](Self::shutdown) was called.
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// The counters now.
    pub fn counters(&self) -> Counters {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counters {
            sequences_created: get(&c.sequences_created),
            sequences_released: get(&c.sequences_released),
            appends: get(&c.appends),
            grants_refused: get(&c.grants_refused),
            bad_requests: get(&c.bad_requests),
            internal_errors: get(&c.internal_errors),
            prefix_hits: get(&c.prefix_hits),
            prefix_hit_tokens: get(&c.prefix_hit_tokens),
            prefixes_published: get(&c.prefixes_published),
        }
    }

    /// A point-in-time view for `/metrics`.
    pub fn metrics(&self) -> MetricsSnapshot {
        let live_sequences = self.lock().sequences.len() as u64;
        let live_tokens = self.live_tokens.load(Ordering::Relaxed);
        MetricsSnapshot {
            governor: self.vm.governor().snapshot(),
            device: self.vm.device(),
            live_sequences,
            live_tokens,
            counters: self.counters(),
            granule: self.vm.granule(),
            prefix_cache: self.cache.as_ref().map(|c| c.stats()),
        }
    }
}

fn info(id: u64, seq: &LiveSequence, added_bytes: u64) -> SequenceInfo {
    SequenceInfo {
        id,
        tokens: seq.tokens(),
        max_tokens: seq.max_tokens(),
        committed_bytes: seq.committed_bytes(),
        owned_bytes: seq.owned_bytes(),
        shared_bytes: seq.shared_bytes(),
        reserved_bytes: seq.reserved_bytes(),
        added_bytes,
        prefix_hit_tokens: seq.hit_tokens(),
        address: seq.address(),
    }
}
