//! Real-GPU tests of the CUDA backend. Each test prints
//! `skipped: no CUDA driver (<reason>)` and returns when CUDA is unavailable.
//!
//! Run them on a GPU machine with
//! `cargo test -p kvvm-cuda --test gpu -- --nocapture --test-threads=1`.
//! The sticky-fault test re-runs this binary as a child process (a kernel store through a
//! read-only mapping leaves the context unusable).

// Test helpers outside #[test] functions may fail loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use kvvm_cuda::CudaBackend;
use kvvm_hal::{
    AccessDescriptor, AllocationProperties, DeviceAddress, DeviceId, ErrorKind, KernelProbeOp,
    PhysicalHandle, ShareableHandleType, VirtualMemoryBackend,
};

const DEV: DeviceId = DeviceId(0);

fn backend() -> Option<CudaBackend> {
    match CudaBackend::open() {
        Ok(b) => Some(b),
        Err(e) => {
            println!("skipped: no CUDA driver ({e})");
            None
        }
    }
}

fn granule(b: &CudaBackend) -> u64 {
    let g = b
        .granularity(&AllocationProperties::device(DEV))
        .expect("granularity");
    assert!(g.minimum > 0);
    g.minimum
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn byte_sum(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0u64, |acc, &b| acc.wrapping_add(u64::from(b)))
}

/// Reserve `windows` granules, create one handle and map it at the first window with RW.
struct Mapped {
    base: DeviceAddress,
    reserved: u64,
    handle: PhysicalHandle,
    g: u64,
}

fn map_one(b: &CudaBackend, windows: u64) -> Mapped {
    let g = granule(b);
    let reserved = g * windows;
    let base = b.reserve(reserved, 0, None).expect("reserve");
    assert_eq!(base.get() % g, 0, "reservation aligned to the granule");
    let handle = b
        .create(g, &AllocationProperties::device(DEV))
        .expect("create");
    b.map(base, g, handle).expect("map");
    b.set_access(base, g, &[AccessDescriptor::read_write(DEV)])
        .expect("set_access rw");
    Mapped {
        base,
        reserved,
        handle,
        g,
    }
}

fn teardown(b: &CudaBackend, m: &Mapped) {
    b.synchronize(DEV).expect("synchronize");
    b.unmap(m.base, m.reserved).expect("unmap");
    b.release(m.handle).expect("release");
    b.free(m.base, m.reserved).expect("free");
}

#[test]
fn devices_memory_info_and_granularity() {
    let Some(b) = backend() else { return };
    let devices = b.devices().expect("devices");
    assert!(!devices.is_empty());
    for (i, d) in devices.iter().enumerate() {
        println!("{d:?}");
        assert_eq!(d.id, DeviceId(i as u32));
        assert!(!d.name.is_empty());
        assert!(d.total_memory > 0);
        assert!(d.vmm_supported, "{} supports VMM", d.name);
        assert!(
            d.driver_version.starts_with("CUDA "),
            "{}",
            d.driver_version
        );
        let info = b.memory_info(d.id).expect("memory_info");
        assert!(info.total > 0 && info.free <= info.total, "{info:?}");
        let g = b
            .granularity(&AllocationProperties::device(d.id))
            .expect("granularity");
        assert!(g.minimum > 0 && g.recommended >= g.minimum);
        assert_eq!(g.recommended % g.minimum, 0);
        if d.posix_fd_supported {
            let gfd = b
                .granularity(&AllocationProperties {
                    device: d.id,
                    handle_type: ShareableHandleType::PosixFd,
                })
                .expect("granularity posix fd");
            assert!(gfd.minimum > 0);
        }
    }
    let caps = b.capabilities();
    assert_eq!(
        caps.posix_fd_handles,
        devices.iter().all(|d| d.posix_fd_supported)
    );
    assert!(b.kernel_probe().is_some());
    let bad = b.memory_info(DeviceId(devices.len() as u32)).unwrap_err();
    assert_eq!(bad.kind, ErrorKind::InvalidValue);
}

