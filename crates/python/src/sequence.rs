//! `kvvm.Sequence`: one request's KV cache, reserved once at its maximum length and committed
//! window by window as it grows; its layers are zero-copy tensor views. With it,
//! `kvvm.SharedPrefix`: the prompt prefix a sequence owns (`Sequence.own_prefix`) and other
//! sequences map read-only (`SharedPrefix.attach`), billed once.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Weak};

use kvvm::kv::{PrefixDescriptor, SequenceKv, SharedDevicePrefix};
use pyo3::buffer::{PyBuffer, PyUntypedBuffer};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyModule};

use crate::cell::{SeqCell, Unmap};
use crate::count::{Count, Dim};
use crate::errors;
use crate::geometry::PyPlan;
use crate::host_tier::{self, HostTier, SwappedKv};
use crate::manager::{broker_error, broker_of, Manager};
use crate::prefix_meta;
use crate::view::TensorView;
use crate::views::{kind_arg, make_view, unless_viewed, ViewRequest};

/// One request's KV cache (see the module docs of :mod:`kvvm`).
#[pyclass(frozen, module = "kvvm._native")]
pub struct Sequence {
    pub(crate) cell: Arc<SeqCell>,
}

/// The most tokens a sequence of `plan` may hold: `max_tokens`, or the geometry's.
pub(crate) fn max_tokens_arg(
    py: Python<'_>,
    plan: &PyPlan,
    max_tokens: Option<u64>,
) -> PyResult<u64> {
    let cap = plan.plan.geometry().max_tokens();
    match max_tokens {
        None => Ok(cap),
        Some(0) => Err(errors::invalid(py, "max_tokens must be positive")),
        Some(n) if n > cap => Err(errors::raise(
            py,
            errors::ErrorClass::TooManyTokens,
            format!("max_tokens {n} exceeds the geometry's {cap}"),
            &[
                ("tokens", errors::Attr::Int(n)),
                ("max_tokens", errors::Attr::Int(cap)),
            ],
        )),
        Some(n) => Ok(n),
    }
}

/// A copy of the bytes of `data`: any object with the buffer protocol. A buffer of bytes
/// (`bytes`, `bytearray`, a `memoryview` of them, numpy `uint8`) is copied as it is, in C
/// order; one of another item format is read as its raw bytes, which needs it C-contiguous.
fn buffer_bytes(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(buf) = PyBuffer::<u8>::get(data) {
        return buf.to_vec(py);
    }
    if PyUntypedBuffer::get(data).is_err() {
        let kind = data
            .get_type()
            .name()
            .map_or_else(|_| "this object".to_owned(), |n| n.to_string());
        return Err(PyTypeError::new_err(format!(
            "data must be bytes-like (bytes, bytearray, memoryview, a numpy array), not {kind}"
        )));
    }
    let raw = PyModule::import(py, "builtins")?
        .getattr("memoryview")?
        .call1((data,))?
        .call_method1("cast", ("B",))
        .map_err(|_| {
            errors::invalid(
                py,
                "data must be C-contiguous to be read as raw bytes (numpy: np.ascontiguousarray)",
            )
        })?;
    PyBuffer::<u8>::get(&raw)?.to_vec(py)
}

/// Refuses `precommit=True` on a manager without a pre-committer (it would silently grow
/// inline instead).
pub(crate) fn precommit_arg(py: Python<'_>, manager: &Manager, precommit: bool) -> PyResult<()> {
    if precommit && manager.state.precommit.is_none() {
        return Err(errors::invalid(
            py,
            "precommit=True needs a manager started with precommit=True (this one has no \
             pre-committer)",
        ));
    }
    Ok(())
}

