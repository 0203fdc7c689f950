//! [`BrokerConfig`]: the node's budget, the tenants' floors and ceilings, and the limits a
//! broker puts on its clients.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvvm_governor::{Clock, RetryPolicy, SystemClock, TenantBounds};

use crate::error::BrokerError;

/// What one tenant is guaranteed and allowed, per device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantPolicy {
    /// Bytes the tenant is always able to hold: other tenants are asked to give back when
    /// the tenant needs them.
    pub floor: u64,
    /// The most the tenant may hold (`None`: the node's budget).
    pub ceiling: Option<u64>,
    /// The token its clients must present (`None`: none needed).
    pub token: Option<String>,
    /// The user ids whose processes may be this tenant, checked against the socket peer's
    /// credentials (`SO_PEERCRED`) at hello (`None`: any user that may open the socket).
    pub users: Option<Vec<u32>>,
}

impl Default for TenantPolicy {
    /// No floor, no ceiling below the node's budget, no token, any user.
    fn default() -> Self {
        TenantPolicy {
            floor: 0,
            ceiling: None,
            token: None,
            users: None,
        }
    }
}

/// Configuration of a broker.
#[derive(Debug, Clone)]
pub struct BrokerConfig {
    /// The Unix socket the broker listens on.
    pub socket: PathBuf,
    /// The file mode of the socket (who may connect): `0o600` by default.
    pub socket_mode: u32,
    /// The node's KV budget on every device, in bytes.
    pub budget: u64,
    /// Named tenants.
    pub tenants: BTreeMap<String, TenantPolicy>,
    /// The policy of tenants not named (`None`: unnamed tenants are refused).
    pub default_tenant: Option<TenantPolicy>,
    /// The most connections served at once (registered clients and connections that have
    /// not said hello yet).
    pub max_clients: usize,
    /// The most connections of one user (the peer's user id) at once: one user cannot take
    /// every slot.
    pub max_clients_per_user: usize,
    /// How long a new connection has to say hello before it is dropped.
    pub hello_timeout: Duration,
    /// How long a registered client may stay silent (no complete message) before it is
    /// dropped; clients ping at a quarter of it ([`Reply::Welcome`](crate::Reply::Welcome)
    /// tells them).
    pub idle_timeout: Duration,
    /// The devices budgeted: indices `0..devices`, and the host's page-locked memory
    /// ([`kvvm_hal::DeviceId::HOST`], device number `u32::MAX`); a request on another is
    /// refused.
    pub devices: u32,
    /// The most descriptors the broker keeps for published prefixes, over all tenants.
    pub max_prefix_descriptors: usize,
    /// Where the broker records what it has lent, for the broker started after it (`None`:
    /// beside the socket, `<socket>.books`).
    pub books_file: Option<PathBuf>,
    /// After a restart, how long the bytes a previous broker had lent are kept for the
    /// claims of its clients (nothing new is granted out of them until then); the kept bytes
    /// go as soon as every one is claimed.
    pub restart_grace: Duration,
    /// Messages a client may send at once before the rate limit applies.
    pub burst: u32,
    /// Messages per second a client may send in the long run.
    pub messages_per_second: u32,
    /// How `retry_after` is estimated (the governor's policy over bytes given back).
    pub retry: RetryPolicy,
    /// The clock of the rate limit and the retry estimate.
    pub clock: Arc<dyn Clock>,
    /// A file the broker's metrics are written to in Prometheus' text format (for
    /// node_exporter's textfile collector; `None`: none).
    pub metrics_file: Option<PathBuf>,
    /// How often the metrics file is rewritten.
    pub metrics_interval: Duration,
}

impl BrokerConfig {
    /// A broker on `socket` with `budget` bytes per device on 64 devices, unnamed tenants
    /// welcome with no floor, 64 connections (32 per user), a hello within 5 s and a message
    /// at least every 60 s, bursts of 256 messages and 1000 messages per second per client,
    /// 4096 prefix descriptors, a grace of 10 s after a restart, no metrics file (every 5 s
    /// once one is set).
    pub fn new(socket: impl Into<PathBuf>, budget: u64) -> Self {
        BrokerConfig {
            socket: socket.into(),
            socket_mode: 0o600,
            budget,
            tenants: BTreeMap::new(),
            default_tenant: Some(TenantPolicy::default()),
            max_clients: 64,
            max_clients_per_user: 32,
            hello_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            devices: 64,
            max_prefix_descriptors: 4096,
            books_file: None,
            restart_grace: Duration::from_secs(10),
            burst: 256,
            messages_per_second: 1000,
            retry: RetryPolicy::default(),
            clock: Arc::new(SystemClock),
            metrics_file: None,
            metrics_interval: Duration::from_secs(5),
        }
    }

    /// Adds (or replaces) a named tenant.
    #[must_use]
    pub fn tenant(mut self, name: impl Into<String>, policy: TenantPolicy) -> Self {
        self.tenants.insert(name.into(), policy);
        self
    }

    /// The policy of `tenant`, if it may connect.
    pub fn policy(&self, tenant: &str) -> Option<&TenantPolicy> {
        self.tenants.get(tenant).or(self.default_tenant.as_ref())
    }

