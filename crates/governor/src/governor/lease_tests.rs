#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvvm_hal::DeviceId;

use super::*;
use crate::bucket::Bucket;
use crate::error::{Backpressure, Limit, NeverFits};

const D: DeviceId = DeviceId(0);

/// A source with `free` bytes to lease out that records every call.
#[derive(Default)]
struct Fake {
    free: Mutex<u64>,
    calls: Mutex<Vec<String>>,
}

impl LeaseSource for Fake {
    fn acquire(&self, device: DeviceId, need: u64, want: u64) -> Result<u64, Refusal> {
        self.calls
            .lock()
            .unwrap()
            .push(format!("acquire {need} {want}"));
        let mut free = self.free.lock().unwrap();
        if need > 1000 {
            return Err(NeverFits {
                device,
                needed: need,
                limit: Limit::DeviceBudget,
                limit_bytes: 1000,
            }
            .into());
        }
        if need > *free {
            return Err(Backpressure {
                device,
                needed: need,
                available: *free,
                retry_after: Duration::from_secs(3),
            }
            .into());
        }
        let g = want.min(*free);
        *free -= g;
        Ok(g)
    }

    fn give_back(&self, _device: DeviceId, bytes: u64) {
        self.calls
            .lock()
            .unwrap()
            .push(format!("give_back {bytes}"));
        *self.free.lock().unwrap() += bytes;
    }
}

fn leased(free: u64, batch: u64) -> (Governor, Arc<Fake>) {
    let fake = Arc::new(Fake::default());
    *fake.free.lock().unwrap() = free;
    let src: Arc<dyn LeaseSource> = fake.clone();
    let g = Governor::with_lease(
        GovernorConfig::default(),
        src,
        LeasePolicy::batches_of(batch),
    );
    (g, fake)
}

#[test]
fn grants_within_the_lease_stay_local() {
    let (g, fake) = leased(1000, 100);
    g.try_grant(D, 30).unwrap().commit();
    g.try_grant(D, 30).unwrap().commit();
    g.try_grant(D, 40).unwrap().commit();
    assert_eq!(
        *fake.calls.lock().unwrap(),
        vec!["acquire 30 100"],
        "one batch serves three grants"
    );
    assert_eq!(g.lease_held(D), Some(100));
    g.try_grant(D, 150).unwrap().commit();
    assert_eq!(g.lease_held(D), Some(250));
}

#[test]
fn frees_trim_the_lease_down_to_keep() {
    let (g, fake) = leased(1000, 100);
    g.try_grant(D, 500).unwrap().commit();
    g.free(D, Bucket::Committed, 450).unwrap();
    assert_eq!(g.lease_held(D), Some(250), "50 used + 200 kept");
    assert_eq!(*fake.free.lock().unwrap(), 750);
    assert_eq!(g.lease_holdings(), vec![(D, 250)]);
}

#[test]
fn a_free_that_leaves_no_more_than_keep_unused_gives_nothing_back() {
    let (g, fake) = leased(1000, 100);
    g.try_grant(D, 30).unwrap().commit();
    g.free(D, Bucket::Committed, 10).unwrap();
    assert_eq!(g.lease_held(D), Some(100), "80 unused, under the 200 kept");
    assert_eq!(
        *fake.calls.lock().unwrap(),
        vec!["acquire 30 100"],
        "no give-back of 0 bytes"
    );
}

#[test]
fn refusals_keep_the_sources_kind_and_retry_after() {
    let (g, _) = leased(10, 100);
    let r = g.try_grant(D, 20).unwrap_err();
    let b = r.backpressure().expect("backpressure");
    assert_eq!(b.retry_after, Duration::from_secs(3));
    let r = g.try_grant(D, 2000).unwrap_err();
    assert!(r.never_fits().is_some());
    assert_eq!(g.lease_held(D), Some(0), "nothing leased on refusals");
}

#[test]
fn give_back_unused_returns_only_what_is_not_used() {
    let (g, fake) = leased(1000, 100);
    g.try_grant(D, 60).unwrap().commit();
    let pending = g.try_grant(D, 10).unwrap();
    assert_eq!(
        g.give_back_unused(D, 500),
        30,
        "100 held, 60 used, 10 pending"
    );
    assert_eq!(g.lease_held(D), Some(70));
    assert_eq!(*fake.free.lock().unwrap(), 900, "the caller hands it back");
    pending.rollback();
    let weak = g.downgrade();
    assert!(weak.upgrade().is_some());
    drop(g);
    assert!(weak.upgrade().is_none());
}

