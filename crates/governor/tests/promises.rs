//! What the governor promises its callers, asserted through its public API: a settled grant
//! moves exactly its bytes, a refused one says why, every snapshot field equals the books,
//! releases and frees are seen by the retry estimates, and reclaimers are asked in turn.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kvvm_governor::{
    Backpressure, Bucket, DeviceSnapshot, Governor, GovernorConfig, GovernorError,
    GovernorSnapshot, Limit, ManualClock, MappedGrowthGrant, NeverFits, Reclaimer, Refusal,
    RetryPolicy,
};
use kvvm_hal::DeviceId;

const D0: DeviceId = DeviceId(0);
const D1: DeviceId = DeviceId(1);
const D2: DeviceId = DeviceId(2);
const MIB: u64 = 1 << 20;

fn governor(config: GovernorConfig) -> (Governor, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new());
    (Governor::new(config.clock(clock.clone())), clock)
}

fn budget(bytes: u64) -> (Governor, Arc<ManualClock>) {
    governor(GovernorConfig::default().default_device_budget(bytes))
}

fn backpressure(r: Result<MappedGrowthGrant, Refusal>) -> Backpressure {
    match r {
        Err(Refusal::Backpressure(b)) => b,
        other => panic!("expected backpressure, got {other:?}"),
    }
}

fn never_fits(r: Result<MappedGrowthGrant, Refusal>) -> NeverFits {
    match r {
        Err(Refusal::NeverFits(n)) => n,
        other => panic!("expected never-fits, got {other:?}"),
    }
}

/// Puts `committed, pooled, shared, quarantined` bytes on `device` through grants and
/// transfers, and leaves `pending` bytes granted (the grant is returned).
fn fill(
    g: &Governor,
    device: DeviceId,
    [committed, pooled, shared, quarantined, pending]: [u64; 5],
) -> MappedGrowthGrant {
    let mut grant = g
        .try_grant(device, committed + pooled + shared + quarantined)
        .unwrap();
    grant.settle(pooled, Bucket::Pooled).unwrap();
    grant.settle(shared, Bucket::Shared).unwrap();
    grant.settle(quarantined, Bucket::Quarantined).unwrap();
    grant.commit();
    g.try_grant(device, pending).unwrap()
}

#[test]
fn a_rolled_back_grant_returns_every_byte_to_the_budget() {
    let (g, _) = budget(10 * MIB);
    let grant = g.try_grant(D0, 6 * MIB).unwrap();
    assert_eq!(g.snapshot().device(D0).free(), 4 * MIB);
    grant.rollback();
    let s = g.snapshot().device(D0);
    assert_eq!((s.pending, s.used(), s.free()), (0, 0, 10 * MIB));
    // The whole budget can be granted again.
    g.try_grant(D0, 10 * MIB).unwrap().commit();
    assert_eq!(g.snapshot().device(D0).committed, 10 * MIB);
}

#[test]
fn a_partly_settled_grant_rolls_back_only_what_it_still_holds() {
    let (g, _) = budget(10 * MIB);
    let mut grant = g.try_grant(D0, 6 * MIB).unwrap();
    grant.settle(2 * MIB, Bucket::Committed).unwrap();
    grant.give_back(MIB).unwrap();
    assert_eq!(grant.bytes(), 3 * MIB);
    assert_eq!(g.snapshot().device(D0).pending, 3 * MIB);
    grant.rollback();
    let s = g.snapshot().device(D0);
    assert_eq!((s.committed, s.pending, s.free()), (2 * MIB, 0, 8 * MIB));
}

#[test]
fn a_committed_grant_is_committed_and_no_longer_pending() {
    let (g, _) = budget(10 * MIB);
    let grant = g.try_grant(D1, 3 * MIB).unwrap();
    assert_eq!((grant.device(), grant.bytes()), (D1, 3 * MIB));
    assert!(grant.is_from(&g));
    assert!(grant.is_from(&g.clone()));
    assert!(!grant.is_from(&Governor::unlimited()));
    grant.commit();
    let s = g.snapshot().device(D1);
    assert_eq!((s.committed, s.pending, s.free()), (3 * MIB, 0, 7 * MIB));
}

