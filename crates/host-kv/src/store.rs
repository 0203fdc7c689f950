//! [`HostPageStore`]: page-sized host buffers with reuse.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kvvm_layout::KvGeometry;

use kvvm_num::{mul, to_usize};

use crate::error::HostKvError;

/// Identity of a physical page buffer of one store, stable while the buffer lives (also across
/// reuse from the free list).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PhysicalPageId(u64);

impl PhysicalPageId {
    /// The raw number.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for PhysicalPageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "page#{}", self.0)
    }
}

/// A consistent snapshot of a store's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StoreStats {
    /// Pages referenced by at least one page table.
    pub live_pages: usize,
    /// Page buffers on the free list, ready for reuse.
    pub free_pages: usize,
    /// Bytes of one page.
    pub page_bytes: usize,
}

impl StoreStats {
    /// Host bytes the store holds: `(live + free) x page_bytes`.
    pub fn held_bytes(&self) -> usize {
        self.live_pages
            .saturating_add(self.free_pages)
            .saturating_mul(self.page_bytes)
    }
}

#[derive(Debug)]
struct StoreState {
    free: Vec<(PhysicalPageId, Box<[u8]>)>,
    live: usize,
    next_id: u64,
}

#[derive(Debug)]
pub(crate) struct StoreShared {
    geometry: KvGeometry,
    tokens_per_page: usize,
    page_bytes: usize,
    limit: Option<usize>,
    state: Mutex<StoreState>,
}

impl StoreShared {
    /// Locks the state. A poisoned lock is recovered: no code path panics while holding it,
    /// and every critical section leaves the state consistent.
    fn lock(&self) -> MutexGuard<'_, StoreState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn give_back(&self, id: PhysicalPageId, data: Box<[u8]>) {
        let mut state = self.lock();
        state.live = state.live.saturating_sub(1);
        state.free.push((id, data));
    }
}

/// One physical page: a buffer of the store, returned to the store's free list on drop.
/// Shared between forks through `Arc`; the `Arc`'s strong count is the page's reference count.
#[derive(Debug)]
pub(crate) struct PhysicalPage {
    id: PhysicalPageId,
    data: Box<[u8]>,
    store: Arc<StoreShared>,
}

impl PhysicalPage {
    pub(crate) fn id(&self) -> PhysicalPageId {
        self.id
    }

    pub(crate) fn data(&self) -> &[u8] {
        &self.data
    }

    pub(crate) fn data_mut(&mut self) -> &mut [u8] {
        &mut self.data
    }

    pub(crate) fn store_is(&self, store: &HostPageStore) -> bool {
        Arc::ptr_eq(&self.store, &store.shared)
    }
}

impl Drop for PhysicalPage {
    fn drop(&mut self) {
        let data = std::mem::take(&mut self.data);
        self.store.give_back(self.id, data);
    }
}

/// A pool of page-sized host buffers for one KV shape, shared by every sequence and fork
/// that uses it.
///
/// A page holds `tokens_per_page` tokens: the K and V of every layer of each
/// (`tokens_per_page x bytes_per_token` bytes). Dropped pages go to a free list and are
/// reused before new memory is allocated; [`release_free_pages`](Self::release_free_pages)
/// gives the free list back to the allocator.
///
/// `HostPageStore` is a cheap handle (`Clone` shares the same pool) and is `Send + Sync`; its
/// counters sit behind one mutex, taken only to allocate or return a page.
#[derive(Debug, Clone)]
pub struct HostPageStore {
    shared: Arc<StoreShared>,
}

impl HostPageStore {
    /// A store of pages of `tokens_per_page` tokens of `geometry`'s per-token shape
    /// (`geometry.max_tokens()` is not used by the store), with no page limit.
    ///
    /// Errors: [`HostKvError::ZeroTokensPerPage`], [`HostKvError::Overflow`] when the page
    /// size does not fit in `usize`.
    pub fn new(geometry: KvGeometry, tokens_per_page: u32) -> Result<Self, HostKvError> {
        Self::build(geometry, tokens_per_page, None)
    }

