//! [`LeftMapped`]: the hand-back from a dropped commit job to its reservation.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::block::Block;
use kvvm_hal::sync::lock;

/// Blocks a commit job dropped unfinished could not unmap, handed back to the reservation
/// that began it: the driver still maps them, so they stay out of use and in its books (and
/// their bytes committed) until a release or the teardown unmaps them. Closed when the
/// reservation goes; a job dropped after that quarantines what it cannot unmap.
pub(crate) struct LeftMapped {
    /// `None` once the reservation is gone.
    blocks: Mutex<Option<Vec<Block>>>,
    /// Whether `blocks` holds any (read without the lock on every call of the reservation).
    pending: AtomicBool,
}

impl LeftMapped {
    pub(crate) fn open() -> Self {
        LeftMapped {
            blocks: Mutex::new(Some(Vec::new())),
            pending: AtomicBool::new(false),
        }
    }

    /// Hands `block` back to its reservation; returns it when the reservation is gone.
    pub(crate) fn hand_back(&self, block: Block) -> Result<(), Block> {
        let mut blocks = lock(&self.blocks);
        match blocks.as_mut() {
            Some(list) => {
                list.push(block);
                self.pending.store(true, Ordering::Release);
                Ok(())
            }
            None => Err(block),
        }
    }

    /// Takes the blocks handed back so far.
    pub(crate) fn take(&self) -> Vec<Block> {
        if !self.pending.load(Ordering::Acquire) {
            return Vec::new();
        }
        let mut blocks = lock(&self.blocks);
        self.pending.store(false, Ordering::Release);
        blocks.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// A copy of the blocks handed back and not taken yet.
    pub(crate) fn peek(&self) -> Vec<Block> {
        if !self.pending.load(Ordering::Acquire) {
            return Vec::new();
        }
        lock(&self.blocks).clone().unwrap_or_default()
    }

    /// Closes it (the reservation is going) and takes what was handed back.
    pub(crate) fn close(&self) -> Vec<Block> {
        let mut blocks = lock(&self.blocks);
        self.pending.store(false, Ordering::Release);
        blocks.take().unwrap_or_default()
    }
}
