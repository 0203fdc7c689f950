//! Commits named as runs of windows: a commit over parked, committed and free windows at
//! once, a failure in the middle of a run (every step alone and every pair of steps), the
//! first refused window reported exactly, and shared mappings named by index ranges. The
//! commit of `ranges` is checked against a window-by-window model of what it must map.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::single_range_in_vec_init
)]

mod common;

use std::collections::BTreeSet;

use common::{calls_of, Run, Setup, World, WorldConfig, D0};
use kvvm_hal::{Access, ErrorKind, Operation};
use kvvm_sim::FaultRule;
use kvvm_vmm::{Reservation, VmmError};
use proptest::prelude::*;

/// Windows 0..8 committed; 8..16 and 16..24 parked (one mapping each).
fn committed_and_parked(w: &World) -> Reservation {
    let g = w.g;
    let mut r = w.vm.reserve(64 * g).unwrap();
    r.commit(24 * g).unwrap(); // 8 @0, 8 @8, 8 @16
    assert_eq!(r.truncate(8 * g).unwrap(), 0, "parked");
    r
}

fn w_parking() -> World {
    World::multi(8, 64, true)
}

/// Windows 4..30: 4..8 are committed, 8..24 parked wholly inside, 24..30 free.
fn commit_over_parked(w: &World, r: &mut Reservation) -> Result<u64, VmmError> {
    r.commit_range(4 * w.g, 26 * w.g)
        .map(|c| c.map_or(0, |c| c.bytes))
}

#[test]
fn a_run_over_committed_parked_and_free_windows_maps_only_the_free_ones() {
    let w = w_parking();
    let mut r = committed_and_parked(&w);
    assert_eq!(w.shape(&r), vec![(0, 8)]);
    assert_eq!(w.parked_shape(&r), vec![(8, 8), (16, 8)]);
    w.sim.reset_counters();
    let c = r.commit_range(4 * w.g, 26 * w.g).unwrap().unwrap();
    // 8..30: 16 windows parked, 6 fresh (4 @24, 2 @28).
    assert_eq!((c.granules, c.from_pool, c.mappings), (22, 16, 4));
    assert_eq!(c.address.0, r.address().0 + 8 * w.g);
    assert_eq!(w.shape(&r), vec![(0, 8), (8, 8), (16, 8), (24, 4), (28, 2)]);
    assert!(r.parked().is_empty());
    // Only the fresh windows cost driver calls: two creates and maps, one set access.
    assert_eq!(w.sim.calls(Operation::Create), 2);
    assert_eq!(w.sim.calls(Operation::Map), 2);
    assert_eq!(w.sim.calls(Operation::SetAccess), 1);
    assert_eq!(w.sim.calls(Operation::Unmap), 0);
    assert_eq!(w.gov.snapshot().device(D0).committed, 30 * w.g);
    common::assert_accessible(&w.sim, &r);
    w.check(&[&r]);
}

#[test]
fn a_parked_mapping_partly_inside_a_run_is_unmapped_and_its_handle_reused() {
    let w = w_parking();
    let mut r = committed_and_parked(&w);
    w.sim.reset_counters();
    // Windows 20..28: the parked 8 @16 is only partly inside, so it is unmapped first (its
    // handle goes to the pool); the run is cut 4 @20, 4 @24, both created.
    let c = r.commit_range(20 * w.g, 8 * w.g).unwrap().unwrap();
    assert_eq!((c.granules, c.from_pool, c.mappings), (8, 0, 2));
    assert_eq!(w.sim.calls(Operation::Unmap), 1);
    assert_eq!(w.parked_shape(&r), vec![(8, 8)]);
    assert_eq!(w.shape(&r), vec![(0, 8), (20, 4), (24, 4)]);
    assert_eq!(w.vm.pooled_bytes(), 16 * w.g, "8 parked + the evicted 8");
    w.check(&[&r]);
    // Windows 32..40 are one aligned 8-window piece: the pooled handle serves it.
    r.commit_range(32 * w.g, 8 * w.g).unwrap().unwrap();
    assert_eq!(w.vm.pooled_bytes(), 8 * w.g, "the pooled handle was reused");
    w.check(&[&r]);
}