#[pymethods]
impl Sequence {
    /// Reserves the address range of a sequence of at most `max_tokens` tokens (default: the
    /// geometry's) under `plan`; commits nothing. With `precommit=True` a background worker
    /// commits windows ahead of need (the manager must be started with ``precommit=True``:
    /// InvalidArgumentError otherwise).
    #[new]
    #[pyo3(signature = (manager, plan, max_tokens = None, precommit = false))]
    fn new(
        py: Python<'_>,
        manager: &Manager,
        plan: &PyPlan,
        max_tokens: Option<Count>,
        precommit: bool,
    ) -> PyResult<Self> {
        let max_tokens = max_tokens_arg(py, plan, max_tokens.map(|c| c.0))?;
        precommit_arg(py, manager, precommit)?;
        let state = Arc::clone(&manager.state);
        let p = plan.plan;
        let vm = state.vm.clone();
        let seq = py
            .detach(move || SequenceKv::new(&vm, &p, max_tokens))
            .map_err(|e| errors::kv(py, &e))?;
        Ok(Sequence {
            cell: Arc::new(SeqCell::new(state, seq, plan.dtype, precommit)),
        })
    }

    /// The most tokens this sequence holds.
    #[getter]
    fn max_tokens(&self) -> u64 {
        self.cell.max_tokens
    }

    /// Tokens whose windows are all mapped.
    #[getter]
    fn committed_tokens(&self) -> u64 {
        self.cell.committed_tokens()
    }

    /// Bytes mapped in this sequence's range (shared windows included).
    #[getter]
    fn committed_bytes(&self) -> u64 {
        self.cell.with(|s| s.committed_bytes())
    }

    /// Physical bytes this sequence holds on its own (shared prefix windows excluded).
    #[getter]
    fn owned_bytes(&self) -> u64 {
        self.cell.with(|s| s.additional_owned_bytes())
    }

    /// Tokens lying wholly in read-only shared prefix windows (writes there are refused).
    #[getter]
    fn shared_tokens(&self) -> u64 {
        self.cell.with(|s| s.shared_tokens())
    }

    /// Tokens before this one were forgotten (:meth:`forget_before`): never read or written
    /// again, their windows given back. 0 until the sequence forgets, and after a release.
    #[getter]
    fn forgotten_tokens(&self) -> u64 {
        self.cell.forgotten_tokens()
    }

    /// Tokens of the prefix this sequence shares or owns.
    #[getter]
    fn prefix_tokens(&self) -> u64 {
        self.cell.with(|s| s.prefix_tokens())
    }

    /// The base address (it never changes).
    #[getter]
    fn address(&self) -> u64 {
        self.cell.base
    }

    /// Live tensor views of this sequence (release and shrink wait for 0).
    #[getter]
    fn views(&self) -> u64 {
        self.cell.views()
    }

    /// Whether the background pre-committer grows this sequence.
    #[getter]
    fn precommitted(&self) -> bool {
        self.cell.is_precommitted()
    }

    /// Whether nothing is mapped and no prefix is attached (fresh or released).
    #[getter]
    fn is_empty(&self) -> bool {
        self.cell.with(|s| s.is_empty())
    }

    /// Makes the first `tokens` tokens committed (one transaction through the budget);
    /// returns the bytes committed by this call (0 when they were ready).
    ///
    /// Raises BackpressureError (retry later), NeverFitsError, TooManyTokensError or
    /// DriverError (rolled back).
    fn ensure(&self, py: Python<'_>, tokens: Count) -> PyResult<u64> {
        let tokens = tokens.0;
        let cell = Arc::clone(&self.cell);
        py.detach(move || cell.ensure(tokens))
            .map_err(|e| errors::kv(py, &e))
    }

    /// Gives back the windows holding no byte of the first `tokens` tokens (written tokens
    /// and shared windows are kept); returns the bytes unmapped. Refused while views live.
    fn shrink(&self, py: Python<'_>, tokens: Count) -> PyResult<u64> {
        let tokens = tokens.0;
        let cell = Arc::clone(&self.cell);
        unless_viewed(py, std::slice::from_ref(&self.cell), "shrink", move || {
            cell.unmapping(Unmap::Shrink(tokens))
        })
    }