#[test]
fn settling_or_giving_back_more_than_a_grant_holds_fails_and_changes_nothing() {
    let (g, _) = budget(10 * MIB);
    let mut grant = g.try_grant(D0, 2 * MIB).unwrap();
    let before = g.snapshot();
    let e = grant.settle(3 * MIB, Bucket::Committed).unwrap_err();
    assert_eq!(
        e,
        GovernorError::Underflow {
            device: D0,
            bucket: "grant",
            bytes: 3 * MIB,
            held: 2 * MIB
        }
    );
    let e = grant.give_back(3 * MIB).unwrap_err();
    assert!(matches!(e, GovernorError::Underflow { held, .. } if held == 2 * MIB));
    assert_eq!(grant.bytes(), 2 * MIB);
    assert_eq!(g.snapshot(), before);
    grant.give_back(2 * MIB).unwrap();
    assert_eq!(grant.bytes(), 0);
    assert_eq!(g.snapshot().device(D0).pending, 0);
}

#[test]
fn a_settled_grant_puts_its_bytes_in_the_bucket_named() {
    for bucket in [
        Bucket::Committed,
        Bucket::Pooled,
        Bucket::Shared,
        Bucket::Quarantined,
    ] {
        let (g, _) = budget(10 * MIB);
        let mut grant = g.try_grant(D0, 4 * MIB).unwrap();
        grant.settle(3 * MIB, bucket).unwrap();
        drop(grant);
        let s = g.snapshot().device(D0);
        let got = [s.committed, s.pooled, s.shared, s.quarantined];
        let want: Vec<u64> = [
            Bucket::Committed,
            Bucket::Pooled,
            Bucket::Shared,
            Bucket::Quarantined,
        ]
        .iter()
        .map(|b| if *b == bucket { 3 * MIB } else { 0 })
        .collect();
        assert_eq!(got.to_vec(), want, "{bucket}");
        assert_eq!(s.pending, 0);
    }
}

#[test]
fn every_snapshot_field_equals_the_books() {
    let (g, _) = governor(
        GovernorConfig::default()
            .device_budget(D0, 100 * MIB)
            .device_budget(D1, 200 * MIB)
            .process_budget(1000 * MIB),
    );
    let _p0 = fill(&g, D0, [11 * MIB, 7 * MIB, 5 * MIB, 3 * MIB, 2 * MIB]);
    let _p1 = fill(&g, D1, [13 * MIB, 17 * MIB, 19 * MIB, 23 * MIB, 29 * MIB]);
    let snap = g.snapshot();
    let d0 = snap.device(D0);
    assert_eq!(
        d0,
        DeviceSnapshot {
            device: D0,
            budget: Some(100 * MIB),
            committed: 11 * MIB,
            pooled: 7 * MIB,
            shared: 5 * MIB,
            quarantined: 3 * MIB,
            pending: 2 * MIB,
        }
    );
    assert_eq!(
        (
            d0.committed(),
            d0.pooled(),
            d0.shared(),
            d0.quarantined(),
            d0.pending()
        ),
        (11 * MIB, 7 * MIB, 5 * MIB, 3 * MIB, 2 * MIB)
    );
    assert_eq!(d0.used(), 26 * MIB);
    assert_eq!(d0.free(), 100 * MIB - 26 * MIB - 2 * MIB);
    let d1 = snap.device(D1);
    assert_eq!(d1.budget, Some(200 * MIB));
    assert_eq!(d1.used(), 72 * MIB);
    assert_eq!(d1.free(), 200 * MIB - 72 * MIB - 29 * MIB);
    // The governor's sums over every device.
    assert_eq!(snap.committed(), 24 * MIB);
    assert_eq!(snap.pooled(), 24 * MIB);
    assert_eq!(snap.shared(), 24 * MIB);
    assert_eq!(snap.quarantined(), 26 * MIB);
    assert_eq!(snap.pending(), 31 * MIB);
    assert_eq!(snap.used(), 98 * MIB);
    assert_eq!(snap.process_budget, Some(1000 * MIB));
    assert_eq!(snap.process_free(), 1000 * MIB - 98 * MIB - 31 * MIB);
    assert_eq!(snap.devices.len(), 2);
    // A device never seen reads as zero, with its id.
    assert_eq!(
        snap.device(D2),
        DeviceSnapshot {
            device: D2,
            ..DeviceSnapshot::default()
        }
    );
}

