//! [`CommitJob`]: a commit split in three so that its driver calls run without the caller's
//! lock on the reservation.
//!
//! A background committer (the KV layer's pre-committer) holds a sequence's lock only to
//! begin (`Reservation::begin_commit_ranges`) a job (choose and mark the windows) and to
//! finish (`Reservation::finish_commit`) it (record the blocks); the create, map and set
//! access calls of [`CommitJob::run`] happen in between, while the owner of the sequence keeps
//! writing the tokens already committed. The windows of a job are *in flight*: any other
//! commit of them is refused with [`VmmError::Busy`](crate::VmmError::Busy) until the job is
//! finished or dropped. The transaction, rollback, pool and governor are those of a commit.
//!
//! A job dropped without being finished undoes what it did: it unmaps its windows, returns the
//! handles to the pool (or releases them) and gives the bytes back. A window whose unmap fails
//! is still mapped: it is handed back to the reservation that began the job, which records it
//! again (committed, refused to any other commit as already mapped, unmapped by its next
//! release or its teardown); only when that reservation is gone is the window quarantined.

use std::sync::Arc;

use kvvm_governor::Bucket;

use crate::device::quarantine::{QuarantineEntry, QuarantineReason};
use crate::device::Source;
use crate::error::{VmmError, VmmResult};
use crate::mapping::{Commit, MappedBlock};
use crate::transaction::{Applied, Target};
use crate::windows::spans::{self, Span};

use super::left_mapped::LeftMapped;
use super::records::InFlight;
use super::Reservation;

/// A commit begun on a reservation whose driver work runs without borrowing it (see the
/// module docs). Made by `Reservation::begin_commit_ranges`.
pub struct CommitJob {
    target: Target,
    spans: Vec<Span>,
    mark: Arc<()>,
    applied: Option<Applied>,
    /// Where a window this job cannot unmap when dropped goes back to its reservation.
    left_mapped: Arc<LeftMapped>,
}

impl std::fmt::Debug for CommitJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommitJob")
            .field("base", &self.target.base)
            .field("windows", &spans::window_count(&self.spans))
            .field("ran", &self.applied.is_some())
            .finish()
    }
}

impl CommitJob {
    /// Runs the commit's driver calls (pool, grant, create, map, set access, rollback on
    /// failure). Running twice does nothing more; `Reservation::finish_commit`
    /// runs it if it has not run.
    pub fn run(&mut self) {
        if self.applied.is_none() {
            self.applied = Some(self.target.apply(&self.spans, None, None, &[]));
        }
    }

    /// Windows this job commits.
    pub fn windows(&self) -> usize {
        usize::try_from(spans::window_count(&self.spans)).unwrap_or(usize::MAX)
    }

    /// Bytes of the windows this job commits (what the reservation will hold more).
    pub fn bytes(&self) -> u64 {
        spans::window_count(&self.spans).saturating_mul(self.target.state.ctx.granule)
    }

    /// Whether [`run`](Self::run) has run.
    pub fn has_run(&self) -> bool {
        self.applied.is_some()
    }

    /// Whether the run committed every window (`None` before it ran). A job that succeeded
    /// and is dropped unfinished undoes its commit: how a transaction over several
    /// reservations rolls the others back when one fails.
    pub fn succeeded(&self) -> Option<bool> {
        self.applied.as_ref().map(|a| a.result.is_ok())
    }
}