const OPS: [Operation; 5] = [
    Operation::Create,
    Operation::Map,
    Operation::SetAccess,
    Operation::Unmap,
    Operation::Release,
];

fn kind(op: Operation) -> ErrorKind {
    if op == Operation::Create {
        ErrorKind::OutOfMemory
    } else {
        ErrorKind::Other
    }
}

/// Runs `run` after `setup` with `rules` armed; a failed commit must leave the committed
/// mappings as they were, parked mappings only where they were, and the books equal to the
/// ledger; after teardown nothing is left.
fn with_faults(make: fn() -> World, setup: Setup, run: Run, rules: &[FaultRule], what: &str) {
    let unmaps_fail = rules.iter().any(|r| {
        matches!(
            r,
            FaultRule::Nth {
                op: Operation::Unmap,
                ..
            }
        )
    });
    let w = make();
    let mut r = setup(&w);
    let (before, parked_before) = (w.shape(&r), w.parked_shape(&r));
    for rule in rules {
        w.sim.inject(rule.clone());
    }
    let res = run(&w, &mut r);
    w.sim.clear_faults();
    w.check(&[&r]);
    let parked_after: BTreeSet<(u64, u64)> = w.parked_shape(&r).into_iter().collect();
    let parked_before_set: BTreeSet<(u64, u64)> = parked_before.iter().copied().collect();
    let after: BTreeSet<(u64, u64)> = w.shape(&r).into_iter().collect();
    if res.is_err() {
        if unmaps_fail {
            // A mapping the rollback could not unmap stays recorded, as committed.
            assert!(
                before.iter().all(|m| after.contains(m)),
                "{what}: the committed mappings stay"
            );
        } else {
            assert_eq!(w.shape(&r), before, "{what}: a failed commit maps nothing");
        }
        assert!(
            parked_after.is_subset(&parked_before_set),
            "{what}: parked mappings stay where they were"
        );
    }
    drop(r);
    w.vm.trim_pool(0);
    w.check(&[]);
    if w.vm.quarantine().is_empty() {
        assert!(w.sim.ledger().is_empty(), "{what}: leak");
    }
}

/// Every call of `run` failed alone, then every pair of calls failed together, then every
/// call with the first unmap (of the rollback) and the first release failing too.
fn every_fault_and_pair(make: fn() -> World, setup: Setup, run: Run) -> usize {
    let steps: Vec<(Operation, u64)> = calls_of(make, setup, run, &OPS)
        .into_iter()
        .flat_map(|(op, n)| (1..=n).map(move |i| (op, i)))
        .collect();
    assert!(!steps.is_empty());
    let mut n = 0;
    for &(op, i) in &steps {
        let what = format!("{op} {i}");
        with_faults(make, setup, run, &[FaultRule::nth(op, i, kind(op))], &what);
        n += 1;
    }
    for (a, &(op_a, i)) in steps.iter().enumerate() {
        for &(op_b, j) in steps.iter().skip(a + 1) {
            let what = format!("{op_a} {i} + {op_b} {j}");
            let rules = [
                FaultRule::nth(op_a, i, kind(op_a)),
                FaultRule::nth(op_b, j, kind(op_b)),
            ];
            with_faults(make, setup, run, &rules, &what);
            n += 1;
        }
    }
    for &(op, i) in &steps {
        for then in [Operation::Unmap, Operation::Release] {
            let what = format!("{op} {i} + {then} 1");
            let rules = [
                FaultRule::nth(op, i, kind(op)),
                FaultRule::nth(then, 1, kind(then)),
            ];
            with_faults(make, setup, run, &rules, &what);
            n += 1;
        }
    }
    n
}

