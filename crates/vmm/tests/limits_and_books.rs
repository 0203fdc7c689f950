//! The manager's limits and books at their boundaries: which ceiling a commit that can never
//! fit names, that exactly a ceiling fits, that an accounting failure is counted and not
//! fatal, and that the pool and parking keep to their cap byte for byte.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{World, WorldConfig, D0};
use kvvm_governor::{Bucket, Limit, NeverFits};
use kvvm_hal::{ErrorKind, Operation};
use kvvm_sim::FaultRule;
use kvvm_vmm::VmmError;

const G: u64 = 64 << 10;

fn never_fits(e: VmmError) -> NeverFits {
    match e {
        VmmError::NeverFits(n) => n,
        other => panic!("expected never-fits, got {other}"),
    }
}

/// A device of `capacity` windows and a budget of `budget` windows.
fn world(capacity: u64, budget: Option<u64>) -> World {
    let mut c = WorldConfig::new(G);
    c.capacity_granules = capacity;
    c.budget_granules = budget;
    World::new(c)
}

#[test]
fn exactly_the_device_memory_fits_one_window_more_never_does() {
    let w = world(16, None);
    let mut r = w.vm.reserve(32 * G).unwrap();
    let n = never_fits(r.commit(17 * G).unwrap_err());
    assert_eq!(
        (n.device, n.needed, n.limit, n.limit_bytes),
        (D0, 17 * G, Limit::DeviceMemory, 16 * G)
    );
    r.commit(16 * G).unwrap();
    w.check(&[&r]);
}

#[test]
fn the_tighter_ceiling_is_the_one_named() {
    // The device is tighter than the budget.
    let w = world(16, Some(24));
    let mut r = w.vm.reserve(32 * G).unwrap();
    let n = never_fits(r.commit(25 * G).unwrap_err());
    assert_eq!((n.limit, n.limit_bytes), (Limit::DeviceMemory, 16 * G));
    // The budget is tighter than the device.
    let w = world(16, Some(8));
    let mut r = w.vm.reserve(32 * G).unwrap();
    let n = never_fits(r.commit(20 * G).unwrap_err());
    assert_eq!((n.limit, n.limit_bytes), (Limit::DeviceBudget, 8 * G));
    // Only the budget is passed.
    let n = never_fits(r.commit(9 * G).unwrap_err());
    assert_eq!((n.limit, n.limit_bytes), (Limit::DeviceBudget, 8 * G));
    // Equal ceilings: the budget is named.
    let w = world(16, Some(16));
    let mut r = w.vm.reserve(32 * G).unwrap();
    let n = never_fits(r.commit(17 * G).unwrap_err());
    assert_eq!((n.limit, n.limit_bytes), (Limit::DeviceBudget, 16 * G));
    r.commit(16 * G).unwrap();
    w.check(&[&r]);
}

#[test]
fn what_a_reservation_holds_plus_what_it_asks_is_what_never_fits_weighs() {
    let w = world(64, Some(10));
    let mut r = w.vm.reserve(32 * G).unwrap();
    r.commit(4 * G).unwrap();
    // 4 held and 7 asked: 11 of 10.
    let n = never_fits(r.commit(7 * G).unwrap_err());
    assert_eq!(n.needed, 11 * G);
    let n = never_fits(r.commit_range(8 * G, 7 * G).unwrap_err());
    assert_eq!(n.needed, 11 * G);
    // 4 held and 6 asked: exactly the budget.
    r.commit_range(8 * G, 6 * G).unwrap();
    assert_eq!(r.committed_bytes(), 10 * G);
    w.check(&[&r]);
}

#[test]
fn an_accounting_failure_is_counted_and_the_release_still_happens() {
    let w = world(64, None);
    let mut r = w.vm.reserve(8 * G).unwrap();
    r.commit(2 * G).unwrap();
    // Someone takes the committed bytes out of the books behind the manager's back: the
    // release cannot give them back, twice (one handle each).
    w.gov.free(D0, Bucket::Committed, 2 * G).unwrap();
    assert_eq!(w.vm.accounting_errors(), 0);
    assert_eq!(r.release().unwrap(), 2 * G);
    assert_eq!(w.vm.accounting_errors(), 2);
    assert!(
        w.sim.ledger().mappings.is_empty(),
        "the driver work was done"
    );
    assert!(w.sim.ledger().handles.is_empty());
}