#[test]
fn reserve_create_map_set_access_copy_roundtrip() {
    let Some(b) = backend() else { return };
    let m = map_one(&b, 4);
    let data = pattern(m.g as usize, 7);
    b.copy_to_device(m.base, &data).expect("copy_to_device");
    let mut back = vec![0u8; data.len()];
    b.copy_from_device(&mut back, m.base)
        .expect("copy_from_device");
    assert_eq!(back, data);
    // An unaligned small copy inside the mapping.
    let mut small = [0u8; 13];
    b.copy_from_device(&mut small, DeviceAddress(m.base.get() + 1000))
        .expect("small copy");
    assert_eq!(&small[..], &data[1000..1013]);
    b.synchronize(DEV).expect("synchronize");
    teardown(&b, &m);
}

#[test]
fn large_reservation_and_address_hint() {
    let Some(b) = backend() else { return };
    let g = granule(&b);
    let size = 1u64 << 46; // 64 TiB
    let a = b.reserve(size, 0, None).expect("reserve 64 TiB");
    b.free(a, size).expect("free 64 TiB");
    let a = b.reserve(16 * g, 0, None).expect("reserve");
    b.free(a, 16 * g).expect("free");
    let again = b.reserve(16 * g, 0, Some(a)).expect("reserve with hint");
    println!("hint {a} -> {again} (honoured: {})", a == again);
    b.free(again, 16 * g).expect("free");
    let huge = b.reserve(1u64 << 48, 0, None).unwrap_err();
    println!("reserve 2^48: {huge}");
    assert_eq!(huge.kind, ErrorKind::OutOfMemory);
}

#[test]
fn driver_semantics_map_onto_error_kinds() {
    let Some(b) = backend() else { return };
    let m = map_one(&b, 4);
    let g = m.g;
    let props = AllocationProperties::device(DEV);

    // Map of a whole handle over an already-mapped VA: InvalidValue (measured on the H200;
    // the NotSupported of the first measurements comes from mapping part of a handle).
    let h2 = b.create(g, &props).expect("create");
    let e = b.map(m.base, g, h2).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue, "{e}");
    // Map of a whole handle at an unaligned VA: InvalidValue.
    let e = b
        .map(DeviceAddress(m.base.get() + g + 4096), g, h2)
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue, "{e}");
    // Map of part of a handle: NotSupported.
    let h3 = b.create(2 * g, &props).expect("create 2 granules");
    let e = b
        .map(DeviceAddress(m.base.get() + 2 * g), g, h3)
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotSupported, "{e}");
    b.release(h3).expect("release h3");
    // Create of granule + 1: InvalidValue.
    let e = b.create(g + 1, &props).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue, "{e}");
    // Reserve of a non-multiple: InvalidValue.
    let e = b.reserve(g + 1, 0, None).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue, "{e}");
    // Copy through a mapping without access: InvalidValue.
    let second = DeviceAddress(m.base.get() + g);
    b.map(second, g, h2).expect("map second");
    let e = b.copy_to_device(second, &[1, 2, 3]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue, "{e}");
    // Unmap of half of one mapping: InvalidValue.
    let e = b.unmap(second, g / 2).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue, "{e}");
    // Free while a mapping is live: InvalidValue.
    let e = b.free(m.base, m.reserved).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue, "{e}");
    // Release while mapped succeeds (deferred free); a second release is InvalidValue.
    b.release(h2).expect("release while mapped");
    let e = b.release(h2).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue, "{e}");
    b.unmap(second, g).expect("unmap second");
    // Unmap of a range with no mapping: not an error.
    b.unmap(second, g).expect("double unmap is silent");
    // Physical memory exhausted: OutOfMemory.
    let total = b.memory_info(DEV).expect("memory_info").total;
    let too_big = (total / g + 1) * g;
    let e = b.create(too_big, &props).unwrap_err();
    println!("create {too_big}: {e}");
    assert_eq!(e.kind, ErrorKind::OutOfMemory, "{e}");

    teardown(&b, &m);
    // Second free: InvalidValue.
    let e = b.free(m.base, m.reserved).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue, "{e}");
}

