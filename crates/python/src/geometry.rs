//! `kvvm.KvGeometry` and `kvvm.LayoutPlan`: the shape of a model's KV cache and where every
//! byte of it lives under a layout.

use kvvm::kv::{evaluate_prefix_shareability, KvDtype, KvGeometry, KvLayout, LayoutPlan};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::count::{Count, Dim};
use crate::errors;

/// The shape of one sequence's KV cache: `layers x {K, V} x kv_heads x max_tokens x head_dim`
/// elements of `dtype` (``"bf16"``, ``"fp16"``, ``"fp32"`` or ``"fp8"``).
#[pyclass(frozen, name = "KvGeometry", module = "kvvm._native")]
#[derive(Debug, Clone, Copy)]
pub struct PyGeometry {
    pub(crate) geometry: KvGeometry,
    pub(crate) dtype: KvDtype,
}

/// Parses a dtype name.
pub(crate) fn dtype_arg(py: Python<'_>, name: &str) -> PyResult<KvDtype> {
    name.parse::<KvDtype>().map_err(|e| errors::layout(py, &e))
}

#[pymethods]
impl PyGeometry {
    /// A geometry from numbers. Every dimension must be positive.
    #[new]
    #[pyo3(signature = (layers, kv_heads, head_dim, max_tokens, dtype = "bf16"))]
    fn new(
        py: Python<'_>,
        layers: Dim,
        kv_heads: Dim,
        head_dim: Dim,
        max_tokens: Count,
        dtype: &str,
    ) -> PyResult<Self> {
        let (layers, kv_heads, head_dim, max_tokens) =
            (layers.0, kv_heads.0, head_dim.0, max_tokens.0);
        let dtype = dtype_arg(py, dtype)?;
        let geometry = KvGeometry::with_dtype(layers, kv_heads, head_dim, dtype, max_tokens)
            .map_err(|e| errors::layout(py, &e))?;
        Ok(PyGeometry { geometry, dtype })
    }

    /// The geometry of a known model (``"llama-3-8b"``, ``"llama-3-70b"``, ``"mistral-7b"``,
    /// ``"qwen2.5-7b"``).
    #[staticmethod]
    #[pyo3(signature = (name, max_tokens, dtype = "bf16"))]
    fn preset(py: Python<'_>, name: &str, max_tokens: u64, dtype: &str) -> PyResult<Self> {
        let dtype = dtype_arg(py, dtype)?;
        let geometry =
            KvGeometry::preset(name, dtype, max_tokens).map_err(|e| errors::layout(py, &e))?;
        Ok(PyGeometry { geometry, dtype })
    }

    /// The names :meth:`preset` knows.
    #[staticmethod]
    fn preset_names() -> Vec<&'static str> {
        KvGeometry::preset_names()
    }

    /// Layers.
    #[getter]
    fn layers(&self) -> u32 {
        self.geometry.layers()
    }

    /// KV heads (grouped-query attention: fewer than the query heads).
    #[getter]
    fn kv_heads(&self) -> u32 {
        self.geometry.kv_heads()
    }

    /// Elements per head.
    #[getter]
    fn head_dim(&self) -> u32 {
        self.geometry.head_dim()
    }

    /// The most tokens a sequence of this geometry holds.
    #[getter]
    fn max_tokens(&self) -> u64 {
        self.geometry.max_tokens()
    }

    /// The element type's name (``"bf16"``, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.as_str()
    }

    /// Bytes per element.
    #[getter]
    fn dtype_bytes(&self) -> u32 {
        self.geometry.dtype_bytes()
    }

    /// Bytes of one token's K and V in every layer.
    #[getter]
    fn bytes_per_token(&self) -> u64 {
        self.geometry.bytes_per_token()
    }

    /// Bytes of `max_tokens` tokens.
    #[getter]
    fn total_bytes(&self) -> u64 {
        self.geometry.total_bytes()
    }

    /// The same shape with another `max_tokens`.
    fn with_max_tokens(&self, py: Python<'_>, max_tokens: u64) -> PyResult<Self> {
        let geometry = self
            .geometry
            .with_max_tokens(max_tokens)
            .map_err(|e| errors::layout(py, &e))?;
        Ok(PyGeometry {
            geometry,
            dtype: self.dtype,
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "KvGeometry(layers={}, kv_heads={}, head_dim={}, max_tokens={}, dtype={:?})",
            self.geometry.layers(),
            self.geometry.kv_heads(),
            self.geometry.head_dim(),
            self.geometry.max_tokens(),
            self.dtype.as_str()
        )
    }
}

