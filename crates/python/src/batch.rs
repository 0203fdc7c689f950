//! `kvvm.SequenceBatch`: sequences in the slots of one strided reservation, so that one layer's
//! K (or V) of a run of slots is one strided tensor `[batch, kv_heads, tokens, head_dim]`,
//! while each sequence still grows, shares and releases on its own.

use std::sync::Arc;

use kvvm::kv::{KvKind, SequenceKv};
use pyo3::prelude::*;

use crate::cell::{SeqCell, Unmap};
use crate::count::{Count, Dim};
use crate::errors;
use crate::geometry::PyPlan;
use crate::manager::Manager;
use crate::sequence::{max_tokens_arg, precommit_arg, Sequence};
use crate::store::{store, tokens_are_one_run, StoreRequest};
use crate::view::TensorView;
use crate::views::{kind_arg, make_slab, make_view, unless_viewed, ViewRequest};

/// A batch of sequences at a constant address stride (one slot each).
#[pyclass(frozen, module = "kvvm._native")]
pub struct SequenceBatch {
    cells: Vec<Arc<SeqCell>>,
    stride: u64,
}

impl SequenceBatch {
    fn slots(
        &self,
        py: Python<'_>,
        first: usize,
        count: Option<usize>,
    ) -> PyResult<&[Arc<SeqCell>]> {
        let n = self.cells.len();
        let count = count.unwrap_or(n.saturating_sub(first));
        let end = first.checked_add(count).filter(|&e| e <= n && count > 0);
        match end {
            Some(end) => Ok(&self.cells[first..end]),
            None => Err(errors::invalid(
                py,
                format!(
                    "slots {first}..{first}+{count} are not a non-empty range of the batch's {n}"
                ),
            )),
        }
    }
}

/// Makes the first `targets[i]` tokens of `slots[i]` committed; a target of 0 asks nothing of
/// its slot (a released slot stays as it is: a pre-committed one is not woken). The decode
/// path (every slot has its tokens already, committed ahead by the pre-committer) cannot
/// block, so the GIL is kept (releasing and taking it back costs more than the check);
/// otherwise the commits run without it.
fn ensure_slots(py: Python<'_>, slots: &[Arc<SeqCell>], targets: Vec<u64>) -> PyResult<u64> {
    let wanted: Vec<(Arc<SeqCell>, u64)> = slots
        .iter()
        .zip(targets)
        .filter(|&(_, n)| n > 0)
        .map(|(c, n)| (Arc::clone(c), n))
        .collect();
    if wanted.iter().all(|(c, n)| c.committed_tokens() >= *n) {
        for (c, n) in &wanted {
            c.ensure(*n).map_err(|e| errors::kv(py, &e))?;
        }
        return Ok(0);
    }
    py.detach(move || {
        let mut bytes = 0u64;
        for (c, n) in &wanted {
            bytes = bytes.saturating_add(c.ensure(*n)?);
        }
        Ok(bytes)
    })
    .map_err(|e: kvvm::kv::KvCacheError| errors::kv(py, &e))
}

/// A batch's reservation that failed: the driver running out of memory there ran out of
/// address space (a reservation holds no memory), and the message says so with the sizes.
fn address_space_error(
    py: Python<'_>,
    e: &kvvm::kv::KvCacheError,
    slots: u64,
    span: Option<u64>,
) -> PyErr {
    let oom = match e {
        kvvm::kv::KvCacheError::Vmm(kvvm::vmm::VmmError::Backend(b)) => Some(b),
        kvvm::kv::KvCacheError::Backend(b) => Some(b),
        _ => None,
    }
    .filter(|b| b.kind == kvvm::hal::ErrorKind::OutOfMemory);
    match (oom, span) {
        (Some(b), span) => errors::raise(
            py,
            errors::ErrorClass::OutOfMemory,
            format!(
                "out of address space, not memory: {slots} slots need {} bytes of address \
                 space in one reservation and the driver refused it ({b}); use fewer slots \
                 or a smaller max_tokens",
                span.map_or_else(|| "more than 2^64".to_owned(), |n| n.to_string())
            ),
            &[
                ("op", errors::Attr::Str(b.op.as_str().to_owned())),
                ("kind", errors::Attr::Str(b.kind.as_str().to_owned())),
                ("code", errors::Attr::Int(b.code.unsigned_abs())),
                ("code_name", errors::Attr::Str(b.code_name.clone())),
            ],
        ),
        _ => errors::kv(py, e),
    }
}

