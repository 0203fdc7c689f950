//! Two commit paths asserted window by window: a commit into a reservation with holes below
//! its committed end fills the lowest holes first, then grows past the end; a commit job
//! (begin, run, finish or drop) is one transaction whose windows are in flight until it is
//! finished, and a job dropped unfinished undoes exactly what it mapped.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{World, WorldConfig, D0};
use kvvm_governor::Limit;
use kvvm_hal::{ErrorKind, Operation};
use kvvm_sim::FaultRule;
use kvvm_vmm::{Reservation, VmmError};

const G: u64 = 64 << 10;

/// One handle per window, no pool, unlimited budget, a device of 64 windows.
fn world() -> World {
    World::simple(G, 0)
}

fn windows(w: &World, r: &Reservation) -> Vec<u64> {
    w.shape(r).iter().map(|&(o, n)| o + n - 1).collect()
}

/// A reservation of `size` windows with windows 0..6 committed, then windows 1, 3 and 4
/// released: mappings at 0, 2 and 5, holes at 1, 3 and 4, the committed end at 6.
fn with_holes(w: &World, size: u64) -> Reservation {
    let mut r = w.vm.reserve(size * G).unwrap();
    r.commit(6 * G).unwrap();
    assert_eq!(r.release_ranges(&[(G, G), (3 * G, 2 * G)]).unwrap(), 3 * G);
    assert_eq!(windows(w, &r), vec![0, 2, 5]);
    assert_eq!((r.committed_bytes(), r.committed_end()), (3 * G, 6 * G));
    r
}

#[test]
fn a_commit_fills_the_lowest_holes_first() {
    let w = world();
    let mut r = with_holes(&w, 8);
    let c = r.commit(2 * G).unwrap();
    assert_eq!(windows(&w, &r), vec![0, 1, 2, 3, 5]);
    assert_eq!(
        (c.address.0, c.bytes, c.granules, c.mappings),
        (r.address().0 + G, 2 * G, 2, 2)
    );
    assert_eq!(r.committed_end(), 6 * G, "the end did not move");
    w.check(&[&r]);
}

#[test]
fn a_commit_past_the_holes_fills_them_all_then_grows_past_the_end() {
    let w = world();
    let mut r = with_holes(&w, 8);
    // Three holes and two windows past the end: exactly up to the reservation's size.
    let c = r.commit(5 * G).unwrap();
    assert_eq!(windows(&w, &r), (0..8).collect::<Vec<_>>());
    assert_eq!((c.bytes, c.granules), (5 * G, 5));
    assert_eq!((r.committed_bytes(), r.committed_end()), (8 * G, 8 * G));
    w.check(&[&r]);
    // Nothing is left: one window more is out of bounds.
    assert!(matches!(
        r.commit(G).unwrap_err(),
        VmmError::OutOfBounds { .. }
    ));
}

#[test]
fn holes_are_filled_across_commits_lowest_first() {
    let w = world();
    let mut r = with_holes(&w, 8);
    r.commit(G).unwrap();
    assert_eq!(windows(&w, &r), vec![0, 1, 2, 5]);
    r.commit(G).unwrap();
    assert_eq!(windows(&w, &r), vec![0, 1, 2, 3, 5]);
    // The last hole and one window past the end.
    r.commit(2 * G).unwrap();
    assert_eq!(windows(&w, &r), vec![0, 1, 2, 3, 4, 5, 6]);
    w.check(&[&r]);
}

#[test]
fn a_commit_with_holes_that_runs_past_the_reservation_is_out_of_bounds_before_any_driver_call() {
    let w = world();
    let mut r = with_holes(&w, 8);
    let calls = w.sim.driver_calls();
    // Three holes and three windows past the end: one window too many.
    let e = r.commit(6 * G).unwrap_err();
    assert_eq!(
        e,
        VmmError::OutOfBounds {
            offset: 6 * G,
            requested: 6 * G,
            reserved: 8 * G
        }
    );
    assert_eq!(w.sim.driver_calls(), calls);
    assert_eq!(windows(&w, &r), vec![0, 2, 5]);
    w.check(&[&r]);
}

