//! `kvvm.TensorView`: a strided window onto kvvm memory, exported to tensor libraries through
//! DLPack (`__dlpack__` / `__dlpack_device__`), zero-copy.
//!
//! A view holds a guard on every sequence it covers: while a view object or any tensor made
//! from it lives, those sequences refuse to release or shrink ([`ViewsAliveError`]), and their
//! memory (the reservation) stays alive even if the Python sequence object is dropped.
//!
//! [`ViewsAliveError`]: the `kvvm.errors.ViewsAliveError` exception

use std::ffi::c_void;
use std::sync::Arc;

use dlpark::ffi::{
    DLDataType, DLDataTypeCode, DLDevice, DLManagedTensor, DLManagedTensorVersioned,
};
use dlpark::metadata::Dynamic;
use dlpark::python::producer::{ExportAbi, ExportRequest};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use kvvm::kv::KvDtype;
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;

use crate::cell::SeqCell;

/// The DLPack element type of a KV dtype.
pub(crate) fn dl_dtype(dtype: KvDtype) -> DLDataType {
    match dtype {
        KvDtype::F16 => DLDataType::scalar(DLDataTypeCode::FLOAT, 16),
        KvDtype::Bf16 => DLDataType::scalar(DLDataTypeCode::BFLOAT, 16),
        KvDtype::F32 => DLDataType::scalar(DLDataTypeCode::FLOAT, 32),
        KvDtype::Fp8 => DLDataType::scalar(DLDataTypeCode::FLOAT8_E4M3FN, 8),
    }
}

/// What a view describes; shared by the view object and every tensor exported from it.
pub(crate) struct ViewInner {
    /// The sequences the view covers (each counted as viewed while this lives).
    guards: Vec<Arc<SeqCell>>,
    pub(crate) ptr: u64,
    pub(crate) shape: Vec<i64>,
    /// Strides in elements.
    pub(crate) strides: Vec<i64>,
    pub(crate) dtype: KvDtype,
    pub(crate) device: DLDevice,
    pub(crate) readonly: bool,
}

impl Drop for ViewInner {
    fn drop(&mut self) {
        for g in &self.guards {
            g.unview();
        }
    }
}

/// A zero-copy view of kvvm memory for tensor libraries (``torch.from_dlpack(view)``,
/// ``numpy.from_dlpack(view)``).
#[pyclass(frozen, module = "kvvm._native")]
pub struct TensorView {
    pub(crate) inner: Arc<ViewInner>,
}

impl TensorView {
    /// A view over `guards` (already counted as viewed by the caller through
    /// [`SeqCell::try_view`]).
    pub(crate) fn new(
        guards: Vec<Arc<SeqCell>>,
        ptr: u64,
        shape: Vec<i64>,
        strides: Vec<i64>,
        dtype: KvDtype,
        device: DLDevice,
        readonly: bool,
    ) -> Self {
        TensorView {
            inner: Arc::new(ViewInner {
                guards,
                ptr,
                shape,
                strides,
                dtype,
                device,
                readonly,
            }),
        }
    }

    fn export<M: ManagedTensorBase>(&self, flags: DlpackFlags) -> PyResult<Managed<M>> {
        let inner = &self.inner;
        let mut init = Dynamic::new(inner.shape.clone(), inner.strides.clone())
            .initialize_as::<M>(Arc::clone(inner))
            .map_err(|e| PyBufferError::new_err(e.to_string()))?;
        init.set_data(inner.ptr as *mut c_void)
            .set_device(inner.device)
            .set_dtype(dl_dtype(inner.dtype))
            .set_byte_offset(0);
        init.set_flags(flags)
            .map_err(|e| PyBufferError::new_err(e.to_string()))?;
        // SAFETY: the data pointer lies in mapped kvvm memory kept alive by the context (the
        // `Arc<ViewInner>` holds the sequences, hence their reservations, and blocks their
        // release and shrink while it lives); shape and strides were copied into the
        // allocation by `Dynamic::new`; the flags say read-only exactly when every byte of
        // the view lies in read-only shared memory, and never claim a copy.
        Ok(unsafe { init.finish() })
    }
}

#[pymethods]
impl TensorView {
    /// Exports the view as a DLPack capsule (the Python array API's protocol). Zero-copy only:
    /// `copy=True` or another device is refused. A read-only view carries the read-only flag
    /// when the consumer asks for a versioned capsule (the hardware enforces it either way).
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let request = ExportRequest::parse(stream, max_version, dl_device, copy)?;
        let flags = if self.inner.readonly && request.abi() == ExportAbi::Versioned {
            DlpackFlags::READ_ONLY
        } else {
            DlpackFlags::empty()
        };
        // kvvm writes device memory with synchronous driver copies: nothing to order on the
        // consumer's stream.
        request.export_zero_copy(
            py,
            self.inner.device,
            flags,
            || self.export::<DLManagedTensor>(DlpackFlags::empty()),
            || self.export::<DLManagedTensorVersioned>(flags),
        )
    }

    /// `(device_type, device_id)` as DLPack numbers them (1 CPU, 2 CUDA, 10 ROCm).
    fn __dlpack_device__(&self) -> (u32, i32) {
        (self.inner.device.device_type.0, self.inner.device.device_id)
    }

    /// The shape.
    #[getter]
    fn shape(&self) -> Vec<i64> {
        self.inner.shape.clone()
    }

    /// Strides in elements.
    #[getter]
    fn strides(&self) -> Vec<i64> {
        self.inner.strides.clone()
    }

    /// The address of element 0.
    #[getter]
    fn data_ptr(&self) -> u64 {
        self.inner.ptr
    }

    /// The element type's name.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype.as_str()
    }

    /// Whether every byte of the view is read-only shared memory.
    #[getter]
    fn readonly(&self) -> bool {
        self.inner.readonly
    }

    fn __repr__(&self) -> String {
        format!(
            "TensorView(shape={:?}, strides={:?}, dtype={:?}, readonly={}, ptr={:#x})",
            self.inner.shape,
            self.inner.strides,
            self.inner.dtype.as_str(),
            self.inner.readonly,
            self.inner.ptr
        )
    }
}
