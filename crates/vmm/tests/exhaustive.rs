//! Exhaustive fault injection of the manager on the simulator: for every multi-step
//! operation, every driver call of a clean run is failed once, and the invariants 1-3 are
//! checked against the simulator's ledger afterwards.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::ptr_arg
)]

mod common;

use common::{World, WorldConfig, D0};
use kvvm_hal::{DeviceAddress, ErrorKind, Operation};
use kvvm_sim::{FaultRule, SimQuirks, MIB};
use kvvm_vmm::{QuarantineReason, Reservation, VmmError};

const KIB: u64 = 1024;

fn refs(rs: &[Reservation]) -> Vec<&Reservation> {
    rs.iter().collect()
}

// ---------------------------------------------------------------- exhaustive faults

/// Runs the operation under test on the world and its reservations.
type RunFn = fn(&World, &mut Vec<Reservation>) -> Result<(), VmmError>;
/// Checks specific to a faulted run: (world, reservations, committed bytes before, the
/// failed op, the result).
type ExpectFn = fn(&World, &[Reservation], &[u64], Operation, &Result<(), VmmError>);

/// One multi-step operation: how to build the world, what to set up, what to run.
struct Scenario {
    name: &'static str,
    world: fn() -> World,
    setup: fn(&World) -> Vec<Reservation>,
    run: RunFn,
    expect: ExpectFn,
}

const FAULT_OPS: [Operation; 8] = [
    Operation::Reserve,
    Operation::Create,
    Operation::Map,
    Operation::SetAccess,
    Operation::Unmap,
    Operation::Release,
    Operation::Synchronize,
    Operation::Free,
];

fn kind_for(op: Operation) -> ErrorKind {
    match op {
        Operation::Create => ErrorKind::OutOfMemory,
        Operation::Synchronize => ErrorKind::DeviceLost,
        _ => ErrorKind::Other,
    }
}

/// Runs `s` clean to count its driver calls, then once per call with exactly that call
/// failing; checks invariants 1-3 after each, then cleans up and checks that only the
/// quarantine is left. Returns the number of faulted runs.
fn exhaustive(s: &Scenario) -> usize {
    let counts: Vec<(Operation, u64)> = {
        let w = (s.world)();
        let mut rs = (s.setup)(&w);
        w.sim.reset_counters();
        (s.run)(&w, &mut rs).unwrap_or_else(|e| panic!("{}: clean run failed: {e}", s.name));
        w.check(&refs(&rs));
        let c = FAULT_OPS.iter().map(|op| (*op, w.sim.calls(*op))).collect();
        drop(rs);
        w.vm.trim_pool(0);
        assert!(w.sim.ledger().is_empty(), "{}: clean run leaks", s.name);
        c
    };
    let total: u64 = counts.iter().map(|(_, n)| n).sum();
    assert!(total > 0, "{}: no driver calls", s.name);
    let mut runs = 0;
    for &(op, n) in &counts {
        for i in 1..=n {
            let w = (s.world)();
            let mut rs = (s.setup)(&w);
            let before: Vec<u64> = rs.iter().map(Reservation::committed_bytes).collect();
            let bases: Vec<DeviceAddress> = rs.iter().map(Reservation::address).collect();
            w.sim.inject(FaultRule::nth(op, i, kind_for(op)));
            let result = (s.run)(&w, &mut rs);
            w.sim.clear_faults();
            let ctx = format!("{}: {op} call {i} of {n} failing -> {result:?}", s.name);
            let check = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                w.check(&refs(&rs));
                for (r, b) in rs.iter().zip(&bases) {
                    assert_eq!(r.address(), *b, "invariant 5");
                }
                (s.expect)(&w, &rs, &before, op, &result);
            }));
            if let Err(p) = check {
                eprintln!("FAILED: {ctx}");
                std::panic::resume_unwind(p);
            }
            // Everything else still works, and only the quarantine is left behind.
            drop(rs);
            w.vm.trim_pool(0);
            w.check(&[]);
            let q = w.vm.quarantine();
            if q.is_empty() {
                assert!(
                    w.sim.ledger().is_empty(),
                    "{ctx}: leak {:?}",
                    w.sim.ledger()
                );
            }
            runs += 1;
        }
    }
    runs
}

fn world_plain() -> World {
    World::simple(2 * MIB, 0)
}

fn world_pool() -> World {
    World::simple(64 * KIB, 4)
}

fn world_per_mapping_unmap() -> World {
    let mut c = WorldConfig::new(4 * KIB);
    c.pool_granules = 2;
    c.quirks = SimQuirks {
        multi_unmap_breaks_free: true,
        ..SimQuirks::default()
    };
    World::new(c)
}

fn commit_failed_cleanly(
    w: &World,
    rs: &[Reservation],
    before: &[u64],
    _op: Operation,
    res: &Result<(), VmmError>,
) {
    assert!(res.is_err(), "a failed driver call fails the commit");
    for (r, b) in rs.iter().zip(before) {
        assert_eq!(
            r.committed_bytes(),
            *b,
            "a failed commit leaves nothing mapped"
        );
    }
    let _ = w;
}