#[test]
fn a_commit_with_holes_that_can_never_fit_is_refused_for_good() {
    let mut c = WorldConfig::new(G);
    c.budget_granules = Some(5);
    let w = World::new(c);
    let mut r = w.vm.reserve(8 * G).unwrap();
    r.commit(5 * G).unwrap();
    r.release_ranges(&[(G, G)]).unwrap();
    // It holds 4 windows: one more fits, two more never do.
    let calls = w.sim.driver_calls();
    let e = r.commit(2 * G).unwrap_err();
    match e {
        VmmError::NeverFits(n) => assert_eq!(
            (n.needed, n.limit, n.limit_bytes),
            (6 * G, Limit::DeviceBudget, 5 * G)
        ),
        other => panic!("expected never-fits, got {other}"),
    }
    assert_eq!(w.sim.driver_calls(), calls);
    r.commit(G).unwrap();
    assert_eq!(windows(&w, &r), vec![0, 1, 2, 3, 4]);
    w.check(&[&r]);
}

#[test]
fn a_grant_fills_holes_like_a_commit() {
    let w = world();
    let mut r = with_holes(&w, 8);
    let grant = w.vm.try_grant(4 * G).unwrap();
    let c = r.commit_with_grant(grant).unwrap();
    assert_eq!((c.granules, c.address.0), (4, r.address().0 + G));
    assert_eq!(windows(&w, &r), vec![0, 1, 2, 3, 4, 5, 6]);
    w.check(&[&r]);
}

#[test]
fn ensure_committed_fills_the_holes_below_the_length_asked() {
    let w = world();
    let mut r = with_holes(&w, 8);
    let c = r.ensure_committed(4 * G).unwrap().unwrap();
    assert_eq!(c.granules, 2);
    assert_eq!(windows(&w, &r), vec![0, 1, 2, 3, 5]);
    assert!(r.ensure_committed(4 * G).unwrap().is_none());
    w.check(&[&r]);
}

#[test]
fn a_zero_commit_maps_nothing_at_the_committed_end() {
    let w = world();
    let mut r = w.vm.reserve(8 * G).unwrap();
    r.commit(2 * G).unwrap();
    let calls = w.sim.driver_calls();
    let c = r.commit(0).unwrap();
    assert_eq!(
        (c.address.0, c.bytes, c.granules, c.mappings),
        (r.address().0 + 2 * G, 0, 0, 0)
    );
    assert_eq!(w.sim.driver_calls(), calls);
    let mut h = with_holes(&w, 8);
    let calls = w.sim.driver_calls();
    let c = h.commit(0).unwrap();
    assert_eq!((c.address.0, c.bytes), (h.address().0 + 6 * G, 0));
    assert_eq!(windows(&w, &h), vec![0, 2, 5]);
    assert_eq!(w.sim.driver_calls(), calls);
    w.check(&[&r, &h]);
}

#[test]
fn a_job_commits_its_windows_when_finished() {
    let w = world();
    let mut r = w.vm.reserve(8 * G).unwrap();
    let mut job = r.begin_commit_ranges(&[(G, 3 * G)]).unwrap().unwrap();
    assert_eq!((job.windows(), job.bytes()), (3, 3 * G));
    assert!(!job.has_run() && job.succeeded().is_none());
    assert!(r.has_commit_in_flight());
    assert!(format!("{job:?}").contains("CommitJob"));
    job.run();
    assert!(job.has_run());
    assert_eq!(job.succeeded(), Some(true));
    assert_eq!(w.sim.calls(Operation::Map), 3, "run mapped the windows");
    job.run();
    assert_eq!(w.sim.calls(Operation::Map), 3, "a second run does nothing");
    let c = r.finish_commit(job).unwrap();
    assert_eq!((c.address.0, c.granules), (r.address().0 + G, 3));
    assert!(!r.has_commit_in_flight());
    assert_eq!(windows(&w, &r), vec![1, 2, 3]);
    w.check(&[&r]);
}

#[test]
fn finishing_a_job_that_never_ran_runs_it() {
    let w = world();
    let mut r = w.vm.reserve(8 * G).unwrap();
    let job = r.begin_commit_ranges(&[(0, 2 * G)]).unwrap().unwrap();
    assert_eq!(w.sim.calls(Operation::Map), 0, "begin makes no driver call");
    r.finish_commit(job).unwrap();
    assert_eq!(windows(&w, &r), vec![0, 1]);
    w.check(&[&r]);
}

