//! The simulator's own features: ledger, fault injection, latency model, quirks, export.

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use kvvm_hal::{
    AccessDescriptor, AllocationProperties, DeviceId, ErrorKind, Operation, ShareableHandleType,
    VirtualMemoryBackend,
};
use kvvm_sim::{FaultRule, LatencyMode, LatencyModel, SimBackend, SimConfig, SimQuirks, GIB, MIB};

const G: u64 = 2 * MIB;

fn sim() -> SimBackend {
    SimBackend::new(SimConfig::single(G, 64 * MIB))
}

fn props() -> AllocationProperties {
    AllocationProperties::device(DeviceId(0))
}

#[test]
fn ledger_tracks_every_resource_and_deferred_free() {
    let s = sim();
    let va = s.reserve(4 * G, 0, None).unwrap();
    let h = s.create(2 * G, &props()).unwrap();
    s.map(va, 2 * G, h).unwrap();
    s.set_access(va, 2 * G, &[AccessDescriptor::read_only(DeviceId(0))])
        .unwrap();
    let l = s.ledger();
    assert_eq!(l.reservations.len(), 1);
    assert_eq!(l.reservations[0].size, 4 * G);
    assert_eq!(l.handles.len(), 1);
    assert_eq!(l.mappings.len(), 1);
    assert_eq!(
        l.mappings[0].access,
        vec![AccessDescriptor::read_only(DeviceId(0))]
    );
    assert_eq!(l.physical_bytes, vec![2 * G]);
    assert_eq!(l.mapped_bytes_in(va, 4 * G), 2 * G);

    // Release while mapped: the handle is gone, the allocation and its bytes stay.
    s.release(h).unwrap();
    let l = s.ledger();
    assert!(l.handles.is_empty());
    assert_eq!(l.allocations.len(), 1);
    assert_eq!(l.allocations[0].mappings, 1);
    assert_eq!(l.total_physical_bytes(), 2 * G);

    s.unmap(va, 2 * G).unwrap();
    assert_eq!(s.ledger().total_physical_bytes(), 0);
    s.free(va, 4 * G).unwrap();
    assert!(s.ledger().is_empty());
}

#[test]
fn capacity_is_enforced_per_device() {
    let s = SimBackend::new(SimConfig::uniform(2, G, 4 * G));
    let on = |d| AllocationProperties::device(DeviceId(d));
    let a = s.create(4 * G, &on(0)).unwrap();
    let e = s.create(G, &on(0)).unwrap_err();
    assert_eq!(e.kind, ErrorKind::OutOfMemory);
    let b = s.create(4 * G, &on(1)).unwrap();
    assert_eq!(s.memory_info(DeviceId(0)).unwrap().free, 0);
    assert_eq!(
        s.create(G, &on(2)).unwrap_err().kind,
        ErrorKind::InvalidValue,
        "no device 2"
    );
    s.release(a).unwrap();
    s.release(b).unwrap();
    assert!(s.ledger().is_empty());
}

#[test]
fn nth_fault_fails_exactly_that_call_without_side_effects() {
    let s = sim();
    s.inject(FaultRule::nth(Operation::Create, 2, ErrorKind::OutOfMemory));
    let a = s.create(G, &props()).unwrap();
    let e = s.create(G, &props()).unwrap_err();
    assert_eq!(e.kind, ErrorKind::OutOfMemory);
    assert_eq!(e.detail.as_deref(), Some("injected fault"));
    assert_eq!(
        s.ledger().handles.len(),
        1,
        "the failed create left nothing"
    );
    let c = s.create(G, &props()).unwrap();
    assert_eq!(s.calls(Operation::Create), 3);
    s.release(a).unwrap();
    s.release(c).unwrap();
}

#[test]
fn from_nth_and_clear() {
    let s = sim();
    s.inject(FaultRule::failing_synchronize());
    for _ in 0..3 {
        assert_eq!(
            s.synchronize(DeviceId(0)).unwrap_err().kind,
            ErrorKind::DeviceLost
        );
    }
    s.clear_faults();
    s.synchronize(DeviceId(0)).unwrap();
}

