//! Unit tests of [`Tenants`](super::Tenants): grants, refusals, settling, give-back, releases
//! and `retry_after`, and a race of grants across tenants.

#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;
use crate::tenant::TenantLimits;
use crate::{GovernorConfig, ManualClock};
use std::time::Duration;

const A: TenantId = TenantId(1);
const B: TenantId = TenantId(2);

fn seq(reserved_bytes: u64, committed_bytes: u64) -> TenantShare {
    TenantShare {
        sequences: 1,
        reserved_bytes,
        committed_bytes,
    }
}

fn bytes(committed_bytes: u64) -> TenantShare {
    TenantShare {
        committed_bytes,
        ..TenantShare::default()
    }
}

fn tenants(budgets: TenantBudgets) -> (Tenants, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new());
    let governor = Governor::new(GovernorConfig::default().clock(clock.clone()));
    (Tenants::new(&governor, budgets), clock)
}

fn budgets() -> TenantBudgets {
    TenantBudgets {
        all_tenants: TenantLimits {
            sequences: Some(3),
            reserved_bytes: Some(1000),
            committed_bytes: None,
        },
        per_tenant: TenantLimits {
            sequences: Some(2),
            reserved_bytes: Some(100),
            committed_bytes: Some(50),
        },
    }
}

fn backpressure(r: Result<TenantGrant, TenantRefusal>) -> TenantBackpressure {
    match r {
        Err(TenantRefusal::Backpressure(b)) => b,
        other => panic!("expected backpressure, got {other:?}"),
    }
}

#[test]
fn grants_are_held_settled_and_released() {
    let (t, _) = tenants(budgets());
    let g = t.try_take(A, seq(10, 20)).unwrap();
    assert_eq!(g.share(), seq(10, 20));
    assert_eq!(t.held(A), seq(10, 20));
    // Settled to what was really committed (a shared prefix committed less).
    assert_eq!(g.settle(5), seq(10, 5));
    assert_eq!(t.held(A), seq(10, 5));
    assert_eq!(t.total(), seq(10, 5));
    // Growth adds bytes only.
    t.try_take(A, bytes(30)).unwrap().settle(30);
    assert_eq!(t.held(A), seq(10, 35));
    t.release(A, seq(10, 35));
    assert_eq!(t.held(A), TenantShare::default());
    assert_eq!(t.total(), TenantShare::default());
    assert_eq!(t.tenants_holding(), 0);
}

#[test]
fn a_dropped_grant_is_given_back_and_is_no_release() {
    let (t, _) = tenants(budgets());
    t.try_take(A, seq(10, 0)).unwrap().settle(0);
    t.try_take(A, seq(10, 0)).unwrap().settle(0);
    let full = backpressure(t.try_take(A, seq(10, 0)));
    assert_eq!(full.retry_after, RetryPolicy::default().cap);
    let g = t.try_take(B, seq(10, 0)).unwrap();
    drop(g);
    assert_eq!(t.held(B), TenantShare::default());
    // The give-back did not shorten anyone's estimate.
    let again = backpressure(t.try_take(A, seq(10, 0)));
    assert_eq!(again.retry_after, RetryPolicy::default().cap);
}

#[test]
fn a_share_larger_than_a_limit_never_fits() {
    let (t, _) = tenants(budgets());
    let n = t.check_fits(seq(101, 0)).unwrap_err();
    assert_eq!(
        (n.quota, n.scope, n.needed, n.limit),
        (Quota::ReservedBytes, Scope::Tenant, 101, 100)
    );
    match t.try_take(A, seq(10, 51)) {
        Err(TenantRefusal::NeverFits(n)) => {
            assert_eq!((n.quota, n.scope), (Quota::CommittedBytes, Scope::Tenant))
        }
        other => panic!("{other:?}"),
    }
    let n = t.check_fits(seq(2000, 0)).unwrap_err();
    assert_eq!(
        (n.quota, n.scope),
        (Quota::ReservedBytes, Scope::AllTenants)
    );
    assert_eq!(t.total(), TenantShare::default());
}

#[test]
fn full_scopes_refuse_with_backpressure_per_tenant_and_in_total() {
    let (t, _) = tenants(budgets());
    t.try_take(A, seq(10, 0)).unwrap().settle(0);
    t.try_take(A, seq(10, 0)).unwrap().settle(0);
    let b = backpressure(t.try_take(A, seq(10, 0)));
    assert_eq!(
        (b.quota, b.scope, b.used, b.requested, b.limit),
        (Quota::Sequences, Scope::Tenant, 2, 1, 2)
    );
    // Another tenant is bounded by the total only.
    t.try_take(B, seq(10, 0)).unwrap().settle(0);
    let b = backpressure(t.try_take(B, seq(10, 0)));
    assert_eq!((b.quota, b.scope), (Quota::Sequences, Scope::AllTenants));
    // Committed bytes per tenant.
    t.try_take(B, bytes(50)).unwrap().settle(50);
    let b = backpressure(t.try_take(B, bytes(1)));
    assert_eq!(
        (b.quota, b.scope, b.used, b.limit),
        (Quota::CommittedBytes, Scope::Tenant, 50, 50)
    );
}

