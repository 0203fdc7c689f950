//! [`TensorParallelSequence`]: one request's KV cache sharded over the ranks of a
//! tensor-parallel group (one [`SequenceKv`] per device, each holding its share of the heads),
//! grown, shrunk and released as one.
//!
//! Every rank's cache grows by the same tokens at the same step. [`ensure_tokens`] is one
//! transaction over all of them: each rank begins an [`EnsureJob`] (its windows are chosen and
//! marked), every job runs (on one thread per rank by default: the ranks' drivers work in
//! parallel), and only when every rank committed are the jobs finished. If any rank fails, the
//! jobs that succeeded are undone ([`SequenceKv::abort_ensure`]: recorded, then exactly their
//! windows released; one whose unmap fails stays in that rank's books), the failed one is
//! finished so that whatever its rollback left mapped stays recorded, and every rank's
//! committed count is what it was: all ranks or none.
//! Each rank's governor charge is its own device's.
//!
//! Growth ahead of need is the same transaction with a larger count
//! (`ensure_tokens(live + headroom)`); the background [`Precommitter`](crate::precommit::Precommitter)
//! works on single sequences.
//!
//! [`ensure_tokens`]: TensorParallelSequence::ensure_tokens

pub(crate) mod precommit;

use crate::error::KvCacheError;
use crate::sequence::{EnsureJob, SequenceKv};

/// A tensor-parallel commit begun by [`TensorParallelSequence::begin_ensure`]: every rank's
/// [`EnsureJob`]. Run it with no lock held, then hand it back to
/// [`TensorParallelSequence::finish_ensure`]. Dropped unfinished, each rank's job undoes itself.
#[derive(Debug)]
pub struct TensorParallelJob {
    jobs: Vec<Option<EnsureJob>>,
    before: Vec<u64>,
    parallel: bool,
}

impl TensorParallelJob {
    /// Runs every rank's driver calls, on one thread per rank when the group is parallel.
    pub fn run(&mut self) {
        if self.parallel {
            std::thread::scope(|s| {
                for job in self.jobs.iter_mut().flatten() {
                    s.spawn(move || job.run());
                }
            });
        } else {
            for job in self.jobs.iter_mut().flatten() {
                job.run();
            }
        }
    }
}

/// A request's KV cache over the ranks of a tensor-parallel group (see the module docs).
#[derive(Debug)]
pub struct TensorParallelSequence {
    ranks: Vec<SequenceKv>,
    parallel: bool,
}

impl TensorParallelSequence {
    /// The group of `ranks`, one sequence per device, all of the same maximum length.
    ///
    /// Errors: [`KvCacheError::PlanMismatch`] when there is no rank, two ranks share a device,
    /// or their maximum lengths differ.
    pub fn new(ranks: Vec<SequenceKv>) -> Result<TensorParallelSequence, KvCacheError> {
        let mismatch = |reason: String| Err(KvCacheError::PlanMismatch { reason });
        let Some(first) = ranks.first() else {
            return mismatch("a tensor-parallel sequence needs at least one rank".to_owned());
        };
        let max = first.max_tokens();
        for (i, r) in ranks.iter().enumerate() {
            if r.max_tokens() != max {
                return mismatch(format!(
                    "rank {i} holds {} tokens at most, rank 0 {max}",
                    r.max_tokens()
                ));
            }
            if ranks[..i]
                .iter()
                .any(|o| o.vm().device() == r.vm().device())
            {
                return mismatch(format!(
                    "rank {i} is on {}, like an earlier rank",
                    r.vm().device()
                ));
            }
        }
        let parallel = ranks.len() > 1;
        Ok(TensorParallelSequence { ranks, parallel })
    }

    /// A group of no rank (what a stopped [`PrecommittedGroup`](crate::PrecommittedGroup)
    /// leaves behind).
    pub(crate) fn empty() -> TensorParallelSequence {
        TensorParallelSequence {
            ranks: Vec::new(),
            parallel: false,
        }
    }

