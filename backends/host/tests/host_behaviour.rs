//! The host backend through the trait and the manager: what only the real kernel can show
//! (addresses are pointers, the MMU, memfd identity), on top of the conformance suite.
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use kvvm_conformance::{run_suite, RunOptions, Status};
use kvvm_governor::Governor;
use kvvm_hal::{
    AccessDescriptor, AllocationProperties, DeviceAddress, DeviceId, ErrorKind, KernelProbeOp,
    ShareableHandleType, VirtualMemoryBackend,
};
use kvvm_host::{mmap_first_touch, HostBackend, HostConfig};
use kvvm_vmm::{VirtualMemory, VmmConfig, VmmError};

const DEV: DeviceId = DeviceId(0);

fn rw() -> [AccessDescriptor; 1] {
    [AccessDescriptor::read_write(DEV)]
}

fn props() -> AllocationProperties {
    AllocationProperties::device(DEV)
}

fn page(host: &HostBackend) -> u64 {
    host.granularity(&props()).unwrap().minimum
}

#[test]
fn the_conformance_suite_passes_in_process() {
    let host = HostBackend::open().unwrap();
    let report = run_suite(&host, &RunOptions::default());
    let table = report.to_table();
    assert_eq!(report.failed, 0, "{table}");
    // Only the faulting store needs a child process (none is given here); the peer cases need
    // a second device, which the host backend never has.
    let skipped: Vec<_> = report
        .cases
        .iter()
        .filter(|c| c.status == Status::Skip)
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(
        skipped,
        [
            "kernel_store_through_read_alias_faults",
            "peer_access_is_reported_consistently",
            "peer_reads_through_a_shared_mapping",
            "peer_writes_through_read_write_access",
            "peer_store_through_read_access_faults",
        ],
        "{table}"
    );
    assert!(host.ledger().is_empty(), "{:?}", host.ledger());
}

#[test]
fn granularity_and_device() {
    let host = HostBackend::open().unwrap();
    let g = host.granularity(&props()).unwrap();
    assert!(g.minimum >= 4096 && g.minimum.is_power_of_two());
    assert_eq!(g.recommended, 2 << 20);
    let d = host.devices().unwrap();
    assert_eq!(d.len(), 1);
    assert!(d[0].driver_version.starts_with("Linux "), "{d:?}");
    assert!(d[0].posix_fd_supported && d[0].vmm_supported);
    assert_eq!(
        host.memory_info(DeviceId(1)).unwrap_err().kind,
        ErrorKind::InvalidValue
    );
    assert_eq!(
        host.create(g.minimum, &AllocationProperties::device(DeviceId(1)))
            .unwrap_err()
            .kind,
        ErrorKind::InvalidValue
    );
    let caps = host.capabilities();
    assert!(caps.kernels && caps.posix_fd_handles && caps.checks_reservation_bounds);
}

#[test]
fn addresses_are_pointers_of_the_process() {
    let host = HostBackend::open().unwrap();
    let p = page(&host);
    let va = host.reserve(2 * p, 0, None).unwrap();
    let h = host.create(p, &props()).unwrap();
    host.map(va, p, h).unwrap();
    host.set_access(va, p, &rw()).unwrap();
    host.copy_to_device(va, b"written by a copy").unwrap();
    let ptr = usize::try_from(va.0).unwrap() as *mut u8;
    // SAFETY: `[va, va + p)` is a read-write mapping of `h` made above, live until the unmap
    // below; nothing else accesses it meanwhile.
    let seen = unsafe {
        let s = std::slice::from_raw_parts(ptr, 17).to_vec();
        ptr.add(100)
            .copy_from_nonoverlapping(b"stored by the CPU".as_ptr(), 17);
        s
    };
    assert_eq!(seen, b"written by a copy");
    let mut back = [0u8; 17];
    host.copy_from_device(&mut back, DeviceAddress(va.0 + 100))
        .unwrap();
    assert_eq!(&back, b"stored by the CPU");
    // A Read alias of the same handle, elsewhere, shows the same bytes.
    let alias = host.reserve(p, 0, None).unwrap();
    host.map(alias, p, h).unwrap();
    host.set_access(alias, p, &[AccessDescriptor::read_only(DEV)])
        .unwrap();
    let aptr = usize::try_from(alias.0).unwrap() as *const u8;
    // SAFETY: `[alias, alias + p)` is a read-only mapping of `h`, live until unmapped below.
    let via_alias = unsafe { std::slice::from_raw_parts(aptr.add(100), 17).to_vec() };
    assert_eq!(via_alias, b"stored by the CPU");
    for (a, size) in [(alias, p), (va, p)] {
        host.unmap(a, p).unwrap();
        let _ = size;
    }
    host.release(h).unwrap();
    host.free(alias, p).unwrap();
    host.free(va, 2 * p).unwrap();
    assert!(host.ledger().is_empty());
}

