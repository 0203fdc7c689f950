#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Instant;

use kvvm_governor::RetryPolicy;

use super::*;
use crate::prefixes::Published;
use crate::proto::WireRefusal;

fn books(budget: u64) -> (NodeBooks, BrokerConfig) {
    let config = BrokerConfig::new("/nonexistent", budget);
    (NodeBooks::new(&config), config)
}

fn policy(floor: u64, ceiling: Option<u64>) -> TenantPolicy {
    TenantPolicy {
        floor,
        ceiling,
        token: None,
        users: None,
    }
}

fn acquire(b: &mut NodeBooks, client: u64, need: u64, want: u64) -> Result<u64, WireRefusal> {
    b.acquire(
        client,
        0,
        need,
        want,
        &RetryPolicy::default(),
        Instant::now(),
    )
    .unwrap()
    .map_err(|(r, _)| r)
}

#[test]
fn grants_up_to_want_and_refuses_with_backpressure() {
    let (mut b, _) = books(100);
    let a = b.register("a", &policy(0, None), 100);
    let c = b.register("c", &policy(0, None), 100);
    assert_eq!(acquire(&mut b, a, 10, 60), Ok(60));
    assert_eq!(
        acquire(&mut b, c, 10, 60),
        Ok(40),
        "what is left, at least need"
    );
    let r = acquire(&mut b, c, 1, 1).unwrap_err();
    assert!(matches!(
        r,
        WireRefusal::Backpressure {
            needed: 1,
            available: 0,
            ..
        }
    ));
    assert_eq!(b.total_held(0), 100);
}

#[test]
fn never_fits_over_the_ceiling() {
    let (mut b, _) = books(100);
    let a = b.register("a", &policy(0, Some(30)), 30);
    assert_eq!(acquire(&mut b, a, 20, 20), Ok(20));
    let r = acquire(&mut b, a, 11, 11).unwrap_err();
    assert!(matches!(
        r,
        WireRefusal::NeverFits {
            needed: 31,
            limit_bytes: 30,
            ..
        }
    ));
    assert_eq!(acquire(&mut b, a, 10, 50), Ok(10), "the ceiling caps want");
}

#[test]
fn a_request_past_the_budget_names_the_limit_that_binds() {
    let (mut b, _) = books(100);
    let whole = b.register("whole", &policy(0, Some(100)), 100);
    let part = b.register("part", &policy(0, Some(99)), 99);
    let limit = |r: WireRefusal| match r {
        WireRefusal::NeverFits {
            limit, limit_bytes, ..
        } => (limit, limit_bytes),
        other => panic!("{other:?}"),
    };
    // A ceiling equal to the budget binds no more than the budget: the node's is named.
    let r = acquire(&mut b, whole, 101, 101).unwrap_err();
    assert_eq!(limit(r), ("node_budget".to_owned(), 100));
    let r = acquire(&mut b, part, 100, 100).unwrap_err();
    assert_eq!(limit(r), ("tenant_ceiling".to_owned(), 99));
}

#[test]
fn floors_are_kept_free_and_over_floor_tenants_are_asked() {
    let (mut b, _) = books(100);
    let big = b.register("big", &policy(0, None), 100);
    let small = b.register("small", &policy(40, None), 100);
    assert_eq!(
        acquire(&mut b, big, 1, 100),
        Ok(60),
        "40 kept for small's floor"
    );
    assert_eq!(acquire(&mut b, small, 40, 40), Ok(40));
    assert_eq!(b.give_back(big, 0, 20, Instant::now()), Ok(40));
    assert_eq!(
        acquire(&mut b, small, 20, 20),
        Ok(20),
        "small over its floor now"
    );
    let (r, asks) = b
        .acquire(big, 0, 30, 30, &RetryPolicy::default(), Instant::now())
        .unwrap()
        .unwrap_err();
    assert!(matches!(r, WireRefusal::Backpressure { available: 0, .. }));
    assert_eq!(
        asks,
        vec![ReclaimAsk {
            client: small,
            device: 0,
            bytes: 20
        }],
        "only small's excess over its floor is asked"
    );
}

