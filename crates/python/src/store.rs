//! `SequenceBatch.store`: a decode step's new K and V of one layer, written into every slot
//! with one strided row copy each (one row per slot) queued on the caller's stream.
//!
//! A batch's slots are a reservation apart (hundreds of MiB), so one layer's K over all
//! slots spans tens of GiB: PyTorch's elementwise copy splits such a destination into pieces
//! that 32-bit offsets can index and launches one kernel per piece (16 per copy for 64 slots
//! of a Llama-3-8B-sized cache). A row copy is one driver call whatever the span.

use std::sync::Arc;

use dlpark::ffi::DLDeviceType;
use kvvm::hal::{DeviceAddress, RowCopy, StreamHandle, VirtualMemoryBackend};
use kvvm::kv::{KvDtype, KvGeometry, KvKind, LayoutPlan};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::cell::SeqCell;
use crate::errors::{self, Attr};
use crate::views::busy_error;

/// A source array as its own metadata describes it: a PyTorch tensor (``data_ptr()``,
/// ``stride()``) or anything with ``__array_interface__`` (numpy).
struct Source {
    ptr: u64,
    shape: Vec<u64>,
    /// Byte strides.
    strides: Vec<i64>,
    itemsize: u64,
    /// The dtype as its library names it (`"torch.bfloat16"`, numpy's typestr).
    dtype: String,
    /// The CUDA/ROCm device ordinal, or None for host memory.
    gpu: Option<i64>,
}

fn source(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Source> {
    if obj.hasattr("data_ptr")? {
        let ptr: u64 = obj.call_method0("data_ptr")?.extract()?;
        let shape: Vec<u64> = obj.getattr("shape")?.extract()?;
        let itemsize: u64 = obj.call_method0("element_size")?.extract()?;
        let el: Vec<i64> = obj.call_method0("stride")?.extract()?;
        let item = i64::try_from(itemsize).map_err(|_| errors::invalid(py, "element size"))?;
        let strides = el.iter().map(|s| s.saturating_mul(item)).collect();
        let dtype = obj.getattr("dtype")?.str()?.to_string();
        let gpu = if obj.getattr("is_cuda")?.extract::<bool>()? {
            Some(obj.call_method0("get_device")?.extract::<i64>()?)
        } else {
            None
        };
        return Ok(Source {
            ptr,
            shape,
            strides,
            itemsize,
            dtype,
            gpu,
        });
    }
    if let Ok(iface) = obj.getattr("__array_interface__") {
        let iface = iface.cast_into::<PyDict>()?;
        let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
            iface.get_item(k)?.ok_or_else(|| {
                errors::invalid(py, format!("{what}: __array_interface__ lacks {k}"))
            })
        };
        let data = get("data")?;
        let (ptr, _readonly): (u64, bool) = data.extract()?;
        let shape: Vec<u64> = get("shape")?.extract()?;
        let dtype: String = get("typestr")?.extract()?;
        let itemsize: u64 = dtype
            .get(2..)
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| errors::invalid(py, format!("{what}: typestr {dtype:?}")))?;
        let strides_obj = get("strides")?;
        let strides: Vec<i64> = if strides_obj.is_none() {
            // C order.
            let mut out = vec![0i64; shape.len()];
            let mut acc = i64::try_from(itemsize).unwrap_or(i64::MAX);
            for (i, n) in shape.iter().enumerate().rev() {
                out[i] = acc;
                acc = acc.saturating_mul(i64::try_from(*n).unwrap_or(i64::MAX));
            }
            out
        } else {
            strides_obj.cast::<PyTuple>()?.extract()?
        };
        return Ok(Source {
            ptr,
            shape,
            strides,
            itemsize,
            dtype,
            gpu: None,
        });
    }
    Err(errors::invalid(
        py,
        format!("{what} must be a torch tensor or a numpy array"),
    ))
}

/// Whether `dtype` (as the source's library names it) is the cache's element type (an FP8
/// cache holds e4m3 codes: torch's e5m2 is another format of the same size).
fn dtype_matches(src: &Source, dtype: KvDtype) -> bool {
    let want = u64::from(dtype.bytes());
    if src.itemsize != want {
        return false;
    }
    match src.dtype.strip_prefix("torch.") {
        Some(name) => matches!(
            (dtype, name),
            (KvDtype::F16, "float16" | "half")
                | (KvDtype::Bf16, "bfloat16")
                | (KvDtype::F32, "float32" | "float")
                | (KvDtype::Fp8, "float8_e4m3fn")
        ),
        // numpy's typestr: '<f2', '<f4'; bfloat16 and fp8 have no numpy type of their own
        // (ml_dtypes reports raw bytes, 'V').
        None => {
            let kind = src.dtype.as_bytes().get(1).copied();
            match dtype {
                KvDtype::F16 | KvDtype::F32 => kind == Some(b'f'),
                KvDtype::Bf16 | KvDtype::Fp8 => matches!(kind, Some(b'V' | b'u')),
            }
        }
    }
}