#[test]
fn one_unmap_spans_several_mappings_and_one_set_access_too() {
    let Some(b) = backend() else { return };
    let g = granule(&b);
    let n = 8u64;
    let base = b.reserve(n * g, 0, None).expect("reserve");
    let props = AllocationProperties::device(DEV);
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let h = b.create(g, &props).expect("create");
            b.map(DeviceAddress(base.get() + i * g), g, h).expect("map");
            h
        })
        .collect();
    b.set_access(base, n * g, &[AccessDescriptor::read_write(DEV)])
        .expect("one set_access over all mappings");
    let data = pattern((n * g) as usize, 3);
    b.copy_to_device(base, &data).expect("copy across mappings");
    let mut back = vec![0u8; data.len()];
    b.copy_from_device(&mut back, base).expect("copy back");
    assert_eq!(back, data);
    b.unmap(base, n * g).expect("one unmap over all mappings");
    for h in handles {
        b.release(h).expect("release");
    }
    b.free(base, n * g).expect("free");
}

#[test]
fn read_alias_sees_writes_and_refuses_copies() {
    let Some(b) = backend() else { return };
    let m = map_one(&b, 2);
    let ro = DeviceAddress(m.base.get() + m.g);
    b.map(ro, m.g, m.handle).expect("map alias");
    b.set_access(ro, m.g, &[AccessDescriptor::read_only(DEV)])
        .expect("set_access read");
    let data = pattern(m.g as usize, 11);
    b.copy_to_device(m.base, &data).expect("write through RW");
    let mut back = vec![0u8; data.len()];
    b.copy_from_device(&mut back, ro).expect("read through RO");
    assert_eq!(back, data);
    let e = b.copy_to_device(ro, &[1, 2, 3, 4]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue, "{e}");
    // The context stays usable.
    b.copy_from_device(&mut back[..16], m.base)
        .expect("still usable");
    teardown(&b, &m);
}

#[test]
fn kernel_load_through_read_alias_and_store_through_rw() {
    let Some(b) = backend() else { return };
    let probe = b.kernel_probe().expect("kernels");
    let m = map_one(&b, 2);
    let ro = DeviceAddress(m.base.get() + m.g);
    b.map(ro, m.g, m.handle).expect("map alias");
    b.set_access(ro, m.g, &[AccessDescriptor::read_only(DEV)])
        .expect("set_access read");
    let data = pattern(m.g as usize, 5);
    b.copy_to_device(m.base, &data).expect("write");

    let sum = probe
        .run(DEV, KernelProbeOp::Load, ro, m.g, 0)
        .expect("kernel load through RO");
    assert_eq!(sum, byte_sum(&data));
    let sum_small = probe
        .run(
            DEV,
            KernelProbeOp::Load,
            DeviceAddress(ro.get() + 3),
            1000,
            0,
        )
        .expect("small load");
    assert_eq!(sum_small, byte_sum(&data[3..1003]));
    let empty = probe
        .run(DEV, KernelProbeOp::Load, ro, 0, 0)
        .expect("empty load");
    assert_eq!(empty, 0);

    let r = probe
        .run(DEV, KernelProbeOp::Store, m.base, m.g, 0xA5)
        .expect("kernel store through RW");
    assert_eq!(r, 0);
    let mut back = vec![0u8; m.g as usize];
    b.copy_from_device(&mut back, ro).expect("read back");
    assert!(back.iter().all(|&x| x == 0xA5));
    let sum = probe
        .run(DEV, KernelProbeOp::Load, ro, m.g, 0)
        .expect("load after store");
    assert_eq!(sum, 0xA5 * m.g);
    teardown(&b, &m);
}

const CHILD_ENV: &str = "KVVM_CUDA_STORE_FAULT_CHILD";

/// Runs only in the child process started by `kernel_store_through_read_alias_faults`.
#[test]
fn store_fault_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let Some(b) = backend() else { return };
    let probe = b.kernel_probe().expect("kernels");
    let m = map_one(&b, 2);
    let ro = DeviceAddress(m.base.get() + m.g);
    b.map(ro, m.g, m.handle).expect("map alias");
    b.set_access(ro, m.g, &[AccessDescriptor::read_only(DEV)])
        .expect("set_access read");
    let e = probe
        .run(DEV, KernelProbeOp::Store, ro, m.g, 1)
        .unwrap_err();
    println!("store through RO: {e}");
    assert_eq!(e.kind, ErrorKind::DeviceLost, "{e}");
    // Sticky: the context is unusable afterwards.
    let after = b.synchronize(DEV).unwrap_err();
    assert_eq!(after.kind, ErrorKind::DeviceLost, "{after}");
    println!("KVVM_CHILD_DEVICE_LOST_OK");
}