#[test]
fn an_unlimited_snapshot_has_everything_free() {
    let g = Governor::unlimited();
    let _p = fill(&g, D0, [MIB, MIB, MIB, MIB, MIB]);
    let snap = g.snapshot();
    assert_eq!(snap.device(D0).budget, None);
    assert_eq!(snap.device(D0).free(), u64::MAX);
    assert_eq!(snap.process_free(), u64::MAX);
    let empty = GovernorSnapshot::default();
    assert_eq!((empty.used(), empty.pending()), (0, 0));
}

#[test]
fn budgets_per_device_override_the_default_and_the_builders_set_them() {
    let policy = RetryPolicy {
        window: Duration::from_secs(2),
        floor: Duration::from_millis(20),
        cap: Duration::from_secs(7),
    };
    let g = Governor::new(
        GovernorConfig::unlimited()
            .default_device_budget(8 * MIB)
            .device_budget(D1, 3 * MIB)
            .process_budget(9 * MIB)
            .retry_policy(policy),
    );
    assert_eq!(g.device_budget(D0), Some(8 * MIB));
    assert_eq!(g.device_budget(D1), Some(3 * MIB));
    assert_eq!(g.config().process_budget, Some(9 * MIB));
    assert_eq!(g.config().retry, policy);
    assert_eq!(g.config().default_device_budget, Some(8 * MIB));
    assert!(format!("{g:?}").contains("Governor"));
    let w = Governor::with_device_budget(5 * MIB);
    assert_eq!(
        (w.device_budget(D2), w.config().process_budget),
        (Some(5 * MIB), None)
    );
    let u = Governor::unlimited();
    assert_eq!(
        (u.device_budget(D0), u.config().process_budget),
        (None, None)
    );
    assert_eq!(Governor::default().device_budget(D0), None);
    assert_eq!(GovernorConfig::default().retry, RetryPolicy::default());
    assert_eq!(
        RetryPolicy::default(),
        RetryPolicy {
            window: Duration::from_secs(1),
            floor: Duration::from_millis(10),
            cap: Duration::from_secs(5),
        }
    );
}

#[test]
fn exactly_what_is_available_is_granted_one_byte_more_is_backpressure() {
    let (g, _) = budget(10 * MIB);
    g.try_grant(D0, 4 * MIB).unwrap().commit();
    let b = backpressure(g.try_grant(D0, 6 * MIB + 1));
    assert_eq!(
        (b.device, b.needed, b.available),
        (D0, 6 * MIB + 1, 6 * MIB)
    );
    g.try_grant(D0, 6 * MIB).unwrap().commit();
    assert_eq!(g.snapshot().device(D0).free(), 0);
    // Pending bytes are not available either.
    let (g, _) = budget(10 * MIB);
    let _held = g.try_grant(D0, 4 * MIB).unwrap();
    assert_eq!(backpressure(g.try_grant(D0, 7 * MIB)).available, 6 * MIB);
}

#[test]
fn the_process_budget_counts_every_device_used_and_pending() {
    let (g, _) = governor(
        GovernorConfig::default()
            .default_device_budget(8 * MIB)
            .process_budget(10 * MIB),
    );
    let _p = fill(&g, D0, [MIB, MIB, MIB, MIB, 2 * MIB]);
    // 6 MiB on D0: 4 left under the process budget, 8 under D1's own.
    let b = backpressure(g.try_grant(D1, 5 * MIB));
    assert_eq!(b.available, 4 * MIB);
    g.try_grant(D1, 4 * MIB).unwrap().commit();
    assert_eq!(g.snapshot().process_free(), 0);
}