fn setup_one_committed(w: &World) -> Vec<Reservation> {
    let mut r = w.vm.reserve(32 * w.g).unwrap();
    r.commit(2 * w.g).unwrap();
    vec![r]
}

#[test]
fn exhaustive_commit_of_k_granules() {
    fn run_k<const K: u64>(w: &World, rs: &mut Vec<Reservation>) -> Result<(), VmmError> {
        rs[0].commit(K * w.g).map(|_| ())
    }
    let mut runs = 0;
    for (name, run) in [
        (
            "commit 1",
            run_k::<1> as fn(&World, &mut Vec<Reservation>) -> _,
        ),
        ("commit 3", run_k::<3>),
        ("commit 8", run_k::<8>),
    ] {
        runs += exhaustive(&Scenario {
            name,
            world: world_plain,
            setup: setup_one_committed,
            run,
            expect: commit_failed_cleanly,
        });
    }
    // create k + map k + one set access, for k = 1, 3, 8.
    assert_eq!(runs, 3 + 7 + 17);
}

#[test]
fn exhaustive_commit_partly_from_the_pool() {
    // The pool holds 3 handles; a commit of 6 takes 3 from it and creates 3.
    fn setup(w: &World) -> Vec<Reservation> {
        let mut a = w.vm.reserve(8 * w.g).unwrap();
        a.commit(3 * w.g).unwrap();
        a.release().unwrap();
        let b = w.vm.reserve(8 * w.g).unwrap();
        vec![a, b]
    }
    fn run(w: &World, rs: &mut Vec<Reservation>) -> Result<(), VmmError> {
        rs[1].commit(6 * w.g).map(|_| ())
    }
    fn expect(
        w: &World,
        rs: &[Reservation],
        before: &[u64],
        op: Operation,
        res: &Result<(), VmmError>,
    ) {
        commit_failed_cleanly(w, rs, before, op, res);
        // Pooled handles went back to the pool (cap 4: one created handle may join them).
        assert!(w.vm.pooled_bytes() >= 3 * w.g, "{}", w.vm.pooled_bytes());
    }
    let runs = exhaustive(&Scenario {
        name: "commit from pool",
        world: world_pool,
        setup,
        run,
        expect,
    });
    assert_eq!(runs, 3 + 6 + 1);
}

#[test]
fn exhaustive_commit_with_grant() {
    fn run(w: &World, rs: &mut Vec<Reservation>) -> Result<(), VmmError> {
        let grant = w.vm.try_grant(4 * w.g)?;
        rs[0].commit_with_grant(grant).map(|_| ())
    }
    exhaustive(&Scenario {
        name: "commit with grant",
        world: world_plain,
        setup: setup_one_committed,
        run,
        expect: commit_failed_cleanly,
    });
}

fn setup_release(w: &World) -> Vec<Reservation> {
    let mut r = w.vm.reserve(16 * w.g).unwrap();
    r.commit(3 * w.g).unwrap();
    r.commit(3 * w.g).unwrap();
    vec![r]
}

fn release_expect(
    w: &World,
    rs: &[Reservation],
    before: &[u64],
    op: Operation,
    res: &Result<(), VmmError>,
) {
    assert!(res.is_err(), "{op}");
    let r = &rs[0];
    match op {
        // Unmapped blocks are gone; the ones whose unmap failed stay.
        Operation::Unmap => {
            assert!(
                r.committed_bytes() < before[0]
                    || !w.vm.capabilities().unmap_spans_mappings
                    || r.committed_bytes() == before[0]
            );
            assert!(r.committed_bytes() > 0);
        }
        // Every block was unmapped; one handle is quarantined.
        Operation::Release => {
            let q = w.vm.quarantine();
            assert_eq!(q.len(), 1);
            assert_eq!(q[0].reason, QuarantineReason::ReleaseFailed);
            assert_eq!(q[0].handles.len(), 1);
        }
        _ => panic!("unexpected {op}"),
    }
}

#[test]
fn exhaustive_release() {
    fn run(_: &World, rs: &mut Vec<Reservation>) -> Result<(), VmmError> {
        rs[0].release().map(|_| ())
    }
    let a = exhaustive(&Scenario {
        name: "release (one unmap)",
        world: world_pool,
        setup: setup_release,
        run,
        expect: release_expect,
    });
    // 1 unmap, 2 releases (4 pooled).
    assert_eq!(a, 1 + 2);
    let b = exhaustive(&Scenario {
        name: "release (per-mapping unmap)",
        world: world_per_mapping_unmap,
        setup: setup_release,
        run,
        expect: release_expect,
    });
    assert_eq!(b, 6 + 4);
}

#[test]
fn exhaustive_truncate() {
    fn run(w: &World, rs: &mut Vec<Reservation>) -> Result<(), VmmError> {
        rs[0].truncate(2 * w.g + 1).map(|_| ())
    }
    fn expect(
        w: &World,
        rs: &[Reservation],
        _b: &[u64],
        op: Operation,
        res: &Result<(), VmmError>,
    ) {
        assert!(res.is_err(), "{op}");
        assert!(rs[0].committed_bytes() >= 3 * w.g, "the kept blocks stay");
    }
    exhaustive(&Scenario {
        name: "truncate",
        world: world_per_mapping_unmap,
        setup: setup_release,
        run,
        expect,
    });
}

