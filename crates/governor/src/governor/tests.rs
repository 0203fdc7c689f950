//! Unit tests of [`Governor`](super::Governor): grants, refusals, reclaimers, the books.

#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;
use crate::release_window::ReleaseWindow;
use crate::{GovernorConfig, ManualClock, RetryPolicy};
use std::sync::atomic::{AtomicU64, Ordering};

const MAX_FREE_EVENTS: usize = ReleaseWindow::<u64>::MAX_EVENTS;

const D0: DeviceId = DeviceId(0);
const D1: DeviceId = DeviceId(1);
const MIB: u64 = 1 << 20;

fn bp(r: Result<MappedGrowthGrant, Refusal>) -> Backpressure {
    match r {
        Err(Refusal::Backpressure(b)) => b,
        other => panic!("expected backpressure, got {other:?}"),
    }
}

fn governor(budget: u64) -> (Governor, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new());
    let g = Governor::new(
        GovernorConfig::default()
            .default_device_budget(budget)
            .clock(clock.clone()),
    );
    (g, clock)
}

#[test]
fn grant_commit_and_rollback_keep_books() {
    let (g, _) = governor(10 * MIB);
    let a = g.try_grant(D0, 4 * MIB).unwrap();
    assert_eq!(g.snapshot().device(D0).pending, 4 * MIB);
    assert_eq!(g.snapshot().device(D0).free(), 6 * MIB);
    a.commit();
    let s = g.snapshot().device(D0);
    assert_eq!((s.committed, s.pending, s.used()), (4 * MIB, 0, 4 * MIB));
    let b = g.try_grant(D0, 6 * MIB).unwrap();
    let err = bp(g.try_grant(D0, 1));
    assert_eq!((err.needed, err.available), (1, 0));
    b.rollback();
    {
        let _c = g.try_grant(D0, 6 * MIB).unwrap();
        assert_eq!(g.snapshot().device(D0).pending, 6 * MIB);
    }
    assert_eq!(g.snapshot().device(D0).pending, 0, "drop rolls back");
}

#[test]
fn partial_settle_and_give_back() {
    let (g, _) = governor(10 * MIB);
    let mut a = g.try_grant(D0, 8 * MIB).unwrap();
    a.settle(2 * MIB, Bucket::Committed).unwrap();
    a.settle(MIB, Bucket::Pooled).unwrap();
    a.give_back(MIB).unwrap();
    assert!(a.settle(5 * MIB, Bucket::Committed).is_err());
    assert_eq!(a.bytes(), 4 * MIB);
    drop(a);
    let s = g.snapshot().device(D0);
    assert_eq!((s.committed, s.pooled, s.pending), (2 * MIB, MIB, 0));
}

#[test]
fn transfer_free_and_underflow() {
    let (g, _) = governor(10 * MIB);
    g.try_grant(D0, 4 * MIB).unwrap().commit();
    g.transfer(D0, Bucket::Committed, Bucket::Pooled, MIB)
        .unwrap();
    g.transfer(D0, Bucket::Committed, Bucket::Quarantined, MIB)
        .unwrap();
    g.transfer(D0, Bucket::Committed, Bucket::Shared, MIB)
        .unwrap();
    let s = g.snapshot().device(D0);
    assert_eq!(
        (s.committed, s.pooled, s.shared, s.quarantined),
        (MIB, MIB, MIB, MIB)
    );
    assert_eq!(s.used(), 4 * MIB);
    let e = g
        .transfer(D0, Bucket::Pooled, Bucket::Committed, 2 * MIB)
        .unwrap_err();
    assert!(matches!(e, GovernorError::Underflow { .. }));
    assert_eq!(
        g.snapshot().device(D0),
        s,
        "a failed transfer changes nothing"
    );
    g.free(D0, Bucket::Pooled, MIB).unwrap();
    assert!(g.free(D0, Bucket::Pooled, 1).is_err());
    assert_eq!(g.snapshot().device(D0).used(), 3 * MIB);
}