    /// Forgets the tokens before `tokens` (see :meth:`SequenceBatch.forget_each`); returns
    /// the bytes unmapped. Refused while views live.
    fn forget_before(&self, py: Python<'_>, tokens: Count) -> PyResult<u64> {
        let tokens = tokens.0;
        let cell = Arc::clone(&self.cell);
        unless_viewed(
            py,
            std::slice::from_ref(&self.cell),
            "forget tokens",
            move || cell.unmapping(Unmap::Forget(tokens)),
        )
    }

    /// Unmaps everything and detaches from shared prefixes; returns the bytes unmapped.
    /// Refused (ViewsAliveError) while a view or a tensor made from one is alive; the device
    /// is synchronized first.
    ///
    /// The reservation is kept, by design: a released sequence is an empty one at the same
    /// address, ready for the next request (:meth:`ensure` grows it again, a prefix cache may
    /// admit into it), as the slots of a :class:`SequenceBatch` are reused. Nothing raises
    /// ReleasedError here; the address range is freed when the sequence object and its
    /// views are gone.
    fn release(&self, py: Python<'_>) -> PyResult<u64> {
        let cell = Arc::clone(&self.cell);
        unless_viewed(py, std::slice::from_ref(&self.cell), "release", move || {
            cell.unmapping(Unmap::Release)
        })
    }

