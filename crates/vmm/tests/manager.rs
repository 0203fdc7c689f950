//! Behaviour of the manager on the simulator (its exhaustive fault injection is in
//! `exhaustive.rs`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::ptr_arg
)]

mod common;

use std::sync::Arc;

use common::{assert_accessible, World, WorldConfig, D0};
use kvvm_governor::{Governor, GovernorConfig};
use kvvm_hal::{
    BackendResult, Capabilities, DeviceAddress, DeviceId, ErrorKind, Granularity, Operation,
    VirtualMemoryBackend,
};
use kvvm_sim::{FaultRule, SimBackend, SimConfig, SimQuirks, GIB, MIB};
use kvvm_vmm::{
    GranularityChoice, QuarantineReason, Reservation, VirtualMemory, VmmConfig, VmmError,
};

const KIB: u64 = 1024;

// ---------------------------------------------------------------- behaviour

#[test]
fn manager_and_reservation_are_send_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<VirtualMemory>();
    assert_send_sync::<Reservation>();
    assert_send_sync::<Governor>();
}

#[test]
fn commit_grows_after_the_end_and_never_moves_the_pointer() {
    let w = World::simple(2 * MIB, 0);
    let g = w.g;
    let mut r = w.vm.reserve(10 * g - 1).unwrap();
    assert_eq!(r.size(), 10 * g);
    let base = r.address();
    let c = r.commit(1).unwrap();
    assert_eq!(
        (c.address, c.bytes, c.granules, c.from_pool),
        (base, g, 1, 0)
    );
    let c = r.commit(3 * g).unwrap();
    assert_eq!(c.address, DeviceAddress(base.0 + g));
    assert_eq!(r.ensure_committed(4 * g).unwrap(), None);
    let c = r.ensure_committed(6 * g + 1).unwrap().unwrap();
    assert_eq!(c.granules, 3);
    assert_eq!(
        (r.address(), r.committed_bytes(), r.committed_end()),
        (base, 7 * g, 7 * g)
    );
    assert_accessible(&w.sim, &r);
    w.check(&[&r]);
    // Data written survives growth.
    w.sim.copy_to_device(base, b"kv").unwrap();
    r.commit(g).unwrap();
    let mut back = [0u8; 2];
    w.sim.copy_from_device(&mut back, base).unwrap();
    assert_eq!(&back, b"kv");
    // Never beyond the reservation, with no driver call.
    let calls = w.sim.driver_calls();
    let e = r.commit(3 * g).unwrap_err();
    assert_eq!(
        e,
        VmmError::OutOfBounds {
            offset: 8 * g,
            requested: 3 * g,
            reserved: 10 * g
        }
    );
    assert_eq!(w.sim.driver_calls(), calls);
    r.commit(2 * g).unwrap();
    assert!(matches!(r.commit(1), Err(VmmError::OutOfBounds { .. })));
    w.check(&[&r]);
    drop(r);
    assert!(w.sim.ledger().is_empty());
}

#[test]
fn set_access_once_per_commit() {
    let mut c = WorldConfig::new(64 * KIB);
    c.capacity_granules = 600;
    let w = World::new(c);
    let mut r = w.vm.reserve(600 * w.g).unwrap();
    w.sim.reset_counters();
    r.commit(512 * w.g).unwrap();
    assert_eq!(w.sim.calls(Operation::SetAccess), 1);
    assert_eq!(w.sim.calls(Operation::Create), 512);
    assert_eq!(w.sim.calls(Operation::Map), 512);
    assert_accessible(&w.sim, &r);
}

#[test]
fn release_keeps_the_address_and_unmaps_contiguous_blocks_at_once() {
    let w = World::simple(2 * MIB, 0);
    let g = w.g;
    let mut r = w.vm.reserve(16 * g).unwrap();
    r.commit(3 * g).unwrap();
    r.commit(2 * g).unwrap();
    w.sim.reset_counters();
    assert_eq!(r.release().unwrap(), 5 * g);
    assert_eq!(w.sim.calls(Operation::Unmap), 1);
    assert_eq!(w.sim.calls(Operation::Release), 5);
    assert_eq!(r.committed_bytes(), 0);
    assert!(w.sim.ledger().reservation(r.address()).is_some());
    let base = r.address();
    r.commit(4 * g).unwrap();
    assert_eq!(r.address(), base);
    assert_eq!(r.truncate(2 * g + 1).unwrap(), g);
    assert_eq!(r.committed_bytes(), 3 * g);
    w.check(&[&r]);
}

