//! [`HostTier`]: KV windows moved to page-locked host memory and back, under the same governor
//! as the device (its budget on [`DeviceId::HOST`]), instead of being given up and computed
//! again.
//!
//! The tier owns the page-locked memory (`pool.rs`: slabs of one `host_alloc` each, cut into
//! chunks of one window, free chunks kept for reuse, every byte billed on the host), the copy
//! stream its copies are queued on (the caller's, or the backend's own, which overlaps the
//! work of other streams) and the events that say they are done (`event.rs`). What moves is a
//! sequence's windows (`SequenceKv::swap_out`, `sequence/swap.rs`), window by window into
//! chunks, back into the same offsets of a reservation: a sequence swapped back into itself
//! keeps its address.
//!
//! Invariants it keeps:
//! * the governor's host books equal the tier's memory: `committed` = chunks holding a window,
//!   `pooled` = free chunks of live slabs, `quarantined` = chunks (and slabs) that could not be
//!   proven idle or freed; nothing else;
//! * a chunk is handed on (to another swap, or freed with its slab) only once every copy that
//!   touched it is done: its event waited for, or the device synchronized after a failure;
//!   otherwise it is quarantined and freed only with the tier;
//! * no lock of the tier is held while the governor is asked for bytes (its reclaimers, this
//!   tier among them, may run).

mod copy;
mod event;
mod pool;
mod stats;

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use kvvm_governor::{Bucket, Reclaimer, Refusal};
use kvvm_hal::{DeviceId, ErrorKind, StreamHandle};
use kvvm_num::mul;
use kvvm_vmm::VirtualMemory;

use crate::error::KvCacheError;
pub(crate) use copy::{copy_runs, queue_runs, runs, wait_fence, Run};
pub(crate) use event::{CopyEvent, Fence};
pub(crate) use pool::Chunk;
use pool::{free_buffers, Pool};
use stats::Counters;
pub use stats::{HostTierConfig, HostTierStats, DEFAULT_MAX_COPY_BYTES};

/// Page-locked host memory for KV windows, under the governor's host budget (see the
/// module's documentation). Made over one device's manager: its chunks are that manager's
/// windows, its copies run on that device's copy engines.
pub struct HostTier {
    vm: VirtualMemory,
    chunk: u64,
    config: HostTierConfig,
    stream: StreamHandle,
    pool: Mutex<Pool>,
    counters: Mutex<Counters>,
}

impl std::fmt::Debug for HostTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTier")
            .field("chunk_bytes", &self.chunk)
            .field("stream", &self.stream)
            .field("stats", &self.stats())
            .finish()
    }
}

impl HostTier {
    /// A tier for windows of `vm`, registered with `vm`'s governor as a reclaimer of the
    /// host's bytes (idle page-locked slabs are given back before a host grant is refused).
    ///
    /// Errors: a backend without host copies (`NotSupported`); the copy stream could not be
    /// made.
    pub fn new(vm: &VirtualMemory, config: HostTierConfig) -> Result<Arc<HostTier>, KvCacheError> {
        let backend = vm.backend();
        if !backend.capabilities().host_copies {
            return Err(kvvm_hal::BackendError::raised(
                kvvm_hal::Operation::HostAlloc,
                ErrorKind::NotSupported,
                format!(
                    "the {} backend has no page-locked host memory",
                    backend.name()
                ),
            )
            .into());
        }
        let stream = match config.stream {
            Some(s) => s,
            None => backend.copy_stream(vm.device())?,
        };
        let tier = Arc::new(HostTier {
            vm: vm.clone(),
            chunk: vm.granule(),
            config,
            stream,
            pool: Mutex::new(Pool::default()),
            counters: Mutex::new(Counters::default()),
        });
        let arc: Arc<dyn Reclaimer> = tier.clone();
        let weak: Weak<dyn Reclaimer> = Arc::downgrade(&arc);
        vm.governor().register_reclaimer(weak);
        Ok(tier)
    }

    /// The device side's manager.
    pub fn vm(&self) -> &VirtualMemory {
        &self.vm
    }