    /// Begins moving the first `tokens` tokens to `tier` (page-locked host memory billed to
    /// the host budget): their windows' copies are queued on the tier's copy stream after
    /// the work queued on `after` (the torch stream that wrote them; None: the device is
    /// synchronized first). The sequence keeps its memory until :meth:`finish_swap_out` and
    /// must be neither read nor written meanwhile. A mapped shared prefix stays on the
    /// device, held by the swap. Raises BackpressureError or NeverFitsError (the host budget;
    /// nothing changed), NotCommittedError, DriverError.
    #[pyo3(signature = (tier, tokens, after = None))]
    fn swap_out(
        &self,
        py: Python<'_>,
        tier: &HostTier,
        tokens: Count,
        after: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<SwappedKv> {
        host_tier::swap_out(py, &self.cell, tier, tokens.0, after)
    }

    /// Waits for a swap's copies to the host, then releases the sequence (its memory goes
    /// back to the budget; its address stays); returns the bytes released. A failed copy
    /// raises and fails the swap: the sequence keeps its tokens. Refused (ViewsAliveError)
    /// while views live.
    fn finish_swap_out(&self, py: Python<'_>, swap: &Bound<'_, SwappedKv>) -> PyResult<u64> {
        host_tier::finish_swap_out(py, &self.cell, swap)
    }

    /// Brings a swap back into this sequence (empty, of the plan it came from): its windows
    /// committed at the same offsets, the prefix it kept mapped again, the copies back queued.
    /// BackpressureError: nothing changed, the swap waits on the host (try later); any other
    /// error fails the swap and leaves the sequence empty (compute the request again).
    fn swap_in(&self, py: Python<'_>, swap: &Bound<'_, SwappedKv>) -> PyResult<()> {
        host_tier::swap_in(py, &self.cell, swap)
    }

    /// Waits for a swap's copies back; the sequence holds its tokens again. Returns the bytes
    /// copied. A failed copy raises, fails the swap and releases the sequence.
    fn finish_swap_in(&self, py: Python<'_>, swap: &Bound<'_, SwappedKv>) -> PyResult<u64> {
        host_tier::finish_swap_in(py, &self.cell, swap)
    }

    /// Records that tokens ``0..tokens`` hold their data although they were not written with
    /// :meth:`write_tokens` (a model wrote them through a tensor view, on the device), so that
    /// a prefix cache may publish them. The caller vouches for the content. Raises
    /// NotCommittedError when they are not all committed.
    fn mark_written(&self, py: Python<'_>, tokens: Count) -> PyResult<()> {
        let tokens = tokens.0;
        self.cell
            .with(|s| s.mark_written(tokens))
            .map_err(|e| errors::kv(py, &e))
    }

    /// Writes tokens `first..` from `data`: whole tokens in the host layout
    /// `[token][layer][K, V][kv_head][head_dim]` (``geometry.bytes_per_token`` bytes each).
    /// `data` is any bytes-like object: ``bytes``, ``bytearray``, ``memoryview``, a numpy
    /// array (an array of another dtype is read as its raw bytes, so it must be C-contiguous).
    fn write_tokens(&self, py: Python<'_>, first: Count, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let first = first.0;
        let cell = Arc::clone(&self.cell);
        let bytes = buffer_bytes(py, data)?;
        py.detach(move || cell.with(|s| s.write_tokens(first, &bytes)))
            .map_err(|e| errors::kv(py, &e))
    }

    /// Reads `count` tokens from `first` in the host layout of :meth:`write_tokens`.
    fn read_tokens<'py>(
        &self,
        py: Python<'py>,
        first: Count,
        count: Count,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (first, count) = (first.0, count.0);
        let bpt = self.cell.plan.geometry().bytes_per_token();
        let len = count
            .checked_mul(bpt)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| errors::invalid(py, format!("{count} tokens is too many to read")))?;
        if count > self.cell.max_tokens {
            return Err(errors::invalid(
                py,
                format!(
                    "{count} tokens asked for, the sequence holds at most {}",
                    self.cell.max_tokens
                ),
            ));
        }
        let cell = Arc::clone(&self.cell);
        let out = py
            .detach(move || {
                let mut buf = vec![0u8; len];
                cell.with(|s| s.read_tokens(first, &mut buf)).map(|()| buf)
            })
            .map_err(|e| errors::kv(py, &e))?;
        Ok(PyBytes::new(py, &out))
    }

    /// A zero-copy view of layer `layer`'s K (`kind="key"`) or V, tokens `start..end`
    /// (default: the committed tokens), shape ``[kv_heads, tokens, head_dim]``. A view past the
    /// committed tokens needs `allow_uncommitted=True`: the caller then promises to touch
    /// only committed tokens (uncommitted ones fault).
    #[pyo3(signature = (layer, kind = "key", start = Count(0), end = None, allow_uncommitted = false),
        text_signature = "($self, layer, kind='key', start=0, end=None, allow_uncommitted=False)")]
    fn view(
        &self,
        py: Python<'_>,
        layer: Dim,
        kind: &str,
        start: Count,
        end: Option<Count>,
        allow_uncommitted: bool,
    ) -> PyResult<TensorView> {
        let req = ViewRequest {
            layer: layer.0,
            kind: kind_arg(py, kind)?,
            start: start.0,
            end: end.map(|c| c.0),
            allow_uncommitted,
            all_layers: false,
        };
        make_view(py, std::slice::from_ref(&self.cell), 0, false, &req)
    }

    /// Makes this empty sequence the owner of a new shared prefix of `tokens` tokens: its
    /// whole windows are committed as shared memory, read-write for this sequence, the rest of
    /// its tokens privately. Write the prefix's tokens, then :meth:`SharedPrefix.seal` it (its
    /// tail, the bytes past its last whole window, is copied then) and attach it to other
    /// sequences.
    fn own_prefix(&self, py: Python<'_>, tokens: Count) -> PyResult<SharedPrefix> {
        let tokens = tokens.0;
        let cell = Arc::clone(&self.cell);
        let prefix = unless_viewed(
            py,
            std::slice::from_ref(&self.cell),
            "own a prefix",
            move || cell.admission(|s| SharedDevicePrefix::own_in(s, tokens)),
        )?;
        Ok(SharedPrefix {
            prefix,
            owner: Some(Arc::downgrade(&self.cell)),
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "Sequence(address={:#x}, layout={:?}, max_tokens={}, committed_tokens={})",
            self.cell.base,
            self.cell.plan.layout().as_str(),
            self.cell.max_tokens,
            self.cell.committed_tokens()
        )
    }
}

