//! Reproductions of failures that only several faults together reveal, and of requests that
//! must be priced before anything is built for them. Each test failed on the manager before
//! the fix it names.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{World, WorldConfig, D0};
use kvvm_governor::Limit;
use kvvm_hal::{Access, ErrorKind, Operation};
use kvvm_sim::{FaultRule, SimQuirks};
use kvvm_vmm::VmmError;

/// A failed commit whose rollback loses its 1st and 3rd unmap keeps the block list sorted, so
/// that `is_mapped`, `committed_end` and `truncate` see the truth (a truncate used to unmap a
/// block it had to keep).
#[test]
fn rollback_with_two_failed_unmaps_keeps_blocks_sorted() {
    let g = 4096;
    let mut c = WorldConfig::new(g);
    c.capacity_granules = 5;
    let w = World::new(c);
    // Another reservation holds one granule, so that the commit below fits the device's
    // memory (its own 5 windows) but the driver runs out at its 4th create.
    let mut other = w.vm.reserve(g).unwrap();
    other.commit(g).unwrap();
    let mut r = w.vm.reserve(5 * g).unwrap();
    r.commit(g).unwrap();
    w.sim
        .inject(FaultRule::nth(Operation::Unmap, 1, ErrorKind::Other));
    w.sim
        .inject(FaultRule::nth(Operation::Unmap, 3, ErrorKind::Other));
    // Windows 1..3 are created and mapped; the 4th create finds the device full.
    let e = r.commit(4 * g).unwrap_err();
    assert_eq!(
        e.backend_error().map(|b| (b.op, b.kind)),
        Some((Operation::Create, ErrorKind::OutOfMemory))
    );
    w.sim.clear_faults();
    let offsets: Vec<u64> = r
        .mappings()
        .iter()
        .map(|b| b.address.0 - r.address().0)
        .collect();
    assert_eq!(offsets, vec![0, g, 3 * g], "sorted: window 2 was unmapped");
    assert!(r.is_mapped(3 * g) && r.is_mapped(g) && !r.is_mapped(2 * g));
    assert_eq!(r.committed_end(), 4 * g);
    w.check(&[&r, &other]);
    // Truncating to 2 windows keeps windows 0 and 1 and unmaps window 3.
    r.truncate(2 * g).unwrap();
    assert!(r.is_mapped(0) && r.is_mapped(g) && !r.is_mapped(3 * g));
    w.check(&[&r, &other]);
}

/// With one unmap per mapping (the HIP setting), a release that loses one unmap leaves a block
/// above holes; `ensure_committed` and `commit` fill the holes instead of ignoring them.
#[test]
fn ensure_committed_and_commit_fill_holes_left_by_a_failed_release() {
    let g = 4096;
    let mut c = WorldConfig::new(g);
    c.quirks = SimQuirks {
        multi_unmap_breaks_free: true,
        ..SimQuirks::default()
    };
    let w = World::new(c);
    assert!(!w.vm.capabilities().unmap_spans_mappings);
    let mut r = w.vm.reserve(8 * g).unwrap();
    r.commit(4 * g).unwrap();
    w.sim
        .inject(FaultRule::nth(Operation::Unmap, 1, ErrorKind::Other));
    assert!(r.release().is_err());
    w.sim.clear_faults();
    let left: Vec<u64> = r
        .mappings()
        .iter()
        .map(|b| b.address.0 - r.address().0)
        .collect();
    assert_eq!(left, vec![3 * g], "the last window's unmap failed");
    w.check(&[&r]);
    let c2 = r
        .ensure_committed(2 * g)
        .unwrap()
        .expect("windows 0 and 1 are missing");
    assert_eq!((c2.address, c2.granules), (r.address(), 2));
    assert!(r.is_mapped(0) && r.is_mapped(g));
    // The next commit fills window 2 (the last hole), not window 4.
    let c3 = r.commit(g).unwrap();
    assert_eq!(c3.address.0 - r.address().0, 2 * g);
    assert_eq!(r.committed_bytes(), 4 * g);
    assert_eq!(r.committed_end(), 4 * g);
    w.check(&[&r]);
}

/// Bad shared ranges are typed invalid arguments, never a false `AlreadyMapped`.
#[test]
fn commit_shared_refuses_overlapping_and_empty_ranges_as_invalid() {
    let g = 64 << 10;
    let w = World::simple(g, 0);
    let mut r = w.vm.reserve(4 * g).unwrap();
    let overlap = r.commit_shared(&[(0, g), (0, g)]).unwrap_err();
    assert!(
        matches!(&overlap, VmmError::InvalidArgument { reason } if reason.contains("overlap")),
        "{overlap}"
    );
    let empty = r.commit_shared(&[(g / 2, 0)]).unwrap_err();
    assert!(matches!(empty, VmmError::InvalidArgument { .. }), "{empty}");
    assert!(r.mappings().is_empty());
    assert_eq!(w.sim.ledger().total_physical_bytes(), 0);
    // Adjacent ranges are fine; a window already mapped is refused as such.
    let set = r.commit_shared(&[(0, g), (g, g)]).unwrap();
    assert_eq!(set.len(), 2);
    let again = r.commit_shared(&[(g, 2 * g)]).unwrap_err();
    assert_eq!(again, VmmError::AlreadyMapped { offset: g });
    drop(r);
    drop(set);
    drop(w.vm);
    assert!(w.sim.ledger().is_empty());
}

