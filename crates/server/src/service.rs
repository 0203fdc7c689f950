//! The server's core: [`KvService`] owns the backend, the manager, the governor, the prefix
//! caches and the table of live sequences, and is the only place that calls the KV layer.
//! The HTTP layer (`router.rs`) only parses, calls one method here and renders the result.

use kvvm::hal::sync::Unpoison;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvvm::governor::{Governor, GovernorConfig, TenantShare, Tenants};
use kvvm::kv::{KvDtype, KvLayout, LayoutPlan, PrefixCache};
use kvvm::vmm::{VirtualMemory, VmmConfig};

use crate::api::{
    AppendTokens, Counters, CreateSequence, MetricsSnapshot, Released, SequenceInfo, ShutdownReport,
};
use crate::auth::Owner;
use crate::caches::PrefixCaches;
use crate::config::{ServedModel, ServiceConfig};
use crate::counters::{bump, AtomicCounters};
use crate::error::{ServeError, ServiceError};
use crate::limits::{never_fits, refusal, tenant, Limits};
use crate::sequence::LiveSequence;

#[derive(Debug)]
struct State {
    sequences: BTreeMap<u64, Arc<Entry>>,
    next_id: u64,
    closed: bool,
}

/// A table entry: its owner, when it was last used, and the sequence behind its own lock
/// (`None` once released), so that driver calls on different sequences do not wait for each
/// other.
#[derive(Debug)]
struct Entry {
    owner: Owner,
    /// Milliseconds since the service started.
    last_used: AtomicU64,
    seq: Mutex<Option<LiveSequence>>,
}

impl Entry {
    fn lock(&self) -> MutexGuard<'_, Option<LiveSequence>> {
        // Every update of a slot is a single assignment: a poisoned lock is still consistent.
        self.seq.lock().unpoisoned()
    }
}

/// The server's core: backend, manager, governor, layout plan, prefix caches and the table
/// of live sequences with their owners.
///
/// Every method is synchronous (driver calls); the HTTP layer calls them on a blocking
/// thread. The table's lock is held only to look up, insert or remove; each sequence has its
/// own lock, held across its driver calls, so operations on different sequences run in
/// parallel and operations on one sequence one after the other. Each operation is
/// all-or-nothing: an error leaves the table, the limits and the books as they were.
///
/// Every sequence has an [`Owner`]; an operation on another owner's sequence is
/// [`ServiceError::UnknownSequence`], exactly as for an id that does not exist.
pub struct KvService {
    vm: VirtualMemory,
    plan: LayoutPlan,
    caches: PrefixCaches,
    model: ServedModel,
    state: Mutex<State>,
    counters: AtomicCounters,
    /// The server's limits, as tenant budgets of the governor: every owner is a tenant.
    tenants: Tenants,
    limits: Limits,
    idle_timeout: Option<Duration>,
    started: Instant,
    /// Live tokens over all sequences.
    live_tokens: AtomicU64,
}

