//! Building [`TensorView`]s of one layer's K or V over one sequence or a run of strided slots.

use std::sync::Arc;

use kvvm::kv::{KvCacheError, KvKind};
use pyo3::prelude::*;

use crate::cell::{Busy, SeqCell};
use crate::errors::{self, Attr};
use crate::view::TensorView;
use dlpark::ffi::DLDevice;

/// Parses ``"key"``/``"k"`` or ``"value"``/``"v"``.
pub(crate) fn kind_arg(py: Python<'_>, kind: &str) -> PyResult<KvKind> {
    match kind {
        "key" | "k" | "K" => Ok(KvKind::Key),
        "value" | "v" | "V" => Ok(KvKind::Value),
        other => Err(errors::invalid(
            py,
            format!("kind must be 'key' or 'value', not {other:?}"),
        )),
    }
}

/// What a view asks for.
pub(crate) struct ViewRequest {
    pub(crate) layer: u32,
    pub(crate) kind: KvKind,
    pub(crate) start: u64,
    pub(crate) end: Option<u64>,
    pub(crate) allow_uncommitted: bool,
    /// Every layer's K and V at once: shape `[layers, 2, (B,) H, T, D]` (`layer` and `kind`
    /// are then ignored).
    pub(crate) all_layers: bool,
}

fn to_i64(py: Python<'_>, v: u64, what: &str) -> PyResult<i64> {
    i64::try_from(v).map_err(|_| errors::invalid(py, format!("{what} {v} does not fit a tensor")))
}

/// Where `cell`'s memory can be read by tensors, or why it cannot.
fn dl_device(py: Python<'_>, cell: &SeqCell) -> PyResult<DLDevice> {
    cell.manager.dl_device.ok_or_else(|| {
        errors::raise(
            py,
            errors::ErrorClass::Unavailable,
            format!(
                "the {} backend's memory is not addressable by tensors; use the 'host' backend \
                 on a CPU or a GPU backend",
                cell.manager.backend.name()
            ),
            &[],
        )
    })
}

/// The whole address range of `cells` (slots at a constant `slot_stride`) as one dense
/// tensor of shape `[slots, slot_stride / element size]`: every layer's K and V of every
/// slot, the layout's padding and the windows not committed included. What is read or
/// written through it must be committed; it exists so that one tensor, written in place
/// with indices, is all a compiled step mutates.
pub(crate) fn make_slab(
    py: Python<'_>,
    cells: &[Arc<SeqCell>],
    slot_stride: u64,
) -> PyResult<TensorView> {
    let Some(first) = cells.first() else {
        return Err(errors::invalid(py, "a slab needs at least one sequence"));
    };
    let device = dl_device(py, first)?;
    let e = u64::from(first.plan.geometry().dtype_bytes().max(1));
    // A row is a whole stride (dense: the slots are reserved back to back).
    let row = if cells.len() > 1 {
        slot_stride
    } else {
        first.plan.reservation_bytes()
    };
    if !row.is_multiple_of(e) {
        return Err(errors::invalid(
            py,
            format!("a slot stride of {row} bytes is not a whole number of elements"),
        ));
    }
    let rows = to_i64(py, cells.len() as u64, "slot count")?;
    let shape = vec![rows, to_i64(py, row / e, "slot elements")?];
    let strides = vec![shape[1], 1];
    if let Err(busy) = SeqCell::view_all(cells) {
        return Err(busy_error(py, busy, "make a slab"));
    }
    Ok(TensorView::new(
        cells.to_vec(),
        first.base,
        shape,
        strides,
        first.dtype,
        device,
        false,
    ))
}