#[test]
fn a_failure_mid_run_over_parked_windows_rolls_back_and_parks_them_again() {
    // Two creates, two maps, one set access; and the failures of a rollback's unmaps.
    let n = every_fault_and_pair(w_parking, committed_and_parked, commit_over_parked);
    assert!(n >= 10, "{n} cases");
    // A failure of the fresh part leaves the parked windows parked, exactly.
    let w = w_parking();
    let mut r = committed_and_parked(&w);
    w.sim
        .inject(FaultRule::nth(Operation::SetAccess, 1, ErrorKind::Other));
    assert!(commit_over_parked(&w, &mut r).is_err());
    w.sim.clear_faults();
    assert_eq!(w.parked_shape(&r), vec![(8, 8), (16, 8)]);
    assert_eq!(w.shape(&r), vec![(0, 8)]);
    w.check(&[&r]);
}

fn w_no_parking() -> World {
    World::multi(4, 8, false)
}

/// Windows 2..5 and 9..10 committed in a 32-window reservation.
fn with_committed_islands(w: &World) -> Reservation {
    let mut r = w.vm.reserve(32 * w.g).unwrap();
    r.commit_range(2 * w.g, 3 * w.g).unwrap();
    r.commit_range(9 * w.g, w.g).unwrap();
    r
}

/// Windows 0..20 in three overlapping ranges, given out of order: four free runs.
fn commit_around_islands(w: &World, r: &mut Reservation) -> Result<u64, VmmError> {
    let g = w.g;
    r.commit_ranges(&[(12 * g, 8 * g), (0, 7 * g), (6 * g, 7 * g)])
        .map(|c| c.map_or(0, |c| c.bytes))
}

#[test]
fn a_run_around_committed_windows_maps_the_gaps_and_survives_every_fault() {
    let w = w_no_parking();
    let mut r = with_committed_islands(&w);
    w.sim.reset_counters();
    assert_eq!(commit_around_islands(&w, &mut r).unwrap(), 16 * w.g);
    // Free runs 0..2, 5..9, 10..20: 2 @0 | 1 @5, 2 @6, 1 @8 | 2 @10, 4 @12, 4 @16.
    assert_eq!(
        w.shape(&r),
        vec![
            (0, 2),
            (2, 2),
            (4, 1),
            (5, 1),
            (6, 2),
            (8, 1),
            (9, 1),
            (10, 2),
            (12, 4),
            (16, 4)
        ]
    );
    assert_eq!(w.sim.calls(Operation::SetAccess), 3, "one per free run");
    common::assert_accessible(&w.sim, &r);
    w.check(&[&r]);
    let n = every_fault_and_pair(w_no_parking, with_committed_islands, commit_around_islands);
    assert!(n > 100, "{n} cases");
}

/// 2 MiB granules, handles of up to 8 windows, a pool of 16, and a create as dear as an
/// A100's (193 us): pooled handles smaller than a piece serve it when they cost less.
fn w_tiling() -> World {
    let mut c = WorldConfig::new(2 * kvvm_sim::MIB);
    c.capacity_granules = 64;
    c.pool_granules = 16;
    c.max_handle_granules = 8;
    c.commit_cost = kvvm_sim::LatencyModel {
        create: std::time::Duration::from_micros(193),
        ..kvvm_sim::LatencyModel::h200()
    };
    World::new(c)
}

/// Four pooled handles of 2 windows, left by this reservation's own release.
fn with_small_pooled_handles(w: &World) -> Reservation {
    let mut r = w.vm.reserve(16 * w.g).unwrap();
    r.set_max_handle_windows(2);
    r.commit(8 * w.g).unwrap();
    r.release().unwrap();
    r.set_max_handle_windows(8);
    r
}

/// 12 windows: 8 @0 tiled by the four pooled handles, 4 @8 created.
fn commit_tiled(w: &World, r: &mut Reservation) -> Result<u64, VmmError> {
    r.commit(12 * w.g).map(|c| c.bytes)
}

#[test]
fn a_piece_tiled_by_pooled_handles_survives_every_fault() {
    let w = w_tiling();
    let mut r = with_small_pooled_handles(&w);
    let c = r.commit(12 * w.g).unwrap();
    assert_eq!((c.from_pool, c.mappings), (8, 5));
    w.check(&[&r]);
    // 7 driver calls (1 create, 5 maps, 1 set access): 7 alone, 21 pairs, 14 with the
    // rollback's first unmap or release failing too.
    let n = every_fault_and_pair(w_tiling, with_small_pooled_handles, commit_tiled);
    assert_eq!(n, 42);
}