#[test]
fn the_pool_keeps_exactly_up_to_its_cap() {
    let mut c = WorldConfig::new(G);
    c.pool_granules = 3;
    let w = World::new(c);
    let mut r = w.vm.reserve(8 * G).unwrap();
    r.commit(5 * G).unwrap();
    let releases = w.sim.calls(Operation::Release);
    assert_eq!(r.release().unwrap(), 5 * G);
    // Three handles fill the cap exactly; the other two go back to the driver.
    assert_eq!(w.vm.pooled_bytes(), 3 * G);
    assert_eq!(w.vm.pooled_handles().len(), 3);
    assert_eq!(w.sim.calls(Operation::Release) - releases, 2);
    assert_eq!(w.vm.pool_cap_bytes(), 3 * G);
    w.check(&[&r]);
    // A smaller cap releases what is over it.
    assert_eq!(w.vm.set_pool_cap_bytes(G), 2 * G);
    assert_eq!((w.vm.pooled_bytes(), w.vm.pool_cap_bytes()), (G, G));
    w.check(&[&r]);
    // Commits take the pooled handle first.
    let c = r.commit(2 * G).unwrap();
    assert_eq!(c.from_pool, 1);
    assert_eq!(w.vm.pooled_bytes(), 0);
    w.check(&[&r]);
}

#[test]
fn trimming_the_pool_keeps_what_is_asked_and_returns_what_it_released() {
    let mut c = WorldConfig::new(G);
    c.pool_granules = 8;
    let w = World::new(c);
    let mut r = w.vm.reserve(8 * G).unwrap();
    r.commit(6 * G).unwrap();
    r.release().unwrap();
    assert_eq!(w.vm.pooled_bytes(), 6 * G);
    assert_eq!(w.vm.trim_pool(4 * G), 2 * G);
    assert_eq!(w.vm.pooled_bytes(), 4 * G);
    assert_eq!(w.vm.trim_pool(4 * G), 0, "nothing over");
    assert_eq!(w.vm.trim_pool(0), 4 * G);
    assert_eq!(w.vm.pooled_bytes(), 0);
    assert_eq!(w.gov.snapshot().device(D0).pooled, 0);
    w.check(&[&r]);
}

#[test]
fn parked_windows_are_unparked_exactly_as_far_as_asked() {
    let mut c = WorldConfig::new(G);
    c.pool_granules = 8;
    c.park = true;
    let w = World::new(c);
    let mut r = w.vm.reserve(8 * G).unwrap();
    r.commit(4 * G).unwrap();
    r.release().unwrap();
    assert_eq!(w.vm.parked_bytes(), 4 * G);
    // Two windows over the target: exactly two are unmapped and released.
    assert_eq!(w.vm.trim_pool(2 * G), 2 * G);
    assert_eq!(r.parked().len(), 2);
    assert_eq!(w.vm.parked_bytes(), 2 * G);
    assert_eq!(w.sim.calls(Operation::Unmap), 2);
    w.check(&[&r]);
    assert_eq!(w.vm.trim_pool(2 * G), 0, "nothing over: nothing unparked");
    assert_eq!(w.sim.calls(Operation::Unmap), 2);
}

#[test]
fn unparking_goes_on_to_the_next_reservation_until_enough_is_released() {
    let mut c = WorldConfig::new(G);
    c.pool_granules = 8;
    c.park = true;
    let w = World::new(c);
    let mut a = w.vm.reserve(8 * G).unwrap();
    let mut b = w.vm.reserve(8 * G).unwrap();
    a.commit(G).unwrap();
    b.commit(2 * G).unwrap();
    a.release().unwrap();
    b.release().unwrap();
    assert_eq!(w.vm.parked_bytes(), 3 * G);
    assert_eq!(w.vm.trim_pool(0), 3 * G);
    assert!(a.parked().is_empty() && b.parked().is_empty());
    assert_eq!(w.gov.snapshot().device(D0).pooled, 0);
    w.check(&[&a, &b]);
}

#[test]
fn a_dropped_reservations_parked_windows_are_not_unparked_again() {
    let mut c = WorldConfig::new(G);
    c.pool_granules = 8;
    c.park = true;
    let w = World::new(c);
    let mut a = w.vm.reserve(8 * G).unwrap();
    a.commit(2 * G).unwrap();
    a.release().unwrap();
    drop(a);
    // Teardown gave the parked windows back (their handles to the pool): none is parked.
    assert_eq!((w.vm.parked_bytes(), w.vm.pooled_bytes()), (0, 2 * G));
    let unmaps = w.sim.calls(Operation::Unmap);
    let mut b = w.vm.reserve(8 * G).unwrap();
    b.commit(G).unwrap();
    b.release().unwrap();
    assert_eq!(w.vm.parked_bytes(), G);
    // One free handle and one parked window: only the parked one is unmapped.
    assert_eq!(w.vm.trim_pool(0), 2 * G);
    assert_eq!(w.sim.calls(Operation::Unmap), unmaps + 1);
    w.check(&[&b]);
}