#[test]
fn per_mapping_unmap_when_the_backend_needs_it() {
    let mut c = WorldConfig::new(2 * MIB);
    c.quirks = SimQuirks {
        multi_unmap_breaks_free: true,
        ..SimQuirks::default()
    };
    let w = World::new(c);
    assert!(!w.vm.capabilities().unmap_spans_mappings);
    let mut r = w.vm.reserve(8 * w.g).unwrap();
    r.commit(4 * w.g).unwrap();
    w.sim.reset_counters();
    r.release().unwrap();
    assert_eq!(w.sim.calls(Operation::Unmap), 4);
    r.commit(4 * w.g).unwrap();
    drop(r); // teardown unmaps one by one too, so the free succeeds
    assert!(w.sim.ledger().is_empty(), "{:?}", w.sim.ledger());
    assert!(w.vm.quarantine().is_empty());
}

#[test]
fn pool_hit_skips_create_and_release() {
    let w = World::simple(2 * MIB, 8);
    let g = w.g;
    let mut a = w.vm.reserve(16 * g).unwrap();
    a.commit(6 * g).unwrap();
    w.sim.reset_counters();
    a.release().unwrap();
    assert_eq!(w.sim.calls(Operation::Release), 0);
    assert_eq!(w.vm.pooled_bytes(), 6 * g);
    assert_eq!(w.gov.snapshot().device(D0).pooled, 6 * g);
    w.check(&[&a]);
    let mut b = w.vm.reserve(16 * g).unwrap();
    w.sim.reset_counters();
    let c = b.commit(10 * g).unwrap();
    assert_eq!(c.from_pool, 6);
    assert_eq!(w.sim.calls(Operation::Create), 4);
    assert_eq!(w.sim.calls(Operation::SetAccess), 1);
    assert_accessible(&w.sim, &b);
    w.check(&[&a, &b]);
    // Releasing 10 with a cap of 8: 8 pooled, 2 released.
    w.sim.reset_counters();
    b.release().unwrap();
    assert_eq!(w.sim.calls(Operation::Release), 2);
    assert_eq!(w.vm.pooled_bytes(), 8 * g);
    w.check(&[&a, &b]);
    assert_eq!(w.vm.trim_pool(3 * g), 5 * g);
    assert_eq!(w.vm.set_pool_cap_bytes(g), 2 * g);
    w.check(&[&a, &b]);
    drop((a, b));
    let vm = w.vm.clone();
    drop(w.vm);
    assert!(!w.sim.ledger().is_empty(), "pool alive while a clone lives");
    drop(vm);
    assert!(w.sim.ledger().is_empty(), "pool released with the manager");
    assert_eq!(w.gov.snapshot().device(D0).used(), 0);
}

#[test]
fn backpressure_after_evicting_the_pool() {
    let mut c = WorldConfig::new(2 * MIB);
    c.budget_granules = Some(8);
    c.pool_granules = 8;
    let w = World::new(c);
    let g = w.g;
    let mut a = w.vm.reserve(16 * g).unwrap();
    a.commit(6 * g).unwrap();
    a.release().unwrap();
    let mut b = w.vm.reserve(16 * g).unwrap();
    b.commit(2 * g).unwrap(); // from the pool: 4 pooled + 2 committed
    let other = World::simple(2 * MIB, 0); // unrelated sim, for a grant of another governor
                                           // A grant of 4 more: only 2 free, so the governor evicts 2 pooled handles first.
    let grant = w.vm.try_grant(4 * g).unwrap();
    assert_eq!(w.vm.pooled_bytes(), 2 * g);
    let mut c = w.vm.reserve(8 * g).unwrap();
    c.commit_with_grant(grant).unwrap();
    w.check(&[&a, &b, &c]);
    // The commit took the 2 pooled handles first and created 2: 6 committed, nothing pooled.
    assert_eq!(w.vm.pooled_bytes(), 0);
    assert_eq!(w.gov.snapshot().device(D0).committed, 6 * g);
    // A commit of 3 needs 3 granules of budget, 2 are free, nothing to evict: refused.
    let e = c.commit(3 * g).unwrap_err();
    let VmmError::Backpressure(bp) = &e else {
        panic!("{e:?}")
    };
    assert_eq!((bp.needed, bp.available), (3 * g, 2 * g));
    assert!(e.is_retryable());
    assert!(!bp.retry_after.is_zero());
    w.check(&[&a, &b, &c]);
    // Grants must match the manager.
    let foreign = other.vm.try_grant(g).unwrap();
    assert!(matches!(
        c.commit_with_grant(foreign),
        Err(VmmError::GrantMismatch { .. })
    ));
    let odd = w.gov.try_grant(D0, 1).unwrap();
    assert!(matches!(
        c.commit_with_grant(odd),
        Err(VmmError::GrantMismatch { .. })
    ));
    let wrong_dev = w.gov.try_grant(DeviceId(3), g).unwrap();
    assert!(matches!(
        c.commit_with_grant(wrong_dev),
        Err(VmmError::GrantMismatch { .. })
    ));
    w.check(&[&a, &b, &c]);
}