#[test]
fn returns_are_checked_and_a_dropped_client_gives_everything_back() {
    let (mut b, _) = books(100);
    let a = b.register("a", &policy(0, None), 100);
    let other = b.register("a", &policy(0, None), 100);
    assert_eq!(acquire(&mut b, a, 30, 30), Ok(30));
    let e = b.give_back(other, 0, 1, Instant::now()).unwrap_err();
    assert!(matches!(e, BooksError::NotHeld { held: 0, .. }));
    assert!(b.give_back(a, 0, 31, Instant::now()).is_err());
    assert_eq!(b.client_held(a, 0), 30, "a refused return changes nothing");
    assert_eq!(b.drop_client(a, Instant::now()).get(&0), Some(&30));
    assert_eq!(b.total_held(0), 0);
    assert!(b.give_back(a, 0, 0, Instant::now()).is_err(), "gone");
}

#[test]
fn claims_once_per_device_within_the_ceiling() {
    let (mut b, _) = books(100);
    let a = b.register("a", &policy(0, Some(50)), 50);
    assert_eq!(b.claim(a, 0, 40, Instant::now()), Ok(40));
    assert!(b.claim(a, 0, 1, Instant::now()).is_err(), "a second claim");
    assert!(
        b.claim(a, 1, 51, Instant::now()).is_err(),
        "over the ceiling"
    );
    assert_eq!(b.holdings(), vec![(a, 0, 40)]);
}

#[test]
fn the_metrics_count_what_the_books_did() {
    let (mut b, _) = books(100);
    let big = b.register("big", &policy(0, None), 100);
    let small = b.register("small", &policy(40, Some(50)), 50);
    assert_eq!(
        acquire(&mut b, big, 10, 90),
        Ok(60),
        "the small tenant's floor stays free"
    );
    assert_eq!(acquire(&mut b, small, 30, 30), Ok(30));
    // 20 more for small: 10 are free (the rest of its floor), big is asked for 10.
    let (refusal, asks) = b
        .acquire(small, 0, 20, 20, &RetryPolicy::default(), Instant::now())
        .unwrap()
        .unwrap_err();
    assert!(matches!(refusal, WireRefusal::Backpressure { .. }));
    assert_eq!(asks.len(), 1);
    assert!(matches!(
        acquire(&mut b, small, 60, 60),
        Err(WireRefusal::NeverFits { .. })
    ));
    b.give_back(big, 0, 15, Instant::now()).unwrap();
    b.drop_client(small, Instant::now());
    b.drop_client(small, Instant::now()); // a second close changes nothing
    let m = b.metrics();
    assert_eq!((m.budget, m.clients), (100, 1));
    assert_eq!(m.held.get(&("big".to_owned(), 0)), Some(&45));
    assert_eq!(m.held.get(&("small".to_owned(), 0)), None);
    let c = m.counters;
    assert_eq!((c.clients_registered, c.clients_dropped), (2, 1));
    assert_eq!((c.grants, c.granted_bytes), (2, 90));
    assert_eq!((c.backpressure, c.never_fits), (1, 1));
    assert_eq!((c.reclaim_asks, c.reclaim_asked_bytes), (1, asks[0].bytes));
    assert_eq!(c.returned_bytes, 15 + 30);
}

