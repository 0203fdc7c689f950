//! Keep the decode step off the driver: background pre-commit.
//!
//! A decode step that has to commit a window waits for `cuMemCreate` + `cuMemMap` +
//! `cuMemSetAccess` (about 42 us a 2 MiB window on the H200, far more on other platforms), and
//! every request in the batch waits with it. A [`Precommitter`] runs one background worker
//! that commits each sequence's next windows *before* the decode path needs them:
//!
//! * A [`PrecommittedSequence`] wraps a [`SequenceKv`]. Its
//!   [`ensure_tokens`](PrecommittedSequence::ensure_tokens) first reads an atomic count of
//!   tokens already committed: when the tokens are there (the normal case), it returns without
//!   a lock or a driver call ([`Ensured::Ready`]). Otherwise it commits inline, through the
//!   normal transaction and governor (correct, just slower), and counts it
//!   ([`PrecommitStats::inline_commits`]: the worker fell behind).
//! * The worker looks at every sequence each
//!   [`poll_interval`](PrecommitConfig::poll_interval) (the hot path never wakes it: a wake-up
//!   is a system call). When a sequence's committed end is within
//!   [`headroom_tokens`](PrecommitConfig::headroom_tokens) of its live end, the worker commits
//!   up to `live + 2 x headroom_tokens` with [`SequenceKv::ensure_tokens`]: the same
//!   transaction, rollback and governor grant as any commit. Given room to grow
//!   ([`Precommitter::set_grow_ahead_bytes`]), it commits further when that and the bound
//!   allow: up to the end of the largest buddy-aligned handle that can start at
//!   the committed end (at most the manager's largest handle), so that each commit ahead is
//!   one mapping per fragment (the driver's cost is per mapping). A refused grant or a driver failure inside the worker rolls back (the manager's
//!   transaction) and is counted and reported ([`PrecommitStats`],
//!   [`Precommitter::last_error`]); the decode path then commits inline.
//! * Headroom is bounded: the bytes committed ahead of the live ends of all sequences never
//!   exceed [`max_headroom_bytes`](PrecommitConfig::max_headroom_bytes), and they are ordinary
//!   committed bytes for the governor (counted, budgeted).
//! * Under memory pressure the pre-committed windows are the first given back: the
//!   pre-committer registers as a [`Reclaimer`] with the governor, which asks it before
//!   refusing a grant; it shrinks sequences back to their live ends
//!   ([`SequenceKv::shrink_committed`]) and trims the handle pool by what it freed.
//! * Deferred reclaim comes from the manager's handle pool: a finished sequence's windows go
//!   back to the pool and a new sequence takes pooled windows first, so steady-state serving
//!   makes almost no create or release calls; the pool trims itself when the governor needs
//!   memory.
//!
//! [`Precommitter::shutdown`] (also run on drop) stops the worker, joins it, and drops the
//! queue; sequences release everything when they are dropped.

use kvvm_hal::sync::{lock, Unpoison};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;

use kvvm_governor::Reclaimer;
use kvvm_vmm::VirtualMemory;

mod grow;
mod handle;
mod reclaim;
#[cfg(test)]
mod tests;

pub use handle::PrecommittedSequence;

use crate::error::KvCacheError;
use crate::sequence::SequenceKv;
use kvvm_layout::LayoutPlan;

/// Settings of a [`Precommitter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrecommitConfig {
    /// Tokens committed ahead of each sequence's live end: the worker acts on a sequence
    /// with fewer than this many committed ahead and commits up to twice as many.
    pub headroom_tokens: u64,
    /// Upper bound on the bytes committed ahead of need, over all sequences.
    pub max_headroom_bytes: u64,
    /// How often the worker looks at every sequence. The decode path never wakes it (that
    /// would put a system call on the hot path), except after an inline commit.
    pub poll_interval: std::time::Duration,
}

impl Default for PrecommitConfig {
    /// 64 tokens of headroom, at most 1 GiB ahead in all, a look every 200 us.
    fn default() -> Self {
        PrecommitConfig {
            headroom_tokens: 64,
            max_headroom_bytes: 1 << 30,
            poll_interval: std::time::Duration::from_micros(200),
        }
    }
}