#[test]
fn driver_out_of_memory_rolls_back() {
    let mut c = WorldConfig::new(2 * MIB);
    c.capacity_granules = 5;
    let w = World::new(c);
    // Another reservation holds 3 of the 5 granules (a reservation that would itself hold
    // more than the device is never-fits, before any driver call).
    let mut other = w.vm.reserve(16 * w.g).unwrap();
    other.commit(3 * w.g).unwrap();
    let mut r = w.vm.reserve(16 * w.g).unwrap();
    let e = r.commit(3 * w.g).unwrap_err();
    assert_eq!(e.backend_error().unwrap().kind, ErrorKind::OutOfMemory);
    assert!(e.is_retryable());
    assert_eq!(r.committed_bytes(), 0);
    w.check(&[&r, &other]);
    r.commit(2 * w.g).unwrap();
    w.check(&[&r, &other]);
}

#[test]
fn size_errors_are_typed() {
    let w = World::simple(2 * MIB, 0);
    assert_eq!(w.vm.reserve(0).unwrap_err(), VmmError::ZeroSize);
    assert!(matches!(
        w.vm.reserve(u64::MAX),
        Err(VmmError::SizeOverflow { .. })
    ));
    assert!(matches!(
        w.vm.try_grant(u64::MAX),
        Err(VmmError::SizeOverflow { .. })
    ));
    // A reservation the address space cannot hold: the driver's out of memory.
    let e = w.vm.reserve(1 << 60).unwrap_err();
    assert_eq!(e.backend_error().unwrap().kind, ErrorKind::OutOfMemory);
    let mut r = w.vm.reserve(4 * w.g).unwrap();
    assert!(matches!(
        r.commit(u64::MAX),
        Err(VmmError::SizeOverflow { .. })
    ));
    assert_eq!(r.commit(0).unwrap().bytes, 0);
    assert!(w.sim.ledger().mappings.is_empty());
}

#[test]
fn teardown_with_failed_synchronize_quarantines_everything() {
    let w = World::simple(2 * MIB, 4);
    let g = w.g;
    let mut r = w.vm.reserve(8 * g).unwrap();
    r.commit(3 * g).unwrap();
    let (base, size) = (r.address(), r.size());
    w.sim.inject(FaultRule::failing_synchronize());
    w.sim.reset_counters();
    w.sim.inject(FaultRule::failing_synchronize());
    drop(r);
    assert_eq!(w.sim.calls(Operation::Synchronize), 1);
    assert_eq!(
        w.sim.calls(Operation::Unmap)
            + w.sim.calls(Operation::Release)
            + w.sim.calls(Operation::Free),
        0,
        "nothing unmapped, released or freed"
    );
    let q = w.vm.quarantine();
    assert_eq!(q.len(), 1);
    assert_eq!(q[0].reason, QuarantineReason::TeardownSyncFailed);
    assert_eq!(q[0].range, Some((base, size)));
    assert_eq!((q[0].mappings.len(), q[0].bytes), (3, 3 * g));
    let s = w.gov.snapshot().device(D0);
    assert_eq!((s.committed, s.quarantined, s.used()), (0, 3 * g, 3 * g));
    assert_eq!(
        w.vm.pooled_bytes(),
        0,
        "quarantined handles are never pooled"
    );
    w.check(&[]);
    // An empty reservation needs no synchronize.
    let r = w.vm.reserve(g).unwrap();
    drop(r);
    assert_eq!(w.vm.quarantine().len(), 1);
    w.check(&[]);
}

