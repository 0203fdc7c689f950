//! The server's own limits: live sequences, reserved address space and committed bytes, per
//! owner (one API key, or every client when the server has no keys) and in total, and the
//! books that enforce them.
//!
//! A request takes its share before it touches the KV layer ([`LimitBooks::take`]) and
//! settles it to what it really committed afterwards, so two racing requests cannot both
//! pass a limit. A request larger than a limit by itself can never fit (413 `never_fits`,
//! naming the limit); one that does not fit only because of what is live now is refused with
//! 429 `limit_reached` and a `Retry-After` estimated from what that scope released during the
//! last window (the governor's [`RetryPolicy`]), the policy's cap when nothing was.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use kvvm_governor::RetryPolicy;

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

/// What a sequence holds against the limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Share {
    /// Live sequences (1 for one sequence).
    pub(crate) sequences: u64,
    /// Reserved bytes of address space.
    pub(crate) reserved: u64,
    /// Committed bytes billed to it.
    pub(crate) committed: u64,
}

impl Share {
    fn add(&mut self, o: Share) {
        self.sequences = self.sequences.saturating_add(o.sequences);
        self.reserved = self.reserved.saturating_add(o.reserved);
        self.committed = self.committed.saturating_add(o.committed);
    }

    fn sub(&mut self, o: Share) {
        self.sequences = self.sequences.saturating_sub(o.sequences);
        self.reserved = self.reserved.saturating_sub(o.reserved);
        self.committed = self.committed.saturating_sub(o.committed);
    }
}

#[derive(Debug, Default)]
struct Books {
    total: Share,
    owners: HashMap<Owner, Share>,
    /// Releases during the last window: when, by whom, what.
    released: VecDeque<(Instant, Owner, Share)>,
}

/// One limit checked by [`LimitBooks::take`].
struct Check {
    name: &'static str,
    limit: Option<u64>,
    used: u64,
    requested: u64,
    per_owner: bool,
    pick: fn(&Share) -> u64,
}

/// The books of [`Limits`].
#[derive(Debug)]
pub(crate) struct LimitBooks {
    limits: Limits,
    policy: RetryPolicy,
    books: Mutex<Books>,
}

impl LimitBooks {
    pub(crate) fn new(limits: Limits, policy: RetryPolicy) -> Self {
        LimitBooks {
            limits,
            policy,
            books: Mutex::new(Books::default()),
        }
    }

    pub(crate) fn limits(&self) -> &Limits {
        &self.limits
    }

    fn lock(&self) -> MutexGuard<'_, Books> {
        // Every update is a few additions under the lock: a poisoned lock is consistent.
        self.books.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Refuses, before any driver call, a share that no freeing could let through: larger
    /// than a limit by itself.
    pub(crate) fn check_fits(&self, share: Share) -> Result<(), ServiceError> {
        let l = &self.limits;
        let bytes = [
            (
                share.reserved,
                Some(l.max_reserved_bytes),
                "max_reserved_bytes",
            ),
            (
                share.reserved,
                l.max_reserved_bytes_per_key,
                "max_reserved_bytes_per_key",
            ),
            (
                share.committed,
                l.max_committed_bytes_per_key,
                "max_committed_bytes_per_key",
            ),
        ];
        for (needed, limit, name) in bytes {
            if let Some(limit) = limit.filter(|limit| needed > *limit) {
                return Err(ServiceError::NeverFits {
                    needed_bytes: needed,
                    limit_bytes: limit,
                    limit: name,
                });
            }
        }
        let counts = [
            (Some(l.max_sequences), "max_sequences"),
            (l.max_sequences_per_key, "max_sequences_per_key"),
        ];
        for (limit, name) in counts {
            if let Some(limit) = limit.filter(|limit| share.sequences > *limit) {
                return Err(ServiceError::InvalidRequest(format!(
                    "the server allows {limit} live sequences ({name}): none can be opened"
                )));
            }
        }
        Ok(())
    }

