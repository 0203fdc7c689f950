//! `CudaBackend::open` on any machine: with CUDA it opens, without it it reports why.

use kvvm_cuda::CudaBackend;
use kvvm_hal::{ErrorKind, Operation, VirtualMemoryBackend};

#[test]
fn open_returns_a_backend_or_unavailable_and_never_panics() {
    match CudaBackend::open() {
        Ok(backend) => {
            assert_eq!(backend.name(), "cuda");
            assert!(backend.device_count() > 0);
            let caps = backend.capabilities();
            assert!(caps.unmap_spans_mappings && caps.kernels);
            assert!(!caps.checks_reservation_bounds);
            assert_eq!(caps.set_access_retries, 0);
            println!("CUDA available: {:?}", backend.devices());
        }
        Err(e) => {
            assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
            assert_eq!(e.op, Operation::Load, "{e}");
            let reason = e.detail.clone().unwrap_or_default();
            assert!(!reason.is_empty(), "an Unavailable error says why: {e}");
            println!("skipped: no CUDA driver ({e})");
        }
    }
}

#[test]
fn open_is_repeatable_and_thread_safe() {
    let threads: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(|| {
                for _ in 0..3 {
                    let kind = CudaBackend::open().err().map(|e| e.kind);
                    assert!(kind.is_none() || kind == Some(ErrorKind::Unavailable));
                }
            })
        })
        .collect();
    for t in threads {
        assert!(t.join().is_ok(), "open panicked on a thread");
    }
}

#[test]
fn required_symbols_cover_the_vmm_api() {
    let names: Vec<String> = kvvm_cuda::required_symbols()
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    for needed in [
        "cuInit",
        "cuMemAddressReserve",
        "cuMemAddressFree",
        "cuMemCreate",
        "cuMemRelease",
        "cuMemMap",
        "cuMemSetAccess",
        "cuMemUnmap",
        "cuMemGetAllocationGranularity",
        "cuMemExportToShareableHandle",
        "cuMemImportFromShareableHandle",
        "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRelease_v2",
        "cuModuleLoadData",
        "cuLaunchKernel",
    ] {
        assert!(names.iter().any(|n| n == needed), "{needed} missing");
    }
}