#[test]
fn never_fits_is_decided_at_the_limit_exactly() {
    let (g, _) = governor(
        GovernorConfig::default()
            .default_device_budget(8 * MIB)
            .process_budget(10 * MIB),
    );
    // A device's budget: equal fits, one byte more never does.
    assert_eq!(g.check_fits(D0, 8 * MIB), Ok(()));
    let n = g.check_fits(D0, 8 * MIB + 1).unwrap_err();
    assert_eq!(
        (n.device, n.needed, n.limit, n.limit_bytes),
        (D0, 8 * MIB + 1, Limit::DeviceBudget, 8 * MIB)
    );
    // The process budget over several devices: the same boundary.
    assert_eq!(g.check_fits_all(&[(D0, 5 * MIB), (D1, 5 * MIB)]), Ok(()));
    let n = g
        .check_fits_all(&[(D0, 5 * MIB), (D1, 5 * MIB + 1)])
        .unwrap_err();
    assert_eq!(
        (n.device, n.needed, n.limit, n.limit_bytes),
        (D0, 10 * MIB + 1, Limit::ProcessBudget, 10 * MIB)
    );
    assert_eq!(g.check_fits_all(&[]), Ok(()));
    // try_grant decides the same way, and never-fits is no backpressure.
    let r = g.try_grant(D0, 8 * MIB + 1).unwrap_err();
    assert!(r.backpressure().is_none());
    assert_eq!(r.needed(), 8 * MIB + 1);
    assert_eq!(r.never_fits().map(|n| n.limit), Some(Limit::DeviceBudget));
    g.try_grant(D0, 8 * MIB).unwrap().rollback();
}

#[test]
fn quarantine_lowers_the_process_ceiling_on_every_device() {
    let (g, _) = governor(GovernorConfig::default().process_budget(10 * MIB));
    let _p = fill(&g, D0, [0, 0, 0, 3 * MIB, 0]);
    assert_eq!(g.check_fits(D1, 7 * MIB), Ok(()));
    let n = never_fits(g.try_grant(D1, 7 * MIB + 1));
    assert_eq!(
        (n.device, n.limit, n.limit_bytes),
        (D1, Limit::ProcessBudget, 7 * MIB)
    );
}

#[test]
fn a_refusal_says_whether_retrying_can_help() {
    let (g, _) = budget(10 * MIB);
    g.try_grant(D0, 10 * MIB).unwrap().commit();
    let r = g.try_grant(D0, 3 * MIB).unwrap_err();
    let b = r.backpressure().cloned().unwrap();
    assert_eq!((b.needed, b.available), (3 * MIB, 0));
    assert!(r.never_fits().is_none());
    assert_eq!(r.needed(), 3 * MIB);
    assert_eq!(r, Refusal::Backpressure(b.clone()));
    assert!(r.to_string().contains("backpressure"), "{r}");
    let n = g.try_grant(D0, 11 * MIB).unwrap_err();
    assert!(n.to_string().contains("device budget"), "{n}");
}

#[test]
fn limits_and_buckets_have_stable_names() {
    let names: Vec<(&str, String)> = [
        Limit::DeviceBudget,
        Limit::ProcessBudget,
        Limit::DeviceMemory,
    ]
    .iter()
    .map(|l| (l.as_str(), l.to_string()))
    .collect();
    assert_eq!(
        names,
        vec![
            ("device_budget", "device budget".to_owned()),
            ("process_budget", "process budget".to_owned()),
            ("device_memory", "device memory".to_owned()),
        ]
    );
    let buckets: Vec<(&str, String)> = [
        Bucket::Committed,
        Bucket::Pooled,
        Bucket::Shared,
        Bucket::Quarantined,
    ]
    .iter()
    .map(|b| (b.as_str(), b.to_string()))
    .collect();
    assert_eq!(
        buckets,
        vec![
            ("committed", "committed".to_owned()),
            ("pooled", "pooled".to_owned()),
            ("shared", "shared".to_owned()),
            ("quarantined", "quarantined".to_owned()),
        ]
    );
}

