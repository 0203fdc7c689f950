//! [`BrokerConfig`]: the node's budget, the tenants' floors and ceilings, and the limits a
//! broker puts on its clients.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvvm_governor::{Clock, RetryPolicy, SystemClock};

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
    /// The most clients served at once.
    pub max_clients: usize,
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
    /// A broker on `socket` with `budget` bytes per device, unnamed tenants welcome with no
    /// floor, 64 clients, bursts of 256 messages and 1000 messages per second per client, no
    /// metrics file (every 5 s once one is set).
    pub fn new(socket: impl Into<PathBuf>, budget: u64) -> Self {
        BrokerConfig {
            socket: socket.into(),
            socket_mode: 0o600,
            budget,
            tenants: BTreeMap::new(),
            default_tenant: Some(TenantPolicy::default()),
            max_clients: 64,
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

    /// The tenant's ceiling, at most the node's budget.
    pub fn ceiling(&self, policy: &TenantPolicy) -> u64 {
        policy.ceiling.map_or(self.budget, |c| c.min(self.budget))
    }

    /// Checks that the floors fit in the budget and each floor under its ceiling.
    pub fn validate(&self) -> Result<(), BrokerError> {
        let mut floors = 0u64;
        for (name, p) in &self.tenants {
            if p.floor > self.ceiling(p) {
                return Err(BrokerError::Config(format!(
                    "tenant {name}: floor {} over its ceiling {}",
                    p.floor,
                    self.ceiling(p)
                )));
            }
            floors = floors.saturating_add(p.floor);
        }
        if floors > self.budget {
            return Err(BrokerError::Config(format!(
                "the floors add up to {floors} bytes, over the budget of {}",
                self.budget
            )));
        }
        if self.metrics_interval.is_zero() {
            return Err(BrokerError::Config(
                "metrics_interval must be above zero".into(),
            ));
        }
        if self.max_clients == 0 || self.burst == 0 {
            return Err(BrokerError::Config(
                "max_clients and burst must be at least 1".into(),
            ));
        }
        Ok(())
    }
}
