//! [`PrecommittedGroup`]: a [`TensorParallelSequence`] whose ranks a background worker grows
//! ahead of need, every rank in one transaction, the way the single-device
//! [`Precommitter`](crate::precommit::Precommitter) grows one sequence.
//!
//! The decode path's [`ensure_tokens`](PrecommittedGroup::ensure_tokens) claims its tokens in
//! `live` and then reads `ready` (both `SeqCst`): when the worker has committed them on every
//! rank it returns [`Ensured::Ready`] with no lock and no driver call; otherwise it commits
//! inline, through the same transaction. The worker looks at the group every poll interval and,
//! when fewer than `headroom_tokens` are committed ahead of `live`, commits up to
//! `live + 2 x headroom_tokens` on every rank: it holds the group's lock only to begin and to
//! finish the transaction, so the decode thread's writes and reads through
//! [`with_ranks`](PrecommittedGroup::with_ranks) never wait behind a driver call. A refused or failed
//! background commit is rolled back on every rank and counted; the decode path then commits
//! inline. `ready` is lowered before anything is unmapped ([`release`](PrecommittedGroup::release),
//! [`shrink_to_live`](PrecommittedGroup::shrink_to_live)), so a `Ready` never names an unmapped
//! window.

use kvvm_hal::sync::{lock, Unpoison};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::KvCacheError;
use crate::precommit::{spawn_worker, Ensured};
use crate::tensor_parallel::TensorParallelSequence;

/// Counters of a [`PrecommittedGroup`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GroupPrecommitStats {
    /// `ensure_tokens` calls answered from committed tokens.
    pub ready: u64,
    /// `ensure_tokens` calls that committed inline.
    pub inline_commits: u64,
    /// Transactions the worker committed.
    pub background_commits: u64,
    /// Worker transactions refused or failed (rolled back on every rank).
    pub background_failures: u64,
}

struct Shared {
    group: Mutex<TensorParallelSequence>,
    settled: Condvar,
    ready: AtomicU64,
    live: AtomicU64,
    max_tokens: u64,
    headroom: u64,
    poll: Duration,
    stop: Mutex<bool>,
    wake: Condvar,
    /// Worker passes completed, and whether the last one committed anything.
    scans: Mutex<(u64, bool)>,
    idle: Condvar,
    counters: [AtomicU64; 4],
}

impl Shared {
    /// The group's lock once no background transaction is in flight.
    fn lock_settled(&self) -> MutexGuard<'_, TensorParallelSequence> {
        let mut g = lock(&self.group);
        while g.has_commit_in_flight() {
            g = self.settled.wait(g).unpoisoned();
        }
        g
    }

    fn count(&self, i: usize) {
        if let Some(c) = self.counters.get(i) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// One worker pass: grows every rank ahead when the headroom ran short. Returns whether
    /// it committed anything.
    fn pass(&self) -> bool {
        let ready = self.ready.load(Ordering::SeqCst);
        if ready.saturating_sub(self.live.load(Ordering::SeqCst)) >= self.headroom
            || ready >= self.max_tokens
        {
            return false;
        }
        // Decided again under the lock: a release or shrink may have just changed `live`.
        let mut g = self.lock_settled();
        let live = self.live.load(Ordering::SeqCst);
        if g.committed_tokens().saturating_sub(live) >= self.headroom {
            return false;
        }
        let target = live
            .saturating_add(self.headroom.saturating_mul(2))
            .min(self.max_tokens);
        let job = g.begin_ensure(target);
        drop(g);
        let mut job = match job {
            Ok(Some(job)) => job,
            Ok(None) => return false,
            Err(_) => {
                self.count(3);
                return false;
            }
        };
        job.run();
        let mut g = lock(&self.group);
        let result = g.finish_ensure(job);
        self.ready.store(g.committed_tokens(), Ordering::SeqCst);
        drop(g);
        self.settled.notify_all();
        match result {
            Ok(_) => {
                self.count(2);
                true
            }
            Err(e) => {
                tracing::debug!(error = %e, "tensor-parallel pre-commit rolled back");
                self.count(3);
                false
            }
        }
    }

    fn run(self: Arc<Self>) {
        loop {
            {
                let stop = lock(&self.stop);
                if *stop {
                    return;
                }
                let (stop, _) = self.wake.wait_timeout(stop, self.poll).unpoisoned();
                if *stop {
                    return;
                }
            }
            let worked = self.pass();
            let mut scans = lock(&self.scans);
            *scans = (scans.0.wrapping_add(1), worked);
            self.idle.notify_all();
        }
    }
}

/// A tensor-parallel group grown ahead of need by a background worker (see the module docs).
pub struct PrecommittedGroup {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for PrecommittedGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrecommittedGroup")
            .field("ready", &self.shared.ready.load(Ordering::Relaxed))
            .field("live", &self.shared.live.load(Ordering::Relaxed))
            .finish()
    }
}

