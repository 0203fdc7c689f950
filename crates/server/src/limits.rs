//! The server's own limits: live sequences, reserved address space and committed bytes, per
//! owner (one API key, or every client when the server has no keys) and in total.
//!
//! The books are the governor's: every owner is a tenant of the service's governor
//! ([`Tenants`]), and [`Limits`] are its tenant budgets ([`Limits::budgets`]). This module
//! only translates: an owner into a tenant, and a tenant refusal into the server's error with
//! the limit's flag name. A request larger than a limit by itself can never fit (413
//! `never_fits`, naming the limit; a limit of live sequences that admits none is a 400); one
//! that does not fit only because of what is live now is refused with 429 `limit_reached` and
//! the `Retry-After` the governor estimated from what that scope released during the last
//! window.
//!
//! [`Tenants`]: kvvm::governor::Tenants

use kvvm::governor::{
    Quota, Scope, TenantBudgets, TenantId, TenantLimits, TenantNeverFits, TenantRefusal,
};

use crate::auth::Owner;
use crate::error::ServiceError;

/// The server's limits (see `docs/serve.md` for the flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most live sequences in total.
    pub max_sequences: u64,
    /// Most bytes of address space reserved by live sequences in total.
    pub max_reserved_bytes: u64,
    /// Most live sequences per owner (`None`: only the total applies).
    pub max_sequences_per_key: Option<u64>,
    /// Most reserved bytes per owner.
    pub max_reserved_bytes_per_key: Option<u64>,
    /// Most bytes committed by one owner's requests (the budget bounds the total).
    pub max_committed_bytes_per_key: Option<u64>,
}

impl Default for Limits {
    /// 1024 sequences and 64 TiB of address space in total (half of a 47-bit space); no
    /// per-key limit beyond the totals.
    fn default() -> Self {
        Limits {
            max_sequences: 1024,
            max_reserved_bytes: 64 << 40,
            max_sequences_per_key: None,
            max_reserved_bytes_per_key: None,
            max_committed_bytes_per_key: None,
        }
    }
}

impl Limits {
    /// The limits as the governor's tenant budgets (the budget bounds the committed total).
    pub fn budgets(&self) -> TenantBudgets {
        TenantBudgets {
            all_tenants: TenantLimits {
                sequences: Some(self.max_sequences),
                reserved_bytes: Some(self.max_reserved_bytes),
                committed_bytes: None,
            },
            per_tenant: TenantLimits {
                sequences: self.max_sequences_per_key,
                reserved_bytes: self.max_reserved_bytes_per_key,
                committed_bytes: self.max_committed_bytes_per_key,
            },
        }
    }
}

/// The tenant of `owner`.
pub(crate) fn tenant(owner: Owner) -> TenantId {
    TenantId(u64::from(owner.0))
}

/// The flag name of the limit on `quota` in `scope`.
fn limit_name(quota: Quota, scope: Scope) -> &'static str {
    match (quota, scope) {
        (Quota::Sequences, Scope::AllTenants) => "max_sequences",
        (Quota::Sequences, Scope::Tenant) => "max_sequences_per_key",
        (Quota::ReservedBytes, Scope::AllTenants) => "max_reserved_bytes",
        (Quota::ReservedBytes, Scope::Tenant) => "max_reserved_bytes_per_key",
        (Quota::CommittedBytes, Scope::AllTenants) => "max_committed_bytes",
        (Quota::CommittedBytes, Scope::Tenant) => "max_committed_bytes_per_key",
    }
}

/// A share larger than a limit: 413 `never_fits` for bytes, 400 for a limit of sequences
/// that admits none.
pub(crate) fn never_fits(n: TenantNeverFits) -> ServiceError {
    let name = limit_name(n.quota, n.scope);
    if n.quota.is_bytes() {
        ServiceError::NeverFits {
            needed_bytes: n.needed,
            limit_bytes: n.limit,
            limit: name,
        }
    } else {
        ServiceError::InvalidRequest(format!(
            "the server allows {} live sequences ({name}): none can be opened",
            n.limit
        ))
    }
}

/// A tenant budget's refusal as the server answers it: never-fits (413 or 400, see
/// [`never_fits`]) or 429 with the limit's name and its `Retry-After`.
pub(crate) fn refusal(r: TenantRefusal) -> ServiceError {
    match r {
        TenantRefusal::NeverFits(n) => never_fits(n),
        TenantRefusal::Backpressure(b) => ServiceError::LimitReached {
            limit: limit_name(b.quota, b.scope),
            used: b.used,
            requested: b.requested,
            limit_value: b.limit,
            retry_after: b.retry_after,
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kvvm::governor::{Governor, RetryPolicy, TenantShare, Tenants};

    fn seq(reserved_bytes: u64) -> TenantShare {
        TenantShare {
            sequences: 1,
            reserved_bytes,
            committed_bytes: 0,
        }
    }

    #[test]
    fn a_share_larger_than_a_limit_never_fits_and_a_full_scope_is_429() {
        let limits = Limits {
            max_sequences: 3,
            max_reserved_bytes_per_key: Some(100),
            max_sequences_per_key: Some(2),
            ..Limits::default()
        };
        let books = Tenants::new(&Governor::unlimited(), limits.budgets());
        let (a, b) = (tenant(Owner(1)), tenant(Owner(2)));
        match books.try_take(a, seq(101)).map_err(refusal) {
            Err(ServiceError::NeverFits { limit, .. }) => {
                assert_eq!(limit, "max_reserved_bytes_per_key")
            }
            other => panic!("{other:?}"),
        }
        books.try_take(a, seq(10)).unwrap().settle(0);
        books.try_take(a, seq(10)).unwrap().settle(0);
        match books.try_take(a, seq(10)).map_err(refusal) {
            Err(ServiceError::LimitReached {
                limit, retry_after, ..
            }) => {
                assert_eq!(limit, "max_sequences_per_key");
                // Nothing was released: the cap.
                assert_eq!(retry_after, RetryPolicy::default().cap);
            }
            other => panic!("{other:?}"),
        }
        // Another owner is not limited by a's share, only by the total.
        books.try_take(b, seq(10)).unwrap().settle(0);
        assert!(matches!(
            books.try_take(b, seq(10)).map_err(refusal),
            Err(ServiceError::LimitReached {
                limit: "max_sequences",
                ..
            })
        ));
        // A limit of sequences that admits none is the client's error.
        let none = Limits {
            max_sequences: 0,
            ..Limits::default()
        };
        let books = Tenants::new(&Governor::unlimited(), none.budgets());
        assert!(matches!(
            books.try_take(a, seq(10)).map_err(refusal),
            Err(ServiceError::InvalidRequest(_))
        ));
    }
}
