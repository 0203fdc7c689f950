//! [`NodeBooks`]: the broker's books, what every client holds on every device, and the
//! arithmetic of floors, ceilings and the shared rest. Pure: no sockets, no threads.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use kvvm_governor::RetryPolicy;

use crate::config::{BrokerConfig, TenantPolicy};
use crate::metrics::{BrokerCounters, BrokerMetrics};
use crate::prefixes::{OpenedPrefix, PrefixRow, Prefixes, Published, MAX_PREFIXES};
use crate::proto::WireRefusal;

/// Most recent give-backs remembered per device for the retry estimate.
const MAX_EVENTS: usize = 1024;

/// One client's holdings.
#[derive(Debug, Clone)]
struct ClientBooks {
    tenant: String,
    held: BTreeMap<u32, u64>,
}

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
    /// A claim on a device where the client already holds bytes, or over its ceiling.
    #[error("claim refused on device {0}")]
    Claim(u32),
    /// No prefix of that key for the client's tenant, or the client does not use it.
    #[error("no prefix {0:?} for this client")]
    NoPrefix(String),
    /// The tenant already has a prefix of that key, or as many as it may have.
    #[error("prefix {0:?} exists")]
    PrefixExists(String),
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

/// The broker's books.
#[derive(Debug)]
pub struct NodeBooks {
    budget: u64,
    tenants: BTreeMap<String, (u64, u64)>,
    clients: BTreeMap<u64, ClientBooks>,
    next_client: u64,
    given_back: BTreeMap<u32, VecDeque<(Instant, u64)>>,
    prefixes: Prefixes,
    counters: BrokerCounters,
}

impl NodeBooks {
    /// Empty books for `config`'s budget.
    pub fn new(config: &BrokerConfig) -> Self {
        NodeBooks {
            budget: config.budget,
            tenants: BTreeMap::new(),
            clients: BTreeMap::new(),
            next_client: 1,
            given_back: BTreeMap::new(),
            prefixes: Prefixes::default(),
            counters: BrokerCounters::default(),
        }
    }

    /// Registers a client of `tenant` (with its floor and ceiling) and returns its number.
    pub fn register(&mut self, tenant: &str, policy: &TenantPolicy, ceiling: u64) -> u64 {
        self.tenants
            .insert(tenant.to_owned(), (policy.floor.min(ceiling), ceiling));
        let id = self.next_client;
        self.next_client = self.next_client.saturating_add(1);
        self.counters.clients_registered += 1;
        self.clients.insert(
            id,
            ClientBooks {
                tenant: tenant.to_owned(),
                held: BTreeMap::new(),
            },
        );
        id
    }

    /// Bytes `client` holds on `device`.
    pub fn client_held(&self, client: u64, device: u32) -> u64 {
        self.clients
            .get(&client)
            .and_then(|c| c.held.get(&device).copied())
            .unwrap_or(0)
    }

    /// Every client's holdings: (client, device, bytes), for the books check.
    pub fn holdings(&self) -> Vec<(u64, u32, u64)> {
        self.clients
            .iter()
            .flat_map(|(id, c)| c.held.iter().map(move |(d, b)| (*id, *d, *b)))
            .collect()
    }

    /// Bytes `tenant` holds on `device`: its clients' and its prefixes'.
    pub fn tenant_held(&self, tenant: &str, device: u32) -> u64 {
        self.clients
            .values()
            .filter(|c| c.tenant == tenant)
            .filter_map(|c| c.held.get(&device))
            .fold(self.prefixes.tenant_bytes(tenant, device), |a, b| {
                a.saturating_add(*b)
            })
    }

    /// Bytes held on `device`: every client's and every prefix's.
    pub fn total_held(&self, device: u32) -> u64 {
        self.clients
            .values()
            .filter_map(|c| c.held.get(&device))
            .fold(self.prefixes.total_bytes(device), |a, b| {
                a.saturating_add(*b)
            })
    }

    /// Every published prefix: (tenant, key, device, bytes, users).
    pub fn prefixes(&self) -> Vec<PrefixRow> {
        self.prefixes.rows()
    }

    /// The number of clients registered.
    pub fn clients(&self) -> usize {
        self.clients.len()
    }

    /// The books now, with what they did since the start.
    pub fn metrics(&self) -> BrokerMetrics {
        let mut m = BrokerMetrics {
            budget: self.budget,
            clients: self.clients.len() as u64,
            counters: self.counters,
            ..BrokerMetrics::default()
        };
        for c in self.clients.values() {
            for (device, bytes) in &c.held {
                let h = m.held.entry((c.tenant.clone(), *device)).or_default();
                *h = h.saturating_add(*bytes);
            }
        }
        for (tenant, _, device, bytes, _) in self.prefixes.rows() {
            let p = m.prefix_bytes.entry((tenant.clone(), device)).or_default();
            *p = p.saturating_add(bytes);
            let h = m.held.entry((tenant.clone(), device)).or_default();
            *h = h.saturating_add(bytes);
            *m.prefixes.entry(tenant).or_default() += 1;
        }
        m
    }

