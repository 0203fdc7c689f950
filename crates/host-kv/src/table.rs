//! [`PageTable`]: a sequence's logical pages mapped to reference-counted physical pages.

use std::sync::Arc;

use crate::error::HostKvError;
use crate::store::{HostPageStore, PhysicalPage, PhysicalPageId};

/// What [`PageTable::ensure_page_for_write`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PageWrite {
    /// The page was referenced by this table only; nothing was copied.
    Exclusive,
    /// The page was shared: it was copied into a fresh page, which this table now owns.
    Copied {
        /// The shared page, still referenced by the other forks.
        from: PhysicalPageId,
        /// The private copy.
        to: PhysicalPageId,
    },
}

/// Logical page `i` of a sequence -> a physical page of a [`HostPageStore`], with reference
/// counts.
///
/// Each entry holds one counted reference to its physical page (an `Arc`); the reference
/// count of a page is the number of page tables (forks) that map it. Cloning a table (a fork)
/// bumps each count and copies nothing. A page is written in place only while its count is
/// one; [`ensure_page_for_write`](Self::ensure_page_for_write) first copies a shared page.
/// When the last reference goes, the page returns to its store's free list.
#[derive(Debug, Default)]
pub struct PageTable {
    pages: Vec<Arc<PhysicalPage>>,
}

impl PageTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of logical pages.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether the table maps no page.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// The physical page of logical page `logical`.
    pub fn physical_page(&self, logical: usize) -> Option<PhysicalPageId> {
        self.pages.get(logical).map(|p| p.id())
    }

    /// The reference count of logical page `logical`: how many page tables map its physical
    /// page. A snapshot: forks on other threads may change it at any time (but never lower
    /// it below the references this table holds).
    pub fn ref_count(&self, logical: usize) -> Option<usize> {
        self.pages.get(logical).map(Arc::strong_count)
    }

    /// Whether logical page `logical` is shared with another table.
    pub fn is_shared(&self, logical: usize) -> Option<bool> {
        self.ref_count(logical).map(|c| c > 1)
    }

    /// `(physical page, reference count)` of every logical page, in order.
    pub fn entries(&self) -> impl ExactSizeIterator<Item = (PhysicalPageId, usize)> + '_ {
        self.pages.iter().map(|p| (p.id(), Arc::strong_count(p)))
    }

    /// A second table mapping the same physical pages: one reference-count increment per
    /// page, no copy.
    pub fn fork(&self) -> PageTable {
        PageTable {
            pages: self.pages.clone(),
        }
    }

    /// Makes logical page `logical` writable by this table alone: when its reference count
    /// is above one, copies it into a fresh page from `store` and maps the copy (the other
    /// tables keep the original); otherwise does nothing.
    ///
    /// Errors: [`HostKvError::LogicalPageOutOfRange`]; [`HostKvError::StoreMismatch`] when
    /// the page is not from `store`; the store's allocation errors. The table is unchanged on
    /// error.
    pub fn ensure_page_for_write(
        &mut self,
        logical: usize,
        store: &HostPageStore,
    ) -> Result<PageWrite, HostKvError> {
        let slot = self.slot_mut(logical)?;
        if Arc::get_mut(slot).is_some() {
            return Ok(PageWrite::Exclusive);
        }
        if !slot.store_is(store) {
            return Err(HostKvError::StoreMismatch);
        }
        let mut copy = store.allocate()?;
        let from = slot.id();
        let to = copy.id();
        match Arc::get_mut(&mut copy) {
            Some(page) => page.data_mut().copy_from_slice(slot.data()),
            // A freshly allocated page has no other reference.
            None => {
                return Err(HostKvError::PageShared {
                    logical_page: logical,
                    ref_count: Arc::strong_count(&copy),
                })
            }
        }
        // Dropping the old reference decrements the shared page's count.
        *slot = copy;
        Ok(PageWrite::Copied { from, to })
    }

    /// The reference held for logical page `logical`, or
    /// [`HostKvError::LogicalPageOutOfRange`].
    fn slot_mut(&mut self, logical: usize) -> Result<&mut Arc<PhysicalPage>, HostKvError> {
        let pages = self.pages.len();
        self.pages
            .get_mut(logical)
            .ok_or(HostKvError::LogicalPageOutOfRange {
                page: logical,
                pages,
            })
    }

    pub(crate) fn push(&mut self, page: Arc<PhysicalPage>) {
        self.pages.push(page);
    }

    pub(crate) fn truncate(&mut self, pages: usize) {
        self.pages.truncate(pages);
    }

    pub(crate) fn page(&self, logical: usize) -> Option<&PhysicalPage> {
        self.pages.get(logical).map(|p| &**p)
    }

    /// The page's bytes for writing, or [`HostKvError::PageShared`] while it is shared.
    pub(crate) fn page_mut(&mut self, logical: usize) -> Result<&mut [u8], HostKvError> {
        let slot = self.slot_mut(logical)?;
        let ref_count = Arc::strong_count(slot);
        match Arc::get_mut(slot) {
            Some(page) => Ok(page.data_mut()),
            None => Err(HostKvError::PageShared {
                logical_page: logical,
                ref_count,
            }),
        }
    }
}