    /// The tenant's floor and ceiling of the node's budget: the ceiling at most the budget,
    /// the floor at most the ceiling.
    pub fn bounds(&self, policy: &TenantPolicy) -> TenantBounds {
        TenantBounds::within(policy.floor, policy.ceiling, self.budget)
    }

    /// Where the broker records what it has lent ([`books_file`](Self::books_file), or
    /// `<socket>.books`).
    pub fn books_path(&self) -> PathBuf {
        self.books_file.clone().unwrap_or_else(|| {
            let mut p = self.socket.as_os_str().to_owned();
            p.push(".books");
            PathBuf::from(p)
        })
    }

    /// Checks that the configuration can be served: floors within their ceilings and
    /// together within the budget, ceilings within the budget, a socket mode of permission
    /// bits only, some tenant admitted, and every limit and timeout above zero.
    pub fn validate(&self) -> Result<(), BrokerError> {
        let bad = |m: String| Err(BrokerError::Config(m));
        let mut floors = 0u64;
        for (name, p) in &self.tenants {
            if let Some(c) = p.ceiling.filter(|c| *c > self.budget) {
                return bad(format!(
                    "tenant {name}: ceiling {c} over the budget of {}",
                    self.budget
                ));
            }
            let ceiling = self.bounds(p).ceiling;
            if p.floor > ceiling {
                return bad(format!(
                    "tenant {name}: floor {} over its ceiling {ceiling}",
                    p.floor
                ));
            }
            floors = floors.saturating_add(p.floor);
        }
        if floors > self.budget {
            return bad(format!(
                "the floors add up to {floors} bytes, over the budget of {}",
                self.budget
            ));
        }
        if self.socket_mode > 0o777 {
            return bad(format!(
                "socket mode {:o}: permission bits only (0..=777)",
                self.socket_mode
            ));
        }
        if self.default_tenant.is_none() && self.tenants.is_empty() {
            return bad("no tenant may connect: name one, or admit tenants not named".into());
        }
        let zero = [
            ("metrics_interval", self.metrics_interval.is_zero()),
            ("hello_timeout", self.hello_timeout.is_zero()),
            ("idle_timeout", self.idle_timeout.is_zero()),
            ("max_clients", self.max_clients == 0),
            ("max_clients_per_user", self.max_clients_per_user == 0),
            ("burst", self.burst == 0),
            ("devices", self.devices == 0),
        ];
        if let Some((name, _)) = zero.iter().find(|(_, z)| *z) {
            return bad(format!("{name} must be above zero"));
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn refused(c: &BrokerConfig) -> String {
        match c.validate() {
            Err(BrokerError::Config(why)) => why,
            other => format!("{other:?}"),
        }
    }

    #[test]
    fn a_configuration_that_cannot_be_served_is_refused_with_the_reason() {
        let base = || BrokerConfig::new("/x.sock", 100);
        assert!(base().validate().is_ok());
        let floor = |f: u64, c: Option<u64>| TenantPolicy {
            floor: f,
            ceiling: c,
            ..TenantPolicy::default()
        };
        assert!(refused(&base().tenant("a", floor(0, Some(101)))).contains("ceiling 101 over"));
        assert!(base().tenant("a", floor(0, Some(100))).validate().is_ok());
        assert!(refused(&base().tenant("a", floor(60, Some(50)))).contains("floor 60 over"));
        assert!(base().tenant("a", floor(50, Some(50))).validate().is_ok());
        let two = base()
            .tenant("a", floor(60, None))
            .tenant("b", floor(41, None));
        assert!(refused(&two).contains("add up to 101"));
        let exact = base()
            .tenant("a", floor(60, None))
            .tenant("b", floor(40, None));
        assert!(exact.validate().is_ok());
        let mut c = base();
        c.socket_mode = 0o1777;
        assert!(refused(&c).contains("permission bits"));
        c.socket_mode = 0o777;
        assert!(c.validate().is_ok());
        c.default_tenant = None;
        assert!(refused(&c).contains("no tenant may connect"));
        assert!(c.clone().tenant("a", floor(0, None)).validate().is_ok());
        for (name, set) in [
            (
                "metrics_interval",
                (|c: &mut BrokerConfig| c.metrics_interval = Duration::ZERO)
                    as fn(&mut BrokerConfig),
            ),
            ("hello_timeout", |c| c.hello_timeout = Duration::ZERO),
            ("idle_timeout", |c| c.idle_timeout = Duration::ZERO),
            ("max_clients", |c| c.max_clients = 0),
            ("max_clients_per_user", |c| c.max_clients_per_user = 0),
            ("burst", |c| c.burst = 0),
            ("devices", |c| c.devices = 0),
        ] {
            let mut c = base();
            set(&mut c);
            assert_eq!(refused(&c), format!("{name} must be above zero"));
        }
        assert_eq!(base().books_path(), PathBuf::from("/x.sock.books"));
        let mut c = base();
        c.books_file = Some("/elsewhere".into());
        assert_eq!(c.books_path(), PathBuf::from("/elsewhere"));
    }
}