#[test]
fn random_plan_is_seeded() {
    let outcomes = |seed| {
        let s = sim();
        s.inject(FaultRule::random(
            seed,
            0.3,
            vec![Operation::Reserve],
            ErrorKind::Other,
        ));
        (0..200)
            .map(|_| match s.reserve(G, 0, None) {
                Ok(va) => {
                    s.free(va, G).unwrap();
                    true
                }
                Err(e) => {
                    assert_eq!(e.kind, ErrorKind::Other);
                    false
                }
            })
            .collect::<Vec<_>>()
    };
    let a = outcomes(42);
    assert_eq!(a, outcomes(42));
    assert!(a.iter().any(|ok| *ok) && a.iter().any(|ok| !*ok));
}

#[test]
fn latency_model_accounts_driver_time() {
    let s = SimBackend::new(SimConfig::single(G, 64 * MIB));
    let m = LatencyModel::h200();
    let va = s.reserve(4 * G, 0, None).unwrap();
    let hs: Vec<_> = (0..4).map(|_| s.create(G, &props()).unwrap()).collect();
    for (i, h) in hs.iter().enumerate() {
        s.map(kvvm_hal::DeviceAddress(va.0 + i as u64 * G), G, *h)
            .unwrap();
    }
    let rw = [AccessDescriptor::read_write(DeviceId(0))];
    s.set_access(va, 4 * G, &rw).unwrap();
    // Each handle by its size, set access by its fresh mappings.
    let expected = m.reserve
        + m.cost(Operation::Create, G, 0) * 4
        + m.map * 4
        + m.cost(Operation::SetAccess, 4 * G, 4);
    assert_eq!(s.estimated_driver_time(), expected);
    // Mappings whose access is set already cost only the call.
    s.reset_counters();
    s.set_access(va, 4 * G, &rw).unwrap();
    assert_eq!(s.estimated_driver_time(), m.set_access);
    // One unmap over four mappings costs four unmaps (measured: no cheaper per mapping).
    s.reset_counters();
    s.unmap(va, 4 * G).unwrap();
    assert_eq!(
        s.estimated_driver_time(),
        m.cost(Operation::Unmap, 4 * G, 4)
    );
    assert_eq!(s.driver_calls(), 1);
    s.reset_counters();
    for h in &hs {
        s.release(*h).unwrap();
    }
    assert_eq!(
        s.estimated_driver_time(),
        m.cost(Operation::Release, G, 0) * 4
    );
    // A failed call covers nothing.
    s.reset_counters();
    assert!(s.release(hs[0]).is_err());
    assert_eq!(s.estimated_driver_time(), m.release);
    s.free(va, 4 * G).unwrap();
}

#[test]
fn one_large_handle_costs_less_than_many_small_ones() {
    let cost = |handles: u64| {
        let s = SimBackend::new(SimConfig::single(G, 64 * MIB));
        let each = 16 * G / handles;
        let va = s.reserve(16 * G, 0, None).unwrap();
        let hs: Vec<_> = (0..handles)
            .map(|i| {
                let h = s.create(each, &props()).unwrap();
                s.map(kvvm_hal::DeviceAddress(va.0 + i * each), each, h)
                    .unwrap();
                h
            })
            .collect();
        s.set_access(va, 16 * G, &[AccessDescriptor::read_write(DeviceId(0))])
            .unwrap();
        s.unmap(va, 16 * G).unwrap();
        for h in hs {
            s.release(h).unwrap();
        }
        s.free(va, 16 * G).unwrap();
        assert!(s.ledger().is_empty());
        s.estimated_driver_time()
    };
    let (many, one) = (cost(16), cost(1));
    assert!(many > one * 8, "{many:?} vs {one:?}");
}

#[test]
fn spin_mode_spends_the_modelled_time() {
    let mut model = LatencyModel::zero();
    model.create = Duration::from_millis(2);
    let s = SimBackend::new(SimConfig::single(G, 64 * MIB).with_latency(model, LatencyMode::Spin));
    let start = Instant::now();
    let h = s.create(G, &props()).unwrap();
    assert!(start.elapsed() >= Duration::from_millis(2));
    s.release(h).unwrap();
}