/// Whether `tokens` consecutive tokens of one layer's K (or V) of one sequence are one run of
/// bytes in `plan`, ordered `[token][kv_head][head_dim]`: what a row of a row copy needs.
pub(crate) fn tokens_are_one_run(plan: &LayoutPlan, tokens: u64) -> bool {
    let geo = plan.geometry();
    let e = u64::from(geo.dtype_bytes());
    let d = u64::from(geo.head_dim()) * e;
    let h = u64::from(geo.kv_heads());
    let s = plan.strides();
    (h <= 1 || s.head == d) && (tokens <= 1 || s.token == h * d)
}

/// What [`store`] writes.
pub(crate) struct StoreRequest<'a, 'py> {
    pub(crate) layer: u32,
    pub(crate) start: u64,
    pub(crate) keys: &'a Bound<'py, PyAny>,
    pub(crate) values: &'a Bound<'py, PyAny>,
    pub(crate) stream: Option<&'a Bound<'py, PyAny>>,
}

pub(crate) fn stream_arg(
    py: Python<'_>,
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<StreamHandle> {
    match stream {
        None => Ok(StreamHandle(0)),
        Some(s) if s.is_none() => Ok(StreamHandle(0)),
        Some(s) => match s.getattr("cuda_stream") {
            Ok(raw) => Ok(StreamHandle(raw.extract()?)),
            Err(_) => Err(errors::invalid(
                py,
                "stream must be a torch.cuda.Stream (or None for the default stream)",
            )),
        },
    }
}

/// Where a store writes: the first slot's cell (every slot shares its plan), the geometry,
/// and whether the memory is a GPU's (else the host's).
struct Target<'a> {
    first: &'a SeqCell,
    geo: KvGeometry,
    on_gpu: bool,
}

impl Target<'_> {
    /// The shape `keys` and `values` must have: `[slots, kv_heads, tokens, head_dim]`.
    fn source_shape(&self, slots: usize, tokens: u64) -> [u64; 4] {
        let heads = u64::from(self.geo.kv_heads());
        [slots as u64, heads, tokens, u64::from(self.geo.head_dim())]
    }

    /// Bytes of one slot's run: `tokens` tokens of every head.
    fn run_bytes(&self, tokens: u64) -> u64 {
        let g = &self.geo;
        tokens * u64::from(g.kv_heads()) * u64::from(g.head_dim()) * u64::from(g.dtype_bytes())
    }
}

/// Writes `req.keys` and `req.values` (`[slots, kv_heads, tokens, head_dim]`, one slot per
/// cell) as tokens `start..start + tokens` of layer `req.layer` of every cell: the target,
/// the sources and the token span are checked, the slots held as a view holds them, and one
/// row copy per source queued.
pub(crate) fn store(
    py: Python<'_>,
    cells: &[Arc<SeqCell>],
    slot_stride: u64,
    req: &StoreRequest<'_, '_>,
) -> PyResult<()> {
    let target = check_target(py, cells, req.layer)?;
    let stream = stream_arg(py, req.stream)?;
    let keys = source(py, req.keys, "keys")?;
    let values = source(py, req.values, "values")?;
    let tokens = keys.shape.get(2).copied().unwrap_or(0);
    let want = target.source_shape(cells.len(), tokens);
    check_source(py, &target, &keys, "keys", want)?;
    check_source(py, &target, &values, "values", want)?;
    if tokens == 0 {
        return Ok(());
    }
    let end = check_span(py, &target, req.start, tokens)?;
    // Hold every slot as a view does while the copies are queued: no release or shrink can
    // start, and it synchronizes the device before it unmaps.
    SeqCell::view_all(cells).map_err(|busy| busy_error(py, busy, "store into the batch"))?;
    let out = check_slots(py, &target, cells, req.start, end).and_then(|()| {
        let copies = [(KvKind::Key, &keys), (KvKind::Value, &values)]
            .into_iter()
            .map(|(kind, src)| {
                row_copy(py, &target, (req.layer, kind, req.start), src, tokens).map(|copy| {
                    RowCopy {
                        dst_pitch: slot_stride,
                        rows: cells.len() as u64,
                        ..copy
                    }
                })
            })
            .collect::<PyResult<Vec<RowCopy>>>()?;
        run_copies(py, &target, copies, stream)
    });
    for c in cells {
        c.unview();
    }
    out
}

