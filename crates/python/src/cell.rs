//! [`SeqCell`]: one sequence's KV cache as the Python objects share it, plain or handed to the
//! background pre-committer, with the count of live views that keeps its memory mapped.

use kvvm::hal::sync::Unpoison;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kvvm::kv::precommit::{Ensured, PrecommittedSequence};
use kvvm::kv::{KvCacheError, KvDtype, KvKind, LayoutPlan, SequenceKv};

use crate::manager::ManagerState;

/// Set in [`SeqCell::views`] while a release or shrink is unmapping: no view may start.
const UNMAPPING: u64 = 1 << 63;

enum Kind {
    Plain(Box<Mutex<SequenceKv>>),
    Pre(PrecommittedSequence),
}

/// What an unmap does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unmap {
    /// Unmaps everything and detaches from shared prefixes, keeping the address range.
    Release,
    /// Gives back the windows holding no byte of the first this many tokens.
    Shrink(u64),
    /// Forgets the tokens before this one (a sliding window's): the windows holding none of
    /// the later tokens are given back.
    Forget(u64),
}

/// Why a view or an unmap cannot start now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Busy {
    /// This many views are alive.
    Viewed(u64),
    /// The sequence is being unmapped by another thread.
    Unmapping,
}

/// One sequence, shared by its Python object, its batch and its views.
pub(crate) struct SeqCell {
    kind: Kind,
    pub(crate) manager: Arc<ManagerState>,
    pub(crate) plan: LayoutPlan,
    pub(crate) dtype: KvDtype,
    /// Base address of the reservation (it never changes).
    pub(crate) base: u64,
    pub(crate) max_tokens: u64,
    views: AtomicU64,
    /// The most tokens the user asked for since the last release (0: the sequence is unused,
    /// whatever the pre-committer mapped ahead).
    asked: AtomicU64,
    /// Bytes per fragment from the start that a store must not touch: the shared prefix it
    /// maps read-only, and a prefix it owns (sealed or not). Kept at or above the truth, under
    /// the sequence's lock, by every admission and unmap, so that a store checks it without
    /// taking that lock.
    protected_bytes: AtomicU64,
    /// Tokens before this one are forgotten (a sliding window's; read by views and stores
    /// without the sequence's lock). Set under the lock by every unmap.
    forgotten: AtomicU64,
}

/// What [`SeqCell::protected_bytes`] keeps for `s`: its protected shared windows, or the
/// windows of a prefix it owns, whichever reach further.
fn protected_of(s: &SequenceKv) -> u64 {
    let plan = s.plan();
    let g = plan.granule();
    let shared = s.protected_windows().saturating_mul(g);
    let owned = s
        .prefix_tokens()
        .saturating_mul(plan.fragment_bytes_per_token())
        .div_ceil(g.max(1))
        .saturating_mul(g);
    shared.max(owned)
}

impl SeqCell {
    /// Wraps `seq`; hands it to the manager's pre-committer when `precommit` and one runs.
    pub(crate) fn new(
        manager: Arc<ManagerState>,
        seq: SequenceKv,
        dtype: KvDtype,
        precommit: bool,
    ) -> SeqCell {
        let plan = *seq.plan();
        let base = seq.address().0;
        let max_tokens = seq.max_tokens();
        let kind = match (&manager.precommit, precommit) {
            (Some(p), true) => Kind::Pre(p.attach(seq)),
            _ => Kind::Plain(Box::new(Mutex::new(seq))),
        };
        SeqCell {
            kind,
            manager,
            plan,
            dtype,
            base,
            max_tokens,
            views: AtomicU64::new(0),
            asked: AtomicU64::new(0),
            protected_bytes: AtomicU64::new(0),
            forgotten: AtomicU64::new(0),
        }
    }

    /// Whether the pre-committer grows this sequence ahead of need.
    pub(crate) fn is_precommitted(&self) -> bool {
        matches!(self.kind, Kind::Pre(_))
    }

