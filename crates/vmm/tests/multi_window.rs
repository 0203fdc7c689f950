//! Multi-window handles (`VmmConfig::max_handle_bytes`): a commit maps each contiguous run with
//! as few buddy-aligned handles as it allows, with no over-commit; handles are mapped, parked,
//! pooled and released whole; a handle straddling a release boundary stays mapped and committed.
//! Every driver call of a multi-handle commit and of a partial release is failed once and the
//! books are checked against the simulator's ledger.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{calls_of, Run, Setup, World, D0};
use kvvm_hal::{ErrorKind, Operation};
use kvvm_sim::FaultRule;
use kvvm_vmm::{Reservation, VmmError};

#[test]
fn a_run_is_committed_as_few_buddy_aligned_handles() {
    let w = World::multi(8, 0, false);
    let mut r = w.vm.reserve(64 * w.g).unwrap();
    w.sim.reset_counters();
    let c = r.commit(13 * w.g).unwrap();
    assert_eq!((c.granules, c.mappings), (13, 3));
    assert_eq!(w.shape(&r), vec![(0, 8), (8, 4), (12, 1)]);
    assert_eq!(w.sim.calls(Operation::Create), 3);
    assert_eq!(w.sim.calls(Operation::Map), 3);
    assert_eq!(w.sim.calls(Operation::SetAccess), 1);
    // No over-commit: exactly the windows asked for, and the governor charged exactly.
    assert_eq!(r.committed_bytes(), 13 * w.g);
    assert_eq!(w.gov.snapshot().device(D0).committed, 13 * w.g);
    for i in 0..13 {
        assert!(r.is_mapped(i * w.g), "window {i}");
    }
    assert!(!r.is_mapped(13 * w.g));
    // Growth from window 13: aligned to its size from the base (1 @13, 2 @14, 8 @16, 2 @24).
    r.commit(13 * w.g).unwrap();
    assert_eq!(
        w.shape(&r),
        vec![(0, 8), (8, 4), (12, 1), (13, 1), (14, 2), (16, 8), (24, 2)]
    );
    w.check(&[&r]);
}

#[test]
fn one_granule_handles_reproduce_one_handle_per_window() {
    let w = World::multi(1, 0, false);
    let mut r = w.vm.reserve(16 * w.g).unwrap();
    let c = r.commit(5 * w.g).unwrap();
    assert_eq!(c.mappings, 5);
    assert!(w.shape(&r).iter().all(|&(_, n)| n == 1));
    w.check(&[&r]);
}

#[test]
fn a_straddling_handle_stays_mapped_and_committed_until_it_can_go_whole() {
    let w = World::multi(8, 0, false);
    let mut r = w.vm.reserve(64 * w.g).unwrap();
    r.commit(12 * w.g).unwrap(); // 8 @0, 4 @8
                                 // Truncate to 10 windows: the 4-window handle holds windows below 10: it stays whole.
    assert_eq!(r.truncate(10 * w.g).unwrap(), 0);
    assert_eq!(r.committed_bytes(), 12 * w.g);
    assert!(r.is_mapped(11 * w.g), "never reported free while mapped");
    // Truncate to 8: the handle now starts at the boundary and goes, whole.
    assert_eq!(r.truncate(8 * w.g).unwrap(), 4 * w.g);
    assert_eq!(r.committed_bytes(), 8 * w.g);
    // A release of part of a handle unmaps nothing; a release covering it unmaps it. What
    // it would give back is known beforehand, and asking changes nothing.
    assert_eq!(r.owned_bytes_inside(&[(2 * w.g, 4 * w.g)]), 0);
    assert_eq!(
        r.owned_bytes_inside(&[(0, 4 * w.g), (4 * w.g, 4 * w.g)]),
        8 * w.g
    );
    assert_eq!(r.release_ranges(&[(2 * w.g, 4 * w.g)]).unwrap(), 0);
    assert_eq!(r.committed_bytes(), 8 * w.g);
    assert_eq!(
        r.release_ranges(&[(0, 4 * w.g), (4 * w.g, 4 * w.g)])
            .unwrap(),
        8 * w.g
    );
    assert_eq!(r.committed_bytes(), 0);
    w.check(&[&r]);
}