/// The first slot's cell, with the layer in range and memory tensors can be stored into.
fn check_target<'a>(py: Python<'_>, cells: &'a [Arc<SeqCell>], layer: u32) -> PyResult<Target<'a>> {
    let Some(first) = cells.first() else {
        return Err(errors::invalid(py, "a store needs at least one slot"));
    };
    let geo = *first.plan.geometry();
    if layer >= geo.layers() {
        return Err(errors::invalid(
            py,
            format!(
                "layer {layer} out of range: the model has {} layers",
                geo.layers()
            ),
        ));
    }
    let Some(dl) = first.manager.dl_device else {
        return Err(errors::raise(
            py,
            errors::ErrorClass::Unavailable,
            format!(
                "the {} backend's memory is not addressable: nothing can be stored into it",
                first.manager.backend.name()
            ),
            &[],
        ));
    };
    Ok(Target {
        first,
        geo,
        on_gpu: dl.device_type != DLDeviceType::CPU,
    })
}

/// Checks one source array (`name`): its shape `want`, its dtype, its device, and strides
/// that make each slot's tokens one run ordered `[token][kv_head][head_dim]`.
fn check_source(
    py: Python<'_>,
    target: &Target<'_>,
    src: &Source,
    name: &str,
    want: [u64; 4],
) -> PyResult<()> {
    let first = target.first;
    if src.shape != want || src.strides.len() != want.len() {
        return Err(errors::invalid(
            py,
            format!(
                "{name} has shape {:?} ({} strides); [slots, kv_heads, tokens, head_dim] = \
                 {want:?} expected",
                src.shape,
                src.strides.len()
            ),
        ));
    }
    if !dtype_matches(src, first.dtype) {
        return Err(errors::invalid(
            py,
            format!(
                "{name} has dtype {}; the cache holds {}",
                src.dtype,
                first.dtype.as_str()
            ),
        ));
    }
    let device = first.manager.device.0;
    match (target.on_gpu, src.gpu) {
        (true, Some(d)) if d == i64::from(device) => {}
        (false, None) => {}
        _ => {
            return Err(errors::invalid(
                py,
                format!(
                "{name} is not in the memory of the manager's device ({} backend, device {device})",
                first.manager.backend.name()
            ),
            ))
        }
    }
    let [slots, heads, tokens, dim] = want;
    let e = u64::from(target.geo.dtype_bytes());
    let dense = (dim <= 1 || src.strides[3] == e as i64)
        && (heads <= 1 || src.strides[1] == (dim * e) as i64)
        && (tokens <= 1 || src.strides[2] == (heads * dim * e) as i64)
        && (slots <= 1 || src.strides[0] >= target.run_bytes(tokens) as i64);
    if !dense {
        return Err(errors::invalid(
            py,
            format!(
                "{name}: strides {:?} (bytes) do not make each slot's tokens one run \
                 ordered [token][kv_head][head_dim]",
                src.strides
            ),
        ));
    }
    Ok(())
}

/// The end of tokens `start..start + tokens`: one run per slot in the layout, and inside the
/// sequences.
fn check_span(py: Python<'_>, target: &Target<'_>, start: u64, tokens: u64) -> PyResult<u64> {
    let first = target.first;
    if !tokens_are_one_run(&first.plan, tokens) {
        return Err(errors::invalid(
            py,
            format!(
                "the {} layout does not keep {tokens} token(s) of a layer as one run per slot \
                 (see can_store)",
                first.plan.layout().as_str()
            ),
        ));
    }
    start
        .checked_add(tokens)
        .filter(|&e| e <= first.max_tokens)
        .ok_or_else(|| {
            errors::raise(
                py,
                errors::ErrorClass::TooManyTokens,
                format!(
                    "tokens {start}..+{tokens} are past the sequence's {} tokens",
                    first.max_tokens
                ),
                &[("max_tokens", Attr::Int(first.max_tokens))],
            )
        })
}