#[test]
fn twenty_thousand_one_shot_tenants_leave_the_books_as_they_were() {
    let (mut b, _) = books(100);
    let honest = b.register("honest", &policy(0, None), 100);
    assert_eq!(acquire(&mut b, honest, 10, 10), Ok(10));
    let before = b.entries();
    let now = Instant::now();
    for i in 0..20_000u32 {
        let c = b.register(&format!("t{i}"), &policy(0, None), 100);
        // A sync on device 0, a return of nothing on device i, a grant given back.
        assert_eq!(acquire(&mut b, c, 0, 0), Ok(0));
        assert_eq!(b.give_back(c, i, 0, now), Ok(0));
        if i % 2 == 0 {
            assert_eq!(acquire(&mut b, c, 1, 1), Ok(1));
            assert_eq!(b.give_back(c, 0, 1, now), Ok(0));
        }
        b.drop_client(c, now);
    }
    let after = b.entries();
    assert_eq!(
        before.devices, 3,
        "honest's device 0: its own, its tenant's, the node's"
    );
    assert_eq!(
        (after.tenants, after.clients, after.devices),
        (before.tenants, before.clients, before.devices + 1),
        "only device 0's give-back history is new: {before:?} then {after:?}"
    );
    assert_eq!(b.tenant_held("honest", 0), 10);
}

#[test]
fn devices_past_those_budgeted_are_refused_and_leave_nothing() {
    let mut config = BrokerConfig::new("/nonexistent", 100);
    config.devices = 2;
    let mut b = NodeBooks::new(&config);
    let a = b.register("a", &policy(0, None), 100);
    let now = Instant::now();
    for device in [2, 7, u32::MAX - 1] {
        let r = b
            .acquire(a, device, 0, 10, &RetryPolicy::default(), now)
            .unwrap()
            .map_err(|(r, _)| r);
        assert!(
            matches!(&r, Err(WireRefusal::NeverFits { limit, limit_bytes: 0, .. }) if limit == "device_not_budgeted"),
            "{r:?}"
        );
        assert_eq!(
            b.claim(a, device, 1, now),
            Err(BooksError::NoDevice(device))
        );
        assert!(b.give_back(a, device, 1, now).is_err());
        assert_eq!(b.give_back(a, device, 0, now), Ok(0));
    }
    assert_eq!(acquire(&mut b, a, 5, 5), Ok(5));
    assert_eq!(b.give_back(a, 0, 5, now), Ok(0));
    let e = b.entries();
    assert_eq!((e.tenants, e.clients, e.devices), (1, 1, 1), "{e:?}");
    // The host's page-locked memory is budgeted as one more device, whatever `devices` is.
    let host = kvvm_hal::DeviceId::HOST.0;
    assert_eq!(
        b.acquire(a, host, 0, 10, &RetryPolicy::default(), now)
            .unwrap()
            .map_err(|(r, _)| r),
        Ok(10)
    );
    assert_eq!(b.give_back(a, host, 10, now), Ok(0));
}

#[test]
fn named_floors_are_kept_free_before_their_tenant_connects() {
    let config = BrokerConfig::new("/nonexistent", 100).tenant("late", policy(30, None));
    let mut b = NodeBooks::new(&config);
    let early = b.register("early", &policy(0, None), 100);
    assert_eq!(acquire(&mut b, early, 1, 100), Ok(70), "30 kept for late");
    let late = b.register("late", &policy(30, None), 100);
    assert_eq!(acquire(&mut b, late, 30, 30), Ok(30));
    assert_eq!(b.total_held(0), 100);
}

fn lent(entries: &[(&str, u32, u64)]) -> BTreeMap<(String, u32), u64> {
    entries
        .iter()
        .map(|(t, d, b)| (((*t).to_owned(), *d), *b))
        .collect()
}

