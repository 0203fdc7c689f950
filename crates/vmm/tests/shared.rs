//! Shared handles (read-only prefix sharing) and commits of arbitrary windows.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::{World, D0};
use kvvm_hal::{Access, ErrorKind, Operation, VirtualMemoryBackend};
use kvvm_sim::FaultRule;
use kvvm_vmm::{BlockKind, Reservation, VmmError};

const G: u64 = 64 << 10;

/// Governor accounting: committed (owned) + shared (once) + pooled = the driver's bytes.
fn check_books(w: &World, owned: &[&Reservation], shared_bytes: u64) {
    let snap = w.gov.snapshot().device(D0);
    let owned_bytes: u64 = owned
        .iter()
        .flat_map(|r| r.mappings())
        .filter(|b| b.kind == BlockKind::Owned)
        .map(|b| b.size)
        .sum();
    assert_eq!(snap.committed, owned_bytes, "{snap:?}");
    assert_eq!(snap.shared, shared_bytes, "{snap:?}");
    assert_eq!(snap.pooled, w.vm.pooled_bytes());
    assert_eq!(snap.pending, 0);
    assert_eq!(
        snap.used(),
        w.sim.ledger().total_physical_bytes(),
        "governor used vs driver"
    );
    assert_eq!(w.vm.accounting_errors(), 0);
}

#[test]
fn owner_and_sharers_map_one_allocation_billed_once() {
    let w = World::simple(G, 0);
    let mut owner = w.vm.reserve(8 * G).unwrap();
    let set = owner.commit_shared(&[(0, 2 * G)]).unwrap();
    assert_eq!(set.len(), 2);
    assert_eq!(set.mapped_count(), 2);
    w.sim
        .copy_to_device(owner.address(), b"prefix-bytes")
        .unwrap();

    let mut sharers: Vec<Reservation> = (0..3).map(|_| w.vm.reserve(8 * G).unwrap()).collect();
    for s in &mut sharers {
        assert_eq!(s.map_shared(&set, &[0, 1], Access::Read).unwrap(), 2 * G);
        // Each commits its own windows after the prefix.
        s.commit_range(2 * G, G).unwrap().unwrap();
    }
    assert_eq!(set.mapped_count(), 2 + 3 * 2);
    // A release of everything would give back a sharer's own window only: the shared ones
    // drop a reference.
    assert_eq!(sharers[0].owned_bytes_inside(&[(0, 8 * G)]), G);
    // Billed once: 2 shared windows + 3 private ones.
    assert_eq!(w.sim.ledger().total_physical_bytes(), 5 * G);
    check_books(&w, &[&owner, &sharers[0], &sharers[1], &sharers[2]], 2 * G);

    // A sharer reads the prefix, and cannot write it (the hardware refuses).
    let mut buf = [0u8; 12];
    w.sim
        .copy_from_device(&mut buf, sharers[0].address())
        .unwrap();
    assert_eq!(&buf, b"prefix-bytes");
    let e = w
        .sim
        .copy_to_device(sharers[0].address(), b"x")
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidValue);
    // Committing over a shared window is refused by the manager.
    assert!(sharers[1].is_mapped(0));

    // The owner finishes first: the sharers still read the bytes.
    drop(owner);
    w.sim
        .copy_from_device(&mut buf, sharers[2].address())
        .unwrap();
    assert_eq!(&buf, b"prefix-bytes");
    assert_eq!(set.mapped_count(), 6);
    assert_eq!(w.sim.ledger().total_physical_bytes(), 5 * G);

    // Handles are released only when the last mapping and the set itself are gone.
    sharers.truncate(1);
    drop(set);
    assert_eq!(
        w.sim.ledger().total_physical_bytes(),
        3 * G,
        "2 shared + 1 private"
    );
    drop(sharers);
    assert!(w.sim.ledger().is_empty());
    let snap = w.gov.snapshot().device(D0);
    assert_eq!(snap.used(), 0);
}

