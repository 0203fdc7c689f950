//! The realloc-and-copy baseline: what growing a device buffer costs without virtual memory.
//!
//! With a buffer of `size` bytes already allocated (not timed), time allocating `size + extra`,
//! copying `size` bytes device to device, synchronizing (so the copy is complete) and freeing
//! the old buffer. The pointer changes every time. The trait has no plain allocation nor a
//! device-to-device copy, so this needs a vendor backend's own calls: CUDA's
//! [`CudaBackend::mem_alloc`], [`CudaBackend::copy_device_to_device`] and
//! [`CudaBackend::mem_free`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvvm::cuda::CudaBackend;
use kvvm::{BackendError, DeviceId, ErrorKind, Operation, VirtualMemoryBackend};

/// Times one realloc-and-copy of a `size`-byte buffer grown by `extra` bytes on `device`.
/// Everything allocated is freed before returning.
pub fn time_realloc_copy(
    cuda: &CudaBackend,
    device: DeviceId,
    size: u64,
    extra: u64,
) -> Result<Duration, BackendError> {
    let new_len = size.checked_add(extra).ok_or_else(|| {
        BackendError::raised(
            Operation::CopyToDevice,
            ErrorKind::InvalidValue,
            "size + extra overflows",
        )
    })?;
    let old = cuda.mem_alloc(device, size)?;
    let start = Instant::now();
    let new = match cuda.mem_alloc(device, new_len) {
        Ok(p) => p,
        Err(e) => {
            let _ = cuda.mem_free(device, old);
            return Err(e);
        }
    };
    let copied = cuda
        .copy_device_to_device(device, new, old, size)
        .and_then(|()| cuda.synchronize(device));
    let freed_old = cuda.mem_free(device, old);
    let elapsed = start.elapsed();
    let freed_new = cuda.mem_free(device, new);
    copied?;
    freed_old?;
    freed_new?;
    Ok(elapsed)
}

/// The realloc-and-copy baseline of one device, as the manager benchmark takes it.
pub struct ReallocCopy {
    cuda: Arc<CudaBackend>,
    device: DeviceId,
}

impl ReallocCopy {
    /// The baseline on `device` of `cuda`.
    pub fn new(cuda: Arc<CudaBackend>, device: DeviceId) -> Self {
        ReallocCopy { cuda, device }
    }

    /// One measurement (see [`time_realloc_copy`]).
    pub fn time(&mut self, size: u64, extra: u64) -> Result<Duration, BackendError> {
        time_realloc_copy(&self.cuda, self.device, size, extra)
    }
}

/// A backend opened for the manager benchmark: CUDA when asked for (or when `auto` finds it),
/// opened directly so that the realloc-and-copy baseline can use its own calls; any other
/// backend through [`kvvm::open_backend_verbose`].
pub struct BenchBackend {
    /// The backend.
    pub backend: Arc<dyn VirtualMemoryBackend>,
    /// For `auto`: why the better backends were not chosen, when the choice fell back.
    pub notice: Option<String>,
    /// For `auto`: the backends tried before the one chosen, and why each failed.
    pub passed_over: Vec<kvvm::OpenError>,
    cuda: Option<Arc<CudaBackend>>,
}

impl BenchBackend {
    /// Opens `name` (`sim`, `cuda`, `hip`, `host` or `auto`).
    pub fn open(name: &str) -> Result<Self, kvvm::OpenError> {
        let cuda = match name {
            "cuda" => Some(
                CudaBackend::open().map_err(|source| kvvm::OpenError::Backend {
                    name: "cuda".into(),
                    source,
                })?,
            ),
            "auto" => CudaBackend::open().ok(),
            _ => None,
        };
        if let Some(c) = cuda {
            let c = Arc::new(c);
            let backend: Arc<dyn VirtualMemoryBackend> = c.clone();
            return Ok(BenchBackend {
                backend,
                notice: None,
                passed_over: Vec::new(),
                cuda: Some(c),
            });
        }
        let opened = kvvm::open_backend_verbose(name)?;
        Ok(BenchBackend {
            backend: opened.backend,
            notice: opened.notice,
            passed_over: opened.passed_over,
            cuda: None,
        })
    }

    /// The realloc-and-copy baseline on `device`, when the backend can measure it (CUDA).
    pub fn realloc_baseline(&self, device: DeviceId) -> Option<ReallocCopy> {
        self.cuda
            .as_ref()
            .map(|c| ReallocCopy::new(Arc::clone(c), device))
    }
}
