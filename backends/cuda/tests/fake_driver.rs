//! The CUDA backend against a fake `libcuda.so` (`tests/fake_libcuda.c`), so that the loading,
//! context, struct-passing, error-naming and probe code paths run on machines without CUDA.
//!
//! The parent test compiles the fake with the system C compiler (skipped when there is none)
//! and re-runs this test binary once per scenario with `LD_LIBRARY_PATH` pointing at it: the
//! driver library is loaded once per process, so each scenario needs its own process.

// Test helpers outside #[test] functions may fail loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::ffi::{c_int, c_uint, CStr};
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::process::Command;

use kvvm_cuda::CudaBackend;
use kvvm_hal::{
    AccessDescriptor, AllocationProperties, DeviceAddress, DeviceId, ErrorKind, HostBuffer,
    HostCopy, KernelProbeOp, Operation, PhysicalHandle, ShareableHandleType, StreamHandle,
    VirtualMemoryBackend,
};

const SCENARIO_ENV: &str = "KVVM_FAKE_CUDA_SCENARIO";
const GRAN: u64 = 2 << 20;
const TOTAL: u64 = 141 << 30;

fn compile(dir: &Path, extra: &[&str]) -> Option<PathBuf> {
    std::fs::create_dir_all(dir).ok()?;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_libcuda.c");
    let out = dir.join("libcuda.so");
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-o"])
        .arg(&out)
        .arg(&src)
        .args(extra)
        .status()
        .ok()?;
    status.success().then_some(out)
}

fn run_child(lib_dir: &Path, scenario: &str, env: &[(&str, &str)]) {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env("LD_LIBRARY_PATH", lib_dir)
        .env(SCENARIO_ENV, scenario);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("spawn child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains(&format!("FAKE_SCENARIO_OK {scenario}")),
        "scenario {scenario} failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    println!("scenario {scenario}: ok");
}

#[test]
fn fake_driver_scenarios() {
    let base = std::env::temp_dir().join(format!("kvvm-cuda-fake-{}", std::process::id()));
    let full_dir = base.join("full");
    let init_only_dir = base.join("init-only");
    if compile(&full_dir, &[]).is_none() || compile(&init_only_dir, &["-DONLY_INIT"]).is_none() {
        println!("skipped: no C compiler to build the fake libcuda");
        return;
    }
    run_child(&init_only_dir, "missing", &[]);
    run_child(&full_dir, "nodevice", &[("FAKE_CUDA_MODE", "nodevice")]);
    run_child(&full_dir, "zero", &[("FAKE_CUDA_MODE", "zero")]);
    run_child(&full_dir, "nofd", &[("FAKE_CUDA_NO_FD", "1")]);
    run_child(&full_dir, "full", &[]);
    let _ = std::fs::remove_dir_all(&base);
}

/// A test hook of the fake library.
fn hook<T: Copy>(name: &CStr) -> T {
    // SAFETY: the fake library is loaded (the backend opened it through cudarc) and exports
    // `name` with the signature `T` (see fake_libcuda.c).
    unsafe {
        let lib = cudarc::driver::sys::culib();
        *lib.get::<T>(name).expect("fake hook")
    }
}

fn refcount(dev: c_int) -> c_int {
    let f: unsafe extern "C" fn(c_int) -> c_int = hook(c"fake_refcount");
    // SAFETY: a plain getter of the fake.
    unsafe { f(dev) }
}

fn set_current_calls() -> c_int {
    let f: unsafe extern "C" fn() -> c_int = hook(c"fake_set_current_calls");
    // SAFETY: a plain getter of the fake.
    unsafe { f() }
}

fn getter_u32(name: &CStr) -> c_uint {
    let f: unsafe extern "C" fn() -> c_uint = hook(name);
    // SAFETY: a plain getter of the fake.
    unsafe { f() }
}

fn getter_i32(name: &CStr) -> c_int {
    let f: unsafe extern "C" fn() -> c_int = hook(name);
    // SAFETY: a plain getter of the fake.
    unsafe { f() }
}

fn last_access(i: c_int) -> (c_int, c_int, c_uint, c_uint) {
    let f: unsafe extern "C" fn(c_int, *mut c_int, *mut c_uint, *mut c_uint) -> c_int =
        hook(c"fake_last_access");
    let (mut id, mut flags, mut loc) = (0, 0, 0);
    // SAFETY: the fake writes three ints through valid pointers.
    let count = unsafe { f(i, &mut id, &mut flags, &mut loc) };
    (count, id, flags, loc)
}

/// The child side: runs the scenario named by the environment, or nothing.
#[test]
fn child() {
    let Some(scenario) = std::env::var_os(SCENARIO_ENV) else {
        return;
    };
    let scenario = scenario.to_string_lossy().into_owned();
    match scenario.as_str() {
        "missing" => missing(),
        "nodevice" => nodevice(),
        "zero" => zero(),
        "nofd" => nofd(),
        "full" => full(),
        other => panic!("unknown scenario {other}"),
    }
    println!("FAKE_SCENARIO_OK {scenario}");
}

fn missing() {
    let e = CudaBackend::open().unwrap_err();
    println!("{e}");
    assert_eq!(e.kind, ErrorKind::Unavailable);
    assert_eq!(e.op, Operation::Load);
    let detail = e.detail.unwrap_or_default();
    assert!(detail.contains("lacks symbol"), "{detail}");
    assert!(detail.contains("cuMemCreate"), "{detail}");
    assert!(detail.contains("cuLaunchKernel"), "{detail}");
    assert!(!detail.contains("cuInit,"), "cuInit exists: {detail}");
}

fn nodevice() {
    let e = CudaBackend::open().unwrap_err();
    println!("{e}");
    assert_eq!(e.kind, ErrorKind::Unavailable);
    assert_eq!(e.code, 100);
    assert_eq!(e.code_name, "CUDA_ERROR_NO_DEVICE");
    assert!(e.detail.unwrap_or_default().contains("cuInit"));
}

fn zero() {
    let e = CudaBackend::open().unwrap_err();
    println!("{e}");
    assert_eq!(e.kind, ErrorKind::Unavailable);
    assert_eq!(e.code, 100);
    assert!(e.detail.unwrap_or_default().contains("no CUDA device"));
}

fn nofd() {
    let b = CudaBackend::open().expect("open");
    assert!(!b.capabilities().posix_fd_handles);
    let devices = b.devices().expect("devices");
    assert!(devices[0].posix_fd_supported && !devices[1].posix_fd_supported);
    let e = b.export_posix_fd(PhysicalHandle(1)).unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotSupported);
    assert_eq!(e.op, Operation::Export);
}

