//! `kvvm.HostTier` and `kvvm.SwappedKv`: a sequence's KV moved to page-locked host memory
//! (billed to the manager's host budget) and back into the same addresses, instead of being
//! given up and computed again. The steps of a swap are `Sequence` methods (`sequence.rs`
//! calls the functions here): `swap_out` (copies queued), `finish_swap_out` (the sequence's
//! memory given back), `swap_in` (committed again, copies queued), `finish_swap_in`.

use kvvm::hal::sync::Unpoison;
use std::sync::{Arc, Mutex, MutexGuard};

use kvvm::hal::StreamHandle;
use kvvm::kv::{HostTier as KvHostTier, HostTierConfig, KvCacheError, SwappedKv as KvSwapped};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::cell::{Busy, SeqCell};
use crate::count::Count;
use crate::errors;
use crate::manager::Manager;
use crate::views::unless_viewed;

/// Page-locked host memory for one manager's KV windows, under its host budget
/// (``Manager(host_budget_bytes=...)``). Copies run on the backend's own copy stream, which
/// overlaps the work of the compute streams.
///
/// Args:
///     manager: the manager whose windows it holds.
///     slab_windows: windows of one page-locked allocation at least (pinning is slow: a
///         swap reuses the chunks of earlier ones).
///     keep_pooled_bytes: free page-locked bytes kept after a swap gives its chunks back
///         (None: all, until the governor asks for the host's bytes).
///     max_copy_bytes: the most bytes one copy moves (whole windows, one at least; default
///         64 MiB; None: a run of adjacent windows in one copy however long). Copies of a
///         bounded size slow a decode running beside them less than one long copy.
///
/// Raises UnavailableError (a backend without host copies) or DriverError.
#[pyclass(frozen, module = "kvvm._native")]
pub struct HostTier {
    pub(crate) tier: Arc<KvHostTier>,
    manager: Py<Manager>,
}

#[pymethods]
impl HostTier {
    #[new]
    #[pyo3(
        signature = (
            manager,
            slab_windows = 16,
            keep_pooled_bytes = None,
            max_copy_bytes = Some(Count(kvvm::kv::DEFAULT_MAX_COPY_BYTES)),
        ),
        text_signature = "(manager, slab_windows=16, keep_pooled_bytes=None, max_copy_bytes=67108864)"
    )]
    fn new(
        py: Python<'_>,
        manager: Bound<'_, Manager>,
        slab_windows: u64,
        keep_pooled_bytes: Option<Count>,
        max_copy_bytes: Option<Count>,
    ) -> PyResult<Self> {
        let config = HostTierConfig::default()
            .slab_windows(slab_windows)
            .keep_pooled_bytes(keep_pooled_bytes.map(|c| c.0))
            .max_copy_bytes(max_copy_bytes.map(|c| c.0));
        let vm = manager.get().state.vm.clone();
        let tier = py
            .detach(move || KvHostTier::new(&vm, config))
            .map_err(|e| errors::kv(py, &e))?;
        Ok(HostTier {
            tier,
            manager: manager.unbind(),
        })
    }

    /// Bytes of one chunk: the manager's granule (a window).
    #[getter]
    fn chunk_bytes(&self) -> u64 {
        self.tier.chunk_bytes()
    }

    /// The manager it belongs to.
    #[getter]
    fn manager(&self, py: Python<'_>) -> Py<Manager> {
        self.manager.clone_ref(py)
    }

    /// Allocates page-locked memory until at least `bytes` of it are free (an engine does
    /// it at start, off the path of a swap); returns the bytes allocated. Raises
    /// BackpressureError or NeverFitsError (the host budget), DriverError.
    fn prewarm(&self, py: Python<'_>, bytes: Count) -> PyResult<u64> {
        let tier = Arc::clone(&self.tier);
        py.detach(move || tier.prewarm(bytes.0))
            .map_err(|e| errors::kv(py, &e))
    }

    /// Frees idle page-locked allocations until at most `keep_bytes` free bytes are left;
    /// returns the bytes given back to the host budget.
    #[pyo3(signature = (keep_bytes = 0))]
    fn trim(&self, py: Python<'_>, keep_bytes: u64) -> u64 {
        let tier = Arc::clone(&self.tier);
        py.detach(move || tier.trim(keep_bytes))
    }

    /// What the tier holds and did: ``chunk_bytes``, ``slabs``, ``held_bytes`` (windows on
    /// the host), ``pooled_bytes`` (free), ``idle_bytes``, ``quarantined_bytes``,
    /// ``swaps_out``, ``swaps_in``, ``bytes_out``, ``bytes_in``, ``failed``.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.tier.stats();
        crate::dict::counters(
            py,
            &[
                ("chunk_bytes", s.chunk_bytes),
                ("slabs", s.slabs),
                ("held_bytes", s.held_bytes),
                ("pooled_bytes", s.pooled_bytes),
                ("idle_bytes", s.idle_bytes),
                ("quarantined_bytes", s.quarantined_bytes),
                ("swaps_out", s.swaps_out),
                ("swaps_in", s.swaps_in),
                ("bytes_out", s.bytes_out),
                ("bytes_in", s.bytes_in),
                ("failed", s.failed),
            ],
        )
    }

    fn __repr__(&self) -> String {
        let s = self.tier.stats();
        format!(
            "HostTier(chunk_bytes={}, held_bytes={}, pooled_bytes={}, swaps_out={}, swaps_in={})",
            s.chunk_bytes, s.held_bytes, s.pooled_bytes, s.swaps_out, s.swaps_in
        )
    }
}

