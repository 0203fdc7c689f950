//! kvvm-hip -> libhip_on_cuda.so -> a fake libcuda.so.1, end to end, without a GPU.
//!
//! The parent test compiles `tests/fake_cuda/fake_cuda.c` (host memory behind the CUDA VMM
//! API, structs declared as in cuda.h) into a temporary `libcuda.so.1` and re-runs this test
//! binary with `LD_LIBRARY_PATH` pointing there, so that the shim's `dlopen("libcuda.so.1")`
//! finds the fake. The child drives every backend call through the shim and checks the
//! results, including the `CUmemAllocationProp` the fake received (a C compiler's layout
//! against the shim's hand-written one). Without a C compiler the test prints a skip line.

use std::path::PathBuf;
use std::process::Command;

use kvvm_hal::{
    AccessDescriptor, AllocationProperties, DeviceAddress, DeviceId, ErrorKind,
    ShareableHandleType, VirtualMemoryBackend,
};
use kvvm_hip::{HipBackend, PropLayout};

const CHILD_ENV: &str = "KVVM_FAKE_CUDA_CHILD";
const SHIM_ENV: &str = "KVVM_HIP_ON_CUDA_SO";
const MIB: u64 = 1 << 20;

fn shim_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(SHIM_ENV) {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    let fresh = deps.join("libhip_on_cuda.so");
    if fresh.is_file() {
        return Some(fresh);
    }
    Some(deps.parent()?.join("libhip_on_cuda.so"))
}

#[test]
fn the_backend_drives_the_shim_over_a_fake_cuda_driver() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let shim = shim_path().expect("a target directory");
    assert!(shim.is_file(), "{} not built", shim.display());
    let dir = std::env::temp_dir().join(format!("kvvm-fake-cuda-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fake_cuda/fake_cuda.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let built = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o"])
        .arg(dir.join("libcuda.so.1"))
        .arg(&source)
        .status();
    match built {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{cc} failed to build the fake libcuda: {s}"),
        Err(e) => {
            println!("skipped: no C compiler ({cc}: {e})");
            return;
        }
    }
    let mut search = dir.clone().into_os_string();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        search.push(":");
        search.push(old);
    }
    let out = Command::new(std::env::current_exe().expect("current exe"))
        .args([
            "--exact",
            "child_end_to_end",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .env(SHIM_ENV, &shim)
        .env("LD_LIBRARY_PATH", search)
        .output()
        .expect("the child runs");
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}\n{stderr}");
    assert!(out.status.success(), "child failed: {}", out.status);
    assert!(stdout.contains("child: ok"), "the child did not run");
}

/// `CUmemAllocationProp` as the fake received it (read back through `fake_last_prop`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SeenProp {
    type_: u32,
    requested_handle_types: u32,
    location_type: u32,
    location_id: i32,
    win32: usize,
    alloc_flags: u64,
}

fn last_prop_seen_by_the_fake() -> Result<SeenProp, libloading::Error> {
    // SAFETY: libcuda.so.1 is the fake (LD_LIBRARY_PATH), already loaded by the shim; loading
    // it again returns the same instance.
    let lib = unsafe { libloading::Library::new("libcuda.so.1") }?;
    // SAFETY: `fake_last_prop` is `const CUmemAllocationProp *fake_last_prop(void)`.
    let f = unsafe { lib.get::<unsafe extern "C" fn() -> *const SeenProp>("fake_last_prop") }?;
    // SAFETY: the fake returns a pointer to its static 32-byte prop.
    let prop = unsafe { *f() };
    Ok(prop)
}

/// `hipDeviceCanAccessPeer(&can, device, peer)` called on the shim: `(return code, can)`.
fn shim_can_access_peer(
    shim: &std::ffi::OsStr,
    device: i32,
    peer: i32,
) -> Result<(i32, i32), libloading::Error> {
    // SAFETY: the shim is already loaded by the backend; loading it again returns the same
    // instance, and its initialisers are safe to run in any process.
    let lib = unsafe { libloading::Library::new(shim) }?;
    // SAFETY: `hipError_t hipDeviceCanAccessPeer(int*, int, int)`.
    let f = unsafe {
        lib.get::<unsafe extern "C" fn(*mut i32, i32, i32) -> i32>("hipDeviceCanAccessPeer")
    }?;
    let mut can = -1;
    // SAFETY: `can` is a valid out-parameter.
    let rc = unsafe { f(&mut can, device, peer) };
    Ok((rc, can))
}