    /// Bytes kept free on `device` for tenants other than `tenant` that are under their floor.
    fn reserved_for_others(&self, tenant: &str, device: u32) -> u64 {
        self.tenants
            .iter()
            .filter(|(name, _)| name.as_str() != tenant)
            .map(|(name, (floor, _))| floor.saturating_sub(self.tenant_held(name, device)))
            .fold(0u64, u64::saturating_add)
    }

    /// Records bytes a client already held under a previous broker. Accepted once per device
    /// and within the tenant's ceiling; the node may then be over its budget until clients
    /// give back.
    pub fn claim(&mut self, client: u64, device: u32, bytes: u64) -> Result<u64, BooksError> {
        let tenant = self.tenant_of(client)?;
        let ceiling = self.tenants.get(&tenant).map_or(0, |t| t.1);
        let over = self.tenant_held(&tenant, device).saturating_add(bytes) > ceiling;
        let c = self
            .clients
            .get_mut(&client)
            .ok_or(BooksError::UnknownClient(client))?;
        if c.held.contains_key(&device) || over {
            return Err(BooksError::Claim(device));
        }
        c.held.insert(device, bytes);
        Ok(bytes)
    }

    fn tenant_of(&self, client: u64) -> Result<String, BooksError> {
        self.clients
            .get(&client)
            .map(|c| c.tenant.clone())
            .ok_or(BooksError::UnknownClient(client))
    }