#[test]
fn what_a_previous_broker_lent_is_kept_for_claims_until_claimed_or_the_grace_ends() {
    let (mut b, _) = books(100);
    let start = Instant::now();
    let until = start + std::time::Duration::from_secs(10);
    b.keep_for_claims(lent(&[("a", 0, 60), ("b", 0, 30), ("a", 9_999, 5)]), until);
    assert_eq!(b.total_held(0), 90, "kept as held");
    assert_eq!(
        b.lent(),
        lent(&[("a", 0, 60), ("b", 0, 30)]),
        "device 9999 not budgeted"
    );
    let c = b.register("c", &policy(0, None), 100);
    assert_eq!(
        acquire(&mut b, c, 10, 50),
        Ok(10),
        "nothing granted out of what is kept"
    );
    let a1 = b.register("a", &policy(0, None), 100);
    let a2 = b.register("a", &policy(0, None), 100);
    assert_eq!(b.claim(a1, 0, 40, start), Ok(40));
    assert_eq!(
        b.claim(a2, 0, 21, start),
        Err(BooksError::Claim(0)),
        "20 kept for a, and the node has no room for 1 more"
    );
    assert_eq!(b.claim(a2, 0, 20, start), Ok(20));
    assert_eq!(b.unclaimed(), lent(&[("b", 0, 30)]));
    assert_eq!(
        b.total_held(0),
        100,
        "claims moved what was kept: the node never over budget"
    );
    let b1 = b.register("b", &policy(0, None), 100);
    assert_eq!(b.claim(b1, 0, 10, start), Ok(10));
    // The grace ends: b's 20 not claimed go at the next request.
    let before_end = until - std::time::Duration::from_millis(1);
    let r = b.acquire(c, 0, 0, 0, &RetryPolicy::default(), before_end);
    assert!(matches!(r, Ok(Ok(0))));
    assert_eq!(b.unclaimed(), lent(&[("b", 0, 20)]), "not yet");
    let r = b.acquire(c, 0, 0, 0, &RetryPolicy::default(), until);
    assert!(matches!(r, Ok(Ok(0))));
    assert!(b.unclaimed().is_empty());
    assert_eq!(b.total_held(0), 80);
    assert_eq!(acquire(&mut b, c, 20, 20), Ok(20));
    let late = b.register("b", &policy(0, None), 100);
    assert_eq!(
        b.claim(late, 0, 1, until),
        Err(BooksError::Claim(0)),
        "no room left"
    );
}

#[test]
fn prefix_uses_are_claimed_once_billed_and_freed_with_their_last_user() {
    let (mut b, _) = books(100);
    let now = Instant::now();
    b.keep_for_claims(
        lent(&[("t", 0, 30)]),
        now + std::time::Duration::from_secs(10),
    );
    let r1 = b.register("t", &policy(0, None), 100);
    let r2 = b.register("t", &policy(0, None), 100);
    let other = b.register("u", &policy(0, None), 100);
    assert_eq!(b.claim_prefix(r1, "p", (0, 20), 2, now), Ok(1));
    assert_eq!(
        b.claim_prefix(r2, "p", (0, 20), 1, now),
        Ok(2),
        "billed once"
    );
    assert_eq!(
        b.claim_prefix(r2, "p", (0, 20), 1, now),
        Err(BooksError::NoPrefix("p".into()))
    );
    assert!(b.claim_prefix(r1, "q", (0, 20), 0, now).is_err(), "no use");
    let e = b.claim_prefix(other, "p", (0, 19), 1, now);
    assert_eq!(
        e,
        Err(BooksError::Claim(0)),
        "nothing kept for u: during the grace more is no client's"
    );
    assert_eq!(b.total_held(0), 30, "t's 20 out of what was kept");
    assert_eq!(b.unclaimed(), lent(&[("t", 0, 10)]));
    assert!(
        b.open_prefix(r2, "p").is_err(),
        "no descriptors until published again"
    );
    assert_eq!(b.close_prefix(r1, "p", now), Ok(2));
    assert_eq!(b.close_prefix(r1, "p", now), Ok(1));
    assert_eq!(b.close_prefix(r2, "p", now), Ok(0));
    assert_eq!(
        b.tenant_held("t", 0),
        30,
        "during the grace a claimed prefix's bytes go back to what is kept for t"
    );
    let later = now + std::time::Duration::from_secs(10);
    let e = b.claim_prefix(other, "p", (0, 19), 1, later);
    assert_eq!(
        e,
        Ok(1),
        "after the grace, what fits; another tenant's key is its own"
    );
    let mut uses = b.prefix_uses();
    uses.sort();
    assert_eq!(uses, vec![(other, "p".to_owned(), 1)]);
}