#[test]
fn sharer_whose_set_access_fails_withdraws_its_mappings() {
    let w = World::simple(G, 0);
    let mut owner = w.vm.reserve(4 * G).unwrap();
    let set = owner.commit_shared(&[(0, 3 * G)]).unwrap();
    let mut sharer = w.vm.reserve(4 * G).unwrap();
    w.sim
        .inject(FaultRule::nth(Operation::SetAccess, 1, ErrorKind::Other));
    let e = sharer
        .map_shared(&set, &[0, 1, 2], Access::Read)
        .unwrap_err();
    assert!(
        matches!(e, VmmError::Backend(ref b) if b.kind == ErrorKind::Other),
        "{e}"
    );
    assert!(
        sharer.mappings().is_empty(),
        "the sharer's mappings were withdrawn"
    );
    assert_eq!(set.mapped_count(), 3, "only the owner's mappings remain");
    assert_eq!(w.sim.ledger().mappings.len(), 3);
    assert_eq!(
        w.sim.ledger().handles.len(),
        3,
        "the handles stay with the prefix"
    );
    check_books(&w, &[&owner, &sharer], 3 * G);
    // It works on a second try.
    sharer.map_shared(&set, &[0, 1, 2], Access::Read).unwrap();
    assert_eq!(set.mapped_count(), 6);
}

#[test]
fn every_failing_map_of_a_sharer_rolls_back() {
    for n in 1..=3 {
        let w = World::simple(G, 0);
        let mut owner = w.vm.reserve(4 * G).unwrap();
        let set = owner.commit_shared(&[(0, 3 * G)]).unwrap();
        let mut sharer = w.vm.reserve(4 * G).unwrap();
        w.sim
            .inject(FaultRule::nth(Operation::Map, n, ErrorKind::OutOfMemory));
        sharer
            .map_shared(&set, &[0, 1, 2], Access::Read)
            .unwrap_err();
        assert!(sharer.mappings().is_empty(), "map {n}");
        assert_eq!(set.mapped_count(), 3, "map {n}");
        assert_eq!(w.sim.ledger().mappings.len(), 3, "map {n}");
        check_books(&w, &[&owner, &sharer], 3 * G);
    }
}

#[test]
fn every_failing_step_of_commit_shared_rolls_back() {
    // Count a clean run's calls, then fail each call of each operation once.
    for (op, calls) in [
        (Operation::Create, 3),
        (Operation::Map, 3),
        (Operation::SetAccess, 1),
    ] {
        for n in 1..=calls {
            let w = World::simple(G, 2);
            let mut owner = w.vm.reserve(4 * G).unwrap();
            w.sim.inject(FaultRule::nth(op, n, ErrorKind::OutOfMemory));
            let e = owner.commit_shared(&[(0, 3 * G)]).unwrap_err();
            assert!(e.is_retryable(), "{op} {n}: {e}");
            assert!(owner.mappings().is_empty(), "{op} {n}");
            assert!(w.sim.ledger().mappings.is_empty(), "{op} {n}");
            check_books(&w, &[&owner], 0);
            drop(owner);
            w.vm.trim_pool(0);
            assert!(w.sim.ledger().is_empty(), "{op} {n}: {:?}", w.sim.ledger());
        }
    }
}

#[test]
fn commit_range_maps_spread_windows_as_one_transaction() {
    let w = World::simple(G, 0);
    let mut r = w.vm.reserve(16 * G).unwrap();
    // Three fragments of a head-major-like layout, one window each.
    let ranges = [(0, 10), (5 * G, 10), (10 * G + 7, 100)];
    let c = r.commit_ranges(&ranges).unwrap().unwrap();
    assert_eq!(c.granules, 3);
    assert!(r.is_mapped(0) && r.is_mapped(5 * G) && r.is_mapped(10 * G));
    assert_eq!(
        w.sim.calls(Operation::SetAccess),
        3,
        "one set access per run"
    );
    // Nothing left to do.
    assert!(r.commit_ranges(&ranges).unwrap().is_none());
    // Adjacent windows form one run.
    let before = w.sim.calls(Operation::SetAccess);
    r.commit_range(G, 3 * G).unwrap().unwrap();
    assert_eq!(w.sim.calls(Operation::SetAccess) - before, 1);
    w.check(&[&r]);

    // Out of bounds is refused before any driver call.
    let calls = w.sim.driver_calls();
    assert!(matches!(
        r.commit_range(15 * G, 2 * G),
        Err(VmmError::OutOfBounds { .. })
    ));
    assert_eq!(w.sim.driver_calls(), calls);
}

