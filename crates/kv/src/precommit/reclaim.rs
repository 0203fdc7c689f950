//! Giving pre-committed windows back to the governor under memory pressure (the
//! pre-committer is a [`Reclaimer`]).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use kvvm_governor::Reclaimer;
use kvvm_hal::DeviceId;

use super::{lock, Cell, Inner, WorkerCommit};

impl Reclaimer for Inner {
    /// What [`reclaim`](Reclaimer::reclaim) would give back if asked for everything now:
    /// each sequence's owned windows wholly past its claimed tokens, skipping (as reclaim
    /// does) a sequence whose lock is held or whose commit is in flight.
    fn reclaimable(&self, device: DeviceId) -> u64 {
        if device != self.vm.device() {
            return 0;
        }
        let cells: Vec<Arc<Cell>> = lock(&self.cells).iter().filter_map(Weak::upgrade).collect();
        cells
            .iter()
            .filter_map(|cell| {
                let seq = cell.seq.try_lock().ok()?;
                if seq.has_commit_in_flight() {
                    return None;
                }
                let claimed = cell.live.load(Ordering::SeqCst);
                seq.shrinkable_bytes(claimed).ok()
            })
            .fold(0, u64::saturating_add)
    }

    fn reclaim(&self, device: DeviceId, bytes: u64) -> u64 {
        if device != self.vm.device() || WorkerCommit::active() {
            return 0;
        }
        let cells: Vec<Arc<Cell>> = {
            let mut cells = lock(&self.cells);
            cells.retain(|w| w.strong_count() > 0);
            cells.iter().filter_map(Weak::upgrade).collect()
        };
        let mut freed = 0u64;
        for cell in cells {
            if freed >= bytes {
                break;
            }
            // Never wait: the caller may hold a sequence's lock while asking for memory.
            let Ok(mut seq) = cell.seq.try_lock() else {
                continue;
            };
            if seq.has_commit_in_flight() {
                continue;
            }
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