fn full() {
    let b = CudaBackend::open().expect("open");
    assert_eq!(b.name(), "cuda");
    assert_eq!(b.device_count(), 2);
    assert_eq!((refcount(0), refcount(1)), (1, 1), "one retain per device");

    // Devices.
    let devices = b.devices().expect("devices");
    assert_eq!(devices.len(), 2);
    for (i, d) in devices.iter().enumerate() {
        assert_eq!(d.id, DeviceId(i as u32));
        assert_eq!(d.name, format!("Fake H200 #{i}"));
        assert_eq!(d.total_memory, TOTAL);
        assert!(d.vmm_supported && d.posix_fd_supported);
        assert_eq!(d.driver_version, "CUDA 13.0 (driver 13000)");
    }
    let caps = b.capabilities();
    assert!(caps.posix_fd_handles && caps.kernels && caps.unmap_spans_mappings);

    // Contexts: the right one is made current, and only when it is not already.
    let m1 = b.memory_info(DeviceId(1)).expect("memory_info 1");
    assert_eq!(m1.free, TOTAL - (1 << 30), "device 1's context was current");
    let m0 = b.memory_info(DeviceId(0)).expect("memory_info 0");
    assert_eq!(m0.free, TOTAL, "device 0's context was current");
    let before = set_current_calls();
    b.memory_info(DeviceId(0)).expect("memory_info 0 again");
    b.reserve(GRAN, 0, None).expect("device-neutral call");
    assert_eq!(
        set_current_calls(),
        before,
        "no cuCtxSetCurrent when already current"
    );
    let e = b.memory_info(DeviceId(2)).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue);
    // Another thread has no current context until a method makes one current.
    std::thread::scope(|s| {
        s.spawn(|| {
            let m = b
                .memory_info(DeviceId(1))
                .expect("memory_info from a thread");
            assert_eq!(m.free, TOTAL - (1 << 30));
            b.reserve(GRAN, 0, None).expect("reserve from a thread");
        });
    });

    // Granularity, honouring the requested handle type (the fake checks the struct).
    let props = AllocationProperties {
        device: DeviceId(1),
        handle_type: ShareableHandleType::PosixFd,
    };
    let g = b.granularity(&props).expect("granularity");
    assert_eq!((g.minimum, g.recommended), (GRAN, 2 * GRAN));

    // Create: pinned, on the requested device, with the requested handle type.
    let h = b.create(GRAN, &props).expect("create");
    assert_eq!(getter_i32(c"fake_last_create_device"), 1);
    assert_eq!(getter_u32(c"fake_last_handle_type"), 1);
    let h0 = b
        .create(GRAN, &AllocationProperties::device(DeviceId(0)))
        .expect("create 0");
    assert_eq!(getter_i32(c"fake_last_create_device"), 0);
    assert_eq!(getter_u32(c"fake_last_handle_type"), 0);
    let e = b
        .create(GRAN + 1, &AllocationProperties::device(DeviceId(0)))
        .unwrap_err();
    assert_eq!((e.kind, e.op), (ErrorKind::InvalidValue, Operation::Create));
    let e = b
        .create(TOTAL + GRAN, &AllocationProperties::device(DeviceId(0)))
        .unwrap_err();
    assert!(e.is_out_of_memory());

    // Reserve, map, set access with a descriptor array.
    let base = b.reserve(4 * GRAN, 0, None).expect("reserve");
    assert_eq!(base.get() & 0xffff, 0);
    let hinted = b
        .reserve(2 * GRAN, GRAN, Some(DeviceAddress(0x7e00_0000_0000)))
        .expect("reserve with hint");
    assert_eq!(hinted, DeviceAddress(0x7e00_0000_0000));
    let e = b.reserve(1 << 48, 0, None).unwrap_err();
    assert_eq!(e.kind, ErrorKind::OutOfMemory);
    b.map(base, GRAN, h).expect("map");
    let e = b
        .map(DeviceAddress(base.get() + 4096), GRAN, h)
        .unwrap_err();
    assert_eq!((e.kind, e.code), (ErrorKind::NotSupported, 801));
    assert_eq!(e.code_name, "CUDA_ERROR_NOT_SUPPORTED");
    b.set_access(
        base,
        GRAN,
        &[
            AccessDescriptor::read_write(DeviceId(0)),
            AccessDescriptor::read_only(DeviceId(1)),
            AccessDescriptor {
                device: DeviceId(0),
                access: kvvm_hal::Access::None,
            },
        ],
    )
    .expect("set_access");
    assert_eq!(last_access(0), (3, 0, 3, 1));
    assert_eq!(last_access(1), (3, 1, 1, 1));
    assert_eq!(last_access(2), (3, 0, 0, 1));

    // Copies.
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    b.copy_to_device(base, &data).expect("copy_to_device");
    let mut back = vec![0u8; data.len()];
    b.copy_from_device(&mut back, base)
        .expect("copy_from_device");
    assert_eq!(back, data);

    // A code our table does not know is named by cuGetErrorName.
    let e = b.release(PhysicalHandle(0xDEAD)).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Other);
    assert_eq!(e.code, 12345);
    assert_eq!(e.code_name, "FAKE_ERROR_12345");

    // POSIX FD export and import: the fd travels by value.
    let fd = b.export_posix_fd(h).expect("export");
    let imported = b
        .import_posix_fd(kvvm_hal::DeviceId(0), fd.as_fd())
        .expect("import");
    assert_eq!(imported, PhysicalHandle(0x100_0000 + fd.as_raw_fd() as u64));
    drop(fd);

    // Probe kernels (the fake executes them on its memory window).
    let probe = b.kernel_probe().expect("kernels");
    let sum = probe
        .run(DeviceId(0), KernelProbeOp::Load, base, 1000, 0)
        .expect("load");
    let expected: u64 = data[..1000].iter().map(|&x| u64::from(x)).sum();
    assert_eq!(sum, expected);
    assert_eq!(getter_u32(c"fake_last_grid"), 4);
    assert_eq!(getter_u32(c"fake_last_block"), 256);
    let again = probe
        .run(DeviceId(0), KernelProbeOp::Load, base, 1000, 0)
        .expect("load again");
    assert_eq!(again, expected, "out is zeroed before each load");
    let r = probe
        .run(DeviceId(0), KernelProbeOp::Store, base, 100, 0xC3)
        .expect("store");
    assert_eq!(r, 0);
    let mut back = [0u8; 101];
    b.copy_from_device(&mut back, base).expect("read back");
    assert!(back[..100].iter().all(|&x| x == 0xC3));
    assert_eq!(back[100], data[100]);

    host_tier(&b, base);

    for handle in [h, h0, imported] {
        b.release(handle).expect("release");
    }
    b.unmap(base, 4 * GRAN).expect("unmap");
    b.free(base, 4 * GRAN).expect("free");
    b.synchronize(DeviceId(1)).expect("synchronize");

    // A faulting store: launch succeeds, the synchronize reports DeviceLost, and it sticks.
    let e = probe
        .run(
            DeviceId(0),
            KernelProbeOp::Store,
            DeviceAddress(1 << 62),
            16,
            1,
        )
        .unwrap_err();
    assert_eq!(
        (e.kind, e.op, e.code),
        (ErrorKind::DeviceLost, Operation::Kernel, 700)
    );
    assert_eq!(e.code_name, "CUDA_ERROR_ILLEGAL_ADDRESS");
    let e = b.synchronize(DeviceId(0)).unwrap_err();
    assert_eq!(
        (e.kind, e.op),
        (ErrorKind::DeviceLost, Operation::Synchronize)
    );

    // A second backend retains again; dropping both releases every retain.
    let b2 = CudaBackend::open().expect("second open");
    assert_eq!((refcount(0), refcount(1)), (2, 2));
    drop(b2);
    assert_eq!((refcount(0), refcount(1)), (1, 1));
    drop(b);
    assert_eq!(
        (refcount(0), refcount(1)),
        (0, 0),
        "Drop releases the contexts"
    );
    assert_eq!(
        getter_i32(c"fake_tier_live"),
        0,
        "Drop frees the tier's objects"
    );
}