#[test]
fn process_budget_spans_devices() {
    let g = Governor::new(
        GovernorConfig::default()
            .default_device_budget(8 * MIB)
            .process_budget(10 * MIB),
    );
    g.try_grant(D0, 6 * MIB).unwrap().commit();
    let e = bp(g.try_grant(D1, 6 * MIB));
    assert_eq!((e.device, e.needed, e.available), (D1, 6 * MIB, 4 * MIB));
    g.try_grant(D1, 4 * MIB).unwrap().commit();
    assert_eq!(g.snapshot().used(), 10 * MIB);
    assert_eq!(g.snapshot().process_free(), 0);
}

#[test]
fn unlimited_never_refuses() {
    let g = Governor::unlimited();
    g.try_grant(D0, u64::MAX / 2).unwrap().commit();
    g.try_grant(D0, u64::MAX / 2).unwrap().commit();
    assert_eq!(g.snapshot().device(D0).free(), u64::MAX);
}

#[test]
fn retry_estimate_is_clamped_rate() {
    let p = RetryPolicy {
        window: Duration::from_secs(1),
        floor: Duration::from_millis(10),
        cap: Duration::from_secs(5),
    };
    assert_eq!(p.estimate(0, 0), p.floor);
    assert_eq!(p.estimate(MIB, 0), p.cap);
    assert_eq!(p.estimate(50 * MIB, 100 * MIB), Duration::from_millis(500));
    assert_eq!(
        p.estimate(MIB, 1000 * MIB),
        Duration::from_millis(10),
        "floor"
    );
    assert_eq!(p.estimate(1000 * MIB, MIB), Duration::from_secs(5), "cap");
    assert_eq!(
        p.estimate(u64::MAX, 1),
        Duration::from_secs(5),
        "no overflow"
    );
}

#[test]
fn retry_after_follows_recent_release_rate() {
    let (g, clock) = governor(10 * MIB);
    g.try_grant(D0, 10 * MIB).unwrap().commit();
    // Nothing freed yet: the cap.
    let e = bp(g.try_grant(D0, 2 * MIB));
    assert_eq!(e.retry_after, RetryPolicy::default().cap);
    // 4 MiB freed within the window: 4 MiB/s. Asking 6 MiB with 4 MiB free: 2 MiB short,
    // so 500 ms.
    g.free(D0, Bucket::Committed, 4 * MIB).unwrap();
    clock.advance(Duration::from_millis(100));
    let e = bp(g.try_grant(D0, 6 * MIB));
    assert_eq!((e.needed, e.available), (6 * MIB, 4 * MIB));
    assert_eq!(e.retry_after, Duration::from_millis(500));
    // Once the window has passed, the free no longer counts.
    clock.advance(Duration::from_secs(2));
    let e = bp(g.try_grant(D0, 6 * MIB));
    assert_eq!(e.retry_after, RetryPolicy::default().cap);
}

struct Pool {
    g: Governor,
    held: AtomicU64,
    calls: AtomicU64,
}

impl Reclaimer for Pool {
    fn reclaim(&self, device: DeviceId, bytes: u64) -> u64 {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let n = bytes.min(self.held.load(Ordering::SeqCst));
        self.held.fetch_sub(n, Ordering::SeqCst);
        self.g.free(device, Bucket::Pooled, n).unwrap();
        n
    }
}