#[test]
fn kernel_store_through_read_alias_faults() {
    let Some(_b) = backend() else { return };
    let exe = std::env::current_exe().expect("current_exe");
    let out = std::process::Command::new(exe)
        .args([
            "--exact",
            "store_fault_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .output()
        .expect("spawn child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("child stdout:\n{stdout}\nchild stderr:\n{stderr}");
    assert!(out.status.success(), "child failed");
    assert!(stdout.contains("KVVM_CHILD_DEVICE_LOST_OK"));
}

#[test]
fn posix_fd_export_import_map_read() {
    let Some(b) = backend() else { return };
    if !b.capabilities().posix_fd_handles {
        let g = granule(&b);
        let h = b
            .create(g, &AllocationProperties::device(DEV))
            .expect("create");
        let e = b.export_posix_fd(h).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotSupported);
        b.release(h).expect("release");
        println!("skipped: devices lack POSIX FD handles");
        return;
    }
    let props = AllocationProperties {
        device: DEV,
        handle_type: ShareableHandleType::PosixFd,
    };
    let g = b.granularity(&props).expect("granularity").minimum;
    let base = b.reserve(2 * g, 0, None).expect("reserve");
    let h = b.create(g, &props).expect("create exportable");
    b.map(base, g, h).expect("map");
    b.set_access(base, g, &[AccessDescriptor::read_write(DEV)])
        .expect("set_access");
    let data = pattern(g as usize, 42);
    b.copy_to_device(base, &data).expect("write");

    let fd = b.export_posix_fd(h).expect("export");
    use std::os::fd::AsFd;
    let imported = b
        .import_posix_fd(kvvm_hal::DeviceId(0), fd.as_fd())
        .expect("import");
    drop(fd);
    let second = DeviceAddress(base.get() + g);
    b.map(second, g, imported).expect("map imported");
    b.set_access(second, g, &[AccessDescriptor::read_only(DEV)])
        .expect("set_access imported");
    let mut back = vec![0u8; data.len()];
    b.copy_from_device(&mut back, second)
        .expect("read imported");
    assert_eq!(back, data);

    b.unmap(base, 2 * g).expect("unmap");
    b.release(imported).expect("release imported");
    b.release(h).expect("release");
    b.free(base, 2 * g).expect("free");
}

#[test]
fn works_from_many_threads() {
    let Some(b) = backend() else { return };
    let b = Arc::new(b);
    let threads: Vec<_> = (0..8u8)
        .map(|t| {
            let b = Arc::clone(&b);
            std::thread::spawn(move || {
                for round in 0..4u8 {
                    let m = map_one(&b, 2);
                    let data = pattern(4096, t.wrapping_mul(17).wrapping_add(round));
                    b.copy_to_device(m.base, &data).expect("copy");
                    let mut back = vec![0u8; data.len()];
                    b.copy_from_device(&mut back, m.base).expect("copy back");
                    assert_eq!(back, data);
                    let sum = b
                        .kernel_probe()
                        .expect("kernels")
                        .run(DEV, KernelProbeOp::Load, m.base, 4096, 0)
                        .expect("probe from a thread");
                    assert_eq!(sum, byte_sum(&data));
                    teardown(&b, &m);
                }
            })
        })
        .collect();
    for t in threads {
        assert!(t.join().is_ok(), "worker failed");
    }
}

#[test]
fn two_backends_coexist_and_drop_cleanly() {
    let Some(a) = backend() else { return };
    let Some(b) = backend() else { return };
    let m = map_one(&a, 1);
    drop(b);
    // `a`'s context is still retained: work continues after the other backend dropped.
    let data = pattern(64, 1);
    a.copy_to_device(m.base, &data)
        .expect("copy after other drop");
    teardown(&a, &m);
}