/// A prefix one sequence owns (read-write until sealed) and others attach: its whole windows
/// mapped read-only, the rest copied.
#[pyclass(frozen, module = "kvvm._native")]
pub struct SharedPrefix {
    pub(crate) prefix: Arc<SharedDevicePrefix>,
    /// The owner's sequence, for a prefix made here by `Sequence.own_prefix` (it seals it).
    pub(crate) owner: Option<Weak<SeqCell>>,
}

impl SharedPrefix {
    /// A prefix held by a cache or opened from another process: sealed, no owner here.
    pub(crate) fn without_owner(prefix: Arc<SharedDevicePrefix>) -> Self {
        SharedPrefix {
            prefix,
            owner: None,
        }
    }
}

#[pymethods]
impl SharedPrefix {
    /// Seals the prefix read-only: call after the owner wrote its tokens (on a GPU, after the
    /// device finished writing them), before attaching. Its tail is copied into memory of its
    /// own then (one window per fragment, billed once), so that sequences it is attached to
    /// receive every token. ``InvalidArgumentError`` when the owner's sequence was released or
    /// dropped first; backpressure when the budget cannot hold the tail.
    fn seal(&self, py: Python<'_>) -> PyResult<()> {
        if self.prefix.is_sealed() {
            return Ok(());
        }
        let Some(cell) = self.owner.as_ref().and_then(Weak::upgrade) else {
            return Err(errors::invalid(
                py,
                "the prefix's owner sequence is gone: only the owner seals a prefix",
            ));
        };
        py.detach(move || cell.publishing(SequenceKv::seal_prefix))
            .map_err(|e| errors::kv(py, &e))
    }

    /// Whether the prefix is sealed.
    #[getter]
    fn sealed(&self) -> bool {
        self.prefix.is_sealed()
    }

    /// The tokens a sequence it is attached to receives (the prefix's length once sealed).
    #[getter]
    fn tokens(&self) -> u64 {
        self.prefix.tokens()
    }

    /// Tokens lying wholly in the read-only windows (a sequence it is attached to receives
    /// the rest of :attr:`tokens` by copy).
    #[getter]
    fn shared_tokens(&self) -> u64 {
        self.prefix.shared_tokens()
    }

    /// Physical bytes of the prefix, its read-only windows and its tail (billed once).
    #[getter]
    fn bytes(&self) -> u64 {
        self.prefix.bytes()
    }