#[test]
fn retry_after_follows_what_the_scope_released_in_the_window() {
    let (t, clock) = tenants(budgets());
    let policy = RetryPolicy::default();
    t.try_take(A, seq(10, 0)).unwrap().settle(0);
    t.try_take(A, seq(10, 0)).unwrap().settle(0);
    t.try_take(B, seq(10, 0)).unwrap().settle(0);
    t.release(A, seq(10, 0));
    t.try_take(A, seq(10, 0)).unwrap().settle(0);
    // A released one sequence in the window: the estimate for its own scope is one window.
    let a = backpressure(t.try_take(A, seq(10, 0)));
    assert_eq!(a.retry_after, policy.estimate(1, 1));
    assert!(a.retry_after < policy.cap);
    // B released nothing, but the total scope counts A's release.
    let b = backpressure(t.try_take(B, seq(10, 0)));
    assert_eq!(b.scope, Scope::AllTenants);
    assert_eq!(b.retry_after, policy.estimate(1, 1));
    // Once the window passed, the release no longer counts: the cap.
    clock.advance(policy.window + Duration::from_millis(1));
    let a = backpressure(t.try_take(A, seq(10, 0)));
    assert_eq!(a.retry_after, policy.cap);
}

#[test]
fn retry_after_of_a_tenant_follows_its_own_releases_only() {
    let per_tenant = TenantBudgets {
        per_tenant: TenantLimits {
            sequences: Some(1),
            ..TenantLimits::default()
        },
        ..TenantBudgets::default()
    };
    let (t, clock) = tenants(per_tenant);
    let policy = RetryPolicy::default();
    let grant = t.try_take(A, seq(0, 0)).unwrap();
    assert_eq!((grant.tenant(), grant.share()), (A, seq(0, 0)));
    grant.settle(0);
    t.release(A, seq(0, 0));
    t.try_take(A, seq(0, 0)).unwrap().settle(0);
    t.try_take(B, seq(0, 0)).unwrap().settle(0);
    assert_eq!(t.tenants_holding(), 2);
    let a = backpressure(t.try_take(A, seq(0, 0)));
    assert_eq!(
        (a.scope, a.retry_after),
        (Scope::Tenant, policy.estimate(1, 1))
    );
    let b = backpressure(t.try_take(B, seq(0, 0)));
    assert_eq!(
        (b.scope, b.retry_after),
        (Scope::Tenant, policy.cap),
        "B released nothing, whatever A did"
    );
    // Once the window passed, a tenant's releases are forgotten with it.
    assert_eq!(lock(&t.inner.held).released_by.len(), 1);
    clock.advance(policy.window + Duration::from_millis(1));
    let a = backpressure(t.try_take(A, seq(0, 0)));
    assert_eq!(a.retry_after, policy.cap);
    let held = lock(&t.inner.held);
    assert!(held.released_by.is_empty() && held.released.is_empty());
}

#[test]
fn the_books_say_their_budgets_and_what_they_hold() {
    let (t, _) = tenants(budgets());
    assert_eq!(*t.budgets(), budgets());
    assert_eq!(t.tenants_holding(), 0);
    let grant = t.try_take(A, seq(10, 5)).unwrap();
    let shown = format!("{grant:?}");
    assert!(
        shown.contains("TenantGrant") && shown.contains("committed_bytes: 5"),
        "{shown}"
    );
    grant.settle(5);
    let shown = format!("{t:?}");
    assert!(
        shown.contains("Tenants") && shown.contains("reserved_bytes: 10"),
        "{shown}"
    );
    assert!(Quota::CommittedBytes.is_bytes() && Quota::ReservedBytes.is_bytes());
    assert!(!Quota::Sequences.is_bytes());
}

#[test]
fn racing_grants_across_tenants_never_pass_a_limit_and_the_books_balance() {
    let budgets = TenantBudgets {
        all_tenants: TenantLimits {
            sequences: Some(10),
            reserved_bytes: None,
            committed_bytes: Some(400),
        },
        per_tenant: TenantLimits {
            sequences: Some(4),
            reserved_bytes: None,
            committed_bytes: Some(120),
        },
    };
    let (t, _) = tenants(budgets);
    let threads: Vec<_> = (0..8u64)
        .map(|i| {
            let t = t.clone();
            std::thread::spawn(move || {
                let me = TenantId(i % 4);
                let mut mine = Vec::new();
                let (mut granted, mut refused) = (0u64, 0u64);
                for round in 0..400u64 {
                    let asked = 10 + round % 20;
                    match t.try_take(me, seq(1, asked)) {
                        Ok(g) => {
                            granted += 1;
                            let settled = if round % 3 == 0 {
                                drop(g);
                                None
                            } else {
                                // Settled to at most what was taken (a shared prefix commits
                                // less), so that no settle can push a scope past its limit.
                                Some(g.settle(asked - round % 7))
                            };
                            mine.extend(settled);
                        }
                        Err(TenantRefusal::Backpressure(_)) => refused += 1,
                        Err(e) => panic!("{e}"),
                    }
                    let held = t.held(me);
                    assert!(
                        held.sequences <= 4 && held.committed_bytes <= 120,
                        "{held:?}"
                    );
                    let total = t.total();
                    assert!(total.sequences <= 10 && total.committed_bytes <= 400);
                    if round % 2 == 1 {
                        if let Some(s) = mine.pop() {
                            t.release(me, s);
                        }
                    }
                }
                (me, mine, granted, refused)
            })
        })
        .collect();
    let mut left = TenantShare::default();
    let mut refused = 0;
    let mut kept = Vec::new();
    for th in threads {
        let (me, mine, _granted, r) = th.join().unwrap();
        refused += r;
        for s in mine {
            left = left.plus(s);
            kept.push((me, s));
        }
    }
    // The books equal what the threads still hold, and are empty once it is released.
    assert_eq!(t.total(), left);
    assert!(
        refused > 0,
        "the limits were never reached: the race tested nothing"
    );
    for (me, s) in kept {
        t.release(me, s);
    }
    assert_eq!(t.total(), TenantShare::default());
    assert_eq!(t.tenants_holding(), 0);
}