#[test]
fn capacity_is_enforced_and_used_bytes_are_live_memfds() {
    let probe = HostBackend::open().unwrap();
    let p = page(&probe);
    let host = HostBackend::with_config(HostConfig::default().capacity(4 * p)).unwrap();
    assert_eq!(host.memory_info(DEV).unwrap().total, 4 * p);
    let a = host.create(3 * p, &props()).unwrap();
    let e = host.create(2 * p, &props()).unwrap_err();
    assert_eq!(
        (e.kind, e.code_name.as_str()),
        (ErrorKind::OutOfMemory, "ENOMEM")
    );
    let b = host.create(p, &props()).unwrap();
    assert_eq!(host.memory_info(DEV).unwrap().free, 0);
    host.release(a).unwrap();
    host.release(b).unwrap();
    assert_eq!(host.memory_info(DEV).unwrap().free, 4 * p);
}

#[test]
fn the_manager_sees_backpressure_at_the_capacity() {
    let g = 2u64 << 20;
    let host = Arc::new(HostBackend::with_config(HostConfig::default().capacity(8 * g)).unwrap());
    let backend: Arc<dyn VirtualMemoryBackend> = host.clone();
    let vm = VirtualMemory::new(
        backend,
        DEV,
        Governor::unlimited(),
        VmmConfig::default().pool_cap_bytes(0),
    )
    .unwrap();
    assert_eq!(vm.granule(), g);
    // Another reservation holds half the capacity: what `kv` asks for fits the device, not
    // what is free now.
    let mut other = vm.reserve(4 * g).unwrap();
    other.commit(4 * g).unwrap();
    let mut kv = vm.reserve(64 * g).unwrap();
    let base = kv.address();
    kv.commit(2 * g).unwrap();
    host.copy_to_device(DeviceAddress(base.0 + 2 * g - 3), b"kv!")
        .unwrap();
    let refused = kv.commit(4 * g).unwrap_err();
    assert!(refused.is_retryable(), "{refused}");
    // The failed commit rolled back: the books equal the kernel's truth.
    assert_eq!(kv.committed_bytes(), 2 * g);
    assert_eq!(host.ledger().mappings, 2);
    // More than the capacity could ever give it is no backpressure: it never fits.
    let never = kv.commit(7 * g).unwrap_err();
    assert!(
        matches!(never, VmmError::NeverFits(_)) && !never.is_retryable(),
        "{never}"
    );
    other.release().unwrap();
    kv.ensure_committed(6 * g).unwrap();
    assert_eq!(kv.address(), base);
    let mut back = [0u8; 3];
    host.copy_from_device(&mut back, DeviceAddress(base.0 + 2 * g - 3))
        .unwrap();
    assert_eq!(&back, b"kv!");
    drop(other);
    kv.release().unwrap();
    drop(kv);
    drop(vm);
    assert!(host.ledger().is_empty(), "{:?}", host.ledger());
}

#[test]
fn populate_allocates_at_create() {
    let host = HostBackend::with_config(HostConfig::default().populate(true)).unwrap();
    let p = page(&host);
    let va = host.reserve(4 * p, 0, None).unwrap();
    let h = host.create(4 * p, &props()).unwrap();
    host.map(va, 4 * p, h).unwrap();
    host.set_access(va, 4 * p, &rw()).unwrap();
    let mut back = vec![1u8; usize::try_from(4 * p).unwrap()];
    host.copy_from_device(&mut back, va).unwrap();
    assert!(back.iter().all(|b| *b == 0));
    host.unmap(va, 4 * p).unwrap();
    host.release(h).unwrap();
    host.free(va, 4 * p).unwrap();
}

#[test]
fn import_accepts_only_size_sealed_memfds() {
    let host = HostBackend::open().unwrap();
    let p = page(&host);
    let null: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
    assert_eq!(
        host.import_posix_fd(kvvm_hal::DeviceId(0), null.as_fd())
            .unwrap_err()
            .kind,
        ErrorKind::InvalidValue
    );
    // A memfd whose size anyone holding it could still change.
    let loose = rustix::fs::memfd_create("loose", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&loose, p).unwrap();
    assert_eq!(
        host.import_posix_fd(kvvm_hal::DeviceId(0), loose.as_fd())
            .unwrap_err()
            .kind,
        ErrorKind::InvalidValue
    );
    // Export needs an exportable handle; an import of our own export is the same memory,
    // counted once.
    let plain = host.create(p, &props()).unwrap();
    assert_eq!(
        host.export_posix_fd(plain).unwrap_err().kind,
        ErrorKind::InvalidValue
    );
    let fd_props = AllocationProperties {
        device: DEV,
        handle_type: ShareableHandleType::PosixFd,
    };
    let h = host.create(p, &fd_props).unwrap();
    let fd = host.export_posix_fd(h).unwrap();
    let used = host.ledger().used_bytes;
    let again = host
        .import_posix_fd(kvvm_hal::DeviceId(0), fd.as_fd())
        .unwrap();
    assert_eq!(host.ledger().used_bytes, used);
    assert_eq!(host.ledger().allocations, 2);
    for x in [plain, h, again] {
        host.release(x).unwrap();
    }
    assert!(host.ledger().is_empty());
}

