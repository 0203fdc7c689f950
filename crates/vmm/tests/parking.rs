//! Parked windows: released windows kept mapped for reuse by the same reservation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{World, WorldConfig, D0};
use kvvm_hal::{Access, ErrorKind, Operation, VirtualMemoryBackend};
use kvvm_sim::FaultRule;
use kvvm_vmm::VmmError;

const G: u64 = 64 << 10;

fn world(pool_granules: u64, budget_granules: Option<u64>) -> World {
    let mut c = WorldConfig::new(G);
    c.pool_granules = pool_granules;
    c.budget_granules = budget_granules;
    c.park = true;
    World::new(c)
}

#[test]
fn release_parks_and_a_recommit_makes_no_driver_call() {
    let w = world(16, None);
    let mut r = w.vm.reserve(8 * G).unwrap();
    r.commit(4 * G).unwrap();
    w.sim.copy_to_device(r.address(), b"kept").unwrap();
    let calls = w.sim.driver_calls();
    assert_eq!(r.release().unwrap(), 0, "nothing unmapped");
    assert_eq!(w.sim.driver_calls(), calls, "release made no driver call");
    assert_eq!(r.committed_bytes(), 0);
    assert_eq!(r.parked().len(), 4);
    assert_eq!(w.vm.parked_bytes(), 4 * G);
    assert_eq!(w.vm.pooled_bytes(), 4 * G);
    w.check(&[&r]);

    let c = r.commit(4 * G).unwrap();
    assert_eq!(c.from_pool, 4);
    assert_eq!(
        w.sim.driver_calls(),
        calls,
        "the recommit made no driver call"
    );
    assert_eq!(r.committed_bytes(), 4 * G);
    assert!(r.parked().is_empty());
    let mut b = [0u8; 4];
    w.sim.copy_from_device(&mut b, r.address()).unwrap();
    assert_eq!(
        &b, b"kept",
        "the same physical memory, still mapped read-write"
    );
    w.check(&[&r]);
}

#[test]
fn partial_reuse_commits_the_rest_and_sets_access_only_on_new_windows() {
    let w = world(16, None);
    let mut r = w.vm.reserve(8 * G).unwrap();
    r.commit(2 * G).unwrap();
    r.release().unwrap();
    let before = w.sim.calls(Operation::SetAccess);
    let c = r.commit(5 * G).unwrap();
    assert_eq!(c.granules, 5);
    assert_eq!(c.from_pool, 2);
    assert_eq!(w.sim.calls(Operation::Create), 2 + 3);
    assert_eq!(
        w.sim.calls(Operation::SetAccess) - before,
        1,
        "one run of new windows"
    );
    w.check(&[&r]);
}

#[test]
fn the_pool_cap_bounds_parking() {
    let w = world(3, None);
    let mut r = w.vm.reserve(8 * G).unwrap();
    r.commit(5 * G).unwrap();
    assert_eq!(
        r.release().unwrap(),
        2 * G,
        "2 windows over the cap were unmapped"
    );
    assert_eq!(r.parked().len(), 3);
    assert_eq!(w.vm.pooled_bytes(), 3 * G);
    w.check(&[&r]);
}

#[test]
fn parked_windows_are_given_back_under_pressure() {
    let w = world(8, Some(6));
    let mut a = w.vm.reserve(8 * G).unwrap();
    a.commit(4 * G).unwrap();
    a.release().unwrap();
    assert_eq!(a.parked().len(), 4);
    // Another reservation needs 4 new windows; 2 fit the budget: the governor asks the pool,
    // which unmaps and releases parked windows.
    let mut b = w.vm.reserve(8 * G).unwrap();
    b.commit(4 * G).unwrap();
    assert!(a.parked().len() <= 2, "{}", a.parked().len());
    w.check(&[&a, &b]);
    // trim_pool(0) unparks the rest.
    w.vm.trim_pool(0);
    assert!(a.parked().is_empty());
    assert_eq!(w.vm.pooled_bytes(), 0);
    w.check(&[&a, &b]);
}

