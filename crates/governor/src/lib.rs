//! # kvvm-governor: the device-memory budget of kvvm
//!
//! The governor decides **whether** physical device memory may be committed; the manager
//! (`kvvm-vmm`) decides **how**. Committing is never unconditional: the manager first obtains
//! a [`MappedGrowthGrant`] from [`Governor::try_grant`] ("no grant, no commit"), performs the
//! driver calls, and then settles the grant:
//!
//! * on success the granted bytes become [`Bucket::Committed`] ([`MappedGrowthGrant::commit`],
//!   or piece by piece with [`MappedGrowthGrant::settle`]);
//! * on failure the grant is rolled back ([`MappedGrowthGrant::rollback`], or simply dropped):
//!   the budget deducted for it is returned.
//!
//! When a grant cannot be given the caller gets a typed [`Refusal`], never a crash:
//!
//! * [`Backpressure`] (bytes needed, bytes available, and an estimated `retry_after`) when the
//!   request fits the limits but not what is free now: device-memory pressure is a signal to
//!   retry or shed load (a server maps it to HTTP 429 + `Retry-After`);
//! * [`NeverFits`] (the [`Limit`] and its bytes) when the request is larger than a limit no
//!   freeing can raise: the device or process budget less the bytes in quarantine (which never
//!   come back). No `retry_after` is offered: clients would retry forever. A manager adds the
//!   device's physical memory as a limit ([`Governor::check_fits`] is the O(1) check, asked
//!   with everything the requester would hold, pooled memory included).
//!
//! ## Accounting (invariant 2)
//!
//! Per device, every byte of physical memory the process holds is in exactly one
//! [`Bucket`]:
//!
//! | bucket | what it is |
//! |---|---|
//! | [`Bucket::Committed`] | mapped in a reservation and owned by it |
//! | [`Bucket::Pooled`] | an unmapped handle kept by the manager's pool for reuse |
//! | [`Bucket::Shared`] | a handle shared by several mappings (a shared prefix), counted once |
//! | [`Bucket::Quarantined`] | memory that could not be proven idle or could not be released: never reused, never advertised as free |
//!
//! `used = committed + pooled + shared + quarantined` is the physical memory owned plus the
//! quarantined bytes, and is what the budget is charged with. Outstanding grants are
//! `pending`; `free = budget - used - pending`. The manager moves bytes between buckets with
//! [`Governor::transfer`] and gives them back with [`Governor::free`] when the driver has
//! released them; an accounting underflow is a typed [`GovernorError`], never a wrap.
//!
//! ## Evict before refusing
//!
//! Components that hold reclaimable memory (the manager's handle pool, later a prefix cache)
//! register a [`Reclaimer`]. Before refusing a grant, [`Governor::try_grant`] asks each
//! registered reclaimer, in registration order, to free the shortfall, and then checks again.
//! Reclaimers are held weakly, so registering does not keep their owner alive.
//!
//! ## Tenant budgets
//!
//! Inside the device budget, [`Tenants`] keeps budgets per tenant (an API key of a server):
//! live sequences, reserved address space and committed bytes, per tenant and over all
//! tenants ([`TenantBudgets`]). A request takes its [`TenantShare`] first
//! ([`Tenants::try_take`]: a [`TenantGrant`], or a [`TenantRefusal`]: never-fits when the
//! share is larger than a limit by itself, backpressure with a `retry_after` from what that
//! scope released during the last window when it is full now), settles the grant to what it
//! really committed, and releases the share when it ends ([`Tenants::release`]). The committed
//! bytes are still granted by the device budget ([`MappedGrowthGrant`]) when they are
//! committed: a tenant budget narrows the device budget, never widens it.
//!
//! Whether a request of a tenant fits is decided in one place, [`TenantRoom`]: the room under
//! the tenant's own ceiling and the room all tenants together have left, less what is kept
//! free for the floors of the others ([`TenantBounds::room_in`]). [`Tenants`] asks it per
//! quota (no floors); a node broker's books ask it per device, with each tenant's
//! [`TenantBounds`].
//!
//! ## How `retry_after` is estimated
//!
//! The governor records every [`Governor::free`] (bytes returned to the driver) with its time,
//! per device. When refusing, it computes the release rate over the last
//! [`RetryPolicy::window`] (bytes freed in the window divided by the window) and estimates the
//! time until the shortfall is freed:
//!
//! ```text
//! retry_after = clamp(shortfall / rate, floor, cap)     (cap when nothing was freed)
//! ```
//!
//! The estimate is a pure function ([`RetryPolicy::estimate`]) of the shortfall and the bytes
//! freed in the window; time comes from a [`Clock`] ([`ManualClock`] in tests), so it is
//! deterministic.
//!
//! ## Where each part lives
//!
//! `governor/` ([`Governor`]: `mod.rs` grants, reclaim, transfers, snapshots; `grant.rs`
//! [`MappedGrowthGrant`]; `lease.rs` [`Governor::with_lease`], a budget leased from a
//! node-wide broker), `books.rs` (the checked books), `bucket.rs`, `error.rs`
//! ([`Backpressure`], [`GovernorError`]), `clock.rs`, `retry.rs` ([`RetryPolicy`]), `release_window.rs` ([`ReleaseWindow`], what was
//! released during the last window: the ledger's, the tenants' and a node broker's),
//! `reclaim.rs` ([`Reclaimer`]), `config.rs` ([`GovernorConfig`]), `snapshot.rs`, `lease_source.rs`
//! ([`LeaseSource`], [`LeasePolicy`]), `tenant.rs` (the vocabulary of tenant budgets:
//! [`TenantId`], [`TenantShare`], [`TenantBudgets`], [`TenantRefusal`], [`TenantBounds`],
//! [`TenantRoom`]) and `tenants.rs`
//! ([`Tenants`], [`TenantGrant`]).

#![forbid(unsafe_code)]

mod books;
mod bucket;
mod clock;
mod config;
mod error;
mod governor;
mod lease_source;
mod reclaim;
mod release_window;
mod retry;
mod snapshot;
mod tenant;
mod tenants;

pub use bucket::Bucket;
pub use clock::{Clock, ManualClock, SystemClock};
pub use config::GovernorConfig;
pub use error::{Backpressure, GovernorError, Limit, NeverFits, Refusal};
pub use governor::grant::MappedGrowthGrant;
pub use governor::lease::WeakGovernor;
pub use governor::Governor;
pub use lease_source::{LeasePolicy, LeaseSource, LeaseStats};
pub use reclaim::Reclaimer;
pub use release_window::{ReleaseWindow, Released};
pub use retry::RetryPolicy;
pub use snapshot::{DeviceSnapshot, GovernorSnapshot};
pub use tenant::{
    Quota, Scope, TenantBackpressure, TenantBounds, TenantBudgets, TenantId, TenantLimits,
    TenantNeverFits, TenantRefusal, TenantRoom, TenantShare,
};
pub use tenants::{TenantGrant, Tenants};