#[test]
fn rollback_unmap_failure_leaves_the_block_recorded() {
    let w = World::simple(2 * MIB, 8);
    let g = w.g;
    let mut r = w.vm.reserve(16 * g).unwrap();
    r.commit(g).unwrap();
    // Commit 4 more: set access fails, and the rollback's 2nd unmap (of block 3 of 4) fails.
    w.sim
        .inject(FaultRule::nth(Operation::SetAccess, 1, ErrorKind::Other));
    w.sim
        .inject(FaultRule::nth(Operation::Unmap, 2, ErrorKind::Other));
    let e = r.commit(4 * g).unwrap_err();
    assert_eq!(e.backend_error().unwrap().op, Operation::SetAccess);
    w.sim.clear_faults();
    let m = r.mappings();
    assert_eq!(m.len(), 2, "the block whose unmap failed stays recorded");
    assert_eq!(m[1].address, DeviceAddress(r.address().0 + 3 * g));
    assert_eq!((r.committed_bytes(), r.committed_end()), (2 * g, 4 * g));
    assert_eq!(
        w.vm.pooled_bytes(),
        3 * g,
        "the other handles went to the pool"
    );
    w.check(&[&r]);
    // The next commit maps after the committed end; release cleans up both runs.
    r.commit(g).unwrap();
    w.sim.reset_counters();
    r.release().unwrap();
    assert_eq!(
        w.sim.calls(Operation::Unmap),
        2,
        "two runs of adjacent blocks"
    );
    w.check(&[&r]);
}

/// A backend that reports set-access retries and fails the first `fail` set-access calls.
struct FlakySetAccess {
    sim: Arc<SimBackend>,
    fail: std::sync::atomic::AtomicU32,
    retries: u32,
}

impl kvvm_hal::decorate::Forward for FlakySetAccess {
    fn inner(&self) -> &dyn VirtualMemoryBackend {
        &*self.sim
    }
    fn name(&self) -> &str {
        "flaky"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            set_access_retries: self.retries,
            ..self.sim.capabilities()
        }
    }
    /// Fails the first `fail` set-access calls before they reach the simulator.
    fn before(&self, op: Operation) -> BackendResult<()> {
        use std::sync::atomic::Ordering;
        let failing = op == Operation::SetAccess
            && self
                .fail
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        if failing {
            return Err(kvvm_hal::BackendError::new(
                Operation::SetAccess,
                ErrorKind::Other,
                1,
                "FLAKY",
            ));
        }
        Ok(())
    }
}

#[test]
fn set_access_is_retried_as_the_backend_asks() {
    let g = 2 * MIB;
    for (fail, retries, ok) in [(2, 2, true), (3, 2, false), (1, 0, false), (0, 0, true)] {
        let sim = Arc::new(SimBackend::new(SimConfig::single(g, 64 * g)));
        let flaky = Arc::new(FlakySetAccess {
            sim: sim.clone(),
            fail: std::sync::atomic::AtomicU32::new(fail),
            retries,
        });
        let gov = Governor::unlimited();
        let vm = VirtualMemory::new(flaky, D0, gov.clone(), VmmConfig::default()).unwrap();
        let mut r = vm.reserve(8 * g).unwrap();
        assert_eq!(r.commit(4 * g).is_ok(), ok, "fail {fail} retries {retries}");
        common::check(&sim, &vm, &gov, &[&r]);
        drop(r);
        drop(vm);
        assert!(sim.ledger().is_empty());
    }
}

#[test]
fn granularities_from_4k_to_1g() {
    for g in [4 * KIB, 64 * KIB, 2 * MIB, 32 * MIB, 512 * MIB, GIB] {
        let mut c = WorldConfig::new(g);
        c.capacity_granules = 16;
        c.pool_granules = 2;
        c.budget_granules = Some(12);
        let w = World::new(c);
        assert_eq!(w.vm.granule(), g);
        let mut a = w.vm.reserve(64 * g).unwrap();
        let mut b = w.vm.reserve(4 * g).unwrap();
        a.commit(5 * g - 1).unwrap();
        b.commit(g + 1).unwrap();
        assert_eq!(a.committed_bytes(), 5 * g);
        assert!(matches!(b.commit(3 * g), Err(VmmError::OutOfBounds { .. })));
        // 5 + 2 held, 6 more: within the budget of 12 but over what is free.
        assert!(matches!(a.commit(6 * g), Err(VmmError::Backpressure(_))));
        // 5 held and 8 more is over the budget whatever is freed.
        assert!(matches!(a.commit(8 * g), Err(VmmError::NeverFits(_))));
        w.check(&[&a, &b]);
        a.truncate(g).unwrap();
        a.commit(3 * g).unwrap();
        w.check(&[&a, &b]);
        drop((a, b));
        w.vm.trim_pool(0);
        assert!(w.sim.ledger().is_empty(), "granule {g}");
        assert_eq!(w.gov.snapshot().device(D0).used(), 0);
    }
}

