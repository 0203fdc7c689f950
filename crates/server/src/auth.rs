//! API keys and who owns what: bearer authentication (`Authorization: Bearer <key>`), the
//! [`Owner`] of a sequence, each key's [`Role`], and where keys come from (`--api-key`, a keys
//! file, the `KVVM_API_KEYS` environment variable; `--operator-key`, `KVVM_OPERATOR_KEYS`).
//!
//! Without keys every client is the one anonymous owner: the limits per key then apply to
//! all clients together, and everything the server shows is that owner's. With keys each
//! tenant key is an owner: it sees, grows and releases only its own sequences (another key's
//! are 404, as if they did not exist), has its own prefix cache namespace unless the cache is
//! shared explicitly, and sees no figure that moves with another key's activity (the global
//! `/metrics`, the global count of `/healthz`). Those are for an operator key, which reads
//! `/metrics` and all of `/healthz` and uses no sequence.

use std::fmt;

use crate::error::{ServeError, ServiceError};

/// Who owns a sequence: the index of an API key, or [`Owner::ANONYMOUS`] without keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Owner(pub u32);

impl Owner {
    /// Every client of a server without keys.
    pub const ANONYMOUS: Owner = Owner(0);
}

/// What a caller may do and see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Every client of a server without keys: the API, and everything the server shows (all
    /// of it is this one owner's).
    Anonymous,
    /// A tenant's key: its own sequences; not `/metrics`, whose figures are every key's.
    Tenant,
    /// An operator's key (a metrics scraper, a dashboard): `/metrics` and all of `/healthz`;
    /// no sequence routes.
    Operator,
}

/// An authenticated caller: its owner id, its role and a name for logs (never the key
/// itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The owner of what it creates.
    pub owner: Owner,
    /// The key's name (`key-N` unless the keys file names it), or `anonymous`.
    pub name: String,
    /// What it may do and see.
    pub role: Role,
}

impl Principal {
    /// Whether it may use the sequence routes (`/v1/...`).
    pub fn may_use_sequences(&self) -> bool {
        self.role != Role::Operator
    }

    /// Whether it may see figures that move with every owner's activity (`/metrics`, the
    /// global counts of `/healthz`).
    pub fn sees_every_owner(&self) -> bool {
        self.role != Role::Tenant
    }
}

struct Key {
    name: String,
    secret: Vec<u8>,
    operator: bool,
}

/// The API keys a server accepts; empty: no authentication.
#[derive(Default)]
pub struct ApiKeys {
    keys: Vec<Key>,
}

impl fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Names only: a key never reaches a log.
        let names: Vec<&str> = self.keys.iter().map(|k| k.name.as_str()).collect();
        f.debug_struct("ApiKeys").field("names", &names).finish()
    }
}

impl Clone for ApiKeys {
    fn clone(&self) -> Self {
        ApiKeys {
            keys: self
                .keys
                .iter()
                .map(|k| Key {
                    name: k.name.clone(),
                    secret: k.secret.clone(),
                    operator: k.operator,
                })
                .collect(),
        }
    }
}

