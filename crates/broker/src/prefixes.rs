//! [`Prefixes`]: prefixes published to the broker, as the exported handles (descriptors) of
//! their physical memory. A prefix is billed once, to its tenant, for as long as any client
//! uses it; only clients of its tenant can open it (a key of another tenant is not found).
//!
//! After a restart, the clients that used a prefix under the previous broker claim their
//! uses again ([`Prefixes::claim`]): the prefix is billed again, without descriptors (they
//! died with the previous broker), so it cannot be opened until it is published anew.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;

use kvvm_governor::TenantId;

/// The most prefixes one tenant may have published at once (each holds descriptors open in
/// the broker).
pub const MAX_PREFIXES: usize = 256;

/// One published prefix.
#[derive(Debug)]
struct Entry {
    device: u32,
    bytes: u64,
    sizes: Vec<u64>,
    meta: String,
    /// Client → how many times it opened (or published) the prefix and has not closed it.
    users: BTreeMap<u64, u32>,
    /// Empty for a prefix claimed after a restart and not published since.
    fds: Vec<OwnedFd>,
}

/// What a client gets when it opens a prefix: where it lives and its handles.
#[derive(Debug)]
pub struct OpenedPrefix {
    /// The device index.
    pub device: u32,
    /// The size of each handle.
    pub sizes: Vec<u64>,
    /// The handles, duplicated for the client, in the order of `sizes`.
    pub fds: Vec<OwnedFd>,
    /// What the publisher said its readers need besides the descriptors.
    pub meta: String,
}

/// What a client publishes: where the prefix lives, its handles and what its readers need.
#[derive(Debug)]
pub struct Published {
    /// The device index.
    pub device: u32,
    /// The size of each handle.
    pub sizes: Vec<u64>,
    /// What its readers need besides the descriptors (carried as is).
    pub meta: String,
    /// The handles, in the order of `sizes`.
    pub fds: Vec<OwnedFd>,
}

/// Every published prefix, by (tenant, key).
#[derive(Debug, Default)]
pub struct Prefixes {
    map: BTreeMap<(TenantId, String), Entry>,
    /// Descriptors held, over every prefix.
    descriptors: usize,
}

/// One prefix as the books see it: (tenant, key, device, bytes, users).
pub type PrefixRow = (String, String, u32, u64, u32);

/// A prefix freed with its last user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Freed {
    /// Its device.
    pub device: u32,
    /// Its bytes.
    pub bytes: u64,
    /// Whether it was claimed after a restart (not published since): users of the previous
    /// broker may still come to claim it.
    pub claimed: bool,
}

impl Freed {
    fn of(e: &Entry) -> Freed {
        Freed {
            device: e.device,
            bytes: e.bytes,
            claimed: e.fds.is_empty(),
        }
    }
}

/// What a claim of a prefix use found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixClaim {
    /// The prefix is billed already (published again, or claimed by another user): the use
    /// was added; the users it has now.
    Joined(usize),
    /// No such prefix: the caller bills its bytes, then [`Prefixes::insert_claimed`].
    Absent,
    /// A prefix of that key on another device or of another size, or the client uses it
    /// already: nothing changed.
    Mismatch,
}

fn key(tenant: TenantId, key: &str) -> (TenantId, String) {
    (tenant, key.to_owned())
}