#[pymethods]
impl SequenceBatch {
    /// Reserves `slots` sequences of at most `max_tokens` tokens (default: the geometry's)
    /// under `plan` in one address range, at a stride of ``plan.reservation_bytes``. With
    /// `window_handles`, every commit maps one handle per window, so that
    /// :meth:`forget_each` gives back each window behind a sliding window on its own.
    #[new]
    #[pyo3(signature = (manager, plan, slots, max_tokens = None, precommit = false,
        window_handles = false))]
    fn new(
        py: Python<'_>,
        manager: &Manager,
        plan: &PyPlan,
        slots: Count,
        max_tokens: Option<Count>,
        precommit: bool,
        window_handles: bool,
    ) -> PyResult<Self> {
        let slots = slots.0;
        let max_tokens = max_tokens_arg(py, plan, max_tokens.map(|c| c.0))?;
        if slots == 0 {
            return Err(errors::invalid(py, "a batch needs at least one slot"));
        }
        precommit_arg(py, manager, precommit)?;
        let span = slots.checked_mul(plan.plan.reservation_bytes());
        let state = Arc::clone(&manager.state);
        let p = plan.plan;
        let vm = state.vm.clone();
        let seqs = py
            .detach(move || -> Result<Vec<SequenceKv>, kvvm::kv::KvCacheError> {
                vm.reserve_strided(slots, p.reservation_bytes())?
                    .into_iter()
                    .map(|r| {
                        let mut s = SequenceKv::in_reservation(&vm, &p, max_tokens, r)?;
                        if window_handles {
                            s.use_window_handles();
                        }
                        Ok(s)
                    })
                    .collect()
            })
            .map_err(|e| address_space_error(py, &e, slots, span))?;
        let stride = match (seqs.first(), seqs.get(1)) {
            (Some(a), Some(b)) => b.address().0.saturating_sub(a.address().0),
            _ => p.reservation_bytes(),
        };
        let cells = seqs
            .into_iter()
            .map(|s| Arc::new(SeqCell::new(Arc::clone(&state), s, plan.dtype, precommit)))
            .collect();
        Ok(SequenceBatch { cells, stride })
    }

    fn __len__(&self) -> usize {
        self.cells.len()
    }

    /// The sequence in slot `index`.
    fn __getitem__(&self, py: Python<'_>, index: isize) -> PyResult<Sequence> {
        let n = self.cells.len() as isize;
        let i = if index < 0 { index + n } else { index };
        if i < 0 || i >= n {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "slot {index} out of range for a batch of {n}"
            )));
        }
        let _ = py;
        Ok(Sequence {
            cell: Arc::clone(&self.cells[i as usize]),
        })
    }

    /// Bytes between consecutive slots.
    #[getter]
    fn slot_stride(&self) -> u64 {
        self.stride
    }

    /// Bytes mapped in all slots (shared windows counted in every slot that maps them).
    #[getter]
    fn committed_bytes(&self) -> u64 {
        self.cells
            .iter()
            .map(|c| c.with(|s| s.committed_bytes()))
            .sum()
    }

    /// Physical bytes the slots hold on their own (shared prefixes excluded).
    #[getter]
    fn owned_bytes(&self) -> u64 {
        self.cells
            .iter()
            .map(|c| c.with(|s| s.additional_owned_bytes()))
            .sum()
    }

    /// Makes the first `tokens` tokens of slots `first..first+count` (default: all)
    /// committed, slot by slot; returns the bytes committed by this call. On an error the
    /// slots done so far keep their commits (each slot's commit is its own transaction).
    #[pyo3(signature = (tokens, first = 0, count = None))]
    fn ensure(
        &self,
        py: Python<'_>,
        tokens: Count,
        first: usize,
        count: Option<usize>,
    ) -> PyResult<u64> {
        let slots = self.slots(py, first, count)?;
        ensure_slots(py, slots, vec![tokens.0; slots.len()])
    }

    /// Makes the first ``tokens[i]`` tokens of slot ``first + i`` committed, for every ``i``
    /// (a ragged batch's step in one call); returns the bytes committed by this call. Errors
    /// as :meth:`ensure`.
    #[pyo3(signature = (tokens, first = 0))]
    fn ensure_each(&self, py: Python<'_>, tokens: Vec<Count>, first: usize) -> PyResult<u64> {
        let slots = self.slots(py, first, Some(tokens.len()))?;
        ensure_slots(py, slots, tokens.into_iter().map(|c| c.0).collect())
    }

    /// Forgets the tokens before ``tokens[i]`` in slot ``first + i``, for every ``i`` (0: that
    /// slot is left alone): a sliding window's oldest tokens, never read again. The windows
    /// holding none of the later tokens are unmapped (the pool takes them back); reading or
    /// writing a forgotten token is refused afterwards. Returns the bytes unmapped. Refused,
    /// with nothing unmapped, while a view of any of those slots is alive (ViewsAliveError);
    /// the device is synchronized first. NotCommittedError when a slot has not committed
    /// that many tokens, NotShareableError when it maps or owns a shared prefix.
    #[pyo3(signature = (tokens, first = 0))]
    fn forget_each(&self, py: Python<'_>, tokens: Vec<Count>, first: usize) -> PyResult<u64> {
        let slots = self.slots(py, first, Some(tokens.len()))?;
        let (cells, ops): (Vec<Arc<SeqCell>>, Vec<Unmap>) = slots
            .iter()
            .zip(tokens)
            .filter(|(_, t)| t.0 > 0)
            .map(|(c, t)| (Arc::clone(c), Unmap::Forget(t.0)))
            .unzip();
        let viewed = cells.clone();
        unless_viewed(py, &viewed, "forget tokens", move || {
            SeqCell::unmapping_each(&cells, &ops)
        })
    }

    /// Releases every slot (see :meth:`Sequence.release`); returns the bytes unmapped.
    /// Refused, with nothing released, while a view of any slot is alive.
    fn release(&self, py: Python<'_>) -> PyResult<u64> {
        let cells = self.cells.clone();
        unless_viewed(py, &self.cells, "release the batch", move || {
            SeqCell::unmapping_all(&cells, Unmap::Release)
        })
    }

    /// One strided view of layer `layer`'s K or V over slots `first..first+count` (default:
    /// all), tokens `start..end` (default: the fewest committed of those slots): shape
    /// ``[batch, kv_heads, tokens, head_dim]``. See :meth:`Sequence.view` for
    /// `allow_uncommitted`.
    #[pyo3(signature = (layer, kind = "key", start = Count(0), end = None, first = 0, count = None,
        allow_uncommitted = false),
        text_signature = "($self, layer, kind='key', start=0, end=None, first=0, count=None, \
        allow_uncommitted=False)")]
    #[allow(clippy::too_many_arguments)]
    fn view(
        &self,
        py: Python<'_>,
        layer: Dim,
        kind: &str,
        start: Count,
        end: Option<Count>,
        first: usize,
        count: Option<usize>,
        allow_uncommitted: bool,
    ) -> PyResult<TensorView> {
        let cells = self.slots(py, first, count)?;
        let req = ViewRequest {
            layer: layer.0,
            kind: kind_arg(py, kind)?,
            start: start.0,
            end: end.map(|c| c.0),
            allow_uncommitted,
            all_layers: false,
        };
        make_view(py, cells, self.stride, true, &req)
    }

    /// The whole address range of every slot as one dense tensor ``[slots, slot_stride /
    /// element size]`` (zero-copy, like :meth:`view`, and counted as a view of every slot):
    /// each slot's K and V of every layer, at the offsets :meth:`LayoutPlan.strides` and
    /// ``LayoutPlan.offset`` give, windows not committed included. Only committed tokens may
    /// be touched through it.
    fn slab(&self, py: Python<'_>) -> PyResult<TensorView> {
        make_slab(py, &self.cells, self.stride)
    }

    /// One strided view of every layer's K and V over slots `first..first+count` (default:
    /// all), tokens `start..end` (as :meth:`view`): shape
    /// ``[layers, 2, batch, kv_heads, tokens, head_dim]``, index 0 of the second dimension K,
    /// 1 V. A decode step slices it once for all layers instead of once per layer.
    #[pyo3(signature = (start = Count(0), end = None, first = 0, count = None,
        allow_uncommitted = false),
        text_signature = "($self, start=0, end=None, first=0, count=None, allow_uncommitted=False)")]
    fn view_all(
        &self,
        py: Python<'_>,
        start: Count,
        end: Option<Count>,
        first: usize,
        count: Option<usize>,
        allow_uncommitted: bool,
    ) -> PyResult<TensorView> {
        let cells = self.slots(py, first, count)?;
        let req = ViewRequest {
            layer: 0,
            kind: KvKind::Key,
            start: start.0,
            end: end.map(|c| c.0),
            allow_uncommitted,
            all_layers: true,
        };
        make_view(py, cells, self.stride, true, &req)
    }

    /// Writes a step's new K and V of layer `layer` into slots `first..first+count` (default:
    /// all) at tokens `start..start + tokens`: `keys` and `values` are
    /// ``[slots, kv_heads, tokens, head_dim]`` (a torch tensor on the manager's device, or a
    /// numpy array on the host backend) whose slots each hold their tokens as one run
    /// ordered ``[token][kv_head][head_dim]`` (what a model's projected K/V of a decode step
    /// are). One strided row copy per K and V (a row per slot), queued on `stream` (a
    /// ``torch.cuda.Stream``; None: the default stream) after the work that made the
    /// sources; the copy is not waited for.
    ///
    /// The tokens must be committed and claimed (:meth:`ensure`) in every slot and lie past
    /// any read-only shared prefix; the layout must keep them as one run per slot
    /// (:meth:`can_store`). Refused, with nothing written, otherwise.
    #[pyo3(signature = (layer, start, keys, values, stream = None, first = 0, count = None))]
    #[allow(clippy::too_many_arguments)]
    fn store(
        &self,
        py: Python<'_>,
        layer: Dim,
        start: Count,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
        first: usize,
        count: Option<usize>,
    ) -> PyResult<()> {
        let cells = self.slots(py, first, count)?;
        let req = StoreRequest {
            layer: layer.0,
            start: start.0,
            keys,
            values,
            stream,
        };
        store(py, cells, self.stride, &req)
    }

    /// Whether :meth:`store` can write `tokens` tokens per slot in one row each with this
    /// batch's layout (token-major: one token; seq-major: any number; head-major: none when
    /// there are several KV heads).
    fn can_store(&self, tokens: Count) -> bool {
        tokens_are_one_run(&self.cells[0].plan, tokens.0)
    }

    fn __repr__(&self) -> String {
        format!(
            "SequenceBatch(slots={}, slot_stride={}, layout={:?})",
            self.cells.len(),
            self.stride,
            self.cells[0].plan.layout().as_str()
        )
    }
}
