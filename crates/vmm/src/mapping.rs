//! What the manager reports about mappings: [`MappedBlock`], [`BlockKind`] and the result of a
//! commit, [`Commit`]. Plain records, no behaviour.

use kvvm_hal::{DeviceAddress, PhysicalHandle};

/// Who owns the physical memory behind a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BlockKind {
    /// The reservation owns the handle: release returns it to the pool or the driver.
    Owned,
    /// A mapping of a [`SharedHandles`](crate::SharedHandles) set (a shared prefix): unmapping
    /// it only drops a reference (`note_unmapped`); the handle is released when the set is
    /// dropped, which cannot happen before every mapping of it is gone (invariant 4).
    Shared {
        /// Whether this mapping has write access (the owner's) or read-only (a sharer's).
        writable: bool,
    },
}

/// One mapped block of a reservation, as the manager records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MappedBlock {
    /// Where it is mapped.
    pub address: DeviceAddress,
    /// Its size: the handle's, a whole number of granules.
    pub size: u64,
    /// The physical handle mapped there.
    pub handle: PhysicalHandle,
    /// Who owns the handle.
    pub kind: BlockKind,
}

/// What a successful commit did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    /// Address of the first newly mapped byte.
    pub address: DeviceAddress,
    /// Bytes newly mapped.
    pub bytes: u64,
    /// Granules newly mapped.
    pub granules: u64,
    /// Of those, granules whose handle came from the pool or from parking (no create).
    pub from_pool: u64,
    /// Mappings (one handle each) the commit added: fewer than `granules` when a run of
    /// windows was mapped with multi-window handles.
    pub mappings: u64,
}

impl Commit {
    /// A commit that mapped nothing, at `address`.
    pub(crate) fn empty(address: DeviceAddress) -> Self {
        Commit {
            address,
            bytes: 0,
            granules: 0,
            from_pool: 0,
            mappings: 0,
        }
    }
}