impl std::fmt::Debug for KvService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvService")
            .field("backend", &self.backend_name())
            .field("device", &self.vm.device())
            .field("model", &self.model.name())
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
            layout,
            pool_cap_bytes,
            prefix_cache,
            shared_prefix_cache,
            limits,
            idle_timeout,
        } = config;
        let budget = match budget_bytes {
            Some(b) => Some(b),
            None => kvvm::sim::default_budget(&*backend, device),
        };
        let governor = match budget {
            Some(b) => Governor::new(GovernorConfig::default().device_budget(device, b)),
            None => Governor::unlimited(),
        };
        let tenants = Tenants::new(&governor, limits.budgets());
        let mut vmm_config = VmmConfig::default();
        if let Some(cap) = pool_cap_bytes {
            vmm_config = vmm_config.pool_cap_bytes(cap);
        }
        let vm = VirtualMemory::new(backend, device, governor, vmm_config)?;
        let plan = LayoutPlan::new(*model.geometry(), layout, vm.granule())
            .map_err(|e| ServeError::Config(e.to_string()))?;
        let cache = if prefix_cache {
            Some(
                crate::caches::window_block_cache(&vm, &plan)
                    .map_err(|e| ServeError::Config(format!("prefix cache: {e}")))?,
            )
        } else {
            None
        };
        Ok(KvService {
            vm,
            plan,
            caches: PrefixCaches::new(cache, shared_prefix_cache),
            model,
            state: Mutex::new(State {
                sequences: BTreeMap::new(),
                next_id: 1,
                closed: false,
            }),
            counters: AtomicCounters::default(),
            tenants,
            limits,
            idle_timeout,
            started: Instant::now(),
            live_tokens: AtomicU64::new(0),
        })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The bytes a sequence really gives back when it ends: its own windows, and a shared
    /// prefix only it held (one still cached or mapped by others frees nothing).
    fn note_release(&self, freed_bytes: u64) {
        self.vm
            .governor()
            .note_released(self.vm.device(), freed_bytes);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the table half-updated (every update
        // is a single insert or remove), so a poisoned lock is still usable. The table lock
        // is never held across a driver call.
        self.state.lock().unpoisoned()
    }

    /// The entry of live sequence `id` owned by `owner` (another owner's is unknown).
    fn entry(&self, owner: Owner, id: u64) -> Result<Arc<Entry>, ServiceError> {
        let state = self.lock();
        if state.closed {
            return Err(ServiceError::ShuttingDown);
        }
        let entry = state
            .sequences
            .get(&id)
            .filter(|e| e.owner == owner)
            .cloned()
            .ok_or(ServiceError::UnknownSequence(id))?;
        entry.last_used.store(self.now_ms(), Ordering::Relaxed);
        Ok(entry)
    }

    /// Closes a sequence that was taken out of the table: releases it, gives its share of
    /// the limits back and records the release. Returns the bytes given back (its own
    /// windows, and a shared prefix only it held).
    fn close(&self, owner: Owner, seq: LiveSequence) -> Result<u64, ServiceError> {
        self.live_tokens.fetch_sub(seq.tokens(), Ordering::Relaxed);
        bump(&self.counters.sequences_released, 1);
        let share = TenantShare {
            sequences: 1,
            reserved_bytes: seq.reserved_bytes(),
            committed_bytes: seq.billed_bytes(),
        };
        let closed = seq.close();
        self.tenants.release(tenant(owner), share);
        if let Ok(freed) = closed {
            self.note_release(freed);
        }
        closed
    }

    /// Gives back what the service still holds after every sequence is gone: the prefix
    /// caches' entries and the handle pool.
    fn drain(&self) {
        for cache in self.caches.all() {
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
        self.model.name()
    }

    /// The KV element type served.
    pub fn dtype(&self) -> KvDtype {
        self.model.dtype()
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

    /// The prefix cache of anonymous clients (and of every key when it is shared), when
    /// the cache is on.
    pub fn prefix_cache(&self) -> Option<&Arc<PrefixCache>> {
        self.caches.default_cache()
    }

    /// The idle timeout after which unused sequences are released.
    pub fn idle_timeout(&self) -> Option<Duration> {
        self.idle_timeout
    }

    /// Why no sequence can ever be opened under these settings (a reservation at the
    /// model's limit larger than a limit), if that is so: worth a warning at start.
    pub fn never_fits_reason(&self) -> Option<String> {
        let share = TenantShare {
            sequences: 1,
            reserved_bytes: self.plan.reservation_bytes(),
            committed_bytes: 0,
        };
        let refusal = self.tenants.check_fits(share).err()?;
        Some(never_fits(refusal).to_string())
    }

    /// Number of live sequences.
    pub fn live_sequences(&self) -> usize {
        self.lock().sequences.len()
    }

    /// Counts a response by its status (429, 503, another 4xx, another 5xx).
    pub fn note_status(&self, status: u16) {
        self.counters.note_status(status);
    }

    /// Opens a sequence for `owner`: checks the numbers and the limits, reserves its address
    /// space and commits the prompt. On error nothing changed.
    pub fn create(&self, owner: Owner, req: &CreateSequence) -> Result<SequenceInfo, ServiceError> {
        let (prompt, max) = req.checked(self.max_tokens())?;
        if self.lock().closed {
            return Err(ServiceError::ShuttingDown);
        }
        let needed = self.plan.committed_bytes_for_tokens(prompt)?;
        let share = TenantShare {
            sequences: 1,
            reserved_bytes: self.plan.reservation_bytes(),
            committed_bytes: needed,
        };
        let grant = self
            .tenants
            .try_take(tenant(owner), share)
            .map_err(refusal)?;
        // The driver calls run without the table lock: other sequences proceed meanwhile.
        let opened = match self.caches.for_owner(owner, &self.vm, &self.plan) {
            Ok(cache) => match (cache, &req.token_ids) {
                (Some(cache), Some(ids)) => LiveSequence::admit(&self.vm, &cache, ids, max, needed),
                _ => LiveSequence::open(&self.vm, &self.plan, max, (prompt, needed)),
            },
            Err(e) => Err(e),
        };
        let (seq, opened) = match opened {
            Ok(o) => o,
            Err(e) => {
                // The grant goes back unsettled: a failed request is no release.
                drop(grant);
                return Err(e);
            }
        };
        grant.settle(opened.committed_bytes);
        let mut state = self.lock();
        if state.closed {
            // Shutdown started meanwhile (a request whose client went away): give back what
            // this one took, as shutdown did for the others.
            drop(state);
            if let Err(e) = self.close(owner, seq) {
                tracing::warn!(error = %e, "release of a sequence opened during shutdown failed");
            }
            self.drain();
            return Err(ServiceError::ShuttingDown);
        }
        self.live_tokens.fetch_add(seq.tokens(), Ordering::Relaxed);
        let id = state.next_id;
        state.next_id = id.saturating_add(1);
        let info = info(id, &seq, opened.committed_bytes);
        let entry = Entry {
            owner,
            last_used: AtomicU64::new(self.now_ms()),
            seq: Mutex::new(Some(seq)),
        };
        state.sequences.insert(id, Arc::new(entry));
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

    /// Grows `owner`'s sequence `id` by `req.tokens` tokens. On error nothing changed.
    pub fn append(
        &self,
        owner: Owner,
        id: u64,
        req: &AppendTokens,
    ) -> Result<SequenceInfo, ServiceError> {
        if req.tokens == 0 {
            return Err(ServiceError::InvalidRequest(
                "tokens must be at least 1".into(),
            ));
        }
        let entry = self.entry(owner, id)?;
        let mut guard = entry.lock();
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
        let growth = seq.growth_to(target)?;
        let share = TenantShare {
            committed_bytes: growth.needed,
            ..TenantShare::default()
        };
        let grant = self
            .tenants
            .try_take(tenant(owner), share)
            .map_err(refusal)?;
        let added = match seq.grow(&self.vm, growth) {
            Ok(added) => added,
            Err(e) => {
                drop(guard);
                drop(grant);
                return Err(e);
            }
        };
        grant.settle(added);
        self.live_tokens.fetch_add(req.tokens, Ordering::Relaxed);
        let info = info(id, seq, added);
        drop(guard);
        bump(&self.counters.appends, 1);
        Ok(info)
    }

    /// `owner`'s sequence `id`.
    pub fn get(&self, owner: Owner, id: u64) -> Result<SequenceInfo, ServiceError> {
        let entry = self.entry(owner, id)?;
        let guard = entry.lock();
        let seq = guard.as_ref().ok_or(ServiceError::UnknownSequence(id))?;
        Ok(info(id, seq, 0))
    }

    /// `owner`'s live sequences, by id.
    pub fn list(&self, owner: Owner) -> Result<Vec<SequenceInfo>, ServiceError> {
        let entries: Vec<(u64, Arc<Entry>)> = {
            let state = self.lock();
            if state.closed {
                return Err(ServiceError::ShuttingDown);
            }
            state
                .sequences
                .iter()
                .filter(|(_, e)| e.owner == owner)
                .map(|(id, e)| (*id, e.clone()))
                .collect()
        };
        Ok(entries
            .into_iter()
            .filter_map(|(id, e)| e.lock().as_ref().map(|s| info(id, s, 0)))
            .collect())
    }

    /// Releases `owner`'s sequence `id` (its memory and its address range).
    pub fn release(&self, owner: Owner, id: u64) -> Result<Released, ServiceError> {
        let entry = {
            let mut state = self.lock();
            match state.sequences.get(&id) {
                Some(e) if e.owner == owner => state.sequences.remove(&id),
                _ => None,
            }
        }
        .ok_or(ServiceError::UnknownSequence(id))?;
        // Waits for an operation in progress on this sequence, then takes it.
        let seq = entry
            .lock()
            .take()
            .ok_or(ServiceError::UnknownSequence(id))?;
        let tokens = seq.tokens();
        // Once out of the table the sequence is gone whatever happens: a failed release is
        // quarantined by the manager, never forgotten.
        let released_bytes = self.close(owner, seq)?;
        Ok(Released {
            id,
            tokens,
            released_bytes,
        })
    }

    /// Releases every sequence nobody used for the idle timeout; returns how many.
    pub fn expire_idle(&self) -> u64 {
        let Some(idle) = self.idle_timeout else {
            return 0;
        };
        let idle_ms = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
        let now = self.now_ms();
        let stale = |e: &Entry| now.saturating_sub(e.last_used.load(Ordering::Relaxed)) >= idle_ms;
        let expired: Vec<(u64, Arc<Entry>)> = {
            let mut state = self.lock();
            let ids: Vec<u64> = state
                .sequences
                .iter()
                .filter(|(_, e)| stale(e))
                .map(|(id, _)| *id)
                .collect();
            ids.into_iter()
                .filter_map(|id| state.sequences.remove(&id).map(|e| (id, e)))
                .collect()
        };
        let mut n = 0;
        for (id, entry) in expired {
            let Some(seq) = entry.lock().take() else {
                continue;
            };
            n += 1;
            bump(&self.counters.sequences_expired, 1);
            if let Err(e) = self.close(entry.owner, seq) {
                tracing::warn!(id, error = %e, "release of an idle sequence failed");
            } else {
                tracing::info!(id, idle_ms, "released an idle sequence");
            }
        }
        n
    }

    /// Refuses new work and releases every sequence, then empties the prefix caches and the
    /// manager's handle pool: afterwards the service holds no device memory (quarantine
    /// aside).
    pub fn shutdown(&self) -> ShutdownReport {
        let device = self.vm.device();
        let used_before = self.vm.governor().snapshot().device(device).used();
        let sequences = {
            let mut state = self.lock();
            state.closed = true;
            std::mem::take(&mut state.sequences)
        };
        let mut report = ShutdownReport::default();
        for (id, entry) in sequences {
            // Waits for an operation in progress on this sequence.
            let Some(seq) = entry.lock().take() else {
                continue;
            };
            report.sequences += 1;
            if let Err(e) = self.close(entry.owner, seq) {
                report.failures += 1;
                tracing::warn!(id, error = %e, "release at shutdown failed");
            }
        }
        self.drain();
        let held = self.vm.governor().snapshot().device(device).used();
        report.released_bytes = used_before.saturating_sub(held);
        report.held_bytes = held;
        report
    }

    /// Whether [`shutdown`](Self::shutdown) was called.
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// The counters now.
    pub fn counters(&self) -> Counters {
        self.counters.snapshot()
    }

    /// A point-in-time view for `/metrics`.
    pub fn metrics(&self) -> MetricsSnapshot {
        let live_sequences = self.lock().sequences.len() as u64;
        let live_tokens = self.live_tokens.load(Ordering::Relaxed);
        MetricsSnapshot {
            governor: self.vm.governor().snapshot(),
            available_bytes: self.vm.governor().available_bytes(self.vm.device()),
            device: self.vm.device(),
            live_sequences,
            live_tokens,
            counters: self.counters(),
            granule: self.vm.granule(),
            prefix_cache: self.caches.stats(),
        }
    }

    /// What `owner` holds against the limits, from the governor's tenant books: live
    /// sequences, reserved and committed bytes.
    pub fn held_by(&self, owner: Owner) -> (u64, u64, u64) {
        let s = self.tenants.held(tenant(owner));
        (s.sequences, s.reserved_bytes, s.committed_bytes)
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        self.limits
    }
}

fn info(id: u64, seq: &LiveSequence, added_bytes: u64) -> SequenceInfo {
    SequenceInfo {
        id,
        tokens: seq.tokens(),
        max_tokens: seq.max_tokens(),
        committed_bytes: seq.committed_bytes(),
        owned_bytes: seq.committed_bytes(),
        shared_bytes: seq.shared_bytes(),
        mapped_bytes: seq.mapped_bytes(),
        reserved_bytes: seq.reserved_bytes(),
        added_bytes,
        prefix_hit_tokens: seq.hit_tokens(),
        address: Some(seq.address()),
    }
}