#[test]
fn lease_stats_count_local_grants_and_round_trips() {
    let (g, _fake) = leased(150, 100);
    assert_eq!(g.lease_stats().unwrap().hit_rate(), None);
    for _ in 0..4 {
        g.try_grant(D, 25).unwrap().commit();
    }
    // 4 grants of 25 in a batch of 100: one top-up, three local.
    let s = g.lease_stats().unwrap();
    assert_eq!(
        (s.grants, s.local_grants, s.top_ups, s.top_up_refusals),
        (4, 3, 1, 0)
    );
    assert_eq!(s.hit_rate(), Some(0.75));
    assert!(s.mean_top_up().unwrap() <= s.top_up_max && s.top_up_max <= s.top_up_time);
    // Past the source's 150: the second top-up is refused.
    assert!(g.try_grant(D, 60).is_err());
    let s = g.lease_stats().unwrap();
    assert_eq!(
        (s.grants, s.local_grants, s.top_ups, s.top_up_refusals),
        (5, 3, 2, 1)
    );
    assert_eq!(Governor::unlimited().lease_stats(), None);
}

#[test]
fn a_lease_short_of_the_books_after_a_hand_over_tops_up_the_difference_too() {
    let (g, fake) = leased(1000, 100);
    g.try_grant(D, 100).unwrap().commit();
    // 60 of the 100 used now belong to a published prefix: used 100, leased 40.
    assert!(g.hand_over_lease(D, 60));
    assert_eq!(g.lease_held(D), Some(40));
    // A grant of 30 needs the 60 the lease is short by and its own 30.
    g.try_grant(D, 30).unwrap().commit();
    assert_eq!(fake.calls.lock().unwrap().last().unwrap(), "acquire 90 100");
    assert_eq!(g.lease_held(D), Some(140));
}

#[test]
fn lease_stats_average_and_bound_their_top_ups() {
    let mut s = LeaseStats::default();
    assert_eq!((s.mean_top_up(), s.hit_rate()), (None, None));
    s.note_top_up(Duration::from_millis(10), false);
    s.note_top_up(Duration::from_millis(30), true);
    assert_eq!(s.mean_top_up(), Some(Duration::from_millis(20)));
    assert_eq!(s.top_up_max, Duration::from_millis(30));
    assert_eq!(s.top_up_time, Duration::from_millis(40));
    assert_eq!((s.top_ups, s.top_up_refusals), (2, 1));
}

/// A pool that frees a whole handle of `handle` bytes per ask (more than asked, as a pool
/// does), and records what it was asked for.
struct Pool {
    governor: Governor,
    handle: u64,
    asked: Mutex<Vec<u64>>,
}

impl crate::reclaim::Reclaimer for Pool {
    fn reclaim(&self, device: DeviceId, bytes: u64) -> u64 {
        self.asked.lock().unwrap().push(bytes);
        self.governor
            .free(device, Bucket::Pooled, self.handle)
            .unwrap();
        self.handle
    }
}

#[test]
fn give_back_unused_asks_the_reclaimers_for_the_shortfall_and_takes_no_more_than_asked() {
    let (g, _fake) = leased(1000, 100);
    g.try_grant(D, 100).unwrap().commit();
    g.transfer(D, Bucket::Committed, Bucket::Pooled, 40)
        .unwrap();
    g.free(D, Bucket::Committed, 20).unwrap();
    // Held 100: 40 pooled, 40 committed, 20 unused (under the trim's keep).
    let pool = Arc::new(Pool {
        governor: g.clone(),
        handle: 40,
        asked: Mutex::new(Vec::new()),
    });
    let r: Arc<dyn crate::reclaim::Reclaimer> = pool.clone();
    g.register_reclaimer(Arc::downgrade(&r));
    assert_eq!(
        g.give_back_unused(D, 30),
        30,
        "20 unused and 10 of the pool's 40"
    );
    assert_eq!(
        *pool.asked.lock().unwrap(),
        vec![10],
        "asked for the shortfall only"
    );
    assert_eq!(
        g.lease_held(D),
        Some(70),
        "the rest of the freed handle stays leased"
    );
    assert_eq!(
        g.give_back_unused(D, 30),
        30,
        "the lease's unused 30: nothing asked"
    );
    assert_eq!(*pool.asked.lock().unwrap(), vec![10]);
}

#[test]
fn a_forgotten_lease_drops_to_zero_without_giving_anything_back() {
    let (g, fake) = leased(1000, 100);
    g.try_grant(D, 60).unwrap().commit();
    assert_eq!(g.forget_lease(D), 100);
    assert_eq!(g.lease_held(D), Some(0));
    assert_eq!(*fake.free.lock().unwrap(), 900, "nothing given back");
    // What is used (60) is not leased: a grant tops up that much as well.
    g.try_grant(D, 10).unwrap().commit();
    assert_eq!(fake.calls.lock().unwrap().last().unwrap(), "acquire 70 100");
    assert_eq!(Governor::unlimited().forget_lease(D), 0);
}