#[test]
fn refusals_name_the_first_refused_window() {
    let w = World::multi(4, 0, false);
    let g = w.g;
    let mut r = w.vm.reserve(16 * g).unwrap();
    r.commit_range(11 * g, g).unwrap();
    let job = r.begin_commit_ranges(&[(8 * g, 2 * g)]).unwrap().unwrap();
    // Windows 6..16 less window 11: window 8 is the first in flight.
    assert!(matches!(
        r.commit_range(6 * g, 10 * g),
        Err(VmmError::Busy { offset }) if offset == 8 * g
    ));
    // Shared commits check every window: in flight first at 8, mapped first at 11.
    assert!(matches!(
        r.commit_shared(&[(6 * g, 4 * g)]),
        Err(VmmError::Busy { offset }) if offset == 8 * g
    ));
    assert!(matches!(
        r.commit_shared(&[(10 * g, 4 * g)]),
        Err(VmmError::AlreadyMapped { offset }) if offset == 11 * g
    ));
    assert!(matches!(
        r.commit_shared(&[(12 * g, 2 * g), (4 * g, 6 * g)]),
        Err(VmmError::Busy { offset }) if offset == 8 * g
    ));
    r.finish_commit(job).unwrap();
    assert!(matches!(
        r.commit_shared(&[(4 * g, 5 * g)]),
        Err(VmmError::AlreadyMapped { offset }) if offset == 8 * g
    ));
    assert!(matches!(
        r.commit_shared(&[(14 * g, 4 * g)]),
        Err(VmmError::OutOfBounds { .. })
    ));
    assert_eq!(r.committed_bytes(), 3 * g);
    w.check(&[&r]);
}

#[test]
fn shared_windows_named_as_ranges_map_like_indices() {
    let w = World::multi(4, 0, false);
    let g = w.g;
    let mut owner = w.vm.reserve(16 * g).unwrap();
    // Handles 4 @0, 4 @4, 2 @8 (no handle crosses a range's start).
    let set = owner
        .commit_shared(&[(0, 4 * g), (4 * g, 4 * g), (8 * g, 2 * g)])
        .unwrap();
    assert_eq!((set.len(), set.handle_count()), (10, 3));
    let mut by_ranges = w.vm.reserve(16 * g).unwrap();
    let mut by_indices = w.vm.reserve(16 * g).unwrap();
    w.sim.reset_counters();
    assert_eq!(
        by_ranges
            .map_shared_ranges(&set, &[8..10, 0..4, 2..8], Access::Read)
            .unwrap(),
        10 * g
    );
    assert_eq!(
        (
            w.sim.calls(Operation::Map),
            w.sim.calls(Operation::SetAccess)
        ),
        (3, 1)
    );
    let all: Vec<usize> = (0..10).rev().collect();
    assert_eq!(
        by_indices.map_shared(&set, &all, Access::Read).unwrap(),
        10 * g
    );
    assert_eq!(w.shape(&by_ranges), w.shape(&by_indices));
    assert_eq!(set.mapped_count(), 9);

    // The same refusals, with the same words, before any driver call.
    let mut other = w.vm.reserve(16 * g).unwrap();
    let calls = w.sim.driver_calls();
    let partial = |e: VmmError| match e {
        VmmError::InvalidArgument { reason } => reason,
        e => panic!("{e:?}"),
    };
    let a = partial(
        other
            .map_shared_ranges(&set, &[0..3], Access::Read)
            .unwrap_err(),
    );
    let b = partial(
        other
            .map_shared(&set, &[0, 1, 2], Access::Read)
            .unwrap_err(),
    );
    assert_eq!(a, b);
    assert!(a.starts_with("3 of the 4 windows of the shared handle at offset 0"));
    // Two ranges inside one handle count together.
    let c = partial(
        other
            .map_shared_ranges(&set, &[4..5, 6..8, 0..4], Access::Read)
            .unwrap_err(),
    );
    assert!(
        c.starts_with("3 of the 4 windows of the shared handle at offset 8388608"),
        "{c}"
    );
    for e in [
        other.map_shared_ranges(&set, &[0..4, 8..12], Access::Read),
        other.map_shared(&set, &[0, 1, 2, 3, 8, 9, 10, 11], Access::Read),
    ] {
        assert!(matches!(
            e,
            Err(VmmError::OutOfBounds {
                offset: 10,
                requested: 1,
                reserved: 10
            })
        ));
    }
    assert!(matches!(
        other.map_shared(&set, &[usize::MAX, 3], Access::Read),
        Err(VmmError::OutOfBounds { offset, .. }) if offset == usize::MAX as u64
    ));
    assert_eq!(w.sim.driver_calls(), calls);
    assert_eq!(other.map_shared_ranges(&set, &[], Access::Read).unwrap(), 0);
    assert_eq!(
        other
            .map_shared_ranges(&set, &[3..3], Access::Read)
            .unwrap(),
        0
    );

    // A window mapped here already: the first one is named.
    other.commit_range(5 * g, g).unwrap();
    assert!(matches!(
        other.map_shared_ranges(&set, &[0..10], Access::Read),
        Err(VmmError::AlreadyMapped { offset }) if offset == 5 * g
    ));
    assert_eq!(other.committed_bytes(), g);
    // Billed once, as shared; the one private window as committed.
    let snap = w.gov.snapshot().device(D0);
    assert_eq!((snap.committed, snap.shared, snap.pending), (g, 10 * g, 0));
    assert_eq!(snap.used(), w.sim.ledger().total_physical_bytes());
    assert_eq!(w.vm.accounting_errors(), 0);
    drop((by_ranges, by_indices, other, owner, set));
    w.check(&[]);
    assert!(w.sim.ledger().is_empty());
}

