//! [`NodeBooks`]: the broker's books, what every client holds on every device, by the
//! governor's tenant model: tenants keyed by [`TenantId`] (a name resolved once, through
//! [`TenantNames`]), each with its [`TenantBounds`], and whether a request fits decided by the
//! governor's [`TenantRoom`](kvvm_governor::TenantRoom) (floors, ceilings, the shared rest).
//! Pure: no sockets, no threads.
//!
//! The books keep what they decide with incrementally: each tenant's bytes per device (its
//! clients' leases, its prefixes, what is kept for its claims after a restart) and the
//! node's, so that a request costs the same however many clients came and went. A tenant with
//! no client and no bytes is forgotten, and so is a device at 0 bytes; devices past
//! [`BrokerConfig::devices`] are refused, but for the host's page-locked memory
//! ([`DeviceId::HOST`], budgeted as one more device).
//!
//! Where each part lives: `held.rs` (the parts: bytes per device, a client's and a tenant's
//! books), `names.rs` (the tenants' names and ids), `lease.rs` (acquire, give back, claim,
//! the grace after a restart), `prefix.rs` (publish, open, close and claim prefixes).

mod held;
mod lease;
mod names;
mod prefix;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvvm_governor::{ReleaseWindow, TenantBounds, TenantId};
use kvvm_hal::DeviceId;

use crate::config::{BrokerConfig, TenantPolicy};
use crate::metrics::{BrokerCounters, BrokerMetrics};
use crate::prefixes::{PrefixRow, Prefixes};
use held::{ClientBooks, DeviceBytes, TenantBooks};
pub use lease::AcquireOutcome;
use names::TenantNames;

/// A client's request the books would not serve: nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BooksError {
    /// The client is not registered.
    #[error("unknown client {0}")]
    UnknownClient(u64),
    /// A return of more than the client holds.
    #[error("returns {bytes} bytes on device {device} but holds {held}")]
    NotHeld {
        /// The device.
        device: u32,
        /// Bytes returned.
        bytes: u64,
        /// Bytes held.
        held: u64,
    },
    /// A claim on a device where the client already holds bytes, or one that does not fit
    /// (its tenant's ceiling, the budget, or the bytes kept for other tenants' claims).
    #[error("claim refused on device {0}")]
    Claim(u32),
    /// No prefix of that key for the client's tenant, or the client does not use it.
    #[error("no prefix {0:?} for this client")]
    NoPrefix(String),
    /// The tenant already has a prefix of that key, or as many as it may have, or the
    /// broker holds as many descriptors as it may.
    #[error("prefix {0:?} exists, or no more prefixes may be published")]
    PrefixExists(String),
    /// A device the broker does not budget.
    #[error("device {0} is not budgeted by this broker")]
    NoDevice(u32),
}

/// An ask the broker sends: `client` should give back up to `bytes` on `device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReclaimAsk {
    /// The client asked.
    pub client: u64,
    /// The device.
    pub device: u32,
    /// Bytes wanted back.
    pub bytes: u64,
}

/// How many entries the books keep: what stays bounded however many clients come and go.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BookEntries {
    /// Tenants known now (with a client or bytes).
    pub tenants: usize,
    /// Clients registered now.
    pub clients: usize,
    /// Per-device entries of clients, tenants, the node and the give-back history.
    pub devices: usize,
    /// Prefixes published.
    pub prefixes: usize,
    /// Tenant names known: the configuration's and those of the tenants known now.
    pub names: usize,
}

/// The bytes kept after a restart for the claims of the previous broker's clients.
#[derive(Debug, Default)]
struct Grace {
    /// When the bytes not claimed by then are let go (`None`: no grace running).
    until: Option<Instant>,
    /// Per (tenant, device): bytes lent by the previous broker and not claimed yet.
    unclaimed: BTreeMap<(TenantId, u32), u64>,
}

/// The broker's books.
#[derive(Debug)]
pub struct NodeBooks {
    budget: u64,
    devices: u32,
    max_descriptors: usize,
    /// Every tenant's name and id.
    names: TenantNames,
    /// The limits of the tenants named in the configuration.
    named: BTreeMap<TenantId, TenantBounds>,
    /// The limits of tenants not named (`None`: refused).
    default: Option<TenantBounds>,
    tenants: BTreeMap<TenantId, TenantBooks>,
    clients: BTreeMap<u64, ClientBooks>,
    /// Every tenant's bytes, per device.
    total: DeviceBytes,
    next_client: u64,
    /// Bytes given back per device during the last window of the retry policy.
    given_back: BTreeMap<u32, ReleaseWindow>,
    /// That window.
    window: Duration,
    prefixes: Prefixes,
    grace: Grace,
    counters: BrokerCounters,
    /// Whether what is lent changed since [`take_changed`](Self::take_changed).
    changed: bool,
}