/// Parses a layout name (``"head-major"``, ``"seq-major"``, ``"token-major"``).
pub(crate) fn layout_arg(py: Python<'_>, name: &str) -> PyResult<KvLayout> {
    name.parse::<KvLayout>().map_err(|e| errors::layout(py, &e))
}

/// A geometry laid out under a layout for a granule: every fragment starts on a granule
/// boundary, so windows are committed, shared and released whole.
#[pyclass(frozen, name = "LayoutPlan", module = "kvvm._native")]
#[derive(Debug, Clone, Copy)]
pub struct PyPlan {
    pub(crate) plan: LayoutPlan,
    pub(crate) dtype: KvDtype,
}

#[pymethods]
impl PyPlan {
    /// Lays `geometry` out under `layout` for `granule` bytes (use ``Manager.granule``).
    #[new]
    fn new(py: Python<'_>, geometry: &PyGeometry, layout: &str, granule: u64) -> PyResult<Self> {
        let layout = layout_arg(py, layout)?;
        let plan = LayoutPlan::new(geometry.geometry, layout, granule)
            .map_err(|e| errors::layout(py, &e))?;
        Ok(PyPlan {
            plan,
            dtype: geometry.dtype,
        })
    }

    /// The geometry.
    #[getter]
    fn geometry(&self) -> PyGeometry {
        PyGeometry {
            geometry: *self.plan.geometry(),
            dtype: self.dtype,
        }
    }

    /// The layout's name.
    #[getter]
    fn layout(&self) -> &'static str {
        self.plan.layout().as_str()
    }

    /// The granule.
    #[getter]
    fn granule(&self) -> u64 {
        self.plan.granule()
    }

    /// Address space one sequence reserves.
    #[getter]
    fn reservation_bytes(&self) -> u64 {
        self.plan.reservation_bytes()
    }

    /// Reserved bytes that never hold data (fragments padded to the granule).
    #[getter]
    fn padding_bytes(&self) -> u64 {
        self.plan.padding_bytes()
    }

    /// Contiguous fragments of a sequence.
    #[getter]
    fn fragments(&self) -> u64 {
        self.plan.slice_count()
    }

    /// Byte strides: a dict with ``layer``, ``kv``, ``head`` and ``token``.
    fn strides<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.plan.strides();
        crate::dict::counters(
            py,
            &[
                ("layer", s.layer),
                ("kv", s.kv),
                ("head", s.head),
                ("token", s.token),
            ],
        )
    }

    /// Bytes committed for `tokens` live tokens (granule x windows holding a live byte).
    fn committed_bytes_for_tokens(&self, py: Python<'_>, tokens: u64) -> PyResult<u64> {
        self.plan
            .committed_bytes_for_tokens(tokens)
            .map_err(|e| errors::layout(py, &e))
    }

    /// The most tokens whose bytes all lie in the windows that hold the first `tokens`
    /// tokens: what may be written past `tokens` without committing another window.
    fn mapped_tokens(&self, py: Python<'_>, tokens: u64) -> PyResult<u64> {
        self.plan
            .mapped_tokens(tokens)
            .map_err(|e| errors::layout(py, &e))
    }

    /// Whether a prefix of `prefix_tokens` can be shared under this plan: a dict with
    /// ``shareable`` (bool), ``shared_tokens`` and ``reason`` (None when shareable).
    fn shareability<'py>(
        &self,
        py: Python<'py>,
        prefix_tokens: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let v = evaluate_prefix_shareability(
            self.plan.geometry(),
            self.plan.layout(),
            prefix_tokens,
            self.plan.granule(),
        )
        .map_err(|e| errors::layout(py, &e))?;
        let d = PyDict::new(py);
        d.set_item("shareable", v.shareable)?;
        d.set_item(
            "shared_granules_per_fragment",
            v.shareable_granules_per_fragment,
        )?;
        d.set_item("reason", v.refusal_reason())?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "LayoutPlan(layout={:?}, granule={}, reservation_bytes={})",
            self.plan.layout().as_str(),
            self.plan.granule(),
            self.plan.reservation_bytes()
        )
    }
}