/// Checks, with the slots held, that tokens `start..end` of every slot are committed and
/// claimed and lie past its read-only shared prefix.
fn check_slots(
    py: Python<'_>,
    target: &Target<'_>,
    cells: &[Arc<SeqCell>],
    start: u64,
    end: u64,
) -> PyResult<()> {
    let bpt = target.first.plan.fragment_bytes_per_token();
    for c in cells {
        let claimed = c.usable_tokens();
        if end > claimed {
            return Err(errors::raise(
                py,
                errors::ErrorClass::NotCommitted,
                format!(
                    "tokens {start}..{end} are not all committed and claimed: {claimed} tokens \
                     are (call ensure)"
                ),
                &[],
            ));
        }
        let forgotten = c.forgotten_tokens();
        if start < forgotten {
            return Err(errors::raise(
                py,
                errors::ErrorClass::NotCommitted,
                format!("token {start} was forgotten: the tokens before {forgotten} lie behind the sliding window"),
                &[],
            ));
        }
        if start.saturating_mul(bpt) < c.protected_bytes() {
            return Err(errors::raise(
                py,
                errors::ErrorClass::WriteIntoSharedPrefix,
                format!("token {start} lies in the sequence's read-only shared prefix"),
                &[],
            ));
        }
    }
    Ok(())
}

/// The row copy of `src` into `(layer, kind, start)` of the first slot (one row; the caller
/// sets the rows and the destination pitch).
fn row_copy(
    py: Python<'_>,
    target: &Target<'_>,
    (layer, kind, start): (u32, KvKind, u64),
    src: &Source,
    tokens: u64,
) -> PyResult<RowCopy> {
    let first = target.first;
    let width = target.run_bytes(tokens);
    let off = first
        .offset(layer, kind, start)
        .map_err(|err| errors::kv(py, &err))?;
    Ok(RowCopy {
        dst: DeviceAddress(first.base.saturating_add(off)),
        dst_pitch: 0,
        src: DeviceAddress(src.ptr),
        src_pitch: u64::try_from(src.strides[0]).unwrap_or(0).max(width),
        width,
        rows: 1,
    })
}

/// Runs the copies: queued on `stream` without the GIL on a GPU; read from host memory with
/// the GIL held on the host (the source is any readable host memory, a numpy array or a CPU
/// tensor, not memory of the backend).
fn run_copies(
    py: Python<'_>,
    target: &Target<'_>,
    copies: Vec<RowCopy>,
    stream: StreamHandle,
) -> PyResult<()> {
    let backend = Arc::clone(&target.first.manager.backend);
    if !target.on_gpu {
        return copies
            .iter()
            .try_for_each(|copy| copy_host_rows(backend.as_ref(), copy))
            .map_err(|err| errors::backend(py, &err));
    }
    py.detach(move || {
        copies
            .iter()
            .try_for_each(|copy| backend.copy_rows_async(copy, stream))
    })
    .map_err(|err| errors::backend(py, &err))
}

/// Copies `copy`'s rows from host memory into the backend's memory, one
/// `copy_to_device` per row (the backend checks each destination row against its mappings).
/// The source is the array [`store`] checked: every row of `width` bytes, `src_pitch` apart,
/// lies in it.
fn copy_host_rows(
    backend: &dyn VirtualMemoryBackend,
    copy: &RowCopy,
) -> Result<(), kvvm::hal::BackendError> {
    copy.check()?;
    let bad = || {
        kvvm::hal::BackendError::raised(
            kvvm::hal::Operation::CopyRows,
            kvvm::hal::ErrorKind::InvalidValue,
            format!("a host row copy out of the address space: {copy:?}"),
        )
    };
    let width = usize::try_from(copy.width).map_err(|_| bad())?;
    for row in 0..copy.rows {
        // In range: `check` proved the last row's end does not overflow.
        let src = copy.src.0 + row * copy.src_pitch;
        let dst = copy.dst.0 + row * copy.dst_pitch;
        let src = usize::try_from(src).map_err(|_| bad())?;
        // SAFETY: `src..src + width` is one slot's run of the source array: `store` checked its
        // shape `[slots, kv_heads, tokens, head_dim]` and strides (each slot's tokens one run
        // of `width` bytes, slots `src_pitch` apart) from its own metadata, and the caller
        // holds a reference to the array and the GIL, so it is neither freed nor resized
        // while the bytes are read. The bytes are only read, into a copy of their own (the
        // source may be a view of the very memory the row is written to).
        let row_bytes = unsafe {
            std::slice::from_raw_parts(std::ptr::with_exposed_provenance::<u8>(src), width)
        }
        .to_vec();
        backend.copy_to_device(DeviceAddress(dst), &row_bytes)?;
    }
    Ok(())
}