/// A sequence's tokens on their way to the host tier, there, or on their way back
/// (``Sequence.swap_out`` makes one). ``phase`` is ``"copying_out"``, ``"on_host"``,
/// ``"copying_in"``, ``"done"`` or ``"failed"`` (the host copy is gone: the request is
/// computed again). Dropping it waits for copies in flight and gives its host memory back.
#[pyclass(frozen, module = "kvvm._native")]
pub struct SwappedKv {
    swap: Mutex<KvSwapped>,
}

impl SwappedKv {
    pub(crate) fn lock(&self) -> MutexGuard<'_, KvSwapped> {
        self.swap.lock().unpoisoned()
    }
}

#[pymethods]
impl SwappedKv {
    /// Where it is (see the class).
    #[getter]
    fn phase(&self) -> &'static str {
        self.lock().phase().as_str()
    }

    /// Tokens it holds (the sequence's first ``tokens``).
    #[getter]
    fn tokens(&self) -> u64 {
        self.lock().tokens()
    }

    /// Bytes of host memory it holds (0 once done or failed).
    #[getter]
    fn bytes(&self) -> u64 {
        self.lock().bytes()
    }

    /// Base address of the sequence it came from (or went back into).
    #[getter]
    fn address(&self) -> u64 {
        self.lock().address().0
    }

    /// Copies queued (adjacent windows move in one).
    #[getter]
    fn copies(&self) -> usize {
        self.lock().copies()
    }

    /// Whether the copies of the current phase are done, without waiting (a failed copy
    /// raises: finishing the phase then fails the swap).
    fn is_done(&self, py: Python<'_>) -> PyResult<bool> {
        self.lock().is_done().map_err(|e| errors::kv(py, &e))
    }

    fn __repr__(&self) -> String {
        let s = self.lock();
        format!(
            "SwappedKv(phase={:?}, tokens={}, bytes={})",
            s.phase().as_str(),
            s.tokens(),
            s.bytes()
        )
    }
}

/// The stream the copies out wait for: `after` (a torch stream), or the device synchronized
/// first (None).
fn after_arg(
    py: Python<'_>,
    cell: &SeqCell,
    after: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<StreamHandle>> {
    match after {
        Some(s) if !s.is_none() => Ok(Some(crate::store::stream_arg(py, Some(s))?)),
        _ => {
            let state = Arc::clone(&cell.manager);
            py.detach(move || state.synchronize())
                .map_err(|e| errors::kv(py, &KvCacheError::Backend(e)))?;
            Ok(None)
        }
    }
}

/// `Sequence.swap_out`: queues the copies of the first `tokens` tokens to `tier`.
pub(crate) fn swap_out(
    py: Python<'_>,
    cell: &Arc<SeqCell>,
    tier: &HostTier,
    tokens: u64,
    after: Option<&Bound<'_, PyAny>>,
) -> PyResult<SwappedKv> {
    let after = after_arg(py, cell, after)?;
    let (c, t) = (Arc::clone(cell), Arc::clone(&tier.tier));
    let swap = py
        .detach(move || c.with(|s| s.swap_out(&t, tokens, after)))
        .map_err(|e| errors::kv(py, &e))?;
    Ok(SwappedKv {
        swap: Mutex::new(swap),
    })
}

/// `Sequence.finish_swap_out`: waits for the copies, then releases the sequence (refused
/// while views of it live).
pub(crate) fn finish_swap_out(
    py: Python<'_>,
    cell: &Arc<SeqCell>,
    swap: &Bound<'_, SwappedKv>,
) -> PyResult<u64> {
    swap_step(py, cell, swap, "finish a swap out", |c, s| {
        c.swap_releasing(|q| q.finish_swap_out(s))
    })
}

/// `Sequence.swap_in`: commits the sequence again (an admission: it must be empty) and
/// queues the copies back.
pub(crate) fn swap_in(
    py: Python<'_>,
    cell: &Arc<SeqCell>,
    swap: &Bound<'_, SwappedKv>,
) -> PyResult<()> {
    swap_step(py, cell, swap, "swap in", |c, s| {
        c.admission(|q| q.swap_in(s))
    })
}

/// `Sequence.finish_swap_in`: waits for the copies back; returns the bytes copied. A failed
/// copy releases the sequence, so it is refused while views of it live, as a release is.
pub(crate) fn finish_swap_in(
    py: Python<'_>,
    cell: &Arc<SeqCell>,
    swap: &Bound<'_, SwappedKv>,
) -> PyResult<u64> {
    swap_step(py, cell, swap, "finish a swap in", |c, s| {
        c.swap_releasing(|q| q.finish_swap_in(s))
    })
}

/// One step of a swap after `swap_out`, run with the GIL released: `step` gets the sequence's
/// cell and the swap's state. A sequence busy with views or an unmap is refused naming `what`;
/// a failed step raises its kv error.
fn swap_step<R: Send>(
    py: Python<'_>,
    cell: &Arc<SeqCell>,
    swap: &Bound<'_, SwappedKv>,
    what: &str,
    step: impl FnOnce(&SeqCell, &mut KvSwapped) -> Result<Result<R, KvCacheError>, Busy> + Send,
) -> PyResult<R> {
    let (c, s) = (Arc::clone(cell), swap.clone().unbind());
    unless_viewed(py, std::slice::from_ref(cell), what, move || {
        step(&c, &mut s.get().lock())
    })
}