/// A view of layer `req.layer`'s K or V, tokens `start..end`, over `cells` (one sequence, or
/// slots at a constant `slot_stride` with `batched`): shape `[H, T, D]` or `[B, H, T, D]`.
pub(crate) fn make_view(
    py: Python<'_>,
    cells: &[Arc<SeqCell>],
    slot_stride: u64,
    batched: bool,
    req: &ViewRequest,
) -> PyResult<TensorView> {
    let Some(first) = cells.first() else {
        return Err(errors::invalid(py, "a view needs at least one sequence"));
    };
    let device = dl_device(py, first)?;
    check_layer(py, first, req)?;
    let end = token_end(py, cells, first.max_tokens, req)?;
    let ptr = view_address(py, first, req)?;
    let batch = batched.then_some((cells.len() as u64, slot_stride));
    let (shape, el_strides) = view_shape(py, first, req, end, batch)?;
    // Count first, check second: once counted, no release or shrink can start on these
    // sequences, so what the check sees stays true while the view lives.
    if let Err(busy) = SeqCell::view_all(cells) {
        return Err(busy_error(py, busy, "make a view"));
    }
    let readonly = match committed_and_readonly(py, cells, req, end) {
        Ok(readonly) => readonly,
        Err(err) => {
            for c in cells {
                c.unview();
            }
            return Err(err);
        }
    };
    Ok(TensorView::new(
        cells.to_vec(),
        ptr,
        shape,
        el_strides,
        first.dtype,
        device,
        readonly,
    ))
}

/// Refuses a layer the model does not have (unless the view is of every layer).
fn check_layer(py: Python<'_>, first: &SeqCell, req: &ViewRequest) -> PyResult<()> {
    let layers = first.plan.geometry().layers();
    if !req.all_layers && req.layer >= layers {
        return Err(errors::invalid(
            py,
            format!(
                "layer {} out of range: the model has {} layers",
                req.layer, layers
            ),
        ));
    }
    Ok(())
}

/// The view's end token: `req.end`, or the tokens every cell can use; `req.start..end` must
/// be a range inside the sequence's `max_tokens`.
fn token_end(
    py: Python<'_>,
    cells: &[Arc<SeqCell>],
    max_tokens: u64,
    req: &ViewRequest,
) -> PyResult<u64> {
    let end = req
        .end
        .unwrap_or_else(|| cells.iter().map(|c| c.usable_tokens()).min().unwrap_or(0));
    if req.start > end || end > max_tokens {
        return Err(errors::raise(
            py,
            errors::ErrorClass::TooManyTokens,
            format!(
                "tokens {}..{end} are not a range inside the sequence's {} tokens",
                req.start, max_tokens
            ),
            &[
                ("tokens", Attr::Int(end)),
                ("max_tokens", Attr::Int(max_tokens)),
            ],
        ));
    }
    Ok(end)
}

/// The address of the view's first element in `first`: token `req.start` of the layer and
/// kind asked for (layer 0's K for a view of every layer).
fn view_address(py: Python<'_>, first: &SeqCell, req: &ViewRequest) -> PyResult<u64> {
    let (layer, kind) = if req.all_layers {
        (0, KvKind::Key)
    } else {
        (req.layer, req.kind)
    };
    let offset = first
        .offset(layer, kind, req.start)
        .map_err(|err| errors::kv(py, &err))?;
    first
        .base
        .checked_add(offset)
        .ok_or_else(|| errors::invalid(py, "view address overflows"))
}

/// The view's shape and strides in elements: `[H, T, D]`, with the batch of `batch` (slots,
/// slot stride in bytes) in front, and `[layers, 2]` in front of that for a view of every
/// layer.
fn view_shape(
    py: Python<'_>,
    first: &SeqCell,
    req: &ViewRequest,
    end: u64,
    batch: Option<(u64, u64)>,
) -> PyResult<(Vec<i64>, Vec<i64>)> {
    let geo = *first.plan.geometry();
    let e = u64::from(geo.dtype_bytes().max(1));
    let strides = first.plan.strides();
    let mut shape = vec![
        i64::from(geo.kv_heads()),
        to_i64(py, end - req.start, "token count")?,
        i64::from(geo.head_dim()),
    ];
    let mut el_strides = vec![
        to_i64(py, strides.head / e, "head stride")?,
        to_i64(py, strides.token / e, "token stride")?,
        1,
    ];
    if let Some((slots, slot_stride)) = batch {
        shape.insert(0, to_i64(py, slots, "batch")?);
        el_strides.insert(0, to_i64(py, slot_stride / e, "slot stride")?);
    }
    if req.all_layers {
        shape.splice(0..0, [i64::from(geo.layers()), 2]);
        el_strides.splice(
            0..0,
            [
                to_i64(py, strides.layer / e, "layer stride")?,
                to_i64(py, strides.kv / e, "K/V stride")?,
            ],
        );
    }
    Ok((shape, el_strides))
}

