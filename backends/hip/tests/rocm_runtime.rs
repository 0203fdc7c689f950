//! The backend against a real HIP runtime: Debian's ROCm 5.2 (`apt-get install -y
//! libamdhip64-5`), on a machine without an AMD GPU (CI).
//!
//! When no libamdhip64 is installed at all, each test prints
//! `skipped: no HIP runtime (libamdhip64 not found)` and returns. CI installs the package, so
//! there these tests really run. On a machine *with* an AMD GPU the no-device test checks that
//! opening succeeds instead.

use std::mem::{offset_of, size_of};
use std::time::{Duration, Instant};

use kvvm_hal::{BackendError, ErrorKind, Operation};
use kvvm_hip::driver::{HipMemAllocationPropV52, HipMemAllocationPropV54};
use kvvm_hip::{HipRuntime, PropLayout, RuntimeVersion};

/// The system runtime, or `Ok(None)` (with the skip line printed) when none is installed.
/// A runtime that is installed but cannot be loaded is an error, not a skip.
fn system_runtime() -> Result<Option<HipRuntime>, BackendError> {
    match HipRuntime::load_system() {
        Ok(rt) => Ok(Some(rt)),
        Err(e) if e.to_string().contains("libamdhip64 not found") => {
            println!("skipped: no HIP runtime (libamdhip64 not found)");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

#[test]
fn the_runtime_version_is_read_and_picks_the_layout() {
    let Some(rt) = system_runtime().expect("an installed runtime loads") else {
        return;
    };
    let v = rt.version();
    println!("loaded {} (HIP runtime {v}, raw {})", rt.library(), v.raw());
    assert!(v >= RuntimeVersion::new(5, 0, 0), "{v}");
    if v.major() == 5 && v.minor() == 2 {
        // Debian 12's libamdhip64-5 (ROCm 5.2.3) reports 50221153.
        assert_eq!(v, RuntimeVersion(50221153));
        assert_eq!(v.to_string(), "5.2.21153");
        assert_eq!(rt.layout(), Ok(PropLayout::Rocm52));
    } else if v >= RuntimeVersion::new(5, 4, 0) && v < RuntimeVersion::new(8, 0, 0) {
        assert_eq!(rt.layout(), Ok(PropLayout::Rocm54));
    }
}

#[test]
fn no_amd_gpu_is_unavailable_within_a_second() {
    let Some(rt) = system_runtime().expect("an installed runtime loads") else {
        return;
    };
    let version = rt.version();
    let start = Instant::now();
    let result = rt.open();
    let elapsed = start.elapsed();
    assert!(
        elapsed < Duration::from_secs(1),
        "opening took {elapsed:?}: it must not hang"
    );
    match result {
        Err(e) => {
            println!("open: {e} ({elapsed:?})");
            assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
            assert_eq!(e.op, Operation::Load);
            let s = e.to_string();
            assert!(s.contains("no HIP device"), "{s}");
            assert!(s.contains("hipErrorNoDevice"), "{s}");
            assert!(s.contains(&version.to_string()), "{s}");
        }
        Ok(backend) => {
            // A machine with an AMD GPU: the runtime opened for real.
            println!(
                "a HIP device is present: {} device(s), runtime {}",
                backend.device_count(),
                backend.runtime_version()
            );
            assert!(backend.device_count() > 0);
        }
    }
}

#[test]
fn the_backend_open_path_is_typed_too() {
    // Through the public entry point (KVVM_HIP_LIBRARY or the default names): never a panic,
    // and without a GPU always a typed Unavailable.
    let start = Instant::now();
    match kvvm_hip::HipBackend::open() {
        Ok(b) => assert!(b.device_count() > 0),
        Err(e) => assert_eq!(e.kind, ErrorKind::Unavailable, "{e}"),
    }
    assert!(start.elapsed() < Duration::from_secs(1));
}

#[test]
fn rocm_5_2_layout_offsets() {
    assert_eq!(size_of::<HipMemAllocationPropV52>(), 32);
    assert_eq!(offset_of!(HipMemAllocationPropV52, compression_type), 0);
    assert_eq!(offset_of!(HipMemAllocationPropV52, location), 4);
    assert_eq!(offset_of!(HipMemAllocationPropV52, location.id), 8);
    assert_eq!(
        offset_of!(HipMemAllocationPropV52, requested_handle_type),
        12
    );
    assert_eq!(offset_of!(HipMemAllocationPropV52, type_), 16);
    assert_eq!(offset_of!(HipMemAllocationPropV52, usage), 20);
    assert_eq!(
        offset_of!(HipMemAllocationPropV52, win32_handle_meta_data),
        24
    );
}

#[test]
fn rocm_5_4_and_later_layout_offsets() {
    assert_eq!(size_of::<HipMemAllocationPropV54>(), 32);
    assert_eq!(offset_of!(HipMemAllocationPropV54, type_), 0);
    assert_eq!(
        offset_of!(HipMemAllocationPropV54, requested_handle_type),
        4
    );
    assert_eq!(offset_of!(HipMemAllocationPropV54, location), 8);
    assert_eq!(offset_of!(HipMemAllocationPropV54, location.id), 12);
    assert_eq!(
        offset_of!(HipMemAllocationPropV54, win32_handle_meta_data),
        16
    );
    assert_eq!(offset_of!(HipMemAllocationPropV54, alloc_flags), 24);
    assert_eq!(
        offset_of!(HipMemAllocationPropV54, alloc_flags.compression_type),
        24
    );
    assert_eq!(
        offset_of!(HipMemAllocationPropV54, alloc_flags.gpu_direct_rdma_capable),
        25
    );
    assert_eq!(offset_of!(HipMemAllocationPropV54, alloc_flags.usage), 26);
}