#[test]
fn child_end_to_end() {
    let Some(shim) = std::env::var_os(CHILD_ENV).and(std::env::var_os(SHIM_ENV)) else {
        return;
    };
    let b = HipBackend::open_library(&shim.to_string_lossy()).expect("opens over the fake");
    assert_eq!(b.runtime_version().to_string(), "6.2.41134");
    assert_eq!(b.prop_layout(), PropLayout::Rocm54);

    let devices = b.devices().expect("devices");
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].name, "Fake CUDA Device");
    assert_eq!(devices[0].total_memory, 64 * MIB);
    assert!(devices[0].vmm_supported);
    assert!(devices[0].driver_version.contains("6.2.41134"));
    assert!(devices[0].driver_version.contains("driver 13000"));

    let caps = b.capabilities();
    assert!(!caps.unmap_spans_mappings && !caps.kernels);
    assert!(caps.set_access_retries > 0);

    // Peer access: a device reaches its own memory; a device the backend lacks is refused.
    assert!(b.can_access_peer(DeviceId(0), DeviceId(0)).expect("itself"));
    let e = b
        .can_access_peer(DeviceId(0), DeviceId(1))
        .expect_err("one device");
    assert_eq!(e.kind, ErrorKind::InvalidValue, "{e}");
    // The shim's hipDeviceCanAccessPeer forwards to cuDeviceCanAccessPeer (the fake answers 0
    // for device 0) and maps an unknown ordinal onto hipErrorInvalidDevice.
    let peer = |d, p| shim_can_access_peer(&shim, d, p).expect("hipDeviceCanAccessPeer");
    assert_eq!(peer(0, 0), (0, 0));
    assert_eq!(peer(0, 1).0, 101);

    let d0 = DeviceId(0);
    let props = AllocationProperties::device(d0);
    let g = b.granularity(&props).expect("granularity");
    assert_eq!((g.minimum, g.recommended), (2 * MIB, 2 * MIB));
    let info = b.memory_info(d0).expect("memory info");
    assert_eq!((info.free, info.total), (64 * MIB, 64 * MIB));

    let base = b.reserve(8 * MIB, 0, None).expect("reserve");
    assert_ne!(base, DeviceAddress(0));

    let h = b.create(2 * MIB, &props).expect("create");
    let seen = last_prop_seen_by_the_fake().expect("the fake libcuda");
    assert_eq!(
        (
            seen.type_,
            seen.requested_handle_types,
            seen.location_type,
            seen.location_id
        ),
        (1, 0, 1, 0),
        "{seen:?}"
    );
    let posix = AllocationProperties {
        device: d0,
        handle_type: ShareableHandleType::PosixFd,
    };
    let h2 = b.create(2 * MIB, &posix).expect("create exportable");
    let seen = last_prop_seen_by_the_fake().expect("the fake libcuda");
    assert_eq!(seen.requested_handle_types, 1);

    let e = b
        .create(2 * MIB + 1, &props)
        .expect_err("not a granule multiple");
    assert_eq!((e.kind, e.code), (ErrorKind::InvalidValue, 1), "{e}");
    let e = b.create(128 * MIB, &props).expect_err("past capacity");
    assert_eq!(e.kind, ErrorKind::OutOfMemory, "{e}");
    assert_eq!(e.code_name, "hipErrorOutOfMemory");

    b.map(base, 2 * MIB, h).expect("map");
    let e = b.map(base, 2 * MIB, h2).expect_err("over a live mapping");
    assert_eq!(e.kind, ErrorKind::NotSupported, "{e}");

    let data: Vec<u8> = (0..=255u8).cycle().take(4096).collect();
    let e = b.copy_to_device(base, &data).expect_err("no access yet");
    assert_eq!(e.kind, ErrorKind::InvalidValue, "{e}");
    b.set_access(base, 2 * MIB, &[AccessDescriptor::read_write(d0)])
        .expect("set access");
    b.copy_to_device(base, &data).expect("copy in");
    let mut back = vec![0u8; data.len()];
    b.copy_from_device(&mut back, base).expect("copy out");
    assert_eq!(back, data);

    b.set_access(base, 2 * MIB, &[AccessDescriptor::read_only(d0)])
        .expect("read only");
    let e = b
        .copy_to_device(base, &data)
        .expect_err("write through a read mapping");
    assert_eq!(e.kind, ErrorKind::InvalidValue, "{e}");
    b.copy_from_device(&mut back, base)
        .expect("read through a read mapping");
    b.synchronize(d0).expect("synchronize");

    let e = b.free(base, 8 * MIB).expect_err("a mapping is live");
    assert_eq!(e.kind, ErrorKind::InvalidValue, "{e}");
    let e = b.export_posix_fd(h2).expect_err("the fake does not export");
    assert_eq!(e.kind, ErrorKind::NotSupported, "{e}");

    b.unmap(base, 2 * MIB).expect("unmap");
    b.release(h).expect("release");
    b.release(h2).expect("release exportable");
    let e = b.release(h).expect_err("second release");
    assert_eq!(e.kind, ErrorKind::InvalidValue, "{e}");
    b.free(base, 8 * MIB).expect("free");
    println!("child: ok");
}