#[test]
fn commit_range_fault_at_every_step_leaves_no_trace() {
    let ranges = [(0, G), (4 * G, 2 * G), (9 * G, G)];
    // Clean run: 4 creates, 4 maps, 3 set accesses.
    for (op, calls) in [
        (Operation::Create, 4),
        (Operation::Map, 4),
        (Operation::SetAccess, 3),
    ] {
        for n in 1..=calls {
            let w = World::simple(G, 1);
            let mut r = w.vm.reserve(12 * G).unwrap();
            r.commit_range(2 * G, G).unwrap();
            w.sim.inject(FaultRule::nth(op, n, ErrorKind::OutOfMemory));
            r.commit_ranges(&ranges).unwrap_err();
            assert_eq!(r.mappings().len(), 1, "{op} {n}: only the earlier window");
            w.check(&[&r]);
        }
    }
}

#[test]
fn unmap_failure_of_a_sharer_keeps_the_handle_alive() {
    let w = World::simple(G, 0);
    let mut owner = w.vm.reserve(2 * G).unwrap();
    let set = owner.commit_shared(&[(0, G)]).unwrap();
    let mut sharer = w.vm.reserve(2 * G).unwrap();
    sharer.map_shared(&set, &[0], Access::Read).unwrap();
    drop(owner);
    let weak = Arc::downgrade(&set);
    drop(set);
    assert!(
        weak.upgrade().is_some(),
        "the sharer's mapping holds the set"
    );
    w.sim
        .inject(FaultRule::nth(Operation::Unmap, 1, ErrorKind::Other));
    sharer.release().unwrap_err();
    assert_eq!(sharer.mappings().len(), 1, "still mapped, still recorded");
    assert!(weak.upgrade().is_some());
    assert_eq!(w.sim.ledger().handles.len(), 1, "not released while mapped");
    sharer.release().unwrap();
    assert!(weak.upgrade().is_none());
    drop(sharer);
    assert!(w.sim.ledger().is_empty());
}

#[test]
fn release_ranges_gives_back_only_whole_windows_inside() {
    let w = World::simple(G, 4);
    let mut r = w.vm.reserve(16 * G).unwrap();
    r.commit_ranges(&[(0, 3 * G), (8 * G, 3 * G)]).unwrap();
    // Windows 1-2 and 9-10 go; 0 and 8 stay; a range covering half a window frees nothing.
    let ranges = [(G, 2 * G), (9 * G, 2 * G), (12 * G, G / 2)];
    assert_eq!(r.owned_bytes_inside(&ranges), 4 * G);
    let freed = r
        .release_ranges(&[(G, 2 * G), (9 * G, 2 * G), (12 * G, G / 2)])
        .unwrap();
    assert_eq!(freed, 4 * G);
    let left: Vec<u64> = r
        .mappings()
        .iter()
        .map(|b| b.address.0 - r.address().0)
        .collect();
    assert_eq!(left, vec![0, 8 * G]);
    assert_eq!(w.vm.pooled_bytes(), 4 * G);
    w.check(&[&r]);
    // A failing unmap keeps the block recorded.
    w.sim
        .inject(FaultRule::nth(Operation::Unmap, 1, ErrorKind::Other));
    r.release_ranges(&[(0, G)]).unwrap_err();
    assert!(r.is_mapped(0));
    w.check(&[&r]);
}
