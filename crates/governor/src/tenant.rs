//! The vocabulary of tenant budgets: who holds a share ([`TenantId`]), what a share is
//! ([`TenantShare`], one figure per [`Quota`]), the limits on it ([`TenantLimits`] per
//! [`Scope`], together [`TenantBudgets`]) and why a share is refused ([`TenantRefusal`]);
//! [`TenantBounds`], a tenant's floor and ceiling of a byte budget tenants share (a node
//! broker's books keep theirs with it), and [`TenantRoom`], the one rule by which a request
//! of a tenant fits (`Tenants` and a node broker's books both decide with it).
//!
//! A tenant budget sits inside the device budget: the committed bytes of a tenant's share are
//! also granted by the device budget when they are committed (a `MappedGrowthGrant`); the
//! tenant's quota only narrows what one tenant, or all of them together, may hold. The books
//! themselves are `Tenants` (`tenants.rs`).

use std::time::Duration;

use crate::release_window::Released;

/// A tenant: a client whose share is budgeted on its own (an API key of a server). Opaque.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct TenantId(pub u64);

/// One figure of a share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Quota {
    /// Live sequences (each holds one reservation).
    Sequences,
    /// Bytes of address space reserved.
    ReservedBytes,
    /// Bytes of device memory committed.
    CommittedBytes,
}

impl Quota {
    /// Every quota, in the order refusals are checked.
    pub const ALL: [Quota; 3] = [
        Quota::Sequences,
        Quota::ReservedBytes,
        Quota::CommittedBytes,
    ];

    /// Whether the quota counts bytes (not sequences).
    pub fn is_bytes(self) -> bool {
        !matches!(self, Quota::Sequences)
    }
}

/// Whether a limit bounds each tenant or all tenants together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Every tenant together.
    AllTenants,
    /// Each tenant on its own.
    Tenant,
}

impl Scope {
    /// Both scopes, in the order refusals are checked.
    pub const ALL: [Scope; 2] = [Scope::AllTenants, Scope::Tenant];
}

/// What a tenant holds, or asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TenantShare {
    /// Live sequences.
    pub sequences: u64,
    /// Bytes of address space reserved.
    pub reserved_bytes: u64,
    /// Bytes of device memory committed.
    pub committed_bytes: u64,
}

impl TenantShare {
    /// The figure of `quota`.
    pub fn get(&self, quota: Quota) -> u64 {
        match quota {
            Quota::Sequences => self.sequences,
            Quota::ReservedBytes => self.reserved_bytes,
            Quota::CommittedBytes => self.committed_bytes,
        }
    }

    /// `self + other`, figure by figure (saturating: the books never wrap).
    pub fn plus(self, other: TenantShare) -> TenantShare {
        TenantShare {
            sequences: self.sequences.saturating_add(other.sequences),
            reserved_bytes: self.reserved_bytes.saturating_add(other.reserved_bytes),
            committed_bytes: self.committed_bytes.saturating_add(other.committed_bytes),
        }
    }

    /// `self - other`, figure by figure (saturating at zero).
    pub fn minus(self, other: TenantShare) -> TenantShare {
        TenantShare {
            sequences: self.sequences.saturating_sub(other.sequences),
            reserved_bytes: self.reserved_bytes.saturating_sub(other.reserved_bytes),
            committed_bytes: self.committed_bytes.saturating_sub(other.committed_bytes),
        }
    }
}

impl Released for TenantShare {
    fn plus(self, other: Self) -> Self {
        TenantShare::plus(self, other)
    }
}

/// Limits on a share, one per quota (`None`: unlimited).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TenantLimits {
    /// Most live sequences.
    pub sequences: Option<u64>,
    /// Most bytes of address space reserved.
    pub reserved_bytes: Option<u64>,
    /// Most bytes of device memory committed.
    pub committed_bytes: Option<u64>,
}

impl TenantLimits {
    /// The limit of `quota`.
    pub fn get(&self, quota: Quota) -> Option<u64> {
        match quota {
            Quota::Sequences => self.sequences,
            Quota::ReservedBytes => self.reserved_bytes,
            Quota::CommittedBytes => self.committed_bytes,
        }
    }
}

