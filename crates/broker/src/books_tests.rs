#![allow(clippy::unwrap_used)]

use std::time::Instant;

use kvvm_governor::RetryPolicy;

use super::*;

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
    assert_eq!(b.claim(a, 0, 40), Ok(40));
    assert!(b.claim(a, 0, 1).is_err(), "a second claim");
    assert!(b.claim(a, 1, 51).is_err(), "over the ceiling");
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