impl PrecommittedGroup {
    /// Starts a worker that keeps `headroom_tokens` committed ahead of the decode path on every
    /// rank of `group`, looking every `poll`. What the group has committed counts as live.
    pub fn start(
        group: TensorParallelSequence,
        headroom_tokens: u64,
        poll: Duration,
    ) -> Result<PrecommittedGroup, KvCacheError> {
        let committed = group.committed_tokens();
        let shared = Arc::new(Shared {
            max_tokens: group.max_tokens(),
            group: Mutex::new(group),
            settled: Condvar::new(),
            ready: AtomicU64::new(committed),
            live: AtomicU64::new(committed),
            headroom: headroom_tokens.max(1),
            poll,
            stop: Mutex::new(false),
            wake: Condvar::new(),
            scans: Mutex::new((0, false)),
            idle: Condvar::new(),
            counters: Default::default(),
        });
        let worker_shared = Arc::clone(&shared);
        let worker = spawn_worker("kvvm-tp-precommit", move || worker_shared.run())?;
        Ok(PrecommittedGroup {
            shared,
            worker: Some(worker),
        })
    }

    /// Makes the first `n` tokens committed on every rank: [`Ensured::Ready`] with no lock
    /// when the worker has them, else one inline transaction.
    pub fn ensure_tokens(&self, n: u64) -> Result<Ensured, KvCacheError> {
        let s = &self.shared;
        s.live.fetch_max(n, Ordering::SeqCst);
        if n <= s.ready.load(Ordering::SeqCst) {
            s.count(0);
            return Ok(Ensured::Ready);
        }
        let mut g = s.lock_settled();
        let result = g.ensure_tokens(n);
        if result.is_ok() {
            // Claim the tokens again before the lock is free: while this call waited for it,
            // a release may have lowered `live` below the claim above, and `shrink_to_live`
            // would then give back windows this call is about to promise.
            s.live.fetch_max(n, Ordering::SeqCst);
        }
        s.ready.store(g.committed_tokens(), Ordering::SeqCst);
        drop(g);
        let bytes = result?;
        s.count(1);
        s.wake.notify_one();
        Ok(Ensured::Inline(bytes))
    }

    /// Blocks until a worker pass that started after this call committed nothing (for tests
    /// and orderly measurements): every rank then holds its headroom, or the worker cannot
    /// commit it. Returns at once once the worker is stopped.
    pub fn wait_idle(&self) {
        let s = &self.shared;
        loop {
            let start = {
                let scans = lock(&s.scans);
                scans.0
            };
            // A pass in flight may have started before the call: wait for two.
            loop {
                if *lock(&s.stop) {
                    return;
                }
                s.wake.notify_one();
                let scans = lock(&s.scans);
                if scans.0.wrapping_sub(start) >= 2 {
                    if !scans.1 {
                        return;
                    }
                    break;
                }
                // Bounded so that a wake-up the worker missed (it was not waiting yet) costs
                // one poll interval, never a hang.
                drop(s.idle.wait_timeout(scans, s.poll).unpoisoned());
            }
        }
    }

    /// Tokens committed on every rank now.
    pub fn committed_tokens(&self) -> u64 {
        self.shared.ready.load(Ordering::SeqCst)
    }

    /// Runs `f` on the group's ranks (writes, reads, pointers) without waiting for a
    /// background transaction in flight: `f` must not change their mappings.
    pub fn with_ranks<R>(&self, f: impl FnOnce(&mut [crate::SequenceKv]) -> R) -> R {
        f(lock(&self.shared.group).ranks_mut())
    }

    /// Gives back, on every rank, the windows committed ahead of the live tokens. Returns the
    /// bytes unmapped.
    pub fn shrink_to_live(&self) -> Result<u64, KvCacheError> {
        let s = &self.shared;
        let mut g = s.lock_settled();
        let live = s.live.load(Ordering::SeqCst);
        s.ready
            .store(live.min(g.committed_tokens()), Ordering::SeqCst);
        let keep = live.max(s.live.load(Ordering::SeqCst));
        let result = g.shrink_committed(keep);
        s.ready.store(g.committed_tokens(), Ordering::SeqCst);
        result
    }

    /// Releases every rank (their address ranges kept), as [`TensorParallelSequence::release`].
    pub fn release(&self) -> Result<u64, KvCacheError> {
        let s = &self.shared;
        let mut g = s.lock_settled();
        s.ready.store(0, Ordering::SeqCst);
        let result = g.release();
        s.ready.store(g.committed_tokens(), Ordering::SeqCst);
        s.live.store(g.committed_tokens(), Ordering::SeqCst);
        result
    }

    /// The counters.
    pub fn stats(&self) -> GroupPrecommitStats {
        let c = |i: usize| {
            self.shared
                .counters
                .get(i)
                .map_or(0, |a| a.load(Ordering::Relaxed))
        };
        GroupPrecommitStats {
            ready: c(0),
            inline_commits: c(1),
            background_commits: c(2),
            background_failures: c(3),
        }
    }

    /// Stops the worker and gives the group back.
    pub fn stop(mut self) -> TensorParallelSequence {
        self.shutdown();
        std::mem::replace(
            &mut *lock(&self.shared.group),
            TensorParallelSequence::empty(),
        )
    }

    fn shutdown(&mut self) {
        *lock(&self.shared.stop) = true;
        self.shared.wake.notify_all();
        if let Some(w) = self.worker.take() {
            if w.join().is_err() {
                tracing::error!("the tensor-parallel pre-commit worker panicked");
            }
        }
    }
}

impl Drop for PrecommittedGroup {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
#[path = "precommit_tests.rs"]
mod tests;