/// A range reserved (aligned to `align`), freed and reserved again with its address as the
/// hint, which the backend honours: that address, reserved. Another test's thread may map
/// into the freed range before the hinted reserve (the tests of this binary run side by side
/// in one process), so up to four fresh addresses are tried before the test fails.
fn reserved_again_where_freed(host: &HostBackend, size: u64, align: u64) -> DeviceAddress {
    let mut missed = Vec::new();
    for _ in 0..4 {
        let va = host.reserve(size, align, None).unwrap();
        host.free(va, size).unwrap();
        let again = host.reserve(size, align, Some(va)).unwrap();
        if again == va {
            return va;
        }
        host.free(again, size).unwrap();
        missed.push(format!("{va} -> {again}"));
    }
    panic!("no freed address was honoured as a hint: {missed:?}");
}

#[test]
fn reservations_honour_alignment_and_hints() {
    let host = HostBackend::open().unwrap();
    let p = page(&host);
    let align = 1u64 << 30;
    let va = reserved_again_where_freed(&host, 16 * p, align);
    assert_eq!(va.0 % align, 0);
    // A taken address is only a hint: the range lands elsewhere.
    let other = host.reserve(16 * p, 0, Some(va)).unwrap();
    assert_ne!(other, va);
    host.free(other, 16 * p).unwrap();
    host.free(va, 16 * p).unwrap();
    assert_eq!(
        host.reserve(p, 3 * p, None).unwrap_err().kind,
        ErrorKind::InvalidValue
    );
}

#[test]
fn probes_use_the_mmu_and_check_only_the_mapping() {
    let host = HostBackend::open().unwrap();
    let probe = host.kernel_probe().unwrap();
    let p = page(&host);
    let va = host.reserve(2 * p, 0, None).unwrap();
    let h = host.create(p, &props()).unwrap();
    host.map(va, p, h).unwrap();
    host.set_access(va, p, &rw()).unwrap();
    host.copy_to_device(va, &[1, 2, 3, 4]).unwrap();
    assert_eq!(probe.run(DEV, KernelProbeOp::Load, va, 4, 0).unwrap(), 10);
    assert_eq!(probe.run(DEV, KernelProbeOp::Store, va, 2, 9).unwrap(), 0);
    let mut back = [0u8; 4];
    host.copy_from_device(&mut back, va).unwrap();
    assert_eq!(back, [9, 9, 3, 4]);
    // Past the mapping: refused before any access.
    let e = probe
        .run(DEV, KernelProbeOp::Load, DeviceAddress(va.0 + p - 2), 4, 0)
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue);
    host.unmap(va, p).unwrap();
    host.release(h).unwrap();
    host.free(va, 2 * p).unwrap();
}

#[test]
fn first_touch_keeps_bytes_and_needs_write_access() {
    let host = HostBackend::open().unwrap();
    let p = page(&host);
    let va = host.reserve(4 * p, 0, None).unwrap();
    let h = host.create(4 * p, &props()).unwrap();
    host.map(va, 4 * p, h).unwrap();
    host.set_access(va, 4 * p, &rw()).unwrap();
    host.copy_to_device(DeviceAddress(va.0 + p), b"keep")
        .unwrap();
    host.touch_pages(va, 4 * p).unwrap();
    let mut back = [0u8; 4];
    host.copy_from_device(&mut back, DeviceAddress(va.0 + p))
        .unwrap();
    assert_eq!(&back, b"keep");
    host.set_access(va, 4 * p, &[AccessDescriptor::read_only(DEV)])
        .unwrap();
    assert_eq!(
        host.touch_pages(va, 4 * p).unwrap_err().kind,
        ErrorKind::InvalidValue
    );
    host.unmap(va, 4 * p).unwrap();
    host.release(h).unwrap();
    host.free(va, 4 * p).unwrap();
    assert!(mmap_first_touch(16 * p).unwrap() > std::time::Duration::ZERO);
}

#[test]
fn errors_carry_errno_names() {
    let host = HostBackend::open().unwrap();
    let p = page(&host);
    let va = host.reserve(2 * p, 0, None).unwrap();
    let h = host.create(p, &props()).unwrap();
    host.map(va, p, h).unwrap();
    let e = host.map(va, p, h).unwrap_err();
    assert_eq!(
        (e.kind, e.code, e.code_name.as_str()),
        (ErrorKind::InvalidValue, 22, "EINVAL")
    );
    assert!(e.to_string().contains("already mapped"), "{e}");
    let e = host.map(DeviceAddress(va.0 + p), p / 2, h).unwrap_err();
    assert_eq!(
        (e.kind, e.code_name.as_str()),
        (ErrorKind::NotSupported, "EOPNOTSUPP")
    );
    let e = host.reserve(1 << 48, 0, None).unwrap_err();
    assert_eq!(
        (e.kind, e.code_name.as_str()),
        (ErrorKind::OutOfMemory, "ENOMEM")
    );
    host.unmap(va, p).unwrap();
    host.release(h).unwrap();
    host.free(va, 2 * p).unwrap();
}