#[test]
fn the_pool_reuses_a_handle_of_exactly_the_size_needed() {
    let w = World::multi(8, 16, false);
    let mut a = w.vm.reserve(16 * w.g).unwrap();
    a.commit(8 * w.g).unwrap();
    a.release().unwrap();
    assert_eq!(w.vm.pooled_bytes(), 8 * w.g);
    let mut b = w.vm.reserve(16 * w.g).unwrap();
    w.sim.reset_counters();
    // 4 windows: no pooled handle of that size, so one is created (the 8-window one stays).
    let c = b.commit(4 * w.g).unwrap();
    assert_eq!((c.from_pool, w.sim.calls(Operation::Create)), (0, 1));
    b.release().unwrap();
    // 8 windows: the pooled 8-window handle, one map and one set access, no create.
    w.sim.reset_counters();
    let c = b.commit(8 * w.g).unwrap();
    assert_eq!((c.from_pool, c.mappings), (8, 1));
    assert_eq!(w.sim.calls(Operation::Create), 0);
    assert_eq!(w.sim.calls(Operation::Map), 1);
    w.check(&[&a, &b]);
}

#[test]
fn parked_mappings_come_back_whole_and_partial_overlaps_are_unmapped_first() {
    let w = World::multi(8, 64, true);
    let mut r = w.vm.reserve(32 * w.g).unwrap();
    r.commit(12 * w.g).unwrap(); // 8 @0, 4 @8
    r.release().unwrap();
    assert_eq!(r.parked().len(), 2);
    w.sim.reset_counters();
    // Windows 0..8: the parked 8-window mapping lies wholly inside, taken back with no call.
    let c = r.commit(8 * w.g).unwrap();
    assert_eq!((c.from_pool, c.mappings), (8, 1));
    assert_eq!(w.sim.calls(Operation::Map), 0);
    // Windows 8..10 overlap part of the parked 4-window mapping: it is unmapped first.
    r.commit(2 * w.g).unwrap();
    assert_eq!(w.sim.calls(Operation::Unmap), 1);
    assert!(r.parked().is_empty());
    assert_eq!(r.committed_bytes(), 10 * w.g);
    w.check(&[&r]);
}

// ------------------------------------------------------------------- fault injection

const OPS: [Operation; 6] = [
    Operation::Create,
    Operation::Map,
    Operation::SetAccess,
    Operation::Unmap,
    Operation::Release,
    Operation::Synchronize,
];

/// Runs `run` clean to count its calls, then with each call failing alone; the books must
/// equal the ledger after each, and after teardown only the quarantine may be left.
fn every_fault(make: fn() -> World, setup: Setup, run: Run) -> usize {
    let counts = calls_of(make, setup, run, &OPS);
    let mut n = 0;
    for (op, calls) in counts {
        for i in 1..=calls {
            let w = make();
            let mut r = setup(&w);
            let before = r.committed_bytes();
            let kind = if op == Operation::Create {
                ErrorKind::OutOfMemory
            } else {
                ErrorKind::Other
            };
            w.sim.inject(FaultRule::nth(op, i, kind));
            let res = run(&w, &mut r);
            w.sim.clear_faults();
            w.check(&[&r]);
            if matches!(
                op,
                Operation::Create | Operation::Map | Operation::SetAccess
            ) {
                assert!(res.is_err(), "{op} {i}");
                assert_eq!(
                    r.committed_bytes(),
                    before,
                    "{op} {i}: a failed commit maps nothing"
                );
            }
            drop(r);
            w.vm.trim_pool(0);
            w.check(&[]);
            if w.vm.quarantine().is_empty() {
                assert!(w.sim.ledger().is_empty(), "{op} {i}: leak");
            }
            n += 1;
        }
    }
    n
}

