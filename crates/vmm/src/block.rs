//! [`Block`]: one mapping of a reservation as the manager records it. A commit makes blocks,
//! a release or teardown unmaps them; the reservation keeps them sorted by offset.

use std::sync::Arc;

use kvvm_hal::PhysicalHandle;

use crate::mapping::BlockKind;
use crate::shared::SharedHandles;

/// One mapping of a reservation: `windows` granule windows from `offset`, one handle mapped
/// whole.
#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub(crate) offset: u64,
    /// Granule windows the mapping spans (its handle is `windows x granule` bytes).
    pub(crate) windows: u64,
    pub(crate) handle: PhysicalHandle,
    pub(crate) kind: BlockKind,
    /// For shared blocks: the set the handle belongs to (keeps it alive while mapped).
    pub(crate) shared: Option<Arc<SharedHandles>>,
}

impl Block {
    /// A block whose handle the reservation owns.
    pub(crate) fn owned(offset: u64, windows: u64, handle: PhysicalHandle) -> Self {
        Block {
            offset,
            windows,
            handle,
            kind: BlockKind::Owned,
            shared: None,
        }
    }

    /// Its size in bytes (the handle's).
    pub(crate) fn bytes(&self, g: u64) -> u64 {
        self.windows.saturating_mul(g)
    }

    /// The offset just past it.
    pub(crate) fn end(&self, g: u64) -> u64 {
        self.offset.saturating_add(self.bytes(g))
    }
}