impl NodeBooks {
    /// Empty books for `config`'s budget, devices and tenants.
    pub fn new(config: &BrokerConfig) -> Self {
        let names = TenantNames::new(config.tenants.keys());
        let named = config
            .tenants
            .iter()
            .filter_map(|(n, p)| Some((names.id(n)?, config.bounds(p))))
            .collect();
        NodeBooks {
            budget: config.budget,
            devices: config.devices,
            max_descriptors: config.max_prefix_descriptors,
            names,
            named,
            default: config.default_tenant.as_ref().map(|p| config.bounds(p)),
            tenants: BTreeMap::new(),
            clients: BTreeMap::new(),
            total: DeviceBytes::default(),
            next_client: 1,
            given_back: BTreeMap::new(),
            window: config.retry.window,
            prefixes: Prefixes::default(),
            grace: Grace::default(),
            counters: BrokerCounters::default(),
            changed: false,
        }
    }

    /// The limits of `tenant` by the configuration (the default's for a tenant not named;
    /// none at all, the budget as its ceiling, for one no longer admitted).
    fn limits_of(&self, tenant: TenantId) -> TenantBounds {
        self.named
            .get(&tenant)
            .copied()
            .or(self.default)
            .unwrap_or(TenantBounds::within(0, None, self.budget))
    }

    /// The books of `tenant`, entered if it was not known.
    fn tenant_mut(&mut self, tenant: TenantId) -> &mut TenantBooks {
        let limits = self.limits_of(tenant);
        self.tenants
            .entry(tenant)
            .or_insert_with(|| TenantBooks::new(limits))
    }

    /// Forgets `tenant`, and its name unless the configuration names it, if it has no client
    /// and no bytes left.
    fn prune(&mut self, tenant: TenantId) {
        if self.tenants.get(&tenant).is_some_and(TenantBooks::is_idle) {
            self.tenants.remove(&tenant);
            self.names.forget(tenant);
        }
    }

    /// `bytes` more on `device` for `tenant` (and its `client`, if any).
    fn lend(&mut self, tenant: TenantId, client: Option<u64>, device: u32, bytes: u64) {
        if let Some(c) = client.and_then(|c| self.clients.get_mut(&c)) {
            c.held.add(device, bytes);
        }
        self.tenant_mut(tenant).held.add(device, bytes);
        self.total.add(device, bytes);
        self.changed = true;
    }

    /// `bytes` on `device` back from `tenant` (and its `client`, if any).
    fn take_back(&mut self, tenant: TenantId, client: Option<u64>, device: u32, bytes: u64) {
        if let Some(c) = client.and_then(|c| self.clients.get_mut(&c)) {
            c.held.sub(device, bytes);
        }
        if let Some(t) = self.tenants.get_mut(&tenant) {
            t.held.sub(device, bytes);
        }
        self.total.sub(device, bytes);
        self.changed = true;
        self.prune(tenant);
    }

    fn check_device(&self, device: u32) -> Result<(), BooksError> {
        if device < self.devices || device == DeviceId::HOST.0 {
            Ok(())
        } else {
            Err(BooksError::NoDevice(device))
        }
    }

    /// Registers a client of the tenant named `name` (with its floor and ceiling) and
    /// returns its number. The name is resolved here, once: the client's books hold its
    /// tenant's id.
    pub fn register(&mut self, name: &str, policy: &TenantPolicy, ceiling: u64) -> u64 {
        let id = self.next_client;
        self.next_client = self.next_client.saturating_add(1);
        self.counters.clients_registered += 1;
        let tenant = self.names.enter(name);
        let t = self.tenant_mut(tenant);
        t.limits = TenantBounds::within(policy.floor, Some(ceiling), ceiling);
        t.clients.insert(id);
        self.clients.insert(
            id,
            ClientBooks {
                tenant,
                held: DeviceBytes::default(),
            },
        );
        id
    }

    /// Bytes `client` holds on `device`.
    pub fn client_held(&self, client: u64, device: u32) -> u64 {
        self.clients.get(&client).map_or(0, |c| c.held.get(device))
    }

    /// What `client` holds on `device` once `bytes` of it go, or [`BooksError::NotHeld`]
    /// when it holds fewer.
    fn held_after(&self, client: u64, device: u32, bytes: u64) -> Result<u64, BooksError> {
        let held = self.client_held(client, device);
        held.checked_sub(bytes).ok_or(BooksError::NotHeld {
            device,
            bytes,
            held,
        })
    }

    /// Every client's holdings: (client, device, bytes), for the books check.
    pub fn holdings(&self) -> Vec<(u64, u32, u64)> {
        self.clients
            .iter()
            .flat_map(|(id, c)| c.held.iter().map(move |(d, b)| (*id, d, b)))
            .collect()
    }

    /// Bytes the tenant named `name` holds on `device`: its clients' leases, its prefixes,
    /// and what is kept for its clients' claims after a restart.
    pub fn tenant_held(&self, name: &str, device: u32) -> u64 {
        self.names.id(name).map_or(0, |t| self.held_by(t, device))
    }