#[test]
fn a_claimed_prefix_closed_during_the_grace_is_kept_for_its_other_users() {
    let (mut b, _) = books(100);
    let now = Instant::now();
    let until = now + std::time::Duration::from_secs(10);
    b.keep_for_claims(lent(&[("t", 0, 30), ("u", 0, 70)]), until);
    let first = b.register("t", &policy(0, None), 100);
    assert_eq!(b.claim_prefix(first, "p", (0, 30), 1, now), Ok(1));
    assert_eq!(
        b.close_prefix(first, "p", now),
        Ok(0),
        "the first user back lets go"
    );
    assert_eq!(
        b.unclaimed(),
        lent(&[("t", 0, 30), ("u", 0, 70)]),
        "kept again, not freed"
    );
    let second = b.register("t", &policy(0, None), 100);
    assert_eq!(
        b.claim_prefix(second, "p", (0, 30), 1, now),
        Ok(1),
        "its other user claims it"
    );
    b.drop_client(second, now);
    assert_eq!(
        b.unclaimed().get(&("t".to_owned(), 0)),
        Some(&30),
        "kept again"
    );
    let newcomer = b.register("v", &policy(0, None), 100);
    assert!(
        b.acquire(newcomer, 0, 1, 1, &RetryPolicy::default(), until)
            .unwrap()
            .is_ok(),
        "the grace is over: what was kept goes"
    );
    assert_eq!(b.total_held(0), 1);
}

#[test]
fn a_tenant_is_asked_for_its_excess_over_its_floor_once_across_its_clients() {
    let (mut b, _) = books(100);
    let big1 = b.register("big", &policy(50, None), 100);
    let big2 = b.register("big", &policy(50, None), 100);
    assert_eq!(acquire(&mut b, big1, 40, 40), Ok(40));
    assert_eq!(acquire(&mut b, big2, 40, 40), Ok(40));
    let other = b.register("other", &policy(0, None), 100);
    let (_, asks) = b
        .acquire(other, 0, 100, 100, &RetryPolicy::default(), Instant::now())
        .unwrap()
        .unwrap_err();
    assert_eq!(
        asks,
        vec![ReclaimAsk {
            client: big1,
            device: 0,
            bytes: 30
        }],
        "big holds 80 over a floor of 50: 30 in all, the first client has them"
    );
}

#[test]
fn a_tenant_with_bytes_kept_for_its_claims_is_not_forgotten_when_a_client_leaves() {
    let (mut b, _) = books(100);
    let now = Instant::now();
    b.keep_for_claims(
        lent(&[("r", 0, 50)]),
        now + std::time::Duration::from_secs(10),
    );
    let r = b.register("r", &policy(0, None), 100);
    b.drop_client(r, now);
    assert_eq!(
        b.lent(),
        lent(&[("r", 0, 50)]),
        "still kept, still in the books file"
    );
    assert_eq!(b.entries().tenants, 1);
}

#[test]
fn no_asks_when_the_tenant_s_own_ceiling_leaves_as_little_as_the_node() {
    let (mut b, _) = books(100);
    let other = b.register("other", &policy(0, None), 100);
    let small = b.register("small", &policy(0, Some(50)), 50);
    let small2 = b.register("small", &policy(0, Some(50)), 50);
    assert_eq!(acquire(&mut b, other, 50, 50), Ok(50));
    assert_eq!(acquire(&mut b, small, 10, 10), Ok(10));
    // Room: 40 in small's ceiling, 40 on the node. Others giving back would not help.
    let (r, asks) = b
        .acquire(small2, 0, 41, 41, &RetryPolicy::default(), Instant::now())
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(r, WireRefusal::Backpressure { available: 40, .. }),
        "{r:?}"
    );
    assert!(asks.is_empty(), "{asks:?}");
}