    /// Whether the ranks' driver calls run on one thread per rank (the default with more
    /// than one rank) or one rank after the other (deterministic call order, for tests).
    #[must_use]
    pub fn with_parallel(mut self, parallel: bool) -> Self {
        self.parallel = parallel;
        self
    }

    /// The ranks, in order.
    pub fn ranks(&self) -> &[SequenceKv] {
        &self.ranks
    }

    /// The ranks, to write and read their tokens.
    pub fn ranks_mut(&mut self) -> &mut [SequenceKv] {
        &mut self.ranks
    }

    /// Gives the ranks back.
    pub fn into_ranks(self) -> Vec<SequenceKv> {
        self.ranks
    }

    /// Tokens committed on every rank.
    pub fn committed_tokens(&self) -> u64 {
        self.ranks
            .iter()
            .map(SequenceKv::committed_tokens)
            .min()
            .unwrap_or(0)
    }

    /// Makes the first `n` tokens committed on every rank, as one transaction (see the module
    /// docs). Returns the bytes committed over all ranks. On error every rank has the
    /// committed count it had, and the error is the first rank's that failed.
    pub fn ensure_tokens(&mut self, n: u64) -> Result<u64, KvCacheError> {
        let span = tracing::debug_span!("kv.tp_ensure", ranks = self.ranks.len(), tokens = n);
        let _e = span.enter();
        let Some(mut job) = self.begin_ensure(n)? else {
            return Ok(0);
        };
        job.run();
        self.finish_ensure(job)
    }

    /// Begins the transaction of [`ensure_tokens`](Self::ensure_tokens) on every rank (their
    /// windows chosen and marked; no driver call), so that a background committer can run it
    /// ([`TensorParallelJob::run`]) without holding its lock on the group and then
    /// [`finish_ensure`](Self::finish_ensure) it. `None` when every rank has the tokens.
    pub fn begin_ensure(&mut self, n: u64) -> Result<Option<TensorParallelJob>, KvCacheError> {
        let before: Vec<u64> = self
            .ranks
            .iter()
            .map(SequenceKv::committed_tokens)
            .collect();
        if before.iter().all(|&b| b >= n) {
            return Ok(None);
        }
        let mut jobs: Vec<Option<EnsureJob>> = Vec::with_capacity(self.ranks.len());
        for r in &mut self.ranks {
            match r.begin_ensure(n) {
                Ok(job) => jobs.push(job),
                Err(e) => {
                    drop(jobs);
                    self.restore(&before);
                    return Err(e);
                }
            }
        }
        if let Err(never) = self.check_fits(&jobs) {
            drop(jobs);
            self.restore(&before);
            return Err(never.into());
        }
        Ok(Some(TensorParallelJob {
            jobs,
            before,
            parallel: self.parallel,
        }))
    }

    /// Finishes a job of [`begin_ensure`](Self::begin_ensure) (running it first if it has not
    /// run): records every rank's commit when all succeeded, else undoes the ranks that
    /// succeeded and restores every rank's count (see the module docs).
    pub fn finish_ensure(&mut self, mut job: TensorParallelJob) -> Result<u64, KvCacheError> {
        if job.jobs.iter().flatten().any(|j| j.succeeded().is_none()) {
            job.run();
        }
        let TensorParallelJob { jobs, before, .. } = job;
        let all_ok = jobs.iter().flatten().all(|j| j.succeeded() == Some(true));
        if all_ok {
            let mut bytes = 0u64;
            let mut first_error = None;
            for (r, job) in self.ranks.iter_mut().zip(jobs) {
                if let Some(job) = job {
                    match r.finish_ensure(job) {
                        Ok(b) => bytes = bytes.saturating_add(b),
                        Err(e) => {
                            first_error.get_or_insert(e);
                        }
                    }
                }
            }
            return match first_error {
                None => Ok(bytes),
                Some(e) => {
                    // Recording a successful job cannot fail; if it did, promise nothing new.
                    self.restore(&before);
                    Err(e)
                }
            };
        }
        // Roll back: undo the ranks that committed (their windows released again, any that
        // cannot be unmapped kept in their books), record what the failed ones left.
        let mut first_error = None;
        let mut undo_error = None;
        for (r, job) in self.ranks.iter_mut().zip(jobs) {
            match job {
                Some(job) if job.succeeded() == Some(true) => {
                    if let Err(e) = r.abort_ensure(job) {
                        undo_error.get_or_insert(e);
                    }
                }
                Some(job) => {
                    if let Err(e) = r.finish_ensure(job) {
                        first_error.get_or_insert(e);
                    }
                }
                None => {}
            }
        }
        if let Some(e) = undo_error {
            tracing::warn!(error = %e, "undoing a rank's commit left windows mapped (recorded)");
        }
        self.restore(&before);
        tracing::debug!("tensor-parallel commit failed; every rank rolled back");
        Err(first_error.unwrap_or_else(|| KvCacheError::PlanMismatch {
            reason: "a rank's commit failed without an error".to_owned(),
        }))
    }