impl Prefixes {
    /// `tenant`'s prefixes.
    fn of(&self, tenant: TenantId) -> impl Iterator<Item = (&String, &Entry)> + '_ {
        self.map
            .range(key(tenant, "")..)
            .take_while(move |((t, _), _)| *t == tenant)
            .map(|((_, k), e)| (k, e))
    }

    /// How many prefixes `tenant` has published.
    pub fn count(&self, tenant: TenantId) -> usize {
        self.of(tenant).count()
    }

    /// Descriptors the broker holds for every prefix.
    pub fn descriptors(&self) -> usize {
        self.descriptors
    }

    /// How many prefixes there are.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether `tenant` has a prefix `key`.
    pub fn contains(&self, tenant: TenantId, key_: &str) -> bool {
        self.map.contains_key(&key(tenant, key_))
    }

    /// Records a prefix published by `client`, its first user.
    pub fn publish(&mut self, tenant: TenantId, key_: &str, client: u64, published: Published) {
        let Published {
            device,
            sizes,
            meta,
            fds,
        } = published;
        let bytes = sizes.iter().fold(0u64, |a, s| a.saturating_add(*s));
        self.descriptors = self.descriptors.saturating_add(fds.len());
        let entry = Entry {
            device,
            bytes,
            sizes,
            meta,
            users: BTreeMap::from([(client, 1)]),
            fds,
        };
        self.map.insert(key(tenant, key_), entry);
    }

    /// Opens `tenant`'s prefix `key` for `client`: `None` if there is none, if it has no
    /// descriptors (claimed after a restart), or if duplicating them failed (which changes
    /// nothing).
    pub fn open(&mut self, tenant: TenantId, key_: &str, client: u64) -> Option<OpenedPrefix> {
        let e = self.map.get_mut(&key(tenant, key_))?;
        if e.fds.is_empty() {
            return None;
        }
        let fds = e
            .fds
            .iter()
            .map(OwnedFd::try_clone)
            .collect::<Result<Vec<_>, _>>()
            .ok()?;
        let n = e.users.entry(client).or_default();
        *n = n.saturating_add(1);
        Some(OpenedPrefix {
            device: e.device,
            sizes: e.sizes.clone(),
            fds,
            meta: e.meta.clone(),
        })
    }

    /// A client that used `tenant`'s prefix `key` (on `device`, of `bytes`) `uses` times
    /// under a previous broker claims those uses.
    pub fn claim(
        &mut self,
        tenant: TenantId,
        key_: &str,
        client: u64,
        (device, bytes): (u32, u64),
        uses: u32,
    ) -> PrefixClaim {
        let Some(e) = self.map.get_mut(&key(tenant, key_)) else {
            return PrefixClaim::Absent;
        };
        if e.device != device || e.bytes != bytes || e.users.contains_key(&client) {
            return PrefixClaim::Mismatch;
        }
        e.users.insert(client, uses);
        PrefixClaim::Joined(e.users.len())
    }

    /// Records a prefix that `client` claimed `uses` times and nobody billed yet (its
    /// descriptors are gone: it cannot be opened until it is published again).
    pub fn insert_claimed(
        &mut self,
        tenant: TenantId,
        key_: &str,
        client: u64,
        (device, bytes): (u32, u64),
        uses: u32,
    ) {
        let entry = Entry {
            device,
            bytes,
            sizes: Vec::new(),
            meta: String::new(),
            users: BTreeMap::from([(client, uses)]),
            fds: Vec::new(),
        };
        self.map.insert(key(tenant, key_), entry);
    }

    /// `client` lets go of `tenant`'s prefix `key` once. Returns the users left, and the
    /// prefix freed when it was the last; `None` if the client was not a user.
    pub fn close(
        &mut self,
        tenant: TenantId,
        key_: &str,
        client: u64,
    ) -> Option<(usize, Option<Freed>)> {
        let k = key(tenant, key_);
        let e = self.map.get_mut(&k)?;
        let n = e.users.get_mut(&client)?;
        *n = n.saturating_sub(1);
        if *n == 0 {
            e.users.remove(&client);
        }
        let left = e.users.len();
        if left > 0 {
            return Some((left, None));
        }
        let e = self.remove(&k)?;
        Some((0, Some(Freed::of(&e))))
    }

    fn remove(&mut self, k: &(TenantId, String)) -> Option<Entry> {
        let e = self.map.remove(k)?;
        self.descriptors = self.descriptors.saturating_sub(e.fds.len());
        Some(e)
    }

    /// Drops every use of `client` of `tenant` (its socket closed); returns the prefixes it
    /// was the last user of, which are freed.
    pub fn drop_client(&mut self, tenant: TenantId, client: u64) -> Vec<Freed> {
        let mut freed = Vec::new();
        for (k, e) in self.map.range_mut(key(tenant, "")..) {
            if k.0 != tenant {
                break;
            }
            if e.users.remove(&client).is_some() && e.users.is_empty() {
                freed.push(k.clone());
            }
        }
        freed
            .iter()
            .filter_map(|k| self.remove(k))
            .map(|e| Freed::of(&e))
            .collect()
    }

    /// Every prefix: (tenant, key, device, bytes, users), the tenant named by `name`.
    pub fn rows<'a>(&self, name: impl Fn(TenantId) -> &'a str) -> Vec<PrefixRow> {
        self.map
            .iter()
            .map(|((t, k), e)| {
                let users = u32::try_from(e.users.len()).unwrap_or(u32::MAX);
                (name(*t).to_owned(), k.clone(), e.device, e.bytes, users)
            })
            .collect()
    }

    /// Every use: (client, key, times opened or published and not closed).
    pub fn uses(&self) -> Vec<(u64, String, u32)> {
        self.map
            .iter()
            .flat_map(|((_, k), e)| e.users.iter().map(move |(c, n)| (*c, k.clone(), *n)))
            .collect()
    }
}