#[test]
fn a_private_commit_over_some_parked_windows_leaves_the_others_parked() {
    let mut c = WorldConfig::new(G);
    c.pool_granules = 8;
    c.park = true;
    let w = World::new(c);
    let mut r = w.vm.reserve(8 * G).unwrap();
    r.commit(4 * G).unwrap();
    r.release().unwrap();
    let calls = w.sim.driver_calls();
    r.commit_range(G, G).unwrap();
    assert_eq!(
        w.sim.driver_calls(),
        calls,
        "taken back with no driver call"
    );
    assert_eq!(w.parked_shape(&r), vec![(0, 1), (2, 1), (3, 1)]);
    w.check(&[&r]);
}

#[test]
fn a_shared_commit_over_some_parked_windows_unparks_only_those() {
    let mut c = WorldConfig::new(G);
    c.pool_granules = 8;
    c.park = true;
    let w = World::new(c);
    let mut r = w.vm.reserve(8 * G).unwrap();
    r.commit(4 * G).unwrap();
    r.release().unwrap();
    let set = r.commit_shared(&[(G, 2 * G)]).unwrap();
    assert_eq!(set.len(), 2);
    assert_eq!(w.parked_shape(&r), vec![(0, 1), (3, 1)]);
    assert_eq!(w.sim.calls(Operation::Unmap), 2, "the two windows under it");
    let s = w.gov.snapshot().device(D0);
    assert_eq!((s.shared, s.pooled, s.committed), (2 * G, 2 * G, 0));
    assert_eq!(s.used(), w.sim.ledger().physical_bytes[0]);
    assert_eq!(w.vm.accounting_errors(), 0);
}

#[test]
fn the_pool_frees_nothing_for_another_devices_shortage() {
    use std::sync::Arc;

    use kvvm_governor::{Governor, GovernorConfig};
    use kvvm_hal::{DeviceId, VirtualMemoryBackend};
    use kvvm_sim::{SimBackend, SimConfig};
    use kvvm_vmm::{GranularityChoice, VirtualMemory, VmmConfig};

    let d1 = DeviceId(1);
    let sim = Arc::new(SimBackend::new(SimConfig::single(G, 64 * G)));
    let gov = Governor::new(
        GovernorConfig::default()
            .device_budget(D0, 8 * G)
            .device_budget(d1, 2 * G),
    );
    let backend: Arc<dyn VirtualMemoryBackend> = sim.clone();
    let vm = VirtualMemory::new(
        backend,
        D0,
        gov.clone(),
        VmmConfig::default()
            .pool_cap_bytes(8 * G)
            .granularity(GranularityChoice::Minimum),
    )
    .unwrap();
    let mut r = vm.reserve(8 * G).unwrap();
    r.commit(3 * G).unwrap();
    r.release().unwrap();
    assert_eq!(vm.pooled_bytes(), 3 * G);
    // Device 1 is short: the governor asks every reclaimer, and this pool, on device 0,
    // frees nothing.
    let _held = gov.try_grant(d1, 2 * G).unwrap();
    assert!(gov.try_grant(d1, G).unwrap_err().backpressure().is_some());
    assert_eq!(vm.pooled_bytes(), 3 * G);
    // Device 0 short by one window: exactly one pooled window is released.
    let _d0 = gov.try_grant(D0, 5 * G).unwrap();
    let _more = gov.try_grant(D0, G).unwrap();
    assert_eq!(vm.pooled_bytes(), 2 * G);
}

#[test]
fn a_failed_release_of_a_pooled_handle_quarantines_it() {
    let w = world(64, None);
    let mut r = w.vm.reserve(8 * G).unwrap();
    r.commit(2 * G).unwrap();
    w.sim
        .inject(FaultRule::nth(Operation::Release, 1, ErrorKind::Other));
    assert!(r.release().is_err());
    assert_eq!(w.vm.quarantined_bytes(), G);
    assert_eq!(w.gov.snapshot().device(D0).quarantined, G);
    w.check(&[&r]);
}