    /// Bytes `tenant` holds on `device`.
    fn held_by(&self, tenant: TenantId, device: u32) -> u64 {
        self.tenants.get(&tenant).map_or(0, |t| t.held.get(device))
    }

    /// Bytes held on `device`: every client's, every prefix's, and what is kept for claims.
    pub fn total_held(&self, device: u32) -> u64 {
        self.total.get(device)
    }

    /// Every published prefix: (tenant, key, device, bytes, users).
    pub fn prefixes(&self) -> Vec<PrefixRow> {
        let mut rows = self.prefixes.rows(|t| self.names.name(t));
        rows.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        rows
    }

    /// Every prefix use: (client, key, times opened or published and not closed).
    pub fn prefix_uses(&self) -> Vec<(u64, String, u32)> {
        self.prefixes.uses()
    }

    /// The number of clients registered.
    pub fn clients(&self) -> usize {
        self.clients.len()
    }

    /// How many entries the books keep.
    pub fn entries(&self) -> BookEntries {
        let devices = self.clients.values().map(|c| c.held.len()).sum::<usize>()
            + self.tenants.values().map(|t| t.held.len()).sum::<usize>()
            + self.total.len()
            + self.given_back.len();
        BookEntries {
            tenants: self.tenants.len(),
            clients: self.clients.len(),
            devices,
            prefixes: self.prefixes.len(),
            names: self.names.len(),
        }
    }

    /// What the node has lent, per (tenant, device): what a broker started after this one
    /// must keep for the claims of its clients.
    pub fn lent(&self) -> BTreeMap<(String, u32), u64> {
        self.tenants
            .iter()
            .flat_map(|(id, t)| {
                let name = self.names.name(*id);
                t.held.iter().map(move |(d, b)| ((name.to_owned(), d), b))
            })
            .collect()
    }

    /// `map` with each tenant's name for its id.
    fn by_name(&self, map: &BTreeMap<(TenantId, u32), u64>) -> BTreeMap<(String, u32), u64> {
        map.iter()
            .map(|((t, d), b)| ((self.names.name(*t).to_owned(), *d), *b))
            .collect()
    }

    /// Whether what is lent changed since the last call.
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// The books now, with what they did since the start.
    pub fn metrics(&self) -> BrokerMetrics {
        let mut m = BrokerMetrics {
            budget: self.budget,
            clients: self.clients.len() as u64,
            tenants: self.tenants.len() as u64,
            counters: self.counters,
            ..BrokerMetrics::default()
        };
        m.held = self.lent();
        m.unclaimed = self.by_name(&self.grace.unclaimed);
        for (tenant, _, device, bytes, _) in self.prefixes.rows(|t| self.names.name(t)) {
            let p = m.prefix_bytes.entry((tenant.clone(), device)).or_default();
            *p = p.saturating_add(bytes);
            *m.prefixes.entry(tenant).or_default() += 1;
        }
        m
    }

    /// Counts a connection the acceptor could not take (`accept` failed).
    pub fn note_accept_failure(&mut self) {
        self.counters.accept_failures += 1;
    }

    /// Counts a connection refused for want of a slot.
    pub fn note_refused(&mut self) {
        self.counters.connections_refused += 1;
    }

    /// Counts a connection dropped for a late hello or a long silence.
    pub fn note_timed_out(&mut self) {
        self.counters.connections_timed_out += 1;
    }

    /// Forgets `client` (its socket closed): everything it held goes back to the node.
    /// Returns the bytes per device it held.
    pub fn drop_client(&mut self, client: u64, now: Instant) -> BTreeMap<u32, u64> {
        let Some(c) = self.clients.remove(&client) else {
            return BTreeMap::new();
        };
        self.counters.clients_dropped += 1;
        if let Some(t) = self.tenants.get_mut(&c.tenant) {
            t.clients.remove(&client);
        }
        let held: BTreeMap<u32, u64> = c.held.iter().collect();
        for (d, b) in &held {
            self.take_back(c.tenant, None, *d, *b);
            self.note_given_back(*d, *b, now);
        }
        for f in self.prefixes.drop_client(c.tenant, client) {
            self.free_prefix(c.tenant, f, now);
        }
        self.prune(c.tenant);
        held
    }

    fn tenant_of(&self, client: u64) -> Result<TenantId, BooksError> {
        self.clients
            .get(&client)
            .map(|c| c.tenant)
            .ok_or(BooksError::UnknownClient(client))
    }

    fn note_given_back(&mut self, device: u32, bytes: u64, now: Instant) {
        if bytes == 0 {
            return;
        }
        self.counters.returned_bytes = self.counters.returned_bytes.saturating_add(bytes);
        let window = self.window;
        self.given_back
            .entry(device)
            .or_default()
            .note(now, window, bytes);
    }
}

#[cfg(test)]
mod tests;