/// Counters of a [`Precommitter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrecommitStats {
    /// `ensure_tokens` calls that found their tokens already committed.
    pub ready: u64,
    /// `ensure_tokens` calls that had to commit inline (the worker was behind).
    pub inline_commits: u64,
    /// Commits made by the worker.
    pub background_commits: u64,
    /// Worker commits refused by the governor, now or for good (rolled back; retried on the
    /// next queueing).
    pub background_refused: u64,
    /// Worker commits that failed in the driver (rolled back by the manager's transaction).
    pub background_failures: u64,
    /// Worker passes skipped because the headroom bound was reached.
    pub headroom_capped: u64,
    /// Bytes committed ahead of the live ends right now.
    pub headroom_bytes: u64,
    /// The most bytes ever committed ahead at once.
    pub peak_headroom_bytes: u64,
    /// Bytes given back to the governor under memory pressure.
    pub reclaimed_bytes: u64,
}

/// How [`PrecommittedSequence::ensure_tokens`] got its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ensured {
    /// Already committed (by the worker or earlier): no lock, no driver call.
    Ready,
    /// Committed inline on the calling thread, with this many new bytes.
    Inline(u64),
}

/// One sequence of the pre-committer.
///
/// `ready` and `live` follow one rule: **`ready` never exceeds what is mapped.** It is raised
/// only after a commit completed, and lowered *before* anything is unmapped. The decode path
/// claims its tokens in `live` first and reads `ready` second; a shrink lowers `ready` first
/// and reads `live` second (all four `SeqCst`), so at least one of them sees the other: either
/// the shrink keeps the claimed tokens, or the decode path sees the lower count and commits
/// inline (waiting for the shrink's lock).
pub(crate) struct Cell {
    pub(crate) seq: Mutex<SequenceKv>,
    /// Signalled when a background commit of this sequence finished.
    pub(crate) settled: Condvar,
    /// Tokens committed (published after the commit completed).
    pub(crate) ready: AtomicU64,
    /// The highest token count the decode path asked for.
    pub(crate) live: AtomicU64,
    /// Bytes this sequence has committed ahead of `live` (part of the global headroom).
    pub(crate) ahead: AtomicU64,
    /// Set by a release: the worker leaves the sequence alone until the decode path asks for
    /// tokens again (released memory stays released).
    pub(crate) dormant: AtomicBool,
    pub(crate) max_tokens: u64,
    pub(crate) plan: LayoutPlan,
}

struct Queue {
    /// A scan was asked for (attach, inline commit, `wait_idle`).
    kick: bool,
    /// Scans completed.
    scans: u64,
    /// Whether the last completed scan committed anything.
    last_scan_worked: bool,
    shutdown: bool,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) ready: AtomicU64,
    pub(crate) inline_commits: AtomicU64,
    background_commits: AtomicU64,
    background_refused: AtomicU64,
    background_failures: AtomicU64,
    headroom_capped: AtomicU64,
    headroom_bytes: AtomicU64,
    peak_headroom_bytes: AtomicU64,
    reclaimed_bytes: AtomicU64,
}

pub(crate) struct Inner {
    config: PrecommitConfig,
    vm: VirtualMemory,
    queue: Mutex<Queue>,
    wake: Condvar,
    idle: Condvar,
    cells: Mutex<Vec<Weak<Cell>>>,
    /// Bytes a sequence may hold ahead beyond its headroom (0: no growth).
    grow_ahead: AtomicU64,
    pub(crate) counters: Counters,
    last_error: Mutex<Option<KvCacheError>>,
}

/// A total kept in two's complement, read as 0 while it is below zero.
fn non_negative(total: u64) -> u64 {
    if total >> 63 == 1 {
        0
    } else {
        total
    }
}

/// Starts a pre-commit worker thread named `name` running `run` (for a sequence's
/// [`Precommitter`] and a tensor-parallel group's); a thread the OS refuses is
/// [`KvCacheError::Worker`].
pub(crate) fn spawn_worker(
    name: &str,
    run: impl FnOnce() + Send + 'static,
) -> Result<JoinHandle<()>, KvCacheError> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(run)
        .map_err(|e| KvCacheError::Worker {
            reason: e.to_string(),
        })
}

impl Cell {
    /// The sequence's lock, once no background commit of it is in flight: for anything that
    /// may change its mappings. Writes and reads of committed tokens need not wait.
    pub(crate) fn lock_settled(&self) -> MutexGuard<'_, SequenceKv> {
        let mut seq = lock(&self.seq);
        while seq.has_commit_in_flight() {
            seq = self.settled.wait(seq).unpoisoned();
        }
        seq
    }
}