#[test]
fn a_failed_unmap_while_unparking_keeps_the_window_parked() {
    let w = world(8, None);
    let mut r = w.vm.reserve(4 * G).unwrap();
    r.commit(2 * G).unwrap();
    r.release().unwrap();
    w.sim
        .inject(FaultRule::nth(Operation::Unmap, 1, ErrorKind::Other));
    w.vm.trim_pool(0);
    // The failed one stays parked (it is still mapped); the pass stops at the failure.
    assert_eq!(r.parked().len(), 2);
    w.check(&[&r]);
    w.vm.trim_pool(0);
    assert!(r.parked().is_empty());
    w.check(&[&r]);
}

#[test]
fn a_shared_mapping_evicts_a_parked_window() {
    let w = world(8, None);
    let mut owner = w.vm.reserve(4 * G).unwrap();
    let set = owner.commit_shared(&[(0, G)]).unwrap();
    let mut sharer = w.vm.reserve(4 * G).unwrap();
    sharer.commit(2 * G).unwrap();
    sharer.release().unwrap();
    assert_eq!(sharer.parked().len(), 2);
    sharer.map_shared(&set, &[0], Access::Read).unwrap();
    assert_eq!(
        sharer.parked().len(),
        1,
        "window 0 was unmapped to make room"
    );
    assert!(sharer.is_mapped(0));
    // A commit over the shared window is refused; the parked window 1 is reused.
    assert!(matches!(
        sharer.commit_range(0, 2 * G),
        Ok(Some(c)) if c.granules == 1 && c.from_pool == 1
    ));
    drop(owner);
    drop(set);
    drop(sharer);
    w.vm.trim_pool(0);
    assert!(w.sim.ledger().is_empty(), "{:?}", w.sim.ledger());
}

#[test]
fn every_fault_of_a_mixed_commit_returns_the_reused_windows_to_parking() {
    // 2 parked windows reused + 3 new: 3 creates, 3 maps, 1 set access.
    for (op, calls) in [
        (Operation::Create, 3),
        (Operation::Map, 3),
        (Operation::SetAccess, 1),
    ] {
        for n in 1..=calls {
            let w = world(16, None);
            let mut r = w.vm.reserve(8 * G).unwrap();
            r.commit(2 * G).unwrap();
            r.release().unwrap();
            w.sim.inject(FaultRule::nth(op, n, ErrorKind::OutOfMemory));
            let e = r.commit(5 * G).unwrap_err();
            assert!(matches!(e, VmmError::Backend(_)), "{op} {n}: {e}");
            assert_eq!(r.committed_bytes(), 0, "{op} {n}");
            assert_eq!(
                r.parked().len(),
                2,
                "{op} {n}: reused windows back in parking"
            );
            w.check(&[&r]);
        }
    }
}

#[test]
fn teardown_releases_parked_windows_or_quarantines_them() {
    let w = world(8, None);
    let mut r = w.vm.reserve(4 * G).unwrap();
    r.commit(3 * G).unwrap();
    r.release().unwrap();
    drop(r);
    w.vm.trim_pool(0);
    assert!(w.sim.ledger().is_empty());
    assert_eq!(w.vm.parked_bytes(), 0);

    let mut r = w.vm.reserve(4 * G).unwrap();
    r.commit(2 * G).unwrap();
    r.release().unwrap();
    w.sim.inject(FaultRule::failing_synchronize());
    drop(r);
    // Nothing was unmapped, released or freed: quarantined, never advertised as free.
    assert_eq!(w.vm.quarantined_bytes(), 2 * G);
    assert_eq!(w.vm.parked_bytes(), 0);
    assert_eq!(w.sim.ledger().mappings.len(), 2);
    let snap = w.gov.snapshot().device(D0);
    assert_eq!(snap.quarantined, 2 * G);
    assert_eq!(snap.used(), w.sim.ledger().total_physical_bytes());
}