    /// Runs `f` on the sequence under its lock.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut SequenceKv) -> R) -> R {
        match &self.kind {
            Kind::Plain(m) => f(&mut m.lock().unpoisoned()),
            Kind::Pre(p) => p.with_sequence(f),
        }
    }

    /// Makes the first `n` tokens committed; returns the bytes committed by this call (0 when
    /// they were ready: for a pre-committed sequence, with no lock and no driver call).
    pub(crate) fn ensure(&self, n: u64) -> Result<u64, KvCacheError> {
        self.asked.fetch_max(n, Ordering::AcqRel);
        match &self.kind {
            Kind::Plain(m) => m.lock().unpoisoned().ensure_tokens(n),
            Kind::Pre(p) => p.ensure_tokens(n).map(|e| match e {
                Ensured::Ready => 0,
                Ensured::Inline(b) => b,
            }),
        }
    }

    /// The most tokens the user asked for (with `ensure`) since the last release: what the
    /// pre-committer keeps mapped whatever it reclaims.
    pub(crate) fn claimed_tokens(&self) -> u64 {
        self.asked.load(Ordering::Acquire)
    }

    /// Tokens that stay mapped while a view or a store holds the sequence: the committed
    /// tokens, and for a pre-committed sequence only those the user claimed (the pre-committer
    /// may give back what it mapped ahead of the claims at any time, without a device
    /// synchronization).
    pub(crate) fn usable_tokens(&self) -> u64 {
        let committed = self.committed_tokens();
        if self.is_precommitted() {
            committed.min(self.claimed_tokens())
        } else {
            committed
        }
    }

    /// Records what a store or a view must not reach of `s`, its protected bytes and its
    /// forgotten tokens (called under its lock, after anything that may have changed them).
    fn refresh_protected(&self, s: &SequenceKv) {
        self.protected_bytes
            .store(protected_of(s), Ordering::Release);
        self.forgotten
            .store(s.forgotten_tokens(), Ordering::Release);
    }

    /// Bytes per fragment from the start that a store must not write (see the field).
    pub(crate) fn protected_bytes(&self) -> u64 {
        self.protected_bytes.load(Ordering::Acquire)
    }

    /// Tokens committed now.
    pub(crate) fn committed_tokens(&self) -> u64 {
        match &self.kind {
            Kind::Plain(_) => self.with(|s| s.committed_tokens()),
            Kind::Pre(p) => p.committed_tokens(),
        }
    }

    /// Runs an admission `f` (attach a prefix, own one, admit from a prefix cache) on a
    /// sequence that must be empty. A pre-committed sequence the user never used may hold
    /// windows the worker committed ahead: they are released first, under the same lock, so
    /// that the worker cannot commit in between. Afterwards what `f` mapped counts as in use.
    ///
    /// Views and stores are blocked meanwhile, and the admission is refused ([`Busy`]) while
    /// one is alive: what it unmaps is never under a view. Whether the sequence is unused is
    /// read under the lock, after the block: a claim made before it is seen.
    pub(crate) fn admission<R>(
        &self,
        f: impl FnOnce(&mut SequenceKv) -> Result<R, KvCacheError>,
    ) -> Result<Result<R, KvCacheError>, Busy> {
        self.begin_unmap()?;
        let out = self.with(|s| {
            let unused = self.is_precommitted() && self.asked.load(Ordering::Acquire) == 0;
            if unused && !s.is_empty() && s.written_tokens() == 0 && s.prefix_tokens() == 0 {
                if let Err(e) = s.release() {
                    self.refresh_protected(s);
                    return Err(e);
                }
            }
            let r = f(s);
            self.refresh_protected(s);
            r
        });
        self.end_unmap();
        Ok(out.and_then(|r| {
            let committed = self.committed_tokens();
            self.ensure(committed)?;
            Ok(r)
        }))
    }

    /// Runs `f` (which may hand the sequence's windows to a prefix cache, making them shared)
    /// and refreshes what a store must not write.
    pub(crate) fn publishing<R>(&self, f: impl FnOnce(&mut SequenceKv) -> R) -> R {
        self.with(|s| {
            let r = f(s);
            self.refresh_protected(s);
            r
        })
    }

    /// Counts a view of every cell of `cells`, or of none: on a cell being unmapped, the ones
    /// counted already are given back and its [`Busy`] is returned.
    pub(crate) fn view_all(cells: &[Arc<SeqCell>]) -> Result<(), Busy> {
        for (i, c) in cells.iter().enumerate() {
            if let Err(busy) = c.try_view() {
                for done in &cells[..i] {
                    done.unview();
                }
                return Err(busy);
            }
        }
        Ok(())
    }

    /// Counts a new view, unless an unmap is running.
    pub(crate) fn try_view(&self) -> Result<(), Busy> {
        self.views
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                (v & UNMAPPING == 0).then_some(v.saturating_add(1))
            })
            .map(|_| ())
            .map_err(|_| Busy::Unmapping)
    }

    /// Counts a view gone.
    pub(crate) fn unview(&self) {
        let _ = self
            .views
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some((v & UNMAPPING) | (v & !UNMAPPING).saturating_sub(1))
            });
    }

    /// Live views.
    pub(crate) fn views(&self) -> u64 {
        self.views.load(Ordering::Acquire) & !UNMAPPING
    }

    /// Runs `op` only while no view is alive, and blocks new views meanwhile. The device is
    /// synchronized first: kernels launched on the memory must be done. Returns the bytes
    /// unmapped.
    pub(crate) fn unmapping(
        self: &Arc<Self>,
        op: Unmap,
    ) -> Result<Result<u64, KvCacheError>, Busy> {
        Self::unmapping_all(std::slice::from_ref(self), op)
    }

    /// Runs `op` on every cell of `cells`, in order, only if no view of any of them is
    /// alive, with new views blocked on all of them until the last is done: all or nothing
    /// is started (a view made by another thread after a caller's check makes the whole call
    /// [`Busy`], with nothing unmapped). The device is synchronized once first. Stops at the
    /// first error (the cells before it are done). Returns the bytes unmapped in all.
    pub(crate) fn unmapping_all(
        cells: &[Arc<SeqCell>],
        op: Unmap,
    ) -> Result<Result<u64, KvCacheError>, Busy> {
        let ops = vec![op; cells.len()];
        Self::unmapping_each(cells, &ops)
    }

    /// [`unmapping_all`](Self::unmapping_all) with an operation of its own for each cell
    /// (`ops[i]` for `cells[i]`).
    pub(crate) fn unmapping_each(
        cells: &[Arc<SeqCell>],
        ops: &[Unmap],
    ) -> Result<Result<u64, KvCacheError>, Busy> {
        let Some(first) = cells.first() else {
            return Ok(Ok(0));
        };
        for (i, c) in cells.iter().enumerate() {
            if let Err(busy) = c.begin_unmap() {
                for done in &cells[..i] {
                    done.end_unmap();
                }
                return Err(busy);
            }
        }
        let out = first
            .manager
            .synchronize()
            .map_err(KvCacheError::Backend)
            .and_then(|()| {
                cells.iter().zip(ops).try_fold(0u64, |total, (c, &op)| {
                    Ok(total.saturating_add(c.unmap(op)?))
                })
            });
        for c in cells {
            c.end_unmap();
        }
        Ok(out)
    }

    /// Runs `op` (the caller blocks views). A pre-committed sequence released goes dormant:
    /// the pre-committer maps nothing ahead of it until tokens are asked for again.
    fn unmap(&self, op: Unmap) -> Result<u64, KvCacheError> {
        let result = match (&self.kind, op) {
            (Kind::Pre(p), Unmap::Release) => p.release(),
            (_, Unmap::Release) => self.with(|s| s.release()),
            (_, Unmap::Shrink(tokens)) => self.with(|s| s.shrink_committed(tokens)),
            (_, Unmap::Forget(tokens)) => self.with(|s| s.forget_tokens_before(tokens)),
        };
        self.with(|s| {
            if s.is_empty() {
                self.asked.store(0, Ordering::Release);
            }
            self.refresh_protected(s);
        });
        result
    }

    /// Runs `f`, the end of a swap step that may release the sequence (its copies waited
    /// for first), only while no view is alive, with new views blocked: what it unmaps is
    /// never under a view. No device synchronization: the copies' own event is waited for,
    /// and no step touches a sequence being swapped. A pre-committed sequence left empty
    /// goes dormant, as after a release (the worker maps nothing ahead of it).
    pub(crate) fn swap_releasing(
        &self,
        f: impl FnOnce(&mut SequenceKv) -> Result<u64, KvCacheError>,
    ) -> Result<Result<u64, KvCacheError>, Busy> {
        self.begin_unmap()?;
        // `f`, whether it left the sequence empty and the protected bytes, under one lock: a
        // pre-committed sequence left empty goes dormant before the lock is let go (the
        // worker would otherwise map windows ahead into it).
        let step = |s: &mut SequenceKv| {
            let out = f(s);
            self.refresh_protected(s);
            (out, s.is_empty())
        };
        let (out, empty) = match &self.kind {
            Kind::Plain(m) => step(&mut m.lock().unpoisoned()),
            Kind::Pre(p) => p.with_sequence_releasing(step),
        };
        if empty {
            self.asked.store(0, Ordering::Release);
        }
        self.end_unmap();
        Ok(out)
    }

    /// Tokens before this one are forgotten: a view or a store must not reach them.
    pub(crate) fn forgotten_tokens(&self) -> u64 {
        self.forgotten.load(Ordering::Acquire)
    }

    /// Marks the cell as being unmapped, if no view is alive and no other unmap runs.
    fn begin_unmap(&self) -> Result<(), Busy> {
        match self
            .views
            .compare_exchange(0, UNMAPPING, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Ok(()),
            Err(v) if v & UNMAPPING != 0 => Err(Busy::Unmapping),
            Err(v) => Err(Busy::Viewed(v)),
        }
    }

    /// Lets views start again.
    fn end_unmap(&self) {
        self.views.fetch_and(!UNMAPPING, Ordering::AcqRel);
    }

    /// Byte offset of `(layer, kv, head 0, token)` in the sequence.
    pub(crate) fn offset(&self, layer: u32, kv: KvKind, token: u64) -> Result<u64, KvCacheError> {
        Ok(self.plan.offset(layer, kv, 0, token)?)
    }
}
