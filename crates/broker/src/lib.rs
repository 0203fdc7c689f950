//! # kvvm-broker: one KV budget per node, shared by many engine processes
//!
//! A [`Broker`] is a daemon per node listening on a Unix socket (who may connect is the
//! socket file's mode; a tenant may also require a token). It owns the node's KV budget per
//! device. Engine processes ([`BrokerClient`]) lease bytes from it before committing and give
//! them back after releasing; their [`Governor`](kvvm_governor::Governor) is built on the
//! lease ([`leased_governor`]), so a grant that fits the lease never leaves the process and
//! only top-ups (in batches) and trims are round trips.
//!
//! * Per tenant, per device: a floor (bytes kept free for it while other tenants ask) and a
//!   ceiling (the most it may hold); the rest of the budget is shared on demand. The tenant
//!   model is the governor's ([`TenantId`](kvvm_governor::TenantId),
//!   [`TenantBounds`](kvvm_governor::TenantBounds), and
//!   [`TenantRoom`](kvvm_governor::TenantRoom) deciding whether a request fits); a tenant's
//!   name is resolved to its id once, when a client registers. When a
//!   tenant is refused for lack of room, the tenants over their floor are asked
//!   ([`Reply::Reclaim`]) to give back what they can spare.
//! * A refused lease is the local governor's [`Backpressure`](kvvm_governor::Backpressure)
//!   (with a `retry_after` estimated from the bytes given back recently) or
//!   [`NeverFits`](kvvm_governor::NeverFits).
//! * A client's socket closing (exit, crash, SIGKILL) gives everything it held back. A client
//!   whose broker restarts keeps what it holds, reconnects at once and claims it from the
//!   new broker, which keeps what its predecessor lent for those claims (it never grants
//!   the same bytes twice).
//! * Every request is checked against the client's own books: it can only return what it
//!   holds; the messages per second, the connections (in all and per user), the time to
//!   say hello and to stay silent, the devices, and the descriptors a publish may carry (a
//!   driver's exported memory only) are bounded.
//!
//! See `docs/broker.md` for the protocol, the security model and the failure semantics.
//!
//! ## Where each part lives
//!
//! `proto.rs` (frames and messages), `books/` ([`NodeBooks`]: floors, ceilings, the shared
//! rest, claims and the grace after a restart), `books_file.rs` (what was lent, for the next
//! broker), `prefixes.rs` (published prefixes and their descriptors), `descriptor.rs` (which
//! descriptors a publish may carry), `server/` ([`Broker`]: the socket, accept, slots, one
//! thread per connection, deadlines, validation), `client/` ([`BrokerClient`], the
//! [`LeaseSource`](kvvm_governor::LeaseSource) of a leased governor, its reader thread and
//! reconnects), `fdpass.rs` (descriptors over the socket with `SCM_RIGHTS`), `peer.rs` (the
//! peer's credentials, `SO_PEERCRED`), `metrics.rs` (counters and the Prometheus text),
//! `config.rs`, `error.rs`, `signal.rs` (waiting for SIGTERM).
//!
//! Prefixes: a client publishes a shared prefix's exported handles
//! ([`BrokerClient::publish_prefix`]); its bytes are billed once, to the tenant, until the
//! last user lets go; clients of the same tenant open it ([`BrokerClient::open_prefix`]) and
//! import the descriptors read-only.

mod books;
mod books_file;
mod client;
mod config;
pub mod descriptor;
mod error;
pub mod fdpass;
mod metrics;
mod peer;
mod prefixes;
pub mod proto;
mod server;
pub mod signal;

pub use books::{AcquireOutcome, BookEntries, BooksError, NodeBooks, ReclaimAsk};
pub use client::{leased_governor, BrokerClient, ClientOptions, Welcome};
pub use config::{BrokerConfig, TenantPolicy};
pub use error::BrokerError;
pub use metrics::{BrokerCounters, BrokerMetrics};
pub use peer::{peer_credentials, PeerCredentials};
pub use prefixes::{OpenedPrefix, PrefixRow, Published};
pub use proto::{Reply, Request, WireRefusal};
pub use server::Broker;