#[test]
fn multi_unmap_quirk_breaks_the_later_free() {
    let s = SimBackend::new(SimConfig::single(G, 64 * MIB).with_quirks(SimQuirks {
        multi_unmap_breaks_free: true,
        ..SimQuirks::default()
    }));
    assert!(!s.capabilities().unmap_spans_mappings);
    let va = s.reserve(2 * G, 0, None).unwrap();
    let a = s.create(G, &props()).unwrap();
    let b = s.create(G, &props()).unwrap();
    s.map(va, G, a).unwrap();
    s.map(kvvm_hal::DeviceAddress(va.0 + G), G, b).unwrap();
    s.unmap(va, 2 * G).unwrap();
    assert_eq!(s.free(va, 2 * G).unwrap_err().kind, ErrorKind::InvalidValue);
}

#[test]
fn map_past_the_reservation_is_refused() {
    let s = sim();
    let va = s.reserve(G, 0, None).unwrap();
    let h = s.create(2 * G, &props()).unwrap();
    let e = s.map(va, 2 * G, h).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue);
    assert!(s.ledger().mappings.is_empty());
    s.release(h).unwrap();
    s.free(va, G).unwrap();
}

#[test]
fn huge_reservation_and_device_cost_nothing() {
    let s = SimBackend::new(SimConfig::single(G, 1024 * GIB));
    let va = s.reserve(1 << 46, 0, None).unwrap();
    let h = s.create(512 * GIB, &props()).unwrap();
    s.map(va, 512 * GIB, h).unwrap();
    s.set_access(va, 512 * GIB, &[AccessDescriptor::read_write(DeviceId(0))])
        .unwrap();
    let far = kvvm_hal::DeviceAddress(va.0 + 511 * GIB);
    s.copy_to_device(far, b"end").unwrap();
    let mut back = [0u8; 3];
    s.copy_from_device(&mut back, far).unwrap();
    assert_eq!(&back, b"end");
    s.unmap(va, 512 * GIB).unwrap();
    s.release(h).unwrap();
    s.free(va, 1 << 46).unwrap();
}

#[test]
fn export_requires_an_exportable_handle_and_import_shares_memory() {
    let s = sim();
    let plain = s.create(G, &props()).unwrap();
    assert_eq!(
        s.export_posix_fd(plain).unwrap_err().kind,
        ErrorKind::InvalidValue
    );
    let fd_props = AllocationProperties {
        device: DeviceId(0),
        handle_type: ShareableHandleType::PosixFd,
    };
    let h = s.create(G, &fd_props).unwrap();
    let fd = s.export_posix_fd(h).unwrap();
    let imported = s.import_posix_fd(DeviceId(0), fd.as_fd()).unwrap();
    assert_ne!(imported, h);
    assert_eq!(s.ledger().allocations.len(), 2, "import adds no allocation");
    s.release(h).unwrap();
    assert_eq!(
        s.ledger().total_physical_bytes(),
        2 * G,
        "still held by the import"
    );
    s.release(imported).unwrap();
    s.release(plain).unwrap();
    assert!(s.ledger().is_empty());
    let stranger = std::fs::File::open("/dev/null").unwrap();
    assert_eq!(
        s.import_posix_fd(DeviceId(0), stranger.as_fd())
            .unwrap_err()
            .kind,
        ErrorKind::InvalidValue
    );
}

#[test]
fn fixed_address_is_a_hint() {
    let s = sim();
    let a = s.reserve(4 * G, 0, None).unwrap();
    // Asking for an address inside a live reservation gives another one.
    let b = s.reserve(G, 0, Some(a)).unwrap();
    assert_ne!(a, b);
    s.free(b, G).unwrap();
    s.free(a, 4 * G).unwrap();
    let c = s.reserve(4 * G, 0, Some(a)).unwrap();
    assert_eq!(c, a);
    s.free(c, 4 * G).unwrap();
}