impl Drop for CommitJob {
    fn drop(&mut self) {
        let Some(applied) = self.applied.take() else {
            return;
        };
        if applied.blocks.is_empty() {
            return;
        }
        // Run but never finished: nothing records these blocks, so undo them here.
        let st = &self.target.state;
        let ctx = &st.ctx;
        let g = ctx.granule;
        tracing::warn!(
            blocks = applied.blocks.len(),
            "commit job dropped unfinished; undoing it"
        );
        for b in applied.blocks {
            let addr = self.target.base.offset(b.offset);
            let size = b.bytes(g);
            match ctx.backend.unmap(addr, size) {
                Ok(()) => {
                    // A failed release is quarantined inside.
                    let _ = st.dispose(b.handle, size, Source::Bucket(Bucket::Committed));
                }
                Err(error) => {
                    // Still mapped: its reservation keeps it (and its bytes committed).
                    let Err(b) = self.left_mapped.hand_back(b) else {
                        tracing::warn!(%addr, %error, "undo of a dropped commit job could not unmap; the window stays with its reservation");
                        continue;
                    };
                    ctx.account(ctx.governor.transfer(
                        ctx.device,
                        Bucket::Committed,
                        Bucket::Quarantined,
                        size,
                    ));
                    let block = MappedBlock {
                        address: addr,
                        size,
                        handle: b.handle,
                        kind: b.kind,
                    };
                    ctx.quarantine.add(QuarantineEntry::mapped_block(
                        QuarantineReason::UnmapFailed,
                        block,
                        error,
                    ));
                }
            }
        }
    }
}

impl Reservation {
    /// Begins a commit of every unmapped window overlapping `ranges`, as
    /// [`commit_ranges`](Self::commit_ranges) would make it, but split so that its driver
    /// calls ([`CommitJob::run`](crate::CommitJob::run)) need no borrow of this reservation: the caller may release
    /// its lock on the reservation while they run, then [`finish_commit`](Self::finish_commit).
    /// Until then the windows are in flight (another commit of them is
    /// [`VmmError::Busy`]); one job at a time per reservation. `None` when every window is
    /// mapped. Blocks released while the job runs are not its windows; its own are recorded by
    /// `finish_commit`.
    pub fn begin_commit_ranges(&mut self, ranges: &[(u64, u64)]) -> VmmResult<Option<CommitJob>> {
        self.take_back_left_mapped();
        let spans = self.missing_spans(ranges)?;
        if spans.is_empty() {
            return Ok(None);
        }
        if let Some(f) = &self.in_flight {
            if f.mark.strong_count() > 0 {
                return Err(VmmError::Busy {
                    offset: f.spans.first().map_or(0, |s| s.offset),
                });
            }
        }
        self.check_free(&spans)?;
        let mark = Arc::new(());
        self.in_flight = Some(InFlight {
            mark: Arc::downgrade(&mark),
            spans: spans.clone(),
        });
        Ok(Some(CommitJob {
            target: self.target(),
            spans,
            mark,
            applied: None,
            left_mapped: Arc::clone(&self.left_mapped),
        }))
    }

    /// Finishes a job begun here: runs it if it has not run, records the windows it mapped
    /// (or those a failed rollback left mapped) and returns the commit's result. A job of
    /// another reservation is refused (and undone as it is dropped).
    pub fn finish_commit(&mut self, mut job: CommitJob) -> VmmResult<Commit> {
        self.take_back_left_mapped();
        let ours = self
            .in_flight
            .as_ref()
            .is_some_and(|f| std::ptr::eq(f.mark.as_ptr(), Arc::as_ptr(&job.mark)));
        if !ours {
            // Dropping the job undoes whatever it did.
            return Err(VmmError::InvalidArgument {
                reason: "the commit job was begun on another reservation".to_owned(),
            });
        }
        job.run();
        self.in_flight = None;
        let Some(applied) = job.applied.take() else {
            return Err(VmmError::InvalidArgument {
                reason: "the commit job has no outcome".to_owned(),
            });
        };
        self.insert_blocks(applied.blocks.into_iter());
        applied.result
    }

    /// Undoes a job begun here, recorded first so that a window whose unmap fails stays in
    /// this reservation's books: runs it if it has not run, then releases exactly its windows
    /// (a transaction over several reservations rolling back the parts that succeeded).
    /// Returns the bytes unmapped.
    pub fn abort_commit(&mut self, job: CommitJob) -> VmmResult<u64> {
        self.take_back_left_mapped();
        let g = self.granule();
        let windows: Vec<(u64, u64)> = job.spans.iter().map(|s| (s.offset, s.bytes(g))).collect();
        // A failed commit's result is not this call's concern: what it left is released too.
        let _ = self.finish_commit(job);
        self.release_ranges(&windows)
    }
}