#[test]
fn a_job_that_ran_and_is_dropped_unfinished_undoes_its_windows() {
    let mut c = WorldConfig::new(G);
    c.pool_granules = 2;
    let w = World::new(c);
    let mut r = w.vm.reserve(8 * G).unwrap();
    r.commit(G).unwrap();
    let mut job = r.begin_commit_ranges(&[(2 * G, 3 * G)]).unwrap().unwrap();
    job.run();
    assert_eq!(w.sim.ledger().mappings.len(), 4);
    drop(job);
    // Unmapped, two handles to the pool (its cap), one released; the books are whole.
    assert_eq!(w.sim.ledger().mappings.len(), 1);
    assert_eq!(w.vm.pooled_bytes(), 2 * G);
    assert_eq!(w.sim.calls(Operation::Release), 1);
    assert!(!r.has_commit_in_flight());
    assert_eq!(windows(&w, &r), vec![0]);
    w.check(&[&r]);
    // The windows are free again.
    r.commit_range(2 * G, 3 * G).unwrap();
    assert_eq!(windows(&w, &r), vec![0, 2, 3, 4]);
    w.check(&[&r]);
}

/// A job over windows 0 and 1 (one handle each) that ran, then was dropped unfinished: the
/// undo's first unmap (window 0) fails, the second (window 1) succeeds.
fn dropped_job_whose_first_unmap_fails() -> (World, Reservation) {
    let w = world();
    let mut r = w.vm.reserve(8 * G).unwrap();
    let mut job = r.begin_commit_ranges(&[(0, 2 * G)]).unwrap().unwrap();
    job.run();
    w.sim
        .inject(FaultRule::nth(Operation::Unmap, 1, ErrorKind::Other));
    drop(job);
    (w, r)
}

#[test]
fn a_dropped_job_whose_unmap_fails_leaves_the_window_with_its_reservation() {
    let (w, mut r) = dropped_job_whose_first_unmap_fails();
    // The window whose unmap failed is still mapped: the reservation reads it as mapped and
    // committed, nothing is quarantined, and the books equal the driver's.
    assert!(w.vm.quarantine().is_empty());
    assert_eq!(w.vm.quarantined_bytes(), 0);
    let s = w.gov.snapshot().device(D0);
    assert_eq!((s.committed, s.quarantined), (G, 0));
    assert_eq!(r.mappings().len(), 1);
    assert_eq!(r.mappings()[0].address, r.address());
    assert_eq!(r.mappings()[0].size, G);
    assert!(r.is_mapped(0) && !r.is_mapped(G));
    assert_eq!((r.committed_bytes(), r.committed_end()), (G, G));
    let ledger = w.sim.ledger();
    assert_eq!(ledger.mappings.len(), 1);
    assert_eq!(s.used(), ledger.physical_bytes[0]);
    assert_eq!(w.vm.accounting_errors(), 0);
    w.check(&[&r]);
    // It stays out of use: a commit over it maps only the other window, without a driver
    // error; a job over it is none; a release unmaps it.
    assert!(r.begin_commit_ranges(&[(0, G)]).unwrap().is_none());
    assert_eq!(r.commit_range(0, 2 * G).unwrap().unwrap().granules, 1);
    assert_eq!(windows(&w, &r), vec![0, 1]);
    w.check(&[&r]);
    assert_eq!(r.release().unwrap(), 2 * G);
    w.check(&[&r]);
    assert!(w.sim.ledger().mappings.is_empty());
}

#[test]
fn a_window_left_mapped_by_a_dropped_job_is_unmapped_by_the_teardown() {
    let (w, r) = dropped_job_whose_first_unmap_fails();
    drop(r);
    assert!(w.vm.quarantine().is_empty());
    assert_eq!(w.gov.snapshot().device(D0).committed, 0);
    let ledger = w.sim.ledger();
    assert!(ledger.mappings.is_empty());
    assert_eq!(w.vm.accounting_errors(), 0);
}

#[test]
fn a_job_dropped_before_it_ran_changes_nothing_and_frees_its_windows() {
    let w = world();
    let mut r = w.vm.reserve(8 * G).unwrap();
    let job = r.begin_commit_ranges(&[(0, 2 * G)]).unwrap().unwrap();
    drop(job);
    assert_eq!(w.sim.driver_calls(), 1, "only the reserve");
    assert!(!r.has_commit_in_flight());
    // Another job may begin: the dropped one holds nothing.
    let job = r.begin_commit_ranges(&[(0, 2 * G)]).unwrap().unwrap();
    r.finish_commit(job).unwrap();
    assert_eq!(windows(&w, &r), vec![0, 1]);
    w.check(&[&r]);
}