#[test]
fn a_transfer_moves_exactly_its_bytes_between_the_buckets_named() {
    let (g, _) = budget(100 * MIB);
    let _p = fill(&g, D0, [40 * MIB, 0, 0, 0, 0]);
    g.transfer(D0, Bucket::Committed, Bucket::Pooled, 8 * MIB)
        .unwrap();
    g.transfer(D0, Bucket::Pooled, Bucket::Shared, 3 * MIB)
        .unwrap();
    g.transfer(D0, Bucket::Shared, Bucket::Quarantined, MIB)
        .unwrap();
    g.transfer(D0, Bucket::Quarantined, Bucket::Committed, MIB)
        .unwrap();
    let s = g.snapshot().device(D0);
    assert_eq!(
        (s.committed, s.pooled, s.shared, s.quarantined),
        (33 * MIB, 5 * MIB, 2 * MIB, 0)
    );
}

#[test]
fn a_transfer_of_nothing_or_to_the_same_bucket_changes_nothing_and_never_fails() {
    let (g, _) = budget(100 * MIB);
    let _p = fill(&g, D0, [4 * MIB, 0, 0, 0, 0]);
    let before = g.snapshot();
    // Zero bytes out of an empty bucket: nothing to take, no error.
    g.transfer(D0, Bucket::Pooled, Bucket::Committed, 0)
        .unwrap();
    // A bucket to itself: nothing moves, even for more than it holds.
    g.transfer(D0, Bucket::Committed, Bucket::Committed, 8 * MIB)
        .unwrap();
    g.transfer(D0, Bucket::Committed, Bucket::Committed, 2 * MIB)
        .unwrap();
    assert_eq!(g.snapshot(), before);
    // A real transfer of more than the bucket holds fails and changes nothing.
    let e = g
        .transfer(D0, Bucket::Committed, Bucket::Pooled, 5 * MIB)
        .unwrap_err();
    assert_eq!(
        e,
        GovernorError::Underflow {
            device: D0,
            bucket: "committed",
            bytes: 5 * MIB,
            held: 4 * MIB
        }
    );
    assert_eq!(g.snapshot(), before);
}

#[test]
fn a_transfer_that_would_overflow_the_target_fails_and_changes_nothing() {
    let g = Governor::unlimited();
    g.try_grant(D0, u64::MAX).unwrap().commit();
    g.try_grant(D0, 1)
        .unwrap()
        .settle(1, Bucket::Pooled)
        .unwrap();
    let before = g.snapshot();
    let e = g
        .transfer(D0, Bucket::Pooled, Bucket::Committed, 1)
        .unwrap_err();
    assert_eq!(e, GovernorError::Overflow { device: D0 });
    assert_eq!(g.snapshot(), before, "the take is undone");
    assert_eq!(before.device(D0).pooled, 1);
}

#[test]
fn a_free_leaves_the_books_and_an_underflow_is_refused() {
    let (g, _) = budget(100 * MIB);
    let _p = fill(&g, D0, [10 * MIB, 6 * MIB, 0, 0, 0]);
    g.free(D0, Bucket::Pooled, 4 * MIB).unwrap();
    g.free(D0, Bucket::Pooled, 0).unwrap();
    let s = g.snapshot().device(D0);
    assert_eq!(
        (s.committed, s.pooled, s.used()),
        (10 * MIB, 2 * MIB, 12 * MIB)
    );
    let e = g.free(D0, Bucket::Pooled, 3 * MIB).unwrap_err();
    assert_eq!(
        e,
        GovernorError::Underflow {
            device: D0,
            bucket: "pooled",
            bytes: 3 * MIB,
            held: 2 * MIB
        }
    );
    assert_eq!(g.snapshot().device(D0), s);
    assert!(e.to_string().contains("underflow"), "{e}");
}

