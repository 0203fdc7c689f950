//! [`Tenants`]: the books of the tenant budgets, and [`TenantGrant`], a share taken and not
//! yet settled.
//!
//! A request takes its share before it touches the device ([`Tenants::try_take`]), so two
//! racing requests cannot both pass a limit; it settles the grant to what it really committed
//! ([`TenantGrant::settle`]) or drops it (the share goes back, and is no release anyone can
//! count on). What a tenant holds goes back with [`Tenants::release`], which also counts
//! towards the release rate behind `retry_after`.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::clock::Clock;
use crate::governor::Governor;
use crate::release_window::ReleaseWindow;
use crate::retry::RetryPolicy;
use crate::tenant::{
    Quota, Scope, TenantBackpressure, TenantBounds, TenantBudgets, TenantId, TenantNeverFits,
    TenantRefusal, TenantRoom, TenantShare,
};
use kvvm_hal::sync::lock;

/// What the books hold: every tenant's share, their sum, and the releases of the last window.
#[derive(Debug, Default)]
struct Held {
    total: TenantShare,
    tenants: HashMap<TenantId, TenantShare>,
    /// Releases during the last window, of every tenant.
    released: ReleaseWindow<TenantShare>,
    /// Releases during the last window, per tenant (a tenant with none has no entry).
    released_by: HashMap<TenantId, ReleaseWindow<TenantShare>>,
}

impl Held {
    fn of(&self, tenant: TenantId) -> TenantShare {
        self.tenants.get(&tenant).copied().unwrap_or_default()
    }

    fn add(&mut self, tenant: TenantId, share: TenantShare) {
        self.total = self.total.plus(share);
        let mine = self.tenants.entry(tenant).or_default();
        *mine = mine.plus(share);
    }

    fn remove(&mut self, tenant: TenantId, share: TenantShare) {
        self.total = self.total.minus(share);
        if let Some(mine) = self.tenants.get_mut(&tenant) {
            *mine = mine.minus(share);
            if *mine == TenantShare::default() {
                self.tenants.remove(&tenant);
            }
        }
    }

    fn used(&self, tenant: TenantId, quota: Quota, scope: Scope) -> u64 {
        match scope {
            Scope::AllTenants => self.total.get(quota),
            Scope::Tenant => self.of(tenant).get(quota),
        }
    }

    /// What `scope` (all tenants, or `tenant`) released of `quota` during the `window`
    /// before `now`.
    fn released(
        &self,
        tenant: TenantId,
        quota: Quota,
        scope: Scope,
        (now, window): (Instant, Duration),
    ) -> u64 {
        let events = match scope {
            Scope::AllTenants => Some(&self.released),
            Scope::Tenant => self.released_by.get(&tenant),
        };
        events.map_or(0, |w| w.total(now, window).get(quota))
    }

    /// Records `share` released by `tenant` at `now`.
    fn note_released(
        &mut self,
        tenant: TenantId,
        share: TenantShare,
        now: Instant,
        window: Duration,
    ) {
        self.released.note(now, window, share);
        self.released_by
            .entry(tenant)
            .or_default()
            .note(now, window, share);
    }

    /// Drops the releases older than `window` at `now`, and the tenants left with none.
    fn prune(&mut self, now: Instant, window: Duration) {
        self.released.prune(now, window);
        self.released_by.retain(|_, w| {
            w.prune(now, window);
            !w.is_empty()
        });
    }
}

struct Inner {
    budgets: TenantBudgets,
    retry: RetryPolicy,
    clock: Arc<dyn Clock>,
    held: Mutex<Held>,
}

/// The books of the tenant budgets of one governor. Cheap to clone: clones share the books.
#[derive(Clone)]
pub struct Tenants {
    inner: Arc<Inner>,
}

impl fmt::Debug for Tenants {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tenants")
            .field("budgets", &self.inner.budgets)
            .field("total", &self.total())
            .finish()
    }
}

impl Tenants {
    /// The tenant books of `governor` under `budgets`: `retry_after` follows the governor's
    /// [`RetryPolicy`] and clock.
    pub fn new(governor: &Governor, budgets: TenantBudgets) -> Self {
        let config = governor.config();
        Tenants {
            inner: Arc::new(Inner {
                budgets,
                retry: config.retry,
                clock: Arc::clone(&config.clock),
                held: Mutex::new(Held::default()),
            }),
        }
    }

    /// The budgets in force.
    pub fn budgets(&self) -> &TenantBudgets {
        &self.inner.budgets
    }

    /// Refuses, before anything is taken, a share that no release could let through: larger
    /// than a limit by itself. Bytes are checked before sequences, all tenants before each.
    pub fn check_fits(&self, share: TenantShare) -> Result<(), TenantNeverFits> {
        let order = [
            Quota::ReservedBytes,
            Quota::CommittedBytes,
            Quota::Sequences,
        ];
        for quota in order {
            for scope in Scope::ALL {
                let Some(limit) = self.inner.budgets.limit(quota, scope) else {
                    continue;
                };
                let needed = share.get(quota);
                if needed > limit {
                    return Err(TenantNeverFits {
                        quota,
                        scope,
                        needed,
                        limit,
                    });
                }
            }
        }
        Ok(())
    }