/// The host tier's calls: a pinned buffer, a round trip through it on the backend's copy
/// stream (made once per device), events (a "not ready" answer is `Ok(false)`), the books'
/// refusals of unknown buffers, events and out-of-range copies, and nothing left behind.
fn host_tier(b: &CudaBackend, base: DeviceAddress) {
    assert!(b.capabilities().host_copies);
    let buf = b.host_alloc(DeviceId(0), 4096).expect("host_alloc");
    let stream = b.copy_stream(DeviceId(0)).expect("copy stream");
    assert_ne!(stream, StreamHandle(0));
    assert_eq!(
        b.copy_stream(DeviceId(0)).expect("again"),
        stream,
        "one stream a device"
    );
    let mut data = [0u8; 256];
    b.copy_from_device(&mut data, base).expect("read");
    let out = HostCopy {
        device: base,
        host: buf,
        offset: 64,
        bytes: 256,
    };
    b.copy_to_host_async(&out, stream).expect("to host");
    let back = HostCopy {
        device: DeviceAddress(base.0 + 1024),
        ..out
    };
    b.copy_from_host_async(&back, stream).expect("from host");
    let ev = b.event_record(DeviceId(0), stream).expect("record");
    assert!(
        !b.event_query(ev).expect("query"),
        "the fake's first answer"
    );
    assert!(b.event_query(ev).expect("query again"));
    b.event_wait(ev).expect("wait");
    b.stream_wait_event(StreamHandle(0), ev)
        .expect("stream wait");
    let mut got = [0u8; 256];
    b.copy_from_device(&mut got, DeviceAddress(base.0 + 1024))
        .expect("read back");
    assert_eq!(got, data, "the round trip is byte-exact");
    // Refusals made before the driver is called.
    let past = HostCopy {
        offset: 4000,
        ..out
    };
    let e = b.copy_to_host_async(&past, stream).unwrap_err();
    assert_eq!(
        (e.kind, e.op),
        (ErrorKind::InvalidValue, Operation::CopyToHost)
    );
    let unknown = HostCopy {
        host: HostBuffer(8),
        ..out
    };
    let e = b.copy_from_host_async(&unknown, stream).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue);
    b.event_destroy(ev).expect("destroy");
    assert_eq!(
        b.event_destroy(ev).unwrap_err().kind,
        ErrorKind::InvalidValue
    );
    assert_eq!(b.event_query(ev).unwrap_err().kind, ErrorKind::InvalidValue);
    b.host_free(buf).expect("free");
    assert_eq!(b.host_free(buf).unwrap_err().kind, ErrorKind::InvalidValue);
    // An event and a buffer left live, and the stream, go with the backend's drop.
    b.host_alloc(DeviceId(1), 64).expect("second buffer");
    b.event_record(DeviceId(1), StreamHandle(0))
        .expect("second event");
    assert_eq!(getter_i32(c"fake_tier_live"), 10101);
}
