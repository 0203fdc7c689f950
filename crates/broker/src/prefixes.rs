//! [`Prefixes`]: prefixes published to the broker, as the exported handles (descriptors) of
//! their physical memory. A prefix is billed once, to its tenant, for as long as any client
//! uses it; only clients of its tenant can open it (a key of another tenant is not found).

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;

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
    map: BTreeMap<(String, String), Entry>,
}

/// One prefix as the books see it: (tenant, key, device, bytes, users).
pub type PrefixRow = (String, String, u32, u64, u32);

impl Prefixes {
    /// Bytes of `tenant`'s prefixes on `device`.
    pub fn tenant_bytes(&self, tenant: &str, device: u32) -> u64 {
        self.map
            .iter()
            .filter(|((t, _), e)| t == tenant && e.device == device)
            .fold(0u64, |a, (_, e)| a.saturating_add(e.bytes))
    }

    /// Bytes of every prefix on `device`.
    pub fn total_bytes(&self, device: u32) -> u64 {
        self.map
            .values()
            .filter(|e| e.device == device)
            .fold(0u64, |a, e| a.saturating_add(e.bytes))
    }

    /// How many prefixes `tenant` has published.
    pub fn count(&self, tenant: &str) -> usize {
        self.map.keys().filter(|(t, _)| t == tenant).count()
    }

    /// Whether `tenant` has a prefix `key`.
    pub fn contains(&self, tenant: &str, key: &str) -> bool {
        self.map.contains_key(&(tenant.to_owned(), key.to_owned()))
    }

    /// Records a prefix published by `client`, its first user.
    pub fn publish(&mut self, tenant: &str, key: &str, client: u64, published: Published) {
        let users = BTreeMap::from([(client, 1)]);
        let Published {
            device,
            sizes,
            meta,
            fds,
        } = published;
        let bytes = sizes.iter().fold(0u64, |a, s| a.saturating_add(*s));
        let entry = Entry {
            device,
            bytes,
            sizes,
            meta,
            users,
            fds,
        };
        self.map.insert((tenant.to_owned(), key.to_owned()), entry);
    }

    /// Opens `tenant`'s prefix `key` for `client`: `None` if there is none (or duplicating
    /// its handles failed, which changes nothing).
    pub fn open(&mut self, tenant: &str, key: &str, client: u64) -> Option<OpenedPrefix> {
        let e = self.map.get_mut(&(tenant.to_owned(), key.to_owned()))?;
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

    /// `client` lets go of `tenant`'s prefix `key` once. Returns the users left, and the
    /// (device, bytes) freed when it was the last; `None` if the client was not a user.
    pub fn close(
        &mut self,
        tenant: &str,
        key: &str,
        client: u64,
    ) -> Option<(usize, Option<(u32, u64)>)> {
        let k = (tenant.to_owned(), key.to_owned());
        let e = self.map.get_mut(&k)?;
        let n = e.users.get_mut(&client)?;
        *n -= 1;
        if *n == 0 {
            e.users.remove(&client);
        }
        let left = e.users.len();
        if left > 0 {
            return Some((left, None));
        }
        let e = self.map.remove(&k)?;
        Some((0, Some((e.device, e.bytes))))
    }

    /// Drops every use of `client` (its socket closed); returns the (device, bytes) of the
    /// prefixes it was the last user of, which are freed.
    pub fn drop_client(&mut self, client: u64) -> Vec<(u32, u64)> {
        for e in self.map.values_mut() {
            e.users.remove(&client);
        }
        let freed: Vec<(String, String)> = self
            .map
            .iter()
            .filter(|(_, e)| e.users.is_empty())
            .map(|(k, _)| k.clone())
            .collect();
        freed
            .into_iter()
            .filter_map(|k| self.map.remove(&k))
            .map(|e| (e.device, e.bytes))
            .collect()
    }

    /// Every prefix: (tenant, key, device, bytes, users).
    pub fn rows(&self) -> Vec<PrefixRow> {
        self.map
            .iter()
            .map(|((t, k), e)| {
                let users = u32::try_from(e.users.len()).unwrap_or(u32::MAX);
                (t.clone(), k.clone(), e.device, e.bytes, users)
            })
            .collect()
    }
}