/// The tenant budgets: limits on each tenant and on all of them together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TenantBudgets {
    /// What all tenants together may hold.
    pub all_tenants: TenantLimits,
    /// What each tenant may hold.
    pub per_tenant: TenantLimits,
}

impl TenantBudgets {
    /// The limit of `quota` in `scope`.
    pub fn limit(&self, quota: Quota, scope: Scope) -> Option<u64> {
        match scope {
            Scope::AllTenants => self.all_tenants.get(quota),
            Scope::Tenant => self.per_tenant.get(quota),
        }
    }
}

/// A tenant's floor and ceiling of a byte budget shared by tenants (a node broker's budget
/// of device memory): at least `floor` bytes are kept free for it, whether it holds them or
/// not, and it holds at most `ceiling`. Made by [`within`](Self::within), the floor is at
/// most the ceiling and the ceiling at most the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TenantBounds {
    /// Bytes kept free for the tenant: no other tenant's grant takes them.
    pub floor: u64,
    /// Most bytes the tenant holds.
    pub ceiling: u64,
}

impl TenantBounds {
    /// The bounds of a tenant asking for `floor` and `ceiling` (`None`: the whole budget) of
    /// `budget`: the ceiling at most the budget, the floor at most the ceiling.
    pub fn within(floor: u64, ceiling: Option<u64>, budget: u64) -> Self {
        let ceiling = ceiling.map_or(budget, |c| c.min(budget));
        TenantBounds {
            floor: floor.min(ceiling),
            ceiling,
        }
    }

    /// What a tenant holding `held` has over its floor: what it may be asked to give back.
    pub fn excess(&self, held: u64) -> u64 {
        held.saturating_sub(self.floor)
    }

    /// What is kept free for a tenant holding `held`: the part of its floor it does not hold.
    pub fn kept_free(&self, held: u64) -> u64 {
        self.floor.saturating_sub(held)
    }

    /// What a tenant holding `held` may still take under its ceiling.
    pub fn room(&self, held: u64) -> u64 {
        self.ceiling.saturating_sub(held)
    }

    /// The room of a tenant holding `held` in a budget shared by tenants: under its own
    /// ceiling, and in what all tenants together may still take of `shared` (all tenants'
    /// limit, which they hold `total` of) less `kept` for the floors of the others
    /// ([`kept_free_for`](Self::kept_free_for)).
    pub fn room_in(&self, held: u64, (total, shared): (u64, u64), kept: u64) -> TenantRoom {
        TenantRoom {
            tenant: self.room(held),
            shared: shared.saturating_sub(total).saturating_sub(kept),
        }
    }

    /// What is kept free for the floors of `tenants` ((bounds, held) of each): the part of
    /// each one's floor it does not hold, summed (saturating).
    pub fn kept_free_for(tenants: impl IntoIterator<Item = (TenantBounds, u64)>) -> u64 {
        tenants
            .into_iter()
            .map(|(bounds, held)| bounds.kept_free(held))
            .fold(0, u64::saturating_add)
    }
}

/// The room of one tenant in a budget tenants share ([`TenantBounds::room_in`]): the one
/// admission rule of tenants, for the governor's tenant books (per quota, no floors) and a
/// node broker's books (per device, with floors). A request fits when it fits both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantRoom {
    /// What the tenant may still take under its own ceiling.
    pub tenant: u64,
    /// What all tenants together may still take, less what is kept free for the floors of
    /// the others.
    pub shared: u64,
}

impl TenantRoom {
    /// What the tenant may take now: the lesser room.
    pub fn available(&self) -> u64 {
        self.tenant.min(self.shared)
    }

    /// The scope `requested` bytes do not fit in (all tenants checked first), or `None`
    /// when they fit (nothing always fits).
    pub fn refusing(&self, requested: u64) -> Option<Scope> {
        if requested > self.shared {
            Some(Scope::AllTenants)
        } else if requested > self.tenant {
            Some(Scope::Tenant)
        } else {
            None
        }
    }
}

