//! The never-fits decision: a commit is refused for good when the reservation would then hold
//! more than the budget less its quarantine (or the device's memory), whatever supplies the
//! windows. Memory in the pool or parked is inside the budget already: it is no discount, and
//! a request over the ceiling must never be answered with backpressure (a client would retry
//! forever).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{World, WorldConfig, D0};
use kvvm_governor::Limit;
use kvvm_hal::Operation;
use kvvm_sim::{FaultRule, MIB};
use kvvm_vmm::{Reservation, VmmError};

/// 2 MiB granules, a 512 MiB budget (256 windows), a device of 2 GiB, a pool of 512 MiB and
/// handles of up to 512 MiB: the served simulated H200 in small.
fn world(park: bool) -> World {
    let mut c = WorldConfig::new(2 * MIB);
    c.capacity_granules = 1024;
    c.budget_granules = Some(256);
    c.pool_granules = 256;
    c.max_handle_granules = 256;
    c.park = park;
    World::new(c)
}

/// Creates and maps of the simulator so far: a refusal for good makes none.
fn driver_work(w: &World) -> u64 {
    w.sim.calls(Operation::Create) + w.sim.calls(Operation::Map) + w.sim.calls(Operation::Unmap)
}

fn never_fits(e: &VmmError) -> &kvvm_governor::NeverFits {
    match e {
        VmmError::NeverFits(n) => n,
        other => panic!("expected never-fits, got {other}"),
    }
}

/// Warms the pool with the whole budget: a reservation commits 512 MiB and releases it.
fn warm(w: &World) -> Reservation {
    let g = w.g;
    let mut a = w.vm.reserve(512 * g).unwrap();
    a.commit(256 * g).unwrap();
    a.release().unwrap();
    assert_eq!(
        w.vm.pooled_bytes(),
        256 * g,
        "the pool holds the whole budget"
    );
    a
}

#[test]
fn a_warm_pool_is_no_discount_an_oversize_commit_never_fits() {
    for park in [false, true] {
        let w = world(park);
        let g = w.g;
        let a = warm(&w);
        // 896 MiB against a 512 MiB budget, every way a commit is made; the pool's 512 MiB
        // handle has exactly the size of the first piece, so the old check (needed less
        // pooled: 384 MiB) passed and the grant for the rest was refused as backpressure.
        let mut b = w.vm.reserve(512 * g).unwrap();
        let before = driver_work(&w);
        let e = b.commit(448 * g).unwrap_err();
        assert!(!e.is_retryable(), "park {park}: {e}");
        let n = never_fits(&e);
        assert_eq!(
            (n.needed, n.limit, n.limit_bytes),
            (896 * MIB, Limit::DeviceBudget, 512 * MIB)
        );
        let e = b.commit_range(0, 448 * g).unwrap_err();
        assert_eq!(never_fits(&e).needed, 896 * MIB);
        let e = b.ensure_committed(448 * g).unwrap_err();
        assert_eq!(never_fits(&e).needed, 896 * MIB);
        let e = b.begin_commit_ranges(&[(0, 448 * g)]).unwrap_err();
        assert_eq!(never_fits(&e).needed, 896 * MIB);
        let e = b.commit_shared(&[(0, 448 * g)]).unwrap_err();
        assert_eq!(never_fits(&e).needed, 896 * MIB);
        assert_eq!(driver_work(&w), before, "refused before any driver call");
        assert_eq!(w.vm.pooled_bytes(), 256 * g, "the pool is untouched");
        // The parked windows of the reservation that warmed the pool are no discount to it
        // either.
        let mut a = a;
        let e = a.commit(448 * g).unwrap_err();
        assert_eq!(never_fits(&e).needed, 896 * MIB);
        w.check(&[&a, &b]);
        // Exactly the budget fits, from the pool.
        let c = b.commit(256 * g).unwrap();
        assert_eq!(c.bytes, 512 * MIB);
        assert_eq!(w.vm.pooled_bytes(), 0);
        w.check(&[&a, &b]);
    }
}

#[test]
fn what_the_reservation_maps_counts_and_exactly_the_budget_fits() {
    let w = world(false);
    let g = w.g;
    let a = warm(&w);
    let mut b = w.vm.reserve(512 * g).unwrap();
    b.commit(200 * g).unwrap();
    // 200 held and 57 more: over the budget whatever the others free. The old check saw 57
    // new windows less the pool and answered backpressure.
    let e = b.commit(57 * g).unwrap_err();
    let n = never_fits(&e);
    assert_eq!((n.needed, n.limit_bytes), (257 * g, 256 * g));
    let e = b.commit_range(200 * g, 57 * g).unwrap_err();
    assert_eq!(never_fits(&e).needed, 257 * g);
    // 200 + 56 is exactly the budget: it fits.
    b.commit(56 * g).unwrap();
    assert_eq!(b.committed_bytes(), 256 * g);
    w.check(&[&a, &b]);
}

#[test]
fn memory_held_by_others_is_backpressure_and_quarantine_lowers_the_ceiling() {
    let w = world(false);
    let g = w.g;
    let mut other = w.vm.reserve(512 * g).unwrap();
    other.commit(200 * g).unwrap();
    let mut b = w.vm.reserve(512 * g).unwrap();
    // 100 windows fit the budget but only 56 are free: the other reservation can free its
    // memory, so this is backpressure, retryable.
    let e = b.commit(100 * g).unwrap_err();
    let VmmError::Backpressure(bp) = &e else {
        panic!("{e}")
    };
    assert_eq!((bp.needed, bp.available), (100 * g, 56 * g));
    assert!(e.is_retryable());
    // The other's teardown cannot synchronize: its 200 windows are quarantined for good, and
    // the ceiling is 56 windows from now on.
    w.sim.inject(FaultRule::failing_synchronize());
    drop(other);
    w.sim.clear_faults();
    assert_eq!(w.vm.quarantined_bytes(), 200 * g);
    let e = b.commit(57 * g).unwrap_err();
    let n = never_fits(&e);
    assert_eq!((n.needed, n.limit_bytes), (57 * g, 56 * g));
    b.commit(56 * g).unwrap();
    // Held 56 of a 56-window ceiling: one more never fits.
    let e = b.commit(g).unwrap_err();
    assert_eq!(never_fits(&e).needed, 57 * g);
    w.check(&[&b]);
}

#[test]
fn the_device_memory_is_a_ceiling_too() {
    let mut c = WorldConfig::new(2 * MIB);
    c.capacity_granules = 64;
    c.pool_granules = 64;
    c.max_handle_granules = 64;
    let w = World::new(c);
    let g = w.g;
    let mut a = w.vm.reserve(128 * g).unwrap();
    a.commit(64 * g).unwrap();
    a.release().unwrap();
    let mut b = w.vm.reserve(128 * g).unwrap();
    let e = b.commit(96 * g).unwrap_err();
    let n = never_fits(&e);
    assert_eq!(
        (n.needed, n.limit, n.limit_bytes),
        (96 * g, Limit::DeviceMemory, 64 * g)
    );
    b.commit(64 * g).unwrap();
    assert_eq!(w.gov.snapshot().device(D0).committed, 64 * g);
    w.check(&[&a, &b]);
}