/// A teardown that cannot synchronize while a shared window is mapped quarantines that window
/// (its bytes counted once, in the quarantine) and keeps nothing else alive: the pool is given
/// back when everything is dropped, leaving only the quarantined handle.
#[test]
fn failed_teardown_sync_with_a_shared_mapping_leaks_only_the_quarantined_window() {
    let g = 64 << 10;
    let w = World::simple(g, 4);
    // A pooled handle: committed and released by another reservation.
    let mut other = w.vm.reserve(g).unwrap();
    other.commit(g).unwrap();
    other.release().unwrap();
    assert_eq!(w.vm.pooled_bytes(), g);
    let mut owner = w.vm.reserve(2 * g).unwrap();
    let set = owner.commit_shared(&[(0, g)]).unwrap();
    let mut sharer = w.vm.reserve(2 * g).unwrap();
    sharer.map_shared(&set, &[0], Access::Read).unwrap();
    w.sim.inject(FaultRule::failing_synchronize());
    drop(sharer);
    w.sim.clear_faults();
    let q = w.vm.quarantine();
    assert_eq!(q.len(), 1);
    assert_eq!(q[0].bytes, g, "the shared window's bytes are in the entry");
    let snap = w.gov.snapshot().device(D0);
    assert_eq!((snap.shared, snap.quarantined), (0, g), "{snap:?}");
    assert_eq!(set.quarantined_bytes(), g);
    drop(owner);
    drop(set);
    drop(other);
    drop(w.vm);
    let ledger = w.sim.ledger();
    assert_eq!(
        ledger.handles.len(),
        1,
        "only the quarantined handle: {ledger:?}"
    );
    assert_eq!(ledger.total_physical_bytes(), g);
    let snap = w.gov.snapshot().device(D0);
    assert_eq!((snap.used(), snap.quarantined), (g, g));
}

/// A request that can never fit is refused in O(1) memory with its own error and no retry
/// time, however many granules it names.
#[test]
fn never_fitting_commits_are_priced_before_anything_is_built() {
    let g = 4096;
    let mut c = WorldConfig::new(g);
    c.budget_granules = Some(16); // 64 KiB
    let w = World::new(c);
    let tib = 1u64 << 40;
    let mut r = w.vm.reserve(64 * tib + g).unwrap();
    for bytes in [tib, 64 * tib] {
        let e = r.commit(bytes).unwrap_err();
        let VmmError::NeverFits(n) = &e else {
            panic!("{bytes} bytes: {e}");
        };
        assert_eq!(
            (n.needed, n.limit, n.limit_bytes),
            (bytes, Limit::DeviceBudget, 16 * g)
        );
        assert!(!e.is_retryable());
        let e = r.commit_range(g, bytes).unwrap_err();
        assert!(matches!(e, VmmError::NeverFits(_)), "{e}");
    }
    // Over what is free but within the budget: backpressure, retryable (another reservation
    // holds the memory and may free it).
    let mut other = w.vm.reserve(32 * g).unwrap();
    other.commit(10 * g).unwrap();
    let e = r.commit(8 * g).unwrap_err();
    assert!(
        matches!(e, VmmError::Backpressure(_)) && e.is_retryable(),
        "{e}"
    );
    // What a reservation maps counts: 10 held and 8 more can never fit 16.
    let e = other.commit(8 * g).unwrap_err();
    let VmmError::NeverFits(n) = &e else {
        panic!("{e}");
    };
    assert_eq!((n.needed, n.limit_bytes), (18 * g, 16 * g));
    // Unlimited budget: the device's memory (64 granules in this world) is the limit.
    let w2 = World::simple(g, 0);
    let mut r2 = w2.vm.reserve(tib).unwrap();
    let e = r2.commit(65 * g).unwrap_err();
    let VmmError::NeverFits(n) = &e else {
        panic!("{e}");
    };
    assert_eq!((n.limit, n.limit_bytes), (Limit::DeviceMemory, 64 * g));
    assert!(r.mappings().is_empty() && other.mappings().len() == 10);
    assert!(r2.mappings().is_empty());
    w.check(&[&r, &other]);
    w2.check(&[&r2]);
}