    /// Publishes the sealed prefix to the node's broker under ``key`` (the manager must lease
    /// from one: ``Manager(broker=...)``, on a backend whose handles can be exported as
    /// descriptors). Its handles (read-only windows and tail) travel as descriptors with what
    /// a reader needs to map them, and ``meta``: what a reader must agree with to read the
    /// bytes (one line of printable ASCII; with the descriptor at most
    /// :data:`PREFIX_META_BYTES`, else ``InvalidArgumentError`` before anything is sent);
    /// its bytes leave this process's lease for the prefix, billed once to the tenant while
    /// any process uses it. Other processes of the tenant :meth:`open` it; this one stays a
    /// user until :meth:`Manager.close_prefix` or until it disconnects. Returns the bytes
    /// published.
    #[pyo3(signature = (manager, key, meta = ""))]
    fn publish(&self, py: Python<'_>, manager: &Manager, key: &str, meta: &str) -> PyResult<u64> {
        let client = broker_of(py, manager)?;
        let (descriptor, fds) = self.prefix.export().map_err(|e| errors::kv(py, &e))?;
        let g = manager.state.vm.granule();
        let handles: Vec<(BorrowedFd<'_>, u64)> = fds
            .iter()
            .zip(descriptor.pieces.iter().chain(&descriptor.tail_pieces))
            .map(|(fd, (_, windows))| (fd.as_fd(), windows.saturating_mul(g)))
            .collect();
        let meta = prefix_meta::compose(py, descriptor.encode(), meta)?;
        let device = manager.state.device.0;
        py.detach(|| client.publish_prefix(device, key, &handles, &meta))
            .map_err(|e| broker_error(py, &e))?;
        Ok(self.prefix.bytes())
    }

    /// The prefix another process of the tenant published under ``key``, imported into
    /// ``manager`` under ``plan`` (the publisher's: the same geometry, maximum length, layout
    /// and granule, else ``InvalidArgumentError``), sealed: attach it to sequences of
    /// ``plan``, which receive all its :attr:`tokens`. ``plan`` may be a callable instead: it
    /// is given the ``meta`` the publisher passed to :meth:`publish` (``""`` when it passed
    /// none) and returns the plan, or raises to refuse the prefix. Not billed here (a
    /// sequence pays only for the windows it copies the tail into); this process is a user
    /// of the prefix until :meth:`Manager.close_prefix` or until it disconnects, and the
    /// memory lives while any process maps or holds it. A prefix whose descriptor cannot be
    /// read (the publisher wrote something else, or windows no prefix can have), that the
    /// callable refuses, or that cannot be mapped here is let go at once.
    #[staticmethod]
    fn open(
        py: Python<'_>,
        manager: &Manager,
        key: &str,
        plan: &Bound<'_, PyAny>,
    ) -> PyResult<SharedPrefix> {
        let client = broker_of(py, manager)?;
        let opened = py
            .detach(|| client.open_prefix(key))
            .map_err(|e| broker_error(py, &e))?;
        let (descriptor, reader) = prefix_meta::split(&opened.meta);
        let chosen = match plan.cast::<PyPlan>() {
            Ok(p) => Ok(p.clone()),
            Err(_) => plan
                .call1((reader,))
                .and_then(|p| Ok(p.cast_into::<PyPlan>()?)),
        };
        let plan = match chosen {
            Ok(p) => p,
            Err(e) => {
                // Not a user of a prefix it refused.
                let _ = py.detach(|| client.close_prefix(key));
                return Err(e);
            }
        };
        let plan = plan.get().plan;
        let fds: Vec<BorrowedFd<'_>> = opened.fds.iter().map(AsFd::as_fd).collect();
        let vm = &manager.state.vm;
        let imported = py.detach(|| {
            PrefixDescriptor::decode(descriptor)
                .and_then(|d| SharedDevicePrefix::import(vm, &plan, &d, &fds))
        });
        match imported {
            Ok(prefix) => Ok(SharedPrefix::without_owner(prefix)),
            Err(e) => {
                // Not a user of a prefix it could not read or map.
                let _ = py.detach(|| client.close_prefix(key));
                Err(errors::kv(py, &e))
            }
        }
    }

    /// Gives `sequence` (empty, of the same plan) the prefix's :attr:`tokens`: maps read-only
    /// the windows lying wholly before the end of its last token, commits the rest privately
    /// and copies it from the prefix (waiting for the copy). Returns the bytes mapped
    /// read-only (shared, not billed to the sequence). The sequence then holds the prefix,
    /// written, and writes its own tokens after it, in its own memory only.
    ///
    /// With ``first`` (the layers of a sliding window, which read only the last tokens and
    /// give their oldest windows back): nothing is mapped read-only; the sequence forgets the
    /// tokens before ``first`` from the start and the prefix's tokens from ``first`` on are
    /// copied into its own windows. Returns the bytes copied then.
    #[pyo3(signature = (sequence, first = None))]
    fn attach(&self, py: Python<'_>, sequence: &Sequence, first: Option<Count>) -> PyResult<u64> {
        let cell = Arc::clone(&sequence.cell);
        let prefix = Arc::clone(&self.prefix);
        unless_viewed(
            py,
            std::slice::from_ref(&sequence.cell),
            "attach a prefix",
            move || {
                cell.admission(|s| match first {
                    None => prefix.attach_to(s),
                    Some(Count(t)) => prefix.attach_from(s, t),
                })
            },
        )
    }

    fn __repr__(&self) -> String {
        format!(
            "SharedPrefix(tokens={}, shared_tokens={}, bytes={}, sealed={})",
            self.prefix.prefix_len(),
            self.prefix.shared_tokens(),
            self.prefix.bytes(),
            self.prefix.is_sealed()
        )
    }
}