    /// Takes `share` for `tenant`, or refuses: [`TenantRefusal::NeverFits`] when it is
    /// larger than a limit by itself, [`TenantRefusal::Backpressure`] (with `retry_after`)
    /// when what is held leaves no room.
    pub fn try_take(
        &self,
        tenant: TenantId,
        share: TenantShare,
    ) -> Result<TenantGrant, TenantRefusal> {
        self.check_fits(share)?;
        let mut held = lock(&self.inner.held);
        for quota in Quota::ALL {
            let requested = share.get(quota);
            let Some(scope) = self.room(&held, tenant, quota).refusing(requested) else {
                continue;
            };
            // A scope without a limit has all the room there is: it refuses only past
            // u64::MAX, which it reports as its limit.
            let limit = self.inner.budgets.limit(quota, scope).unwrap_or(u64::MAX);
            let used = held.used(tenant, quota, scope);
            let shortfall = used.saturating_add(requested).saturating_sub(limit);
            let at = (self.inner.clock.now(), self.inner.retry.window);
            held.prune(at.0, at.1);
            let released = held.released(tenant, quota, scope, at);
            return Err(TenantBackpressure {
                quota,
                scope,
                used,
                requested,
                limit,
                retry_after: self.inner.retry.estimate(shortfall, released),
            }
            .into());
        }
        held.add(tenant, share);
        Ok(TenantGrant {
            inner: Arc::clone(&self.inner),
            tenant,
            share,
        })
    }

    /// The room of `tenant` in `quota`: under the per-tenant limit and in what all tenants
    /// may still take (no floors: every tenant is bounded alike).
    fn room(&self, held: &Held, tenant: TenantId, quota: Quota) -> TenantRoom {
        let limit = |scope| self.inner.budgets.limit(quota, scope).unwrap_or(u64::MAX);
        let bounds = TenantBounds {
            floor: 0,
            ceiling: limit(Scope::Tenant),
        };
        let total = held.used(tenant, quota, Scope::AllTenants);
        let shared = limit(Scope::AllTenants);
        bounds.room_in(held.used(tenant, quota, Scope::Tenant), (total, shared), 0)
    }

    /// Gives back what `tenant` held as `share` (a sequence that ended): it leaves the books
    /// and counts towards the release rate of `tenant` and of all tenants.
    pub fn release(&self, tenant: TenantId, share: TenantShare) {
        let mut held = lock(&self.inner.held);
        held.remove(tenant, share);
        let (now, window) = (self.inner.clock.now(), self.inner.retry.window);
        held.note_released(tenant, share, now, window);
        held.prune(now, window);
    }

    /// What `tenant` holds now (zero when nothing).
    pub fn held(&self, tenant: TenantId) -> TenantShare {
        lock(&self.inner.held).of(tenant)
    }

    /// What all tenants hold together.
    pub fn total(&self) -> TenantShare {
        lock(&self.inner.held).total
    }

    /// How many tenants hold something.
    pub fn tenants_holding(&self) -> usize {
        lock(&self.inner.held).tenants.len()
    }
}

/// A share taken by [`Tenants::try_take`] and not yet settled. Dropped unsettled, it goes
/// back to the books (not counted as a release).
#[must_use = "a tenant grant that is dropped is given back"]
pub struct TenantGrant {
    inner: Arc<Inner>,
    tenant: TenantId,
    share: TenantShare,
}

impl fmt::Debug for TenantGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantGrant")
            .field("tenant", &self.tenant)
            .field("share", &self.share)
            .finish()
    }
}

impl TenantGrant {
    /// The tenant.
    pub fn tenant(&self) -> TenantId {
        self.tenant
    }

    /// The share taken.
    pub fn share(&self) -> TenantShare {
        self.share
    }

    /// Settles the grant to the `committed_bytes` really committed (fewer than taken when a
    /// prefix was shared, more when a window was rounded up): the tenant holds the share,
    /// with those bytes, until it is released. Returns the share now held.
    pub fn settle(mut self, committed_bytes: u64) -> TenantShare {
        let taken = std::mem::take(&mut self.share);
        let settled = TenantShare {
            committed_bytes,
            ..taken
        };
        let mut held = lock(&self.inner.held);
        held.remove(self.tenant, taken);
        held.add(self.tenant, settled);
        settled
    }
}

impl Drop for TenantGrant {
    fn drop(&mut self) {
        let share = std::mem::take(&mut self.share);
        if share != TenantShare::default() {
            lock(&self.inner.held).remove(self.tenant, share);
        }
    }
}

#[cfg(test)]
#[path = "tenants_tests.rs"]
mod tests;