fn w8() -> World {
    World::multi(8, 4, false)
}

fn reserve_only(w: &World) -> Reservation {
    w.vm.reserve(64 * w.g).unwrap()
}

fn committed_13(w: &World) -> Reservation {
    let mut r = w.vm.reserve(64 * w.g).unwrap();
    r.commit(13 * w.g).unwrap();
    r
}

#[test]
fn every_fault_of_a_multi_handle_commit_leaves_the_books_exact() {
    fn run(w: &World, r: &mut Reservation) -> Result<u64, VmmError> {
        r.commit(13 * w.g).map(|c| c.bytes)
    }
    // 3 creates, 3 maps, 1 set access.
    assert_eq!(every_fault(w8, reserve_only, run), 7);
}

#[test]
fn every_fault_of_a_partial_release_leaves_the_books_exact() {
    fn truncate(w: &World, r: &mut Reservation) -> Result<u64, VmmError> {
        // Windows 10.. : the 4-window handle at 8 straddles and stays; the one at 12 goes.
        r.truncate(10 * w.g)
    }
    fn ranges(w: &World, r: &mut Reservation) -> Result<u64, VmmError> {
        // Covers the 8-window handle whole and half of the 4-window one.
        r.release_ranges(&[(0, 10 * w.g)])
    }
    // The 1-window handle: one unmap, pooled (no release).
    assert_eq!(every_fault(w8, committed_13, truncate), 1);
    // The 8-window handle: one unmap and one release (over the 4-window pool cap).
    assert_eq!(every_fault(w8, committed_13, ranges), 2);
}

#[test]
fn every_fault_of_a_multi_handle_teardown_leaves_the_books_exact() {
    let mut faulted = 0;
    for op in [
        Operation::Synchronize,
        Operation::Unmap,
        Operation::Release,
        Operation::Free,
    ] {
        for i in 1..=3 {
            let w = w8();
            let r = committed_13(&w);
            w.sim.inject(FaultRule::nth(op, i, ErrorKind::Other));
            drop(r);
            w.sim.clear_faults();
            w.vm.trim_pool(0);
            w.check(&[]);
            let q = w.vm.quarantine();
            let held: u64 = q.iter().map(|e| e.bytes).sum();
            assert_eq!(w.gov.snapshot().device(D0).quarantined, held);
            if q.is_empty() {
                assert!(w.sim.ledger().is_empty(), "{op} {i}: leak");
            } else {
                faulted += 1;
            }
        }
    }
    assert!(faulted >= 3);
}

#[test]
fn a_reservation_asking_for_one_window_handles_gives_back_each_window_behind_alone() {
    let w = World::multi(8, 0, false);
    let mut r = w.vm.reserve(64 * w.g).unwrap();
    assert_eq!(r.max_handle_windows(), 8);
    r.set_max_handle_windows(1);
    assert_eq!(r.max_handle_windows(), 1);
    let c = r.commit(13 * w.g).unwrap();
    assert_eq!((c.granules, c.mappings), (13, 13), "one handle per window");
    // The oldest windows go one at a time, as a sliding window moves past them.
    for gone in 1..=5u64 {
        assert_eq!(r.release_ranges(&[(0, gone * w.g)]).unwrap(), w.g);
        assert_eq!(r.committed_bytes(), (13 - gone) * w.g);
        assert!(!r.is_mapped((gone - 1) * w.g) && r.is_mapped(gone * w.g));
        w.check(&[&r]);
    }
    // Rounded down to a power of two, capped at the manager's largest handle; 0 resets.
    r.set_max_handle_windows(3);
    assert_eq!(r.max_handle_windows(), 2);
    r.set_max_handle_windows(1 << 20);
    assert_eq!(r.max_handle_windows(), 8);
    r.set_max_handle_windows(0);
    assert_eq!(r.max_handle_windows(), 8);
    r.release().unwrap();
    w.check(&[&r]);
}