#[test]
fn evicts_before_refusing() {
    let (g, _) = governor(10 * MIB);
    g.try_grant(D0, 10 * MIB).unwrap().commit();
    g.transfer(D0, Bucket::Committed, Bucket::Pooled, 3 * MIB)
        .unwrap();
    let pool = Arc::new(Pool {
        g: g.clone(),
        held: AtomicU64::new(3 * MIB),
        calls: AtomicU64::new(0),
    });
    let weak: Weak<dyn Reclaimer> = Arc::downgrade(&(pool.clone() as Arc<dyn Reclaimer>));
    g.register_reclaimer(weak);
    let grant = g.try_grant(D0, 2 * MIB).unwrap();
    assert_eq!(pool.calls.load(Ordering::SeqCst), 1);
    assert_eq!(g.snapshot().device(D0).pooled, MIB);
    grant.commit();
    // Only 1 MiB left to reclaim: refused after trying.
    let e = bp(g.try_grant(D0, 2 * MIB));
    assert_eq!(e.available, MIB);
    assert_eq!(pool.calls.load(Ordering::SeqCst), 2);
    // The reclaimer is held weakly.
    drop(pool);
    assert!(g.try_grant(D0, 2 * MIB).is_err());
}

#[test]
fn free_events_are_bounded() {
    let (g, _) = governor(u64::MAX);
    g.try_grant(D0, 4 * MAX_FREE_EVENTS as u64)
        .unwrap()
        .commit();
    for _ in 0..(4 * MAX_FREE_EVENTS) {
        g.free(D0, Bucket::Committed, 1).unwrap();
    }
    let (now, window) = (g.config().clock.now(), g.config().retry.window);
    let books = lock(&g.inner.ledger.books);
    let d = books.devices.get(&D0).unwrap();
    assert!(d.frees.len() <= MAX_FREE_EVENTS);
    assert_eq!(d.frees.total(now, window), 4 * MAX_FREE_EVENTS as u64);
}

#[test]
fn a_request_over_a_limit_never_fits_and_reclaims_nothing() {
    struct Counting(AtomicU64);
    impl Reclaimer for Counting {
        fn reclaim(&self, _device: DeviceId, _bytes: u64) -> u64 {
            self.0.fetch_add(1, Ordering::Relaxed);
            0
        }
    }
    let (g, _) = governor(10 * MIB);
    let counting = Arc::new(Counting(AtomicU64::new(0)));
    let r: Arc<dyn Reclaimer> = counting.clone();
    g.register_reclaimer(Arc::downgrade(&r));
    let n = g.try_grant(D0, 11 * MIB).unwrap_err();
    assert_eq!(
        counting.0.load(Ordering::Relaxed),
        0,
        "never-fits reclaims nothing"
    );
    let n = n.never_fits().cloned().unwrap();
    assert_eq!(
        (n.limit, n.limit_bytes, n.needed),
        (Limit::DeviceBudget, 10 * MIB, 11 * MIB)
    );
    assert_eq!(g.check_fits(D0, 11 * MIB), Err(n));
    assert!(g.check_fits(D0, 10 * MIB).is_ok());
    // Quarantined bytes never come back: they lower the ceiling.
    g.try_grant(D0, 2 * MIB)
        .unwrap()
        .settle(2 * MIB, Bucket::Quarantined)
        .unwrap();
    let n = g.try_grant(D0, 9 * MIB).unwrap_err();
    assert_eq!(n.never_fits().map(|n| n.limit_bytes), Some(8 * MIB));
    // Committed bytes can be freed: a request under the ceiling is backpressure.
    g.try_grant(D0, 4 * MIB).unwrap().commit();
    let b = bp(g.try_grant(D0, 6 * MIB));
    assert_eq!((b.needed, b.available), (6 * MIB, 4 * MIB));
    assert_eq!(
        counting.0.load(Ordering::Relaxed),
        1,
        "backpressure asked the reclaimer"
    );
    drop(r);
    // Process budget.
    let p = Governor::new(GovernorConfig::default().process_budget(3 * MIB));
    let n = p.try_grant(D1, 4 * MIB).unwrap_err();
    assert_eq!(n.never_fits().map(|n| n.limit), Some(Limit::ProcessBudget));
    assert!(Governor::unlimited().check_fits(D0, u64::MAX).is_ok());
}