    /// Bytes of a chunk: the manager's granule (one window).
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk
    }

    /// The stream the tier's copies are queued on.
    pub fn stream(&self) -> StreamHandle {
        self.stream
    }

    /// The most windows one copy moves ([`HostTierConfig::max_copy_bytes`] in whole
    /// windows, one at least; `u64::MAX`: no bound).
    pub(crate) fn max_copy_windows(&self) -> u64 {
        match self.config.max_copy_bytes {
            Some(bytes) => (bytes / self.chunk_bytes().max(1)).max(1),
            None => u64::MAX,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &HostTierConfig {
        &self.config
    }

    fn lock(&self) -> MutexGuard<'_, Pool> {
        self.pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn counters(&self) -> MutexGuard<'_, Counters> {
        self.counters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Allocates page-locked memory until at least `bytes` of it are free (pinning is slow:
    /// an engine does it once at start, not on the path of a swap). Returns the bytes
    /// allocated. Errors: the host budget's refusal, the backend's.
    pub fn prewarm(&self, bytes: u64) -> Result<u64, KvCacheError> {
        let want = bytes.div_ceil(self.chunk.max(1));
        let free = self.lock().free_chunks();
        if want <= free {
            return Ok(0);
        }
        let chunks = want - free;
        self.add_slab(chunks)?;
        Ok(mul(chunks, self.chunk, "prewarm")?)
    }

    /// Takes `n` chunks, allocating slabs for what the pool lacks; billed as committed on the
    /// host. Errors (nothing taken): the host budget refused ([`KvCacheError::Backpressure`]
    /// or [`KvCacheError::NeverFits`] on [`DeviceId::HOST`]), the allocation failed.
    pub(crate) fn take(self: &Arc<Self>, n: u64) -> Result<HostChunks, KvCacheError> {
        let mut held = HostChunks {
            tier: Arc::clone(self),
            chunks: Vec::new(),
        };
        loop {
            let missing = n - held.chunks.len() as u64;
            let got = self.lock().take(missing, self.chunk);
            self.bill(Bucket::Pooled, Bucket::Committed, got.len() as u64);
            held.chunks.extend(got);
            let missing = n - held.chunks.len() as u64;
            if missing == 0 {
                return Ok(held);
            }
            let slab = self.config.slab_windows.max(missing);
            let refused = |e: &KvCacheError| e.backpressure().is_some() || e.never_fits().is_some();
            // A slab of the default size over the budget: only what is missing.
            let added = self.add_slab(slab).or_else(|e| {
                if slab > missing && refused(&e) {
                    self.add_slab(missing)
                } else {
                    Err(e)
                }
            });
            match added {
                Ok(()) => {}
                // Refused on the host, but the governor's reclaimers (a prefix cache's host
                // level) gave chunks back to the pool meanwhile: take those.
                Err(e) if refused(&e) && self.lock().free_chunks() > 0 => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Allocates one slab of `chunks` chunks (granted on the host first), all free.
    fn add_slab(&self, chunks: u64) -> Result<(), KvCacheError> {
        let bytes = mul(chunks, self.chunk, "slab bytes")?;
        let governor = self.vm.governor();
        let mut grant = governor
            .try_grant(DeviceId::HOST, bytes)
            .map_err(|r| match r {
                Refusal::Backpressure(b) => KvCacheError::Backpressure(b),
                Refusal::NeverFits(n) => KvCacheError::NeverFits(n),
            })?;
        // On an error the grant is dropped: its bytes go back to the budget.
        let buffer = self.vm.backend().host_alloc(self.vm.device(), bytes)?;
        if let Err(e) = grant.settle(bytes, Bucket::Pooled) {
            tracing::error!(error = %e, "host tier: accounting error on a slab");
        }
        self.lock().add_slab(buffer, chunks);
        Ok(())
    }

    /// Moves `chunks` chunks' bytes between two buckets of the host's books.
    fn bill(&self, from: Bucket, to: Bucket, chunks: u64) {
        if chunks == 0 {
            return;
        }
        let bytes = chunks.saturating_mul(self.chunk);
        if let Err(e) = self.vm.governor().transfer(DeviceId::HOST, from, to, bytes) {
            tracing::error!(error = %e, "host tier: accounting error");
        }
    }

    /// Gives chunks whose copies are done back to the pool (then trims it to
    /// [`HostTierConfig::keep_pooled_bytes`]).
    fn give_back(&self, chunks: &[Chunk]) {
        self.lock().give_back(chunks);
        self.bill(Bucket::Committed, Bucket::Pooled, chunks.len() as u64);
        if let Some(keep) = self.config.keep_pooled_bytes {
            self.trim(keep);
        }
    }

    /// Quarantines chunks whose copies cannot be proven done: never reused, freed only with
    /// the tier.
    fn quarantine(&self, chunks: &[Chunk]) {
        self.lock().quarantine(chunks);
        self.bill(Bucket::Committed, Bucket::Quarantined, chunks.len() as u64);
    }

    /// Frees idle slabs (all of their chunks free), newest first, until at most `keep` bytes
    /// of free chunks are left or none is idle; retries the frees that failed before.
    /// Returns the bytes given back to the host's budget.
    pub fn trim(&self, keep: u64) -> u64 {
        let (slabs, stuck) = {
            let mut pool = self.lock();
            let free = pool.free_chunks().saturating_mul(self.chunk);
            let over = free.saturating_sub(keep);
            let slabs = if over > 0 {
                pool.remove_idle(over, self.chunk)
            } else {
                Vec::new()
            };
            (slabs, std::mem::take(&mut pool.stuck))
        };
        let backend = self.vm.backend().as_ref();
        let governor = self.vm.governor();
        let (freed, mut left) = free_buffers(backend, governor, slabs, Bucket::Pooled);
        let (again, still) = free_buffers(backend, governor, stuck, Bucket::Quarantined);
        left.extend(still);
        if !left.is_empty() {
            self.lock().stuck.extend(left);
        }
        freed.saturating_add(again)
    }

    /// What the tier holds and did.
    pub fn stats(&self) -> HostTierStats {
        let (total, free, quarantined, idle, slabs) = {
            let p = self.lock();
            (
                p.total_chunks(),
                p.free_chunks(),
                p.quarantined_chunks(),
                p.idle_chunks(),
                p.slabs.len() as u64,
            )
        };
        let c = *self.counters();
        let g = self.chunk;
        HostTierStats {
            chunk_bytes: g,
            slabs,
            held_bytes: total.saturating_sub(free).saturating_sub(quarantined) * g,
            pooled_bytes: free * g,
            idle_bytes: idle * g,
            quarantined_bytes: quarantined * g,
            swaps_out: c.swaps_out,
            swaps_in: c.swaps_in,
            bytes_out: c.bytes_out,
            bytes_in: c.bytes_in,
            failed: c.failed,
        }
    }
}

impl Reclaimer for HostTier {
    fn reclaim(&self, device: DeviceId, bytes: u64) -> u64 {
        if device != DeviceId::HOST || bytes == 0 {
            return 0;
        }
        let pooled = self.lock().free_chunks().saturating_mul(self.chunk);
        self.trim(pooled.saturating_sub(bytes))
    }

    fn reclaimable(&self, device: DeviceId) -> u64 {
        if device != DeviceId::HOST {
            return 0;
        }
        self.lock().idle_chunks().saturating_mul(self.chunk)
    }
}

impl Drop for HostTier {
    /// Every chunk is back (the chunks a swap holds keep their tier alive) or quarantined: the
    /// device is synchronized, then every slab is freed, the quarantined ones too.
    fn drop(&mut self) {
        let pool = std::mem::take(
            self.pool
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        let quarantined = pool.quarantined_chunks();
        if quarantined > 0 || !pool.stuck.is_empty() {
            if let Err(e) = self.vm.backend().synchronize(self.vm.device()) {
                tracing::warn!(error = %e, "host tier: the device cannot be synchronized; its quarantined memory is freed anyway at teardown");
            }
        }
        let g = self.chunk;
        let backend = self.vm.backend().as_ref();
        let governor = self.vm.governor();
        for s in pool.slabs.into_values() {
            let q = s.quarantined.saturating_mul(g);
            let rest = s.chunks.saturating_mul(g).saturating_sub(q);
            if q > 0 {
                // Freed as one buffer: its quarantined part leaves the books with it.
                if let Err(e) =
                    governor.transfer(DeviceId::HOST, Bucket::Quarantined, Bucket::Pooled, q)
                {
                    tracing::error!(error = %e, "host tier: accounting error at drop");
                }
            }
            free_buffers(
                backend,
                governor,
                vec![(s.buffer, q + rest)],
                Bucket::Pooled,
            );
        }
        free_buffers(backend, governor, pool.stuck, Bucket::Quarantined);
    }
}

/// Chunks taken from a [`HostTier`] (billed as committed on the host): given back when
/// dropped, or quarantined by [`quarantine`](Self::quarantine) when the copies that touched
/// them cannot be proven done.
pub(crate) struct HostChunks {
    tier: Arc<HostTier>,
    pub(crate) chunks: Vec<Chunk>,
}

impl std::fmt::Debug for HostChunks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostChunks")
            .field("chunks", &self.chunks.len())
            .finish()
    }
}

impl HostChunks {
    /// The tier.
    pub(crate) fn tier(&self) -> &Arc<HostTier> {
        &self.tier
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> u64 {
        (self.chunks.len() as u64).saturating_mul(self.tier.chunk)
    }

    /// Quarantines the chunks (never reused, freed with the tier).
    pub(crate) fn quarantine(mut self) {
        let chunks = std::mem::take(&mut self.chunks);
        self.tier.quarantine(&chunks);
    }
}

impl Drop for HostChunks {
    fn drop(&mut self) {
        if !self.chunks.is_empty() {
            let chunks = std::mem::take(&mut self.chunks);
            self.tier.give_back(&chunks);
        }
    }
}