/// Checks that tokens `req.start..end` are committed in every cell (unless the request allows
/// uncommitted tokens) and returns whether every byte of the view is read-only shared memory.
/// Called with the view counted on every cell, so that no unmap can run in between.
fn committed_and_readonly(
    py: Python<'_>,
    cells: &[Arc<SeqCell>],
    req: &ViewRequest,
    end: u64,
) -> PyResult<bool> {
    let mut readonly = end > req.start;
    for c in cells {
        let committed = c.usable_tokens();
        if !req.allow_uncommitted && end > committed {
            return Err(errors::raise(
                py,
                errors::ErrorClass::NotCommitted,
                format!(
                    "tokens {}..{end} are not all committed: {committed} tokens are (call ensure)",
                    req.start
                ),
                &[],
            ));
        }
        let forgotten = c.forgotten_tokens();
        if !req.allow_uncommitted && req.start < forgotten && end > req.start {
            return Err(errors::raise(
                py,
                errors::ErrorClass::NotCommitted,
                format!(
                    "tokens {}..{end} reach forgotten tokens: those before {forgotten} lie                      behind the sliding window",
                    req.start
                ),
                &[],
            ));
        }
        let shared = c.with(|s| s.shared_tokens());
        readonly &= end <= shared;
    }
    Ok(readonly)
}

/// Runs `op`, an operation that live views of `cells` refuse (an unmap, an admission, a swap's
/// step), with the GIL released; its refusal raises ViewsAliveError naming `what`, its
/// failure its kv error.
///
/// When a view of one of `cells` is alive, Python's unreachable objects are collected first:
/// a view, or a tensor made from one, that only a reference cycle holds (a frame an
/// exception's traceback keeps, for one) is freed then, where otherwise the collector's last
/// run would decide whether `op` is refused. A view something can still reach keeps the
/// refusal; nothing is collected while no view is alive.
pub(crate) fn unless_viewed<R: Send>(
    py: Python<'_>,
    cells: &[Arc<SeqCell>],
    what: &str,
    op: impl FnOnce() -> Result<Result<R, KvCacheError>, Busy> + Send,
) -> PyResult<R> {
    if cells.iter().any(|c| c.views() > 0) {
        // A collection that fails (none is expected) leaves the refusal to `op`.
        let _ = py.import("gc").and_then(|gc| gc.call_method0("collect"));
    }
    match py.detach(op) {
        Ok(r) => r.map_err(|e| errors::kv(py, &e)),
        Err(busy) => Err(busy_error(py, busy, what)),
    }
}

/// The error of an unmap refused because views are alive.
pub(crate) fn busy_error(py: Python<'_>, busy: Busy, what: &str) -> PyErr {
    match busy {
        Busy::Viewed(n) => errors::raise(
            py,
            errors::ErrorClass::ViewsAlive,
            format!(
                "cannot {what}: {n} tensor view(s) of this sequence are alive; delete them \
                 (and the tensors made from them) first"
            ),
            &[("views", Attr::Int(n))],
        ),
        Busy::Unmapping => errors::raise(
            py,
            errors::ErrorClass::ViewsAlive,
            format!("cannot {what}: another thread is releasing or shrinking this sequence"),
            &[("views", Attr::Int(0))],
        ),
    }
}