    /// Grants `client` at least `need` and at most `want` bytes on `device`, or refuses with
    /// the asks to send to tenants over their floor. Returns the bytes granted.
    pub fn acquire(
        &mut self,
        client: u64,
        device: u32,
        need: u64,
        want: u64,
        retry: &RetryPolicy,
        now: Instant,
    ) -> Result<Result<u64, (WireRefusal, Vec<ReclaimAsk>)>, BooksError> {
        let tenant = self.tenant_of(client)?;
        let (_, ceiling) = self.tenants.get(&tenant).copied().unwrap_or((0, 0));
        let mine = self.client_held(client, device);
        let (limit, limit_bytes) = if ceiling < self.budget {
            ("tenant_ceiling", ceiling)
        } else {
            ("node_budget", self.budget)
        };
        let needed = mine.saturating_add(need);
        if needed > limit_bytes {
            let refusal = WireRefusal::NeverFits {
                needed,
                limit: limit.to_owned(),
                limit_bytes,
            };
            self.counters.never_fits += 1;
            return Ok(Err((refusal, Vec::new())));
        }
        let tenant_room = ceiling.saturating_sub(self.tenant_held(&tenant, device));
        let node_room = self
            .budget
            .saturating_sub(self.total_held(device))
            .saturating_sub(self.reserved_for_others(&tenant, device));
        let available = tenant_room.min(node_room);
        if need <= available {
            let granted = want.max(need).min(available);
            if let Some(c) = self.clients.get_mut(&client) {
                let h = c.held.entry(device).or_default();
                *h = h.saturating_add(granted);
            }
            self.counters.grants += 1;
            self.counters.granted_bytes = self.counters.granted_bytes.saturating_add(granted);
            return Ok(Ok(granted));
        }
        let shortfall = need.saturating_sub(available);
        let asks = if node_room < tenant_room {
            self.asks(&tenant, device, shortfall)
        } else {
            Vec::new()
        };
        let freed = self.given_back_in(device, now, retry.window);
        let retry_after = retry.estimate(shortfall, freed);
        let refusal = WireRefusal::Backpressure {
            needed: need,
            available,
            retry_after_ms: u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX),
        };
        self.counters.backpressure += 1;
        self.counters.reclaim_asks += asks.len() as u64;
        let asked = asks.iter().fold(0u64, |a, k| a.saturating_add(k.bytes));
        self.counters.reclaim_asked_bytes = self.counters.reclaim_asked_bytes.saturating_add(asked);
        Ok(Err((refusal, asks)))
    }

    /// Asks for `shortfall` bytes on `device` from clients of tenants (other than `tenant`)
    /// over their floor, each for at most its tenant's excess and its own holding.
    fn asks(&self, tenant: &str, device: u32, shortfall: u64) -> Vec<ReclaimAsk> {
        let mut left = shortfall;
        let mut asks = Vec::new();
        for (name, (floor, _)) in &self.tenants {
            if name == tenant || left == 0 {
                continue;
            }
            let mut excess = self.tenant_held(name, device).saturating_sub(*floor);
            for (id, c) in self.clients.iter().filter(|(_, c)| &c.tenant == name) {
                let bytes = c
                    .held
                    .get(&device)
                    .copied()
                    .unwrap_or(0)
                    .min(excess)
                    .min(left);
                if bytes > 0 {
                    asks.push(ReclaimAsk {
                        client: *id,
                        device,
                        bytes,
                    });
                    excess -= bytes;
                    left -= bytes;
                }
            }
        }
        asks
    }

    /// Takes `bytes` on `device` back from `client`; more than it holds changes nothing.
    /// Returns what it holds now.
    pub fn give_back(
        &mut self,
        client: u64,
        device: u32,
        bytes: u64,
        now: Instant,
    ) -> Result<u64, BooksError> {
        let c = self
            .clients
            .get_mut(&client)
            .ok_or(BooksError::UnknownClient(client))?;
        let held = c.held.get(&device).copied().unwrap_or(0);
        let rest = held.checked_sub(bytes).ok_or(BooksError::NotHeld {
            device,
            bytes,
            held,
        })?;
        c.held.insert(device, rest);
        self.note_given_back(device, bytes, now);
        Ok(rest)
    }

    /// Forgets `client` (its socket closed): everything it held goes back to the node.
    /// Returns the bytes per device it held.
    pub fn drop_client(&mut self, client: u64, now: Instant) -> BTreeMap<u32, u64> {
        let removed = self.clients.remove(&client);
        if removed.is_some() {
            self.counters.clients_dropped += 1;
        }
        let held = removed.map(|c| c.held).unwrap_or_default();
        for (d, b) in &held {
            self.note_given_back(*d, *b, now);
        }
        for (d, b) in self.prefixes.drop_client(client) {
            self.note_given_back(d, b, now);
        }
        held
    }

    /// `client` publishes `key` (its handles, their sizes, the device and the `meta` its
    /// readers get with them): the bytes move
    /// from its holding to the prefix (billed once, to its tenant) and it is the first user.
    /// Returns what the client holds now.
    pub fn publish_prefix(
        &mut self,
        client: u64,
        key: &str,
        published: Published,
    ) -> Result<u64, BooksError> {
        let device = published.device;
        let bytes = published
            .sizes
            .iter()
            .try_fold(0u64, |a, s| a.checked_add(*s))
            .unwrap_or(u64::MAX);
        let tenant = self.tenant_of(client)?;
        if self.prefixes.contains(&tenant, key) || self.prefixes.count(&tenant) >= MAX_PREFIXES {
            return Err(BooksError::PrefixExists(key.to_owned()));
        }
        let held = self.client_held(client, device);
        let rest = held.checked_sub(bytes).ok_or(BooksError::NotHeld {
            device,
            bytes,
            held,
        })?;
        if let Some(c) = self.clients.get_mut(&client) {
            c.held.insert(device, rest);
        }
        self.prefixes.publish(&tenant, key, client, published);
        Ok(rest)
    }

    /// Opens the tenant's prefix `key` for `client` (not billed again).
    pub fn open_prefix(&mut self, client: u64, key: &str) -> Result<OpenedPrefix, BooksError> {
        let tenant = self.tenant_of(client)?;
        self.prefixes
            .open(&tenant, key, client)
            .ok_or_else(|| BooksError::NoPrefix(key.to_owned()))
    }

    /// `client` lets go of `key` once; the last user's close frees it. Returns the users left.
    pub fn close_prefix(
        &mut self,
        client: u64,
        key: &str,
        now: Instant,
    ) -> Result<usize, BooksError> {
        let tenant = self.tenant_of(client)?;
        let (left, freed) = self
            .prefixes
            .close(&tenant, key, client)
            .ok_or_else(|| BooksError::NoPrefix(key.to_owned()))?;
        if let Some((d, b)) = freed {
            self.note_given_back(d, b, now);
        }
        Ok(left)
    }

    fn note_given_back(&mut self, device: u32, bytes: u64, now: Instant) {
        if bytes == 0 {
            return;
        }
        self.counters.returned_bytes = self.counters.returned_bytes.saturating_add(bytes);
        let q = self.given_back.entry(device).or_default();
        if q.len() >= MAX_EVENTS {
            q.pop_front();
        }
        q.push_back((now, bytes));
    }

    fn given_back_in(&mut self, device: u32, now: Instant, window: Duration) -> u64 {
        self.given_back.get_mut(&device).map_or(0, |q| {
            q.retain(|(t, _)| now.saturating_duration_since(*t) <= window);
            q.iter().fold(0u64, |a, (_, b)| a.saturating_add(*b))
        })
    }
}

#[cfg(test)]
#[path = "books_tests.rs"]
mod tests;