    /// Whether a [`TensorParallelJob`] begun on this group is not finished yet.
    pub fn has_commit_in_flight(&self) -> bool {
        self.ranks.iter().any(SequenceKv::has_commit_in_flight)
    }

    /// The most tokens every rank may hold.
    pub fn max_tokens(&self) -> u64 {
        self.ranks.first().map_or(0, SequenceKv::max_tokens)
    }

    /// The never-fits decision over the whole group, once every rank's job is begun (each
    /// rank's own device was decided when its job began): what the ranks would hold once the
    /// jobs are done, against each governor's limits, a process budget over all of its ranks'
    /// devices included. Ranks that each fit their device may together exceed a process
    /// budget for good; their grants would meet backpressure forever.
    fn check_fits(&self, jobs: &[Option<EnsureJob>]) -> Result<(), kvvm_governor::NeverFits> {
        let mut done: Vec<&kvvm_governor::Governor> = Vec::new();
        for r in &self.ranks {
            let governor = r.vm().governor();
            if done.iter().any(|g| g.same_books(governor)) {
                continue;
            }
            done.push(governor);
            let holdings: Vec<(kvvm_hal::DeviceId, u64)> = self
                .ranks
                .iter()
                .zip(jobs)
                .filter(|(o, _)| o.vm().governor().same_books(governor))
                .map(|(o, job)| {
                    let adding = job.as_ref().map_or(0, EnsureJob::bytes);
                    (o.vm().device(), o.committed_bytes().saturating_add(adding))
                })
                .collect();
            governor.check_fits_all(&holdings)?;
        }
        Ok(())
    }

    /// Every rank back to its committed count of `before` (windows stay mapped).
    fn restore(&mut self, before: &[u64]) {
        for (r, &b) in self.ranks.iter_mut().zip(before) {
            r.lower_committed(b);
        }
    }

    /// [`SequenceKv::shrink_committed`] on every rank; the first error after every rank was
    /// processed. Returns the bytes unmapped over all ranks.
    pub fn shrink_committed(&mut self, n: u64) -> Result<u64, KvCacheError> {
        self.each(|r| r.shrink_committed(n))
    }

    /// [`SequenceKv::release`] on every rank; the first error after every rank was processed.
    /// Returns the bytes unmapped over all ranks.
    pub fn release(&mut self) -> Result<u64, KvCacheError> {
        self.each(SequenceKv::release)
    }

    fn each(
        &mut self,
        mut f: impl FnMut(&mut SequenceKv) -> Result<u64, KvCacheError>,
    ) -> Result<u64, KvCacheError> {
        let mut bytes = 0u64;
        let mut first_error = None;
        for r in &mut self.ranks {
            match f(r) {
                Ok(b) => bytes = bytes.saturating_add(b),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            None => Ok(bytes),
            Some(e) => Err(e),
        }
    }
}