#[test]
fn recommended_granularity_is_used_by_default() {
    let mut cfg = SimConfig::single(4 * KIB, 64 * MIB);
    cfg.devices[0].granularity = Granularity {
        minimum: 4 * KIB,
        recommended: 2 * MIB,
    };
    let sim = Arc::new(SimBackend::new(cfg));
    let vm = VirtualMemory::with_defaults(sim.clone(), D0).unwrap();
    assert_eq!(vm.granule(), 2 * MIB);
    let vm_min = VirtualMemory::new(
        sim.clone(),
        D0,
        Governor::unlimited(),
        VmmConfig::default().granularity(GranularityChoice::Minimum),
    )
    .unwrap();
    assert_eq!(vm_min.granule(), 4 * KIB);
    let mut r = vm.reserve(3 * MIB).unwrap();
    assert_eq!(r.size(), 4 * MIB);
    assert_eq!(r.address().0 % (2 * MIB), 0);
    r.commit(1).unwrap();
    assert_eq!(sim.ledger().total_physical_bytes(), 2 * MIB);
}

#[test]
fn process_budget_is_shared_by_two_devices() {
    let g = 2 * MIB;
    let sim = Arc::new(SimBackend::new(SimConfig::uniform(2, g, 64 * g)));
    let gov = Governor::new(GovernorConfig::default().process_budget(6 * g));
    let vm0 =
        VirtualMemory::new(sim.clone(), DeviceId(0), gov.clone(), VmmConfig::default()).unwrap();
    let vm1 =
        VirtualMemory::new(sim.clone(), DeviceId(1), gov.clone(), VmmConfig::default()).unwrap();
    let mut a = vm0.reserve(8 * g).unwrap();
    let mut b = vm1.reserve(8 * g).unwrap();
    a.commit(4 * g).unwrap();
    assert!(matches!(b.commit(3 * g), Err(VmmError::Backpressure(_))));
    b.commit(2 * g).unwrap();
    let l = sim.ledger();
    assert_eq!(l.physical_bytes, vec![4 * g, 2 * g]);
    assert_eq!(gov.snapshot().used(), 6 * g);
}

#[test]
fn a_refusal_counts_the_whole_commit_and_the_pool_as_available() {
    let mut c = WorldConfig::new(2 * MIB);
    c.budget_granules = Some(8);
    c.pool_granules = 8;
    let w = World::new(c);
    let g = w.g;
    let mut a = w.vm.reserve(8 * g).unwrap();
    a.commit(6 * g).unwrap();
    a.release().unwrap();
    let mut b = w.vm.reserve(8 * g).unwrap();
    b.commit(4 * g).unwrap(); // 4 of the 6 pooled handles: 4 committed, 2 pooled, 2 free
    assert_eq!(w.vm.pooled_bytes(), 2 * g);
    assert_eq!(w.gov.available_bytes(D0), 4 * g, "free plus pooled");
    // 6 windows: the pool supplies 2 and the governor is asked for 4 with 2 free. The refusal
    // names the whole commit and everything it could have had (free and pooled), not the
    // part net of the pool against the free bytes alone.
    let mut c = w.vm.reserve(8 * g).unwrap();
    let e = c.commit(6 * g).unwrap_err();
    let VmmError::Backpressure(bp) = &e else {
        panic!("{e:?}")
    };
    assert_eq!((bp.needed, bp.available), (6 * g, 4 * g));
    assert_eq!(bp.available, w.gov.available_bytes(D0));
    assert_eq!(
        w.vm.pooled_bytes(),
        2 * g,
        "the handles set aside went back"
    );
    // What was reported available is granted.
    c.commit(4 * g).unwrap();
    assert_eq!(w.gov.available_bytes(D0), 0);
    w.check(&[&a, &b, &c]);
}