#[test]
fn retry_after_follows_what_was_given_back_in_the_window() {
    let (mut b, _) = books(100);
    let a = b.register("a", &policy(0, None), 100);
    let c = b.register("c", &policy(0, None), 100);
    assert_eq!(acquire(&mut b, a, 100, 100), Ok(100));
    let now = Instant::now();
    b.give_back(a, 0, 50, now).unwrap();
    assert_eq!(acquire(&mut b, a, 50, 50), Ok(50));
    let retry = RetryPolicy::default();
    let r = b.acquire(c, 0, 10, 10, &retry, now).unwrap().unwrap_err().0;
    let want = u64::try_from(retry.estimate(10, 50).as_millis()).unwrap();
    assert!(want < 5000, "{want}");
    assert!(
        matches!(r, WireRefusal::Backpressure { retry_after_ms, .. } if retry_after_ms == want),
        "{r:?}"
    );
}

fn published(device: u32, size: u64, fds: usize) -> Published {
    let null = std::fs::File::open("/dev/null").unwrap();
    Published {
        device,
        sizes: vec![size],
        meta: String::new(),
        fds: (0..fds).map(|_| null.try_clone().unwrap().into()).collect(),
    }
}

#[test]
fn a_tenant_publishes_at_most_256_prefixes_and_the_broker_keeps_at_most_its_descriptors() {
    let (mut b, _) = books(1000);
    let a = b.register("a", &policy(0, None), 1000);
    assert_eq!(acquire(&mut b, a, 1000, 1000), Ok(1000));
    for i in 0..256 {
        b.publish_prefix(a, &format!("p{i}"), published(0, 1, 0))
            .unwrap();
    }
    let e = b.publish_prefix(a, "p256", published(0, 1, 0)).unwrap_err();
    assert_eq!(e, BooksError::PrefixExists("p256".into()));
    let mut config = BrokerConfig::new("/nonexistent", 100);
    config.max_prefix_descriptors = 3;
    let mut b = NodeBooks::new(&config);
    let a = b.register("a", &policy(0, None), 100);
    assert_eq!(acquire(&mut b, a, 10, 10), Ok(10));
    b.publish_prefix(a, "two", published(0, 1, 2)).unwrap();
    let e = b
        .publish_prefix(a, "two-more", published(0, 1, 2))
        .unwrap_err();
    assert_eq!(
        e,
        BooksError::PrefixExists("two-more".into()),
        "4 descriptors of 3"
    );
    b.publish_prefix(a, "one-more", published(0, 1, 1)).unwrap();
}

#[test]
fn a_tenant_known_only_by_what_is_kept_for_its_claims_has_its_configured_floor() {
    let mut config = BrokerConfig::new("/nonexistent", 100);
    config.default_tenant = Some(policy(30, None));
    let mut b = NodeBooks::new(&config);
    let until = Instant::now() + std::time::Duration::from_secs(10);
    b.keep_for_claims(lent(&[("x", 0, 10)]), until);
    let c = b.register("c", &policy(0, None), 100);
    // x holds 10 for its claims and 20 more of its floor are kept free for it.
    assert_eq!(acquire(&mut b, c, 1, 100), Ok(70));
}

#[test]
fn the_metrics_count_every_tenant_s_prefixes_and_their_bytes() {
    let (mut b, _) = books(1000);
    let a = b.register("a", &policy(0, None), 1000);
    assert_eq!(acquire(&mut b, a, 100, 100), Ok(100));
    b.publish_prefix(a, "p", published(0, 10, 0)).unwrap();
    b.publish_prefix(a, "q", published(0, 20, 0)).unwrap();
    let m = b.metrics();
    assert_eq!(m.prefixes.get("a"), Some(&2));
    assert_eq!(m.prefix_bytes.get(&("a".to_owned(), 0)), Some(&30));
}