impl Inner {
    /// Bytes committed for `tokens` tokens beyond those for `live`, by the sequence's plan.
    pub(crate) fn ahead_bytes(plan: &LayoutPlan, live: u64, tokens: u64) -> u64 {
        let at = |n: u64| plan.committed_bytes_for_tokens(n).unwrap_or(0);
        at(tokens).saturating_sub(at(live))
    }

    /// Records `cell`'s bytes ahead of its live end as `new`, keeping the global total.
    ///
    /// The difference is added exactly (two's complement, wrapping): two threads updating
    /// one cell (the decode path and the worker) may add their differences in the other
    /// order than they swapped, and the total may be below zero for that instant; clamping
    /// it there would leave it above the cells' sum for good, and the worker would find the
    /// bound reached when it is not. [`headroom_total`](Self::headroom_total) reads a
    /// momentarily negative total as 0.
    pub(crate) fn set_ahead(&self, cell: &Cell, new: u64) {
        let old = cell.ahead.swap(new, Ordering::AcqRel);
        let c = &self.counters;
        let before = c
            .headroom_bytes
            .fetch_add(new.wrapping_sub(old), Ordering::AcqRel);
        if new > old {
            let total = non_negative(before.wrapping_add(new - old));
            c.peak_headroom_bytes.fetch_max(total, Ordering::AcqRel);
        }
    }

    /// Bytes committed ahead of the live ends of all sequences.
    pub(crate) fn headroom_total(&self) -> u64 {
        non_negative(self.counters.headroom_bytes.load(Ordering::Acquire))
    }

    /// Whether fewer than `headroom_tokens` tokens are committed ahead of `cell`'s live end.
    fn needs_work(&self, cell: &Cell) -> bool {
        if cell.dormant.load(Ordering::Acquire) {
            return false;
        }
        let ready = cell.ready.load(Ordering::Acquire);
        let live = cell.live.load(Ordering::Acquire);
        ready < cell.max_tokens && ready.saturating_sub(live) < self.config.headroom_tokens
    }

    /// Asks the worker for a scan now.
    pub(crate) fn kick(&self) {
        let mut q = lock(&self.queue);
        q.kick = true;
        self.wake.notify_one();
    }

