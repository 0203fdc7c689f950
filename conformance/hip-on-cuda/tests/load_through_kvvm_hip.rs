//! Loads libhip_on_cuda.so through kvvm-hip, as `KVVM_HIP_LIBRARY` would.
//!
//! Without libcuda.so.1 (this machine, CI) the shim must give a clean `Unavailable` (no
//! device), never a panic or a hang. With a CUDA driver (the H200) it must open and list the
//! GPUs. The .so is the one cargo builds into this test's `deps/` folder; set
//! `KVVM_HIP_ON_CUDA_SO` to test another file.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvvm_hal::{ErrorKind, Operation, VirtualMemoryBackend};
use kvvm_hip::{HipRuntime, PropLayout};

fn shim_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVVM_HIP_ON_CUDA_SO") {
        return Some(PathBuf::from(p));
    }
    // The test binary is target/<profile>/deps/<name>; `cargo test` builds the cdylib into
    // that same deps/ folder (`cargo build` also copies it up to target/<profile>/).
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    let fresh = deps.join("libhip_on_cuda.so");
    if fresh.is_file() {
        return Some(fresh);
    }
    Some(deps.parent()?.join("libhip_on_cuda.so"))
}

fn libcuda_present() -> bool {
    // SAFETY: loading libcuda runs its initialisers, which are safe in any process.
    unsafe { libloading::Library::new("libcuda.so.1") }.is_ok()
}

#[test]
fn the_shim_loads_as_a_rocm_6_runtime() {
    let path = shim_path().expect("a target directory");
    assert!(path.is_file(), "{} not built", path.display());
    let rt = HipRuntime::load_from(&path.to_string_lossy()).expect("the shim has every symbol");
    assert_eq!(rt.version().major(), 6);
    assert_eq!(rt.version().to_string(), "6.2.41134");
    assert_eq!(rt.layout(), Ok(PropLayout::Rocm54));
}

#[test]
fn without_libcuda_the_shim_is_a_clean_unavailable() {
    let path = shim_path().expect("a target directory");
    let rt = HipRuntime::load_from(&path.to_string_lossy()).expect("the shim has every symbol");
    let start = Instant::now();
    let result = rt.open();
    assert!(start.elapsed() < Duration::from_secs(if libcuda_present() { 30 } else { 1 }));
    if libcuda_present() {
        match result {
            Ok(backend) => {
                let devices = backend.devices().expect("devices");
                println!("through the shim: {devices:?}");
                assert!(!devices.is_empty());
                assert!(devices.iter().all(|d| d.vmm_supported));
            }
            // A CUDA driver without a usable GPU.
            Err(e) => assert_eq!(e.kind, ErrorKind::Unavailable, "{e}"),
        }
        return;
    }
    let e = result.expect_err("no libcuda.so.1 here");
    println!("through the shim without CUDA: {e}");
    assert_eq!(e.kind, ErrorKind::Unavailable);
    assert_eq!(e.op, Operation::Load);
    let s = e.to_string();
    assert!(s.contains("no HIP device"), "{s}");
    assert!(s.contains("6.2.41134"), "{s}");
    assert!(s.contains("hipErrorInsufficientDriver"), "{s}");
}