    /// Takes `share` for `owner`, or refuses: never-fits (4xx) when it is larger than a limit
    /// by itself, [`ServiceError::LimitReached`] (429) when what is live leaves no room.
    pub(crate) fn take(&self, owner: Owner, share: Share) -> Result<(), ServiceError> {
        self.check_fits(share)?;
        let l = self.limits;
        let mut books = self.lock();
        let mine = books.owners.get(&owner).copied().unwrap_or_default();
        let total = books.total;
        let checks = [
            Check {
                name: "max_sequences",
                limit: Some(l.max_sequences),
                used: total.sequences,
                requested: share.sequences,
                per_owner: false,
                pick: |s| s.sequences,
            },
            Check {
                name: "max_sequences_per_key",
                limit: l.max_sequences_per_key,
                used: mine.sequences,
                requested: share.sequences,
                per_owner: true,
                pick: |s| s.sequences,
            },
            Check {
                name: "max_reserved_bytes",
                limit: Some(l.max_reserved_bytes),
                used: total.reserved,
                requested: share.reserved,
                per_owner: false,
                pick: |s| s.reserved,
            },
            Check {
                name: "max_reserved_bytes_per_key",
                limit: l.max_reserved_bytes_per_key,
                used: mine.reserved,
                requested: share.reserved,
                per_owner: true,
                pick: |s| s.reserved,
            },
            Check {
                name: "max_committed_bytes_per_key",
                limit: l.max_committed_bytes_per_key,
                used: mine.committed,
                requested: share.committed,
                per_owner: true,
                pick: |s| s.committed,
            },
        ];
        for c in checks {
            let Some(limit) = c.limit else { continue };
            if c.requested == 0 || c.used.saturating_add(c.requested) <= limit {
                continue;
            }
            let shortfall = c.used.saturating_add(c.requested).saturating_sub(limit);
            let released =
                self.released_in_window(&mut books, c.per_owner.then_some(owner), c.pick);
            return Err(ServiceError::LimitReached {
                limit: c.name,
                used: c.used,
                requested: c.requested,
                limit_value: limit,
                retry_after: self.policy.estimate(shortfall, released),
            });
        }
        books.total.add(share);
        books.owners.entry(owner).or_default().add(share);
        Ok(())
    }

    /// Gives back `share` of `owner`: a request that failed (`released: false`, not a
    /// release anyone can count on) or a sequence that ended (`released: true`, counted in
    /// the release rate behind `Retry-After`).
    pub(crate) fn give_back(&self, owner: Owner, share: Share, released: bool) {
        let mut books = self.lock();
        books.total.sub(share);
        if let Some(mine) = books.owners.get_mut(&owner) {
            mine.sub(share);
            if *mine == Share::default() {
                books.owners.remove(&owner);
            }
        }
        if released {
            let now = Instant::now();
            books.released.push_back((now, owner, share));
            self.prune(&mut books, now);
        }
    }

    /// Settles a share taken for `taken` committed bytes to the `actual` bytes committed.
    pub(crate) fn settle_committed(&self, owner: Owner, taken: u64, actual: u64) {
        let mut books = self.lock();
        let adjust = |s: &mut Share| {
            s.committed = s.committed.saturating_sub(taken).saturating_add(actual);
        };
        adjust(&mut books.total);
        if let Some(mine) = books.owners.get_mut(&owner) {
            adjust(mine);
        }
    }

    /// What `owner` holds now (zero when nothing).
    pub(crate) fn held(&self, owner: Owner) -> Share {
        self.lock().owners.get(&owner).copied().unwrap_or_default()
    }

    fn prune(&self, books: &mut Books, now: Instant) {
        let window = self.policy.window;
        while books
            .released
            .front()
            .is_some_and(|(t, _, _)| now.saturating_duration_since(*t) > window)
        {
            books.released.pop_front();
        }
    }

    fn released_in_window(
        &self,
        books: &mut Books,
        owner: Option<Owner>,
        pick: fn(&Share) -> u64,
    ) -> u64 {
        self.prune(books, Instant::now());
        books
            .released
            .iter()
            .filter(|(_, o, _)| owner.is_none_or(|w| w == *o))
            .map(|(_, _, s)| pick(s))
            .fold(0u64, u64::saturating_add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(reserved: u64, committed: u64) -> Share {
        Share {
            sequences: 1,
            reserved,
            committed,
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
        let books = LimitBooks::new(limits, RetryPolicy::default());
        let (a, b) = (Owner(1), Owner(2));
        match books.take(a, seq(101, 0)) {
            Err(ServiceError::NeverFits { limit, .. }) => {
                assert_eq!(limit, "max_reserved_bytes_per_key")
            }
            other => panic!("{other:?}"),
        }
        books.take(a, seq(10, 0)).unwrap();
        books.take(a, seq(10, 0)).unwrap();
        match books.take(a, seq(10, 0)) {
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
        books.take(b, seq(10, 0)).unwrap();
        assert!(matches!(
            books.take(b, seq(10, 0)),
            Err(ServiceError::LimitReached {
                limit: "max_sequences",
                ..
            })
        ));
        // A release by a shortens the estimate for a's scope, not for b's.
        books.give_back(a, seq(10, 0), true);
        books.take(a, seq(10, 0)).unwrap();
        match books.take(a, seq(10, 0)) {
            Err(ServiceError::LimitReached { retry_after, .. }) => {
                assert!(retry_after < RetryPolicy::default().cap, "{retry_after:?}")
            }
            other => panic!("{other:?}"),
        }
        // A failed request's give-back is not a release.
        books.give_back(b, seq(10, 0), false);
        assert_eq!(books.held(b), Share::default());
        assert_eq!(books.held(a).sequences, 2);
    }
}