    /// One worker pass over one sequence; returns whether it committed something. While it
    /// commits, this thread's grants do not reclaim other sequences' headroom (see
    /// [`WorkerCommit`]).
    fn precommit(&self, cell: &Cell) -> bool {
        let _worker = WorkerCommit::enter();
        let live = cell.live.load(Ordering::Acquire);
        let target = live
            .saturating_add(self.config.headroom_tokens.saturating_mul(2))
            .min(cell.max_tokens);
        if cell.ready.load(Ordering::Acquire) >= target {
            return false;
        }
        let seq = cell.lock_settled();
        let have = seq.committed_tokens();
        if have >= target || cell.dormant.load(Ordering::Acquire) {
            return false;
        }
        let extra = Inner::ahead_bytes(&cell.plan, have.max(live), target);
        let total = self.headroom_total();
        if total.saturating_add(extra) > self.config.max_headroom_bytes {
            self.counters
                .headroom_capped
                .fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let grown = self.grown_target(cell, (have, live, target), total);
        drop(seq);
        let span = tracing::debug_span!("kv.precommit", live, target, grown);
        let _e = span.enter();
        let mut asked = grown;
        let mut result = Inner::commit_unlocked(cell, grown);
        let fallback = live
            .saturating_add(self.config.headroom_tokens)
            .min(cell.max_tokens);
        for smaller in [target, fallback] {
            if matches!(&result, Err(e) if refused(e)) && smaller > have && smaller < asked {
                // Refused whole, for now or for good (a sequence may not hold its growth
                // within the budget at all): ask for less (the headroom without growth,
                // then the smaller headroom).
                asked = smaller;
                result = Inner::commit_unlocked(cell, smaller);
            }
        }
        match result {
            Ok((bytes, committed)) => {
                let live_now = cell.live.load(Ordering::SeqCst);
                self.set_ahead(cell, Inner::ahead_bytes(&cell.plan, live_now, committed));
                if bytes > 0 {
                    self.counters
                        .background_commits
                        .fetch_add(1, Ordering::Relaxed);
                }
                bytes > 0
            }
            Err(e) => {
                if refused(&e) {
                    self.counters
                        .background_refused
                        .fetch_add(1, Ordering::Relaxed);
                } else {
                    self.counters
                        .background_failures
                        .fetch_add(1, Ordering::Relaxed);
                }
                tracing::debug!(error = %e, "pre-commit failed; rolled back, the decode path will commit inline");
                *lock(&self.last_error) = Some(e);
                false
            }
        }
    }

    /// Commits `cell`'s first `target` tokens with the sequence's lock held only to begin and
    /// to finish: the driver calls run unlocked, so the decode thread's writes and reads never
    /// wait behind them. Returns the bytes committed and the committed count, published.
    fn commit_unlocked(cell: &Cell, target: u64) -> Result<(u64, u64), KvCacheError> {
        let job = {
            let mut seq = cell.lock_settled();
            // Released meanwhile (the release set this under the same lock): nothing to grow.
            if cell.dormant.load(Ordering::Acquire) {
                return Ok((0, seq.committed_tokens()));
            }
            seq.begin_ensure(target)
        };
        let mut job = match job {
            Ok(Some(job)) => job,
            Ok(None) => {
                let seq = lock(&cell.seq);
                let committed = seq.committed_tokens();
                cell.ready.store(committed, Ordering::SeqCst);
                return Ok((0, committed));
            }
            Err(e) => return Err(e),
        };
        job.run();
        let mut seq = lock(&cell.seq);
        let result = seq.finish_ensure(job);
        let committed = seq.committed_tokens();
        cell.ready.store(committed, Ordering::SeqCst);
        drop(seq);
        cell.settled.notify_all();
        result.map(|bytes| (bytes, committed))
    }

    fn run_worker(self: Arc<Self>) {
        loop {
            {
                let mut q = lock(&self.queue);
                if !q.kick && !q.shutdown {
                    q = self
                        .wake
                        .wait_timeout(q, self.config.poll_interval)
                        .unpoisoned()
                        .0;
                }
                if q.shutdown {
                    self.idle.notify_all();
                    return;
                }
                q.kick = false;
            }
            let cells: Vec<Arc<Cell>> = {
                let mut cells = lock(&self.cells);
                cells.retain(|w| w.strong_count() > 0);
                cells.iter().filter_map(Weak::upgrade).collect()
            };
            let mut worked = false;
            for cell in &cells {
                if self.needs_work(cell) {
                    worked |= self.precommit(cell);
                }
            }
            drop(cells);
            let mut q = lock(&self.queue);
            q.scans = q.scans.wrapping_add(1);
            q.last_scan_worked = worked;
            self.idle.notify_all();
        }
    }
}

/// Whether the governor (or the manager's never-fits check) refused a commit, as opposed to
/// the driver failing it: a refused headroom is not a fault, a smaller one may still fit.
fn refused(e: &KvCacheError) -> bool {
    e.is_retryable() || e.never_fits().is_some()
}

thread_local! {
    /// Set while this thread is the pre-commit worker committing ahead.
    static IN_WORKER_COMMIT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the current thread as committing headroom until dropped. A grant the worker asks for
/// must not be paid for by shrinking another sequence's headroom: that would only move
/// headroom around, and the next scan would move it back (a livelock: every scan "works",
/// `wait_idle` never returns). Without the memory, the worker's commit is refused instead.
struct WorkerCommit;

impl WorkerCommit {
    fn enter() -> WorkerCommit {
        IN_WORKER_COMMIT.with(|f| f.set(true));
        WorkerCommit
    }

    fn active() -> bool {
        IN_WORKER_COMMIT.with(|f| f.get())
    }
}

impl Drop for WorkerCommit {
    fn drop(&mut self) {
        IN_WORKER_COMMIT.with(|f| f.set(false));
    }
}

/// The background pre-committer of one manager (see the module docs).
pub struct Precommitter {
    inner: Arc<Inner>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Precommitter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Precommitter")
            .field("config", &self.inner.config)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Precommitter {
    /// Starts the worker for sequences of `vm` and registers with its governor as a
    /// reclaimer (pre-committed windows are given back first under pressure).
    pub fn start(
        vm: &VirtualMemory,
        config: PrecommitConfig,
    ) -> Result<Precommitter, KvCacheError> {
        let inner = Arc::new(Inner {
            config,
            vm: vm.clone(),
            queue: Mutex::new(Queue {
                kick: false,
                scans: 0,
                last_scan_worked: false,
                shutdown: false,
            }),
            wake: Condvar::new(),
            idle: Condvar::new(),
            cells: Mutex::new(Vec::new()),
            grow_ahead: AtomicU64::new(0),
            counters: Counters::default(),
            last_error: Mutex::new(None),
        });
        let reclaimer: Arc<dyn Reclaimer> = inner.clone();
        vm.governor().register_reclaimer(Arc::downgrade(&reclaimer));
        let worker_inner = Arc::clone(&inner);
        let worker = spawn_worker("kvvm-precommit", move || worker_inner.run_worker())?;
        Ok(Precommitter {
            inner,
            worker: Mutex::new(Some(worker)),
        })
    }

    /// The configuration.
    pub fn config(&self) -> PrecommitConfig {
        self.inner.config
    }

    /// Hands `sequence` to the pre-committer; its windows are committed ahead from now on.
    /// The tokens it has committed already count as live (in use).
    pub fn attach(&self, sequence: SequenceKv) -> PrecommittedSequence {
        let ready = sequence.committed_tokens();
        let max_tokens = sequence.max_tokens();
        let plan = *sequence.plan();
        let cell = Arc::new(Cell {
            plan,
            seq: Mutex::new(sequence),
            settled: Condvar::new(),
            ready: AtomicU64::new(ready),
            // What is committed at attach time (a prompt) counts as in use.
            live: AtomicU64::new(ready),
            dormant: AtomicBool::new(false),
            ahead: AtomicU64::new(0),
            max_tokens,
        });
        lock(&self.inner.cells).push(Arc::downgrade(&cell));
        self.inner.kick();
        PrecommittedSequence {
            cell,
            inner: Arc::clone(&self.inner),
        }
    }

    /// Lets each sequence hold up to `bytes` ahead beyond its headroom, so that the worker's
    /// commits are larger buddy-aligned handles (fewer mappings: the driver's cost is per
    /// mapping), always within `max_headroom_bytes` over all sequences. 0 (the default): the
    /// worker commits what the headroom asks. Give `max_headroom_bytes` at least `sequences x
    /// (headroom + bytes)`, or sequences that grow first take the room that later ones need
    /// for their headroom (those then commit inline until the first have used theirs).
    pub fn set_grow_ahead_bytes(&self, bytes: u64) {
        self.inner.grow_ahead.store(bytes, Ordering::Relaxed);
        self.inner.kick();
    }

    /// The room to grow set by [`set_grow_ahead_bytes`](Self::set_grow_ahead_bytes).
    pub fn grow_ahead_bytes(&self) -> u64 {
        self.inner.grow_ahead.load(Ordering::Relaxed)
    }

    /// The counters.
    pub fn stats(&self) -> PrecommitStats {
        let c = &self.inner.counters;
        PrecommitStats {
            ready: c.ready.load(Ordering::Relaxed),
            inline_commits: c.inline_commits.load(Ordering::Relaxed),
            background_commits: c.background_commits.load(Ordering::Relaxed),
            background_refused: c.background_refused.load(Ordering::Relaxed),
            background_failures: c.background_failures.load(Ordering::Relaxed),
            headroom_capped: c.headroom_capped.load(Ordering::Relaxed),
            headroom_bytes: self.inner.headroom_total(),
            peak_headroom_bytes: c.peak_headroom_bytes.load(Ordering::Acquire),
            reclaimed_bytes: c.reclaimed_bytes.load(Ordering::Relaxed),
        }
    }

    /// The last error the worker (or a reclaim) met, taken out.
    pub fn last_error(&self) -> Option<KvCacheError> {
        lock(&self.inner.last_error).take()
    }

    /// Blocks until a full scan of the worker, started after this call, found nothing to
    /// commit (for tests and orderly measurements). Returns at once after shutdown.
    pub fn wait_idle(&self) {
        let mut q = lock(&self.inner.queue);
        loop {
            if q.shutdown {
                return;
            }
            // A scan in flight may have started before the call: wait for two.
            let start = q.scans;
            q.kick = true;
            self.inner.wake.notify_one();
            while q.scans.wrapping_sub(start) < 2 && !q.shutdown {
                q = self.inner.idle.wait(q).unpoisoned();
            }
            if !q.last_scan_worked {
                return;
            }
        }
    }

    /// Stops the worker and joins it. Sequences keep working (every `ensure_tokens` past the
    /// committed tokens then commits inline) and release everything when dropped.
    pub fn shutdown(&self) {
        {
            let mut q = lock(&self.inner.queue);
            q.shutdown = true;
            self.inner.wake.notify_all();
            self.inner.idle.notify_all();
        }
        if let Some(worker) = lock(&self.worker).take() {
            if worker.join().is_err() {
                tracing::error!("the pre-commit worker panicked");
            }
        }
    }
}

impl Drop for Precommitter {
    fn drop(&mut self) {
        self.shutdown();
    }
}