#[test]
fn a_free_is_seen_by_the_retry_estimate_until_the_window_has_passed() {
    let (g, clock) = budget(10 * MIB);
    g.try_grant(D0, 10 * MIB).unwrap().commit();
    assert_eq!(
        g.estimate_retry_after(D0, MIB),
        RetryPolicy::default().cap,
        "nothing freed: the cap"
    );
    g.free(D0, Bucket::Committed, 4 * MIB).unwrap();
    g.free(D0, Bucket::Committed, 0).unwrap();
    // 4 MiB in the 1 s window: 1 MiB short is 250 ms.
    assert_eq!(g.estimate_retry_after(D0, MIB), Duration::from_millis(250));
    // Another device's frees are not this device's rate.
    assert_eq!(g.estimate_retry_after(D1, MIB), RetryPolicy::default().cap);
    // Exactly the window later the free still counts; past it, it does not.
    clock.advance(Duration::from_secs(1));
    assert_eq!(g.estimate_retry_after(D0, MIB), Duration::from_millis(250));
    clock.advance(Duration::from_nanos(1));
    assert_eq!(g.estimate_retry_after(D0, MIB), RetryPolicy::default().cap);
    assert_eq!(
        g.estimate_retry_after(D0, 0),
        RetryPolicy::default().floor,
        "no shortfall: the floor"
    );
}

#[test]
fn a_release_is_seen_by_the_released_estimate_until_the_window_has_passed() {
    let (g, clock) = budget(10 * MIB);
    let cap = RetryPolicy::default().cap;
    assert_eq!(g.estimate_retry_after_released(D0, MIB), cap);
    g.note_released(D0, 2 * MIB);
    clock.advance(Duration::from_millis(500));
    g.note_released(D0, 2 * MIB);
    // 4 MiB released in the window: 1 MiB short is 250 ms.
    assert_eq!(
        g.estimate_retry_after_released(D0, MIB),
        Duration::from_millis(250)
    );
    // Releases are not frees: the driver-side estimate does not see them.
    assert_eq!(g.estimate_retry_after(D0, MIB), cap);
    assert_eq!(g.estimate_retry_after_released(D1, MIB), cap);
    // The first release is exactly one window old: it still counts.
    clock.advance(Duration::from_millis(500));
    assert_eq!(
        g.estimate_retry_after_released(D0, MIB),
        Duration::from_millis(250)
    );
    // Past it, only the second counts: 2 MiB/s, 1 MiB short is 500 ms.
    clock.advance(Duration::from_nanos(1));
    assert_eq!(
        g.estimate_retry_after_released(D0, MIB),
        Duration::from_millis(500)
    );
    clock.advance(Duration::from_secs(1));
    assert_eq!(g.estimate_retry_after_released(D0, MIB), cap);
}

#[test]
fn the_retry_estimate_is_the_shortfall_over_the_rate_between_floor_and_cap() {
    let p = RetryPolicy {
        window: Duration::from_secs(2),
        floor: Duration::from_millis(10),
        cap: Duration::from_secs(5),
    };
    // 8 MiB in 2 s is 4 MiB/s: 2 MiB short is 500 ms.
    assert_eq!(p.estimate(2 * MIB, 8 * MIB), Duration::from_millis(500));
    assert_eq!(p.estimate(0, 8 * MIB), p.floor);
    assert_eq!(p.estimate(1, 0), p.cap);
    assert_eq!(p.estimate(1, 8 * MIB), p.floor);
    assert_eq!(p.estimate(100 * MIB, MIB), p.cap);
    // A cap under the floor is raised to it.
    let inverted = RetryPolicy {
        cap: Duration::from_millis(1),
        ..p
    };
    assert_eq!(inverted.estimate(1, 0), p.floor);
}

#[test]
fn a_backpressure_carries_the_estimate_of_the_remaining_shortfall() {
    let (g, _) = budget(10 * MIB);
    g.try_grant(D0, 10 * MIB).unwrap().commit();
    g.free(D0, Bucket::Committed, 2 * MIB).unwrap();
    // 2 MiB free, 3 MiB asked: 1 MiB short at 2 MiB/s.
    let b = backpressure(g.try_grant(D0, 3 * MIB));
    assert_eq!(b.retry_after, Duration::from_millis(500));
    assert!(b.to_string().contains("3145728 bytes needed"), "{b}");
}

