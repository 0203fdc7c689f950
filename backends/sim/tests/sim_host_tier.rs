//! The host tier's calls on the simulator, and the decorators over them: buffers and events in
//! the ledger, copies checked in full (the host range inside its buffer, the device range
//! mapped with the access the copy needs) before any byte moves, copies charged by the latency
//! model, the recording's books of buffers and events, and injected faults.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kvvm_hal::decorate::{FaultInjecting, Recording};
use kvvm_hal::{
    AccessDescriptor, AllocationProperties, DeviceAddress, DeviceId, ErrorKind, HostCopy,
    LatencyModel, Operation, StreamHandle, VirtualMemoryBackend,
};
use kvvm_sim::{SimBackend, SimConfig};

const G: u64 = 64 << 10;

/// A simulator with one granule mapped read-write at the returned address (and a second,
/// read-only, right after it).
fn mapped(sim: &dyn VirtualMemoryBackend) -> DeviceAddress {
    let va = sim.reserve(4 * G, 0, None).expect("reserve");
    for (i, access) in [
        AccessDescriptor::read_write(DeviceId(0)),
        AccessDescriptor::read_only(DeviceId(0)),
    ]
    .into_iter()
    .enumerate()
    {
        let h = sim
            .create(G, &AllocationProperties::device(DeviceId(0)))
            .expect("create");
        let at = DeviceAddress(va.0 + i as u64 * G);
        sim.map(at, G, h).expect("map");
        sim.set_access(at, G, &[access]).expect("access");
        sim.release(h).expect("release (mapped: lives on)");
    }
    va
}

fn teardown(sim: &dyn VirtualMemoryBackend, va: DeviceAddress) {
    sim.unmap(va, 2 * G).expect("unmap");
    sim.free(va, 4 * G).expect("free");
}

#[test]
fn buffers_and_events_are_in_the_ledger_and_copies_are_checked_first() {
    let sim = SimBackend::new(SimConfig::single(G, 64 << 20));
    assert!(sim.capabilities().host_copies);
    let va = mapped(&sim);
    let data: Vec<u8> = (0..G).map(|i| (i * 7 % 251) as u8).collect();
    sim.copy_to_device(va, &data).expect("write");
    let buf = sim.host_alloc(DeviceId(0), 2 * G).expect("host_alloc");
    let e = sim.host_alloc(DeviceId(0), 0).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue);
    let e = sim.host_alloc(DeviceId(3), G).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue, "no device 3");
    let ledger = sim.ledger();
    assert_eq!((ledger.host_bytes(), ledger.is_empty()), (2 * G, false));
    let stream = sim.copy_stream(DeviceId(0)).expect("stream");
    let out = HostCopy {
        device: va,
        host: buf,
        offset: G,
        bytes: G,
    };
    sim.copy_to_host_async(&out, stream).expect("to host");
    // Into the read-only granule: refused, nothing written.
    let ro = HostCopy {
        device: DeviceAddress(va.0 + G),
        ..out
    };
    let e = sim.copy_from_host_async(&ro, stream).unwrap_err();
    assert_eq!(
        (e.kind, e.op),
        (ErrorKind::InvalidValue, Operation::CopyFromHost)
    );
    // Past the buffer's end, and over unmapped bytes: refused.
    let past = HostCopy {
        offset: G + 1,
        ..out
    };
    assert_eq!(
        sim.copy_to_host_async(&past, stream).unwrap_err().kind,
        ErrorKind::InvalidValue
    );
    let unmapped = HostCopy {
        device: DeviceAddress(va.0 + 2 * G),
        ..out
    };
    assert_eq!(
        sim.copy_to_host_async(&unmapped, stream).unwrap_err().kind,
        ErrorKind::InvalidValue
    );
    // Back over the first granule, zeroed first: the bytes come back exactly.
    sim.copy_to_device(va, &vec![0u8; G as usize])
        .expect("zero");
    sim.copy_from_host_async(&out, stream).expect("from host");
    let ev = sim.event_record(DeviceId(0), stream).expect("event");
    assert!(sim.event_query(ev).expect("query"));
    sim.event_wait(ev).expect("wait");
    assert_eq!(sim.ledger().events, 1);
    sim.event_destroy(ev).expect("destroy");
    assert_eq!(
        sim.event_wait(ev).unwrap_err().kind,
        ErrorKind::InvalidValue
    );
    let mut back = vec![0u8; G as usize];
    sim.copy_from_device(&mut back, va).expect("read");
    assert_eq!(back, data);
    sim.host_free(buf).expect("free");
    assert_eq!(
        sim.host_free(buf).unwrap_err().kind,
        ErrorKind::InvalidValue
    );
    teardown(&sim, va);
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
}

#[test]
fn copies_to_and_from_the_host_are_charged_by_their_bytes() {
    let mut config = SimConfig::single(G, 64 << 20);
    config.latency = LatencyModel::h200();
    let sim = SimBackend::new(config);
    let va = mapped(&sim);
    let buf = sim.host_alloc(DeviceId(0), G).expect("host_alloc");
    let copy = HostCopy {
        device: va,
        host: buf,
        offset: 0,
        bytes: G,
    };
    sim.reset_counters();
    sim.copy_to_host_async(&copy, StreamHandle(0))
        .expect("copy");
    let one = sim.estimated_driver_time();
    assert!(!one.is_zero());
    assert_eq!(
        one,
        LatencyModel::h200().cost(Operation::CopyToHost, G, 0),
        "charged as any copy of G bytes"
    );
    assert_eq!(sim.calls(Operation::CopyToHost), 1);
    sim.host_free(buf).expect("free");
    teardown(&sim, va);
}

#[test]
fn the_recording_books_buffers_and_events_and_notes_bad_copies() {
    let sim: Arc<dyn VirtualMemoryBackend> =
        Arc::new(SimBackend::new(SimConfig::single(G, 64 << 20)));
    let faults = Arc::new(FaultInjecting::new(Arc::clone(&sim)));
    let rec = Recording::new(faults.clone());
    let va = mapped(&rec);
    let buf = rec.host_alloc(DeviceId(0), G).expect("host_alloc");
    let ev = rec
        .event_record(DeviceId(0), StreamHandle(0))
        .expect("event");
    let r = rec.record();
    assert_eq!((r.host_bytes(), r.events.len()), (G, 1));
    // A copy over unmapped bytes is noted whatever the driver answers.
    let bad = HostCopy {
        device: DeviceAddress(va.0 + 3 * G),
        host: buf,
        offset: 0,
        bytes: 16,
    };
    assert!(rec.copy_to_host_async(&bad, StreamHandle(0)).is_err());
    let noted = rec.take_anomalies();
    assert!(noted.iter().any(|a| a.contains("unmapped")), "{noted:?}");
    // An injected fault of the first host allocation: out of memory, nothing booked.
    faults.arm(&Operation::TIER_CALLS, &[1]);
    let e = rec.host_alloc(DeviceId(0), G).unwrap_err();
    assert_eq!(
        (e.kind, e.op),
        (ErrorKind::OutOfMemory, Operation::HostAlloc)
    );
    // Destroying an event is not a counted step: it cannot be failed.
    faults.arm(&Operation::TIER_CALLS, &[1]);
    rec.event_destroy(ev).expect("destroy");
    assert_eq!(faults.disarm().len(), 0);
    rec.host_free(buf).expect("free");
    teardown(&rec, va);
    assert!(rec.record().is_empty(), "{:?}", rec.record());
}