    /// Like [`new`](Self::new), but allocation fails with [`HostKvError::StoreExhausted`]
    /// once `max_live_pages` pages are live.
    pub fn with_page_limit(
        geometry: KvGeometry,
        tokens_per_page: u32,
        max_live_pages: usize,
    ) -> Result<Self, HostKvError> {
        Self::build(geometry, tokens_per_page, Some(max_live_pages))
    }

    fn build(
        geometry: KvGeometry,
        tokens_per_page: u32,
        limit: Option<usize>,
    ) -> Result<Self, HostKvError> {
        if tokens_per_page == 0 {
            return Err(HostKvError::ZeroTokensPerPage);
        }
        let tokens_per_page = to_usize(u64::from(tokens_per_page), "tokens per page")?;
        let per_token = to_usize(geometry.bytes_per_token(), "bytes per token")?;
        let page_bytes = mul(tokens_per_page, per_token, "page bytes")?;
        Ok(Self {
            shared: Arc::new(StoreShared {
                geometry,
                tokens_per_page,
                page_bytes,
                limit,
                state: Mutex::new(StoreState {
                    free: Vec::new(),
                    live: 0,
                    next_id: 0,
                }),
            }),
        })
    }

    /// The geometry whose per-token shape the pages hold.
    pub fn geometry(&self) -> &KvGeometry {
        &self.shared.geometry
    }

    /// Tokens per page.
    pub fn tokens_per_page(&self) -> usize {
        self.shared.tokens_per_page
    }

    /// Bytes per page: `tokens_per_page x bytes_per_token`.
    pub fn page_bytes(&self) -> usize {
        self.shared.page_bytes
    }

    /// The live-page limit, if any.
    pub fn page_limit(&self) -> Option<usize> {
        self.shared.limit
    }

    /// A consistent snapshot of the counters.
    pub fn stats(&self) -> StoreStats {
        let state = self.shared.lock();
        StoreStats {
            live_pages: state.live,
            free_pages: state.free.len(),
            page_bytes: self.shared.page_bytes,
        }
    }

    /// Pages referenced by at least one page table.
    pub fn live_pages(&self) -> usize {
        self.shared.lock().live
    }

    /// Page buffers on the free list.
    pub fn free_pages(&self) -> usize {
        self.shared.lock().free.len()
    }

    /// Frees the buffers on the free list; returns how many were freed.
    pub fn release_free_pages(&self) -> usize {
        let free = std::mem::take(&mut self.shared.lock().free);
        free.len()
    }

    /// Whether `other` is a handle to the same pool.
    pub fn same_store(&self, other: &HostPageStore) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// Takes a page from the free list or allocates one. A reused page keeps stale bytes; the
    /// cache never exposes bytes of slots it has not written.
    pub(crate) fn allocate(&self) -> Result<Arc<PhysicalPage>, HostKvError> {
        let (id, reused) = {
            let mut state = self.shared.lock();
            if let Some(limit) = self.shared.limit {
                if state.live >= limit {
                    return Err(HostKvError::StoreExhausted { limit });
                }
            }
            let reused = state.free.pop();
            let id = match &reused {
                Some((id, _)) => *id,
                None => {
                    let id = PhysicalPageId(state.next_id);
                    state.next_id = state
                        .next_id
                        .checked_add(1)
                        .ok_or(HostKvError::Overflow { what: "page id" })?;
                    id
                }
            };
            state.live += 1;
            (id, reused.map(|(_, data)| data))
        };
        let data = match reused {
            Some(data) => data,
            None => match zeroed(self.shared.page_bytes) {
                Ok(data) => data,
                Err(e) => {
                    let mut state = self.shared.lock();
                    state.live = state.live.saturating_sub(1);
                    return Err(e);
                }
            },
        };
        Ok(Arc::new(PhysicalPage {
            id,
            data,
            store: Arc::clone(&self.shared),
        }))
    }
}

/// A zeroed buffer of `bytes`, or [`HostKvError::AllocationFailed`] instead of an abort.
fn zeroed(bytes: usize) -> Result<Box<[u8]>, HostKvError> {
    let mut v = Vec::new();
    v.try_reserve_exact(bytes)
        .map_err(|_| HostKvError::AllocationFailed { bytes })?;
    v.resize(bytes, 0);
    Ok(v.into_boxed_slice())
}