/// A reclaimer that frees up to `holds` pooled bytes and records what it was asked.
struct Pool {
    g: Governor,
    holds: AtomicU64,
    asked: Mutex<Vec<(DeviceId, u64)>>,
}

impl Pool {
    fn new(g: &Governor, holds: u64) -> Arc<Pool> {
        Arc::new(Pool {
            g: g.clone(),
            holds: AtomicU64::new(holds),
            asked: Mutex::new(Vec::new()),
        })
    }

    fn asked(&self) -> Vec<(DeviceId, u64)> {
        self.asked.lock().unwrap().clone()
    }
}

impl Reclaimer for Pool {
    fn reclaim(&self, device: DeviceId, bytes: u64) -> u64 {
        self.asked.lock().unwrap().push((device, bytes));
        let n = bytes.min(self.holds.load(Ordering::SeqCst));
        self.holds.fetch_sub(n, Ordering::SeqCst);
        self.g.free(device, Bucket::Pooled, n).unwrap();
        n
    }
}

fn register(g: &Governor, p: &Arc<Pool>) {
    let r: Arc<dyn Reclaimer> = p.clone();
    let w: Weak<dyn Reclaimer> = Arc::downgrade(&r);
    g.register_reclaimer(w);
}

#[test]
fn reclaimers_are_asked_in_turn_for_what_is_still_short() {
    let (g, _) = budget(10 * MIB);
    let _p = fill(&g, D0, [4 * MIB, 6 * MIB, 0, 0, 0]);
    let first = Pool::new(&g, 2 * MIB);
    let second = Pool::new(&g, 4 * MIB);
    let third = Pool::new(&g, 0);
    register(&g, &first);
    register(&g, &second);
    register(&g, &third);
    // 5 MiB short: the first frees 2, the second is asked for the 3 left and frees them;
    // the third is not asked.
    g.try_grant(D0, 5 * MIB).unwrap().commit();
    assert_eq!(first.asked(), vec![(D0, 5 * MIB)]);
    assert_eq!(second.asked(), vec![(D0, 3 * MIB)]);
    assert_eq!(third.asked(), vec![]);
    let s = g.snapshot().device(D0);
    assert_eq!((s.committed, s.pooled), (9 * MIB, MIB));
}

#[test]
fn a_reclaimer_stays_registered_while_its_owner_lives() {
    let (g, _) = budget(10 * MIB);
    let _p = fill(&g, D0, [0, 10 * MIB, 0, 0, 0]);
    let live = Pool::new(&g, 10 * MIB);
    register(&g, &live);
    // Registering others, alive or already dropped, forgets none that lives.
    for _ in 0..3 {
        let gone = Pool::new(&g, 0);
        register(&g, &gone);
    }
    let other = Pool::new(&g, 0);
    register(&g, &other);
    g.try_grant(D0, 3 * MIB).unwrap().commit();
    assert_eq!(live.asked(), vec![(D0, 3 * MIB)]);
    assert_eq!(other.asked(), vec![]);
    // Once the owner is gone, it is not asked (the grant is refused).
    drop(live);
    let b = backpressure(g.try_grant(D0, 8 * MIB));
    assert_eq!(b.available, 0);
    assert_eq!(other.asked(), vec![(D0, 8 * MIB)]);
}

#[test]
fn a_grant_and_a_governor_describe_themselves() {
    let (g, _) = budget(10 * MIB);
    let grant = g.try_grant(D1, 2 * MIB).unwrap();
    let s = format!("{grant:?}");
    assert!(
        s.contains("MappedGrowthGrant") && s.contains("2097152"),
        "{s}"
    );
    let s = format!("{g:?}");
    assert!(s.contains("pending: 2097152"), "{s}");
}
