//! Giving pre-committed windows back to the governor under memory pressure (the
//! pre-committer is a [`Reclaimer`]).

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard, Weak};

use kvvm_governor::Reclaimer;
use kvvm_hal::DeviceId;

use super::{lock, Cell, Inner, WorkerCommit};
use crate::sequence::SequenceKv;

impl Reclaimer for Inner {
    /// What [`reclaim`](Reclaimer::reclaim) would give back if asked for everything now:
    /// each sequence's owned windows wholly past its claimed tokens, skipping (as reclaim
    /// does) a sequence whose lock is held or whose commit is in flight.
    fn reclaimable(&self, device: DeviceId) -> u64 {
        if device != self.vm.device() {
            return 0;
        }
        self.cells_alive()
            .iter()
            .filter_map(|cell| {
                let seq = idle(cell)?;
                seq.shrinkable_bytes(cell.live.load(Ordering::SeqCst)).ok()
            })
            .fold(0, u64::saturating_add)
    }

    fn reclaim(&self, device: DeviceId, bytes: u64) -> u64 {
        if device != self.vm.device() || WorkerCommit::active() {
            return 0;
        }
        let mut freed = 0u64;
        for cell in self.cells_alive() {
            if freed >= bytes {
                break;
            }
            let Some(mut seq) = idle(&cell) else {
                continue;
            };
            let claimed = cell.live.load(Ordering::SeqCst);
            if seq.committed_tokens() <= claimed {
                continue;
            }
            // Lower the count the decode path reads before unmapping anything, then read the
            // claims again: a claim made meanwhile is kept (see `Cell`).
            cell.ready.store(claimed, Ordering::SeqCst);
            let keep = claimed.max(cell.live.load(Ordering::SeqCst));
            let result = seq.shrink_committed(keep);
            cell.ready.store(seq.committed_tokens(), Ordering::SeqCst);
            match result {
                Ok(b) => {
                    freed = freed.saturating_add(b);
                    // A handle that holds the live end stays mapped whole (it is given back
                    // only with all its windows): count what is still mapped ahead, not the
                    // committed count.
                    let live_now = cell.live.load(Ordering::SeqCst);
                    let at_live = cell.plan.committed_bytes_for_tokens(live_now).unwrap_or(0);
                    let mapped = seq.reservation().committed_bytes();
                    self.set_ahead(&cell, mapped.saturating_sub(at_live));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "giving back pre-committed windows failed");
                    *lock(&self.last_error) = Some(e);
                }
            }
        }
        if freed > 0 {
            // The windows went to the handle pool: release that much of it to the driver.
            let keep = self.vm.pooled_bytes().saturating_sub(freed);
            self.vm.trim_pool(keep);
            self.counters
                .reclaimed_bytes
                .fetch_add(freed, Ordering::Relaxed);
        }
        freed
    }
}

impl Inner {
    /// The sequences still attached (the entries of dropped ones are pruned).
    fn cells_alive(&self) -> Vec<Arc<Cell>> {
        let mut cells = lock(&self.cells);
        cells.retain(|w| w.strong_count() > 0);
        cells.iter().filter_map(Weak::upgrade).collect()
    }
}

/// `cell`'s sequence when a reclaim may shrink it now: its lock free (never waited for: the
/// caller may hold a sequence's lock while asking for memory) and no commit in flight.
fn idle(cell: &Cell) -> Option<MutexGuard<'_, SequenceKv>> {
    let seq = cell.seq.try_lock().ok()?;
    (!seq.has_commit_in_flight()).then_some(seq)
}