#[test]
fn a_request_over_several_devices_is_priced_against_the_process_budget_too() {
    let g = Governor::new(
        GovernorConfig::default()
            .default_device_budget(8 * MIB)
            .process_budget(10 * MIB),
    );
    assert!(g.check_fits_all(&[(D0, 5 * MIB), (D1, 5 * MIB)]).is_ok());
    let n = g
        .check_fits_all(&[(D0, 6 * MIB), (D1, 6 * MIB)])
        .unwrap_err();
    assert_eq!(
        (n.device, n.needed, n.limit, n.limit_bytes),
        (D0, 12 * MIB, Limit::ProcessBudget, 10 * MIB)
    );
    let n = g.check_fits_all(&[(D0, MIB), (D1, 9 * MIB)]).unwrap_err();
    assert_eq!((n.device, n.limit), (D1, Limit::DeviceBudget));
    assert!(g.same_books(&g.clone()));
    assert!(!g.same_books(&Governor::unlimited()));
}

/// A reclaimer that reports what it holds but frees only part of it when asked.
struct Stingy {
    held: u64,
}

impl Reclaimer for Stingy {
    fn reclaim(&self, _device: DeviceId, _bytes: u64) -> u64 {
        0
    }

    fn reclaimable(&self, device: DeviceId) -> u64 {
        if device == D0 {
            self.held
        } else {
            0
        }
    }
}

#[test]
fn available_bytes_are_free_plus_reclaimable_and_a_refusal_reports_them() {
    let (g, _) = governor(10 * MIB);
    g.try_grant(D0, 6 * MIB).unwrap().commit();
    assert_eq!(g.available_bytes(D0), 4 * MIB);
    g.transfer(D0, Bucket::Committed, Bucket::Pooled, 2 * MIB)
        .unwrap();
    // Pooled bytes are used until someone reclaims them: a reclaimer says how many it holds.
    assert_eq!(g.available_bytes(D0), 4 * MIB);
    let pool: Arc<dyn Reclaimer> = Arc::new(Stingy { held: 2 * MIB });
    g.register_reclaimer(Arc::downgrade(&pool));
    assert_eq!(g.available_bytes(D0), 6 * MIB);
    assert_eq!(
        g.available_bytes(D1),
        10 * MIB,
        "another device: its own budget, no reclaimable"
    );
    // A refusal reports what is free once the reclaimers gave back what they could: this
    // one gives back nothing.
    let e = bp(g.try_grant(D0, 7 * MIB));
    assert_eq!((e.needed, e.available), (7 * MIB, 4 * MIB));
    assert_eq!(Governor::unlimited().available_bytes(D0), u64::MAX);
}

#[test]
fn dropped_reclaimers_are_forgotten_when_another_registers() {
    let (g, _) = governor(10 * MIB);
    let live: Arc<dyn Reclaimer> = Arc::new(Pool {
        g: g.clone(),
        held: AtomicU64::new(0),
        calls: AtomicU64::new(0),
    });
    for _ in 0..8 {
        let gone: Arc<dyn Reclaimer> = Arc::new(Pool {
            g: g.clone(),
            held: AtomicU64::new(0),
            calls: AtomicU64::new(0),
        });
        g.register_reclaimer(Arc::downgrade(&gone));
    }
    g.register_reclaimer(Arc::downgrade(&live));
    assert_eq!(
        lock(&g.inner.reclaimers).len(),
        1,
        "only the live one is kept"
    );
}

/// A reclaimer that says nothing of what it holds (the trait's default).
struct Silent;

impl Reclaimer for Silent {
    fn reclaim(&self, _device: DeviceId, _bytes: u64) -> u64 {
        0
    }
}

#[test]
fn a_reclaimer_that_counts_nothing_ahead_adds_nothing_to_available_bytes() {
    let (g, _) = governor(10 * MIB);
    let r: Arc<dyn Reclaimer> = Arc::new(Silent);
    g.register_reclaimer(Arc::downgrade(&r));
    assert_eq!(r.reclaimable(D0), 0);
    assert_eq!(g.available_bytes(D0), 10 * MIB);
}