#[test]
fn a_failed_job_dropped_unfinished_leaves_nothing_behind() {
    let w = world();
    let mut r = w.vm.reserve(8 * G).unwrap();
    let mut job = r.begin_commit_ranges(&[(0, 3 * G)]).unwrap().unwrap();
    w.sim
        .inject(FaultRule::nth(Operation::Map, 2, ErrorKind::Other));
    job.run();
    assert_eq!(job.succeeded(), Some(false));
    let unmaps = w.sim.calls(Operation::Unmap);
    drop(job);
    assert_eq!(w.sim.calls(Operation::Unmap), unmaps, "the run rolled back");
    w.check(&[&r]);
}

#[test]
fn one_job_at_a_time_another_begin_is_busy_even_for_other_windows() {
    let w = world();
    let mut r = w.vm.reserve(8 * G).unwrap();
    let job = r.begin_commit_ranges(&[(2 * G, G)]).unwrap().unwrap();
    assert_eq!(
        r.begin_commit_ranges(&[(5 * G, G)]).unwrap_err(),
        VmmError::Busy { offset: 2 * G }
    );
    // A commit of the job's windows is busy too; one of other windows is not.
    assert_eq!(
        r.commit_range(G, 2 * G).unwrap_err(),
        VmmError::Busy { offset: 2 * G }
    );
    r.commit_range(5 * G, G).unwrap();
    r.finish_commit(job).unwrap();
    let job = r.begin_commit_ranges(&[(6 * G, G)]).unwrap().unwrap();
    r.finish_commit(job).unwrap();
    assert_eq!(windows(&w, &r), vec![2, 5, 6]);
    w.check(&[&r]);
}

#[test]
fn a_job_over_mapped_windows_is_none() {
    let w = world();
    let mut r = w.vm.reserve(8 * G).unwrap();
    r.commit(2 * G).unwrap();
    assert!(r.begin_commit_ranges(&[(0, 2 * G)]).unwrap().is_none());
    assert!(!r.has_commit_in_flight());
}

#[test]
fn a_job_finished_on_another_reservation_is_refused_and_undone() {
    let w = world();
    let mut a = w.vm.reserve(8 * G).unwrap();
    let mut b = w.vm.reserve(8 * G).unwrap();
    let mut job = a.begin_commit_ranges(&[(0, 2 * G)]).unwrap().unwrap();
    job.run();
    let e = b.finish_commit(job).unwrap_err();
    assert!(matches!(e, VmmError::InvalidArgument { .. }), "{e}");
    assert!(a.mappings().is_empty() && b.mappings().is_empty());
    assert!(w.sim.ledger().mappings.is_empty(), "the job was undone");
    w.check(&[&a, &b]);
}

#[test]
fn aborting_a_job_releases_exactly_its_windows() {
    let w = world();
    let mut r = w.vm.reserve(8 * G).unwrap();
    r.commit(G).unwrap();
    let mut job = r.begin_commit_ranges(&[(0, 4 * G)]).unwrap().unwrap();
    job.run();
    assert_eq!(r.abort_commit(job).unwrap(), 3 * G);
    assert_eq!(windows(&w, &r), vec![0]);
    assert!(!r.has_commit_in_flight());
    w.check(&[&r]);
}

#[test]
fn ensure_committed_past_the_reservation_names_what_it_would_add() {
    let w = world();
    let mut r = w.vm.reserve(4 * G).unwrap();
    r.commit(G).unwrap();
    // No hole: the windows it would add start at the committed end.
    assert_eq!(
        r.ensure_committed(6 * G).unwrap_err(),
        VmmError::OutOfBounds {
            offset: G,
            requested: 5 * G,
            reserved: 4 * G
        }
    );
    // With a hole the whole range from the base is what it asks for.
    r.commit(2 * G).unwrap();
    r.release_ranges(&[(G, G)]).unwrap();
    assert_eq!(
        r.ensure_committed(6 * G).unwrap_err(),
        VmmError::OutOfBounds {
            offset: 0,
            requested: 6 * G,
            reserved: 4 * G
        }
    );
    let calls = w.sim.driver_calls();
    assert!(r.ensure_committed(6 * G).is_err());
    assert_eq!(
        w.sim.driver_calls(),
        calls,
        "refused before any driver call"
    );
    assert_eq!(windows(&w, &r), vec![0, 2]);
    w.check(&[&r]);
}