/// Equal in time independent of where the bytes differ (the length may leak; keys are long).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl ApiKeys {
    /// No keys: no authentication.
    pub fn none() -> Self {
        ApiKeys::default()
    }

    /// Whether any key is configured.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether a tenant key is configured but no operator key: then no key may read
    /// `/metrics`.
    pub fn lacks_operator(&self) -> bool {
        self.keys.iter().any(|k| !k.operator) && !self.keys.iter().any(|k| k.operator)
    }

    /// Adds one tenant key: `KEY` or `NAME:KEY`. A key is at least 16 visible ASCII
    /// characters without spaces (a short key is guessable).
    pub fn add(&mut self, entry: &str) -> Result<(), ServeError> {
        self.add_key(entry, false)
    }

    /// Adds one operator key (`KEY` or `NAME:KEY`, as [`add`](Self::add)).
    pub fn add_operator(&mut self, entry: &str) -> Result<(), ServeError> {
        self.add_key(entry, true)
    }

    fn add_key(&mut self, entry: &str, operator: bool) -> Result<(), ServeError> {
        let entry = entry.trim();
        let (name, secret) = match entry.split_once(':') {
            Some((n, k)) if !n.is_empty() => (n.trim().to_owned(), k.trim()),
            _ if operator => (format!("operator-{}", self.keys.len() + 1), entry),
            _ => (format!("key-{}", self.keys.len() + 1), entry),
        };
        if secret.len() < 16 || !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ServeError::Refused(format!(
                "API key {name:?} must be at least 16 visible ASCII characters without spaces"
            )));
        }
        if self
            .keys
            .iter()
            .any(|k| constant_time_eq(&k.secret, secret.as_bytes()))
        {
            return Err(ServeError::Refused(format!(
                "API key {name:?} is given twice"
            )));
        }
        if self.keys.iter().any(|k| k.name == name) {
            return Err(ServeError::Refused(format!(
                "two API keys are named {name:?}"
            )));
        }
        self.keys.push(Key {
            name,
            secret: secret.as_bytes().to_vec(),
            operator,
        });
        Ok(())
    }

    /// Adds every entry of a keys file's text: one `KEY` or `NAME:KEY` a line; blank lines
    /// and lines starting with `#` are skipped.
    pub fn add_lines(&mut self, text: &str) -> Result<(), ServeError> {
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .try_for_each(|l| self.add(l))
    }

    /// Adds the comma-separated tenant keys of an environment variable's value.
    pub fn add_list(&mut self, list: &str) -> Result<(), ServeError> {
        entries(list).try_for_each(|e| self.add(e))
    }

    /// Adds the comma-separated operator keys of an environment variable's value.
    pub fn add_operator_list(&mut self, list: &str) -> Result<(), ServeError> {
        entries(list).try_for_each(|e| self.add_operator(e))
    }

    /// Who sends this `Authorization` header value (`None`: no header). Without keys every
    /// caller is anonymous; with keys a missing or unknown key is 401. (Two headers are
    /// refused before this, as a bad request.)
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Principal, ServiceError> {
        if self.keys.is_empty() {
            return Ok(Principal {
                owner: Owner::ANONYMOUS,
                name: "anonymous".into(),
                role: Role::Anonymous,
            });
        }
        let header = authorization.ok_or_else(|| {
            ServiceError::Unauthorized("an API key is required: Authorization: Bearer <key>".into())
        })?;
        let token = header
            .strip_prefix(b"Bearer ")
            .or_else(|| header.strip_prefix(b"bearer "))
            .map(|t| t.trim_ascii())
            .ok_or_else(|| {
                ServiceError::Unauthorized("expected Authorization: Bearer <key>".into())
            })?;
        // Compare with every key, so that the time does not say which one matched.
        let mut found = None;
        for (i, k) in self.keys.iter().enumerate() {
            if constant_time_eq(&k.secret, token) && found.is_none() {
                found = Some(i);
            }
        }
        let i = found.ok_or_else(|| ServiceError::Unauthorized("unknown API key".into()))?;
        let key = self.keys.get(i);
        let name = key.map(|k| k.name.clone()).unwrap_or_default();
        let role = match key {
            Some(k) if k.operator => Role::Operator,
            _ => Role::Tenant,
        };
        let index = u32::try_from(i).unwrap_or(u32::MAX);
        Ok(Principal {
            owner: Owner(index.saturating_add(1)),
            name,
            role,
        })
    }
}

/// The non-empty entries of a comma-separated list.
fn entries(list: &str) -> impl Iterator<Item = &str> {
    list.split(',').map(str::trim).filter(|e| !e.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_authenticate_by_bearer_and_are_never_logged() {
        let mut keys = ApiKeys::none();
        assert_eq!(
            keys.authenticate(None).map(|p| p.owner),
            Ok(Owner::ANONYMOUS)
        );
        keys.add_lines("# team keys\nalice:aaaaaaaaaaaaaaaaaaaa\n\nbbbbbbbbbbbbbbbbbbbb\n")
            .unwrap();
        assert_eq!(keys.len(), 2);
        let a = keys
            .authenticate(Some(b"Bearer aaaaaaaaaaaaaaaaaaaa"))
            .unwrap();
        assert_eq!((a.owner, a.name.as_str()), (Owner(1), "alice"));
        let b = keys
            .authenticate(Some(b"Bearer bbbbbbbbbbbbbbbbbbbb"))
            .unwrap();
        assert_eq!((b.owner, b.name.as_str()), (Owner(2), "key-2"));
        for bad in [
            None,
            Some(&b"Bearer cccccccccccccccccccc"[..]),
            Some(&b"Basic aaaaaaaaaaaaaaaaaaaa"[..]),
            Some(&b"Bearer aaaaaaaaaaaaaaaaaaa"[..]),
        ] {
            let e = keys.authenticate(bad).unwrap_err();
            assert_eq!(e.status(), 401, "{bad:?}");
        }
        assert!(!format!("{keys:?}").contains("aaaa"));
        assert!(keys.add("short").is_err());
        assert!(keys.add("carol:aaaaaaaaaaaaaaaaaaaa").is_err());
        assert_eq!(a.role, Role::Tenant);
        assert!(a.may_use_sequences() && !a.sees_every_owner());
        assert!(keys.lacks_operator());
    }

    #[test]
    fn operator_keys_read_everything_and_use_no_sequence() {
        let mut keys = ApiKeys::none();
        let anonymous = keys.authenticate(None).unwrap();
        assert!(anonymous.may_use_sequences() && anonymous.sees_every_owner());
        keys.add("alice:aaaaaaaaaaaaaaaaaaaa").unwrap();
        keys.add_operator_list(" oooooooooooooooooooo ,").unwrap();
        assert!(!keys.lacks_operator());
        let o = keys
            .authenticate(Some(b"Bearer oooooooooooooooooooo"))
            .unwrap();
        assert_eq!((o.role, o.name.as_str()), (Role::Operator, "operator-2"));
        assert!(!o.may_use_sequences() && o.sees_every_owner());
        // One secret is one key, whatever its role.
        assert!(keys.add_operator("aaaaaaaaaaaaaaaaaaaa").is_err());
        assert!(keys.add("oooooooooooooooooooo").is_err());
    }
}
