//! Strided reservations: slots of one driver range, each committing and tearing down on its own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{World, WorldConfig};
use kvvm_hal::{ErrorKind, Operation};
use kvvm_sim::FaultRule;
use kvvm_vmm::VmmError;

#[test]
fn slots_sit_at_a_constant_stride_inside_one_driver_range() {
    let w = World::simple(64 << 10, 0);
    let g = w.g;
    let slots = w.vm.reserve_strided(4, 3 * g - 1).unwrap();
    assert_eq!(slots.len(), 4);
    let base = slots[0].address().0;
    for (i, s) in slots.iter().enumerate() {
        assert_eq!(s.address().0, base + i as u64 * 3 * g, "slot {i}");
        assert_eq!(s.size(), 3 * g);
        assert!(s.is_strided_slot());
    }
    let ledger = w.sim.ledger();
    assert_eq!(ledger.reservations.len(), 1, "one driver reservation");
    assert_eq!(ledger.reservations[0].size, 12 * g);
}

#[test]
fn each_slot_commits_and_releases_on_its_own_and_the_range_goes_with_the_last() {
    let w = World::simple(64 << 10, 0);
    let g = w.g;
    let mut slots = w.vm.reserve_strided(3, 2 * g).unwrap();
    slots[0].commit(2 * g).unwrap();
    slots[2].commit(g).unwrap();
    // A slot never maps past its own end into its neighbour.
    assert!(slots[2].commit(2 * g).is_err());
    assert_eq!(slots[0].committed_bytes(), 2 * g);
    assert_eq!(slots[1].committed_bytes(), 0);
    assert_eq!(slots[2].committed_bytes(), g);
    let ledger = w.sim.ledger();
    assert_eq!(ledger.mapped_bytes_in(slots[0].address(), 2 * g), 2 * g);
    assert_eq!(ledger.mapped_bytes_in(slots[1].address(), 2 * g), 0);
    assert_eq!(ledger.mapped_bytes_in(slots[2].address(), 2 * g), g);
    assert_eq!(w.gov.snapshot().committed(), 3 * g);

    slots[0].release().unwrap();
    assert_eq!(w.gov.snapshot().committed(), g);
    // Dropping two of three slots keeps the range; the last one frees it.
    let last = slots.pop().unwrap();
    drop(slots);
    let ledger = w.sim.ledger();
    assert_eq!(ledger.reservations.len(), 1);
    assert_eq!(ledger.mapped_bytes_in(last.address(), 2 * g), g);
    drop(last);
    assert!(w.sim.ledger().is_empty(), "{:?}", w.sim.ledger());
    assert_eq!(w.gov.snapshot().used(), 0);
}

#[test]
fn bad_counts_and_sizes_are_refused_before_the_driver() {
    let w = World::simple(64 << 10, 0);
    assert!(matches!(
        w.vm.reserve_strided(0, 1),
        Err(VmmError::ZeroSize)
    ));
    assert!(matches!(
        w.vm.reserve_strided(4, 0),
        Err(VmmError::ZeroSize)
    ));
    assert!(matches!(
        w.vm.reserve_strided(u64::MAX, 1 << 20),
        Err(VmmError::SizeOverflow { .. })
    ));
    assert_eq!(w.sim.calls(Operation::Reserve), 0);
}

#[test]
fn a_failed_driver_reservation_leaves_nothing() {
    let w = World::simple(64 << 10, 0);
    w.sim.inject(FaultRule::nth(
        Operation::Reserve,
        1,
        ErrorKind::OutOfMemory,
    ));
    assert!(w.vm.reserve_strided(2, w.g).is_err());
    assert!(w.sim.ledger().is_empty());
}

#[test]
fn a_quarantined_slot_keeps_the_whole_range_reserved() {
    let mut c = WorldConfig::new(64 << 10);
    c.capacity_granules = 8;
    let w = World::new(c);
    let g = w.g;
    let mut slots = w.vm.reserve_strided(2, g).unwrap();
    slots[0].commit(g).unwrap();
    w.sim.inject(FaultRule::failing_synchronize());
    let second = slots.pop().unwrap();
    drop(slots); // slot 0: teardown sync fails, its block is quarantined
    drop(second);
    let ledger = w.sim.ledger();
    assert_eq!(
        ledger.reservations.len(),
        1,
        "range pinned by the quarantined slot"
    );
    assert_eq!(ledger.mappings.len(), 1, "nothing unmapped");
    assert_eq!(w.vm.quarantined_bytes(), g);
    assert_eq!(w.gov.snapshot().quarantined(), g);
}