#[derive(Debug, Clone)]
enum Step {
    Commit(u64, u64),
    Release(u64, u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u64..32, 1u64..8).prop_map(|(o, n)| Step::Commit(o, n)),
        (0u64..32, 1u64..12).prop_map(|(o, n)| Step::Release(o, n)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// After any history of commits and releases (parking on), a commit of any ranges maps
    /// exactly the windows of their union that were not mapped, and nothing else.
    #[test]
    fn a_commit_of_ranges_maps_exactly_the_missing_windows(
        history in prop::collection::vec(step(), 0..12),
        ranges in prop::collection::vec((0u64..40, 0u64..10), 1..5),
        max_handle in prop::sample::select(vec![1u64, 2, 8]),
    ) {
        let w = World::multi(max_handle, 24, true);
        let g = w.g;
        let windows = 40;
        let mut r = w.vm.reserve(windows * g).unwrap();
        for s in history {
            match s {
                Step::Commit(o, n) => {
                    let n = n.min(windows - o);
                    r.commit_range(o * g, n * g).unwrap();
                }
                Step::Release(o, n) => {
                    r.release_ranges(&[(o * g, n * g)]).unwrap();
                }
            }
        }
        let ranges: Vec<(u64, u64)> = ranges
            .into_iter()
            .map(|(o, n)| (o * g, n.min(windows - o) * g))
            .collect();
        let mapped_before: Vec<bool> = (0..windows).map(|i| r.is_mapped(i * g)).collect();
        let wanted: BTreeSet<u64> = ranges
            .iter()
            .flat_map(|&(o, len)| (o / g)..(o + len).div_ceil(g))
            .collect();
        let missing: Vec<u64> = wanted
            .iter()
            .copied()
            .filter(|&i| !mapped_before[i as usize])
            .collect();
        let committed = r.committed_bytes();
        let c = r.commit_ranges(&ranges).unwrap();
        match c {
            None => prop_assert!(missing.is_empty()),
            Some(c) => {
                prop_assert_eq!(c.granules, missing.len() as u64);
                prop_assert_eq!(c.address.0, r.address().0 + missing[0] * g);
            }
        }
        prop_assert_eq!(r.committed_bytes(), committed + missing.len() as u64 * g);
        for i in 0..windows {
            let want = mapped_before[i as usize] || wanted.contains(&i);
            prop_assert_eq!(r.is_mapped(i * g), want, "window {}", i);
        }
        w.check(&[&r]);
    }
}