fn drop_expect(
    w: &World,
    rs: &[Reservation],
    before: &[u64],
    op: Operation,
    res: &Result<(), VmmError>,
) {
    assert!(res.is_ok() && rs.is_empty());
    let q = w.vm.quarantine();
    assert_eq!(q.len(), 1, "{q:?}");
    let committed = before[0];
    let reason = q[0].reason;
    match op {
        Operation::Synchronize => {
            assert_eq!(reason, QuarantineReason::TeardownSyncFailed);
            assert_eq!(q[0].bytes, committed);
            assert_eq!(q[0].mappings.len() as u64 * w.g, committed);
        }
        Operation::Unmap => {
            assert_eq!(reason, QuarantineReason::UnmapFailed);
            assert!(q[0].bytes > 0 && q[0].range.is_some());
        }
        Operation::Release => {
            assert_eq!(reason, QuarantineReason::ReleaseFailed);
            assert_eq!(q[0].bytes, w.g);
        }
        Operation::Free => {
            assert_eq!(reason, QuarantineReason::FreeFailed);
            assert_eq!(q[0].bytes, 0);
        }
        _ => panic!("unexpected {op}"),
    }
    assert_eq!(w.gov.snapshot().device(D0).quarantined, q[0].bytes);
}

#[test]
fn exhaustive_teardown() {
    fn run(_: &World, rs: &mut Vec<Reservation>) -> Result<(), VmmError> {
        rs.clear();
        Ok(())
    }
    let a = exhaustive(&Scenario {
        name: "drop (one unmap)",
        world: world_pool,
        setup: setup_release,
        run,
        expect: drop_expect,
    });
    assert_eq!(a, 1 + 1 + 2 + 1);
    let b = exhaustive(&Scenario {
        name: "drop (per-mapping unmap)",
        world: world_per_mapping_unmap,
        setup: setup_release,
        run,
        expect: drop_expect,
    });
    assert_eq!(b, 1 + 6 + 4 + 1);
    fn setup_empty(w: &World) -> Vec<Reservation> {
        vec![w.vm.reserve(4 * w.g).unwrap()]
    }
    let c = exhaustive(&Scenario {
        name: "drop empty",
        world: world_plain,
        setup: setup_empty,
        run,
        expect: drop_expect,
    });
    assert_eq!(c, 1);
}

#[test]
fn exhaustive_reserve_and_commit() {
    fn run(w: &World, rs: &mut Vec<Reservation>) -> Result<(), VmmError> {
        let mut r = w.vm.reserve(8 * w.g)?;
        let res = r.commit(3 * w.g).map(|_| ());
        rs.push(r);
        res
    }
    fn setup(_: &World) -> Vec<Reservation> {
        Vec::new()
    }
    fn expect(
        _: &World,
        rs: &[Reservation],
        _b: &[u64],
        op: Operation,
        res: &Result<(), VmmError>,
    ) {
        assert!(res.is_err());
        if op == Operation::Reserve {
            assert!(rs.is_empty());
        } else {
            assert_eq!(rs[0].committed_bytes(), 0);
        }
    }
    exhaustive(&Scenario {
        name: "reserve + commit",
        world: world_plain,
        setup,
        run,
        expect,
    });
}

#[test]
fn exhaustive_reclaim_under_pressure() {
    // Budget 8, pool cap 8: 6 pooled + 2 committed. A grant of 4 needs 4 evicted first.
    fn world() -> World {
        let mut c = WorldConfig::new(64 * KIB);
        c.budget_granules = Some(8);
        c.pool_granules = 8;
        World::new(c)
    }
    fn setup(w: &World) -> Vec<Reservation> {
        let mut a = w.vm.reserve(8 * w.g).unwrap();
        a.commit(8 * w.g).unwrap();
        a.release().unwrap();
        a.commit(2 * w.g).unwrap();
        let b = w.vm.reserve(8 * w.g).unwrap();
        vec![a, b]
    }
    fn run(w: &World, rs: &mut Vec<Reservation>) -> Result<(), VmmError> {
        let grant = w.vm.try_grant(4 * w.g)?;
        rs[1].commit_with_grant(grant).map(|_| ())
    }
    fn expect(
        w: &World,
        rs: &[Reservation],
        before: &[u64],
        op: Operation,
        res: &Result<(), VmmError>,
    ) {
        match op {
            // A failed eviction quarantines the handle; the grant may then be refused.
            Operation::Release => {
                assert_eq!(w.vm.quarantine().len(), 1);
                if let Err(e) = res {
                    assert!(matches!(e, VmmError::Backpressure(_)), "{e}");
                }
            }
            _ => commit_failed_cleanly(w, rs, before, op, res),
        }
    }
    let runs = exhaustive(&Scenario {
        name: "reclaim",
        world,
        setup,
        run,
        expect,
    });
    // 4 evictions (releases), 2 creates, 4 maps (2 pooled + 2 created), 1 set access.
    assert_eq!(runs, 4 + 2 + 4 + 1);
}