/// A share larger than a limit by itself: no release can ever let it through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{needed} of {quota:?} can never fit: the {scope:?} limit is {limit}")]
pub struct TenantNeverFits {
    /// The quota.
    pub quota: Quota,
    /// The scope of the limit.
    pub scope: Scope,
    /// What the share asked for.
    pub needed: u64,
    /// The limit.
    pub limit: u64,
}

/// A share that fits its limits but not what is held now: retry after `retry_after`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "{quota:?} of {scope:?} full: {used} held, {requested} asked, limit {limit}; retry after {retry_after:?}"
)]
pub struct TenantBackpressure {
    /// The quota.
    pub quota: Quota,
    /// The scope of the limit.
    pub scope: Scope,
    /// What the scope holds now.
    pub used: u64,
    /// What the share asked for.
    pub requested: u64,
    /// The limit.
    pub limit: u64,
    /// When a retry is likely to pass, from what the scope released during the last window
    /// of the governor's `RetryPolicy` (its cap when nothing was).
    pub retry_after: Duration,
}

/// Why a tenant's share was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TenantRefusal {
    /// Larger than a limit by itself.
    #[error(transparent)]
    NeverFits(#[from] TenantNeverFits),
    /// The limit is full now.
    #[error(transparent)]
    Backpressure(#[from] TenantBackpressure),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_keep_the_floor_under_the_ceiling_and_the_ceiling_under_the_budget() {
        let b = TenantBounds::within(30, Some(50), 100);
        assert_eq!((b.floor, b.ceiling), (30, 50));
        assert_eq!(TenantBounds::within(80, Some(50), 100).floor, 50);
        assert_eq!(TenantBounds::within(0, Some(150), 100).ceiling, 100);
        assert_eq!(TenantBounds::within(10, None, 100).ceiling, 100);
        assert_eq!((b.excess(45), b.excess(30), b.excess(10)), (15, 0, 0));
        assert_eq!(
            (b.kept_free(10), b.kept_free(30), b.kept_free(45)),
            (20, 0, 0)
        );
        assert_eq!((b.room(45), b.room(50), b.room(70)), (5, 0, 0));
    }

    #[test]
    fn a_tenant_room_is_the_lesser_of_its_ceiling_and_the_shared_rest_past_others_floors() {
        let b = TenantBounds::within(0, Some(50), 100);
        // 20 held of 50; 70 held by all of 100, 25 kept for others: 30 - 25 = 5 shared.
        let room = b.room_in(20, (70, 100), 25);
        assert_eq!(
            room,
            TenantRoom {
                tenant: 30,
                shared: 5
            }
        );
        assert_eq!(room.available(), 5);
        assert_eq!(room.refusing(5), None);
        assert_eq!(room.refusing(6), Some(Scope::AllTenants));
        let own = b.room_in(45, (50, 100), 0);
        assert_eq!((own.available(), own.refusing(6)), (5, Some(Scope::Tenant)));
        assert_eq!(
            b.room_in(60, (120, 100), 7).refusing(0),
            None,
            "nothing fits even over every limit"
        );
        assert_eq!(
            b.room_in(0, (0, 100), u64::MAX).refusing(1),
            Some(Scope::AllTenants),
            "all tenants checked first"
        );
        let floors = [
            (TenantBounds::within(30, None, 100), 10),
            (TenantBounds::within(20, None, 100), 25),
            (TenantBounds::within(u64::MAX, None, u64::MAX), 0),
        ];
        assert_eq!(TenantBounds::kept_free_for(floors[..2].iter().copied()), 20);
        assert_eq!(TenantBounds::kept_free_for(floors), u64::MAX, "saturating");
    }

    #[test]
    fn a_share_released_adds_figure_by_figure() {
        let a = TenantShare {
            sequences: 1,
            reserved_bytes: 2,
            committed_bytes: u64::MAX,
        };
        let sum = Released::plus(a, a);
        assert_eq!(
            (sum.sequences, sum.reserved_bytes, sum.committed_bytes),
            (2, 4, u64::MAX)
        );
    }
}
