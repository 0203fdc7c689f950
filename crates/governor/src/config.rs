//! [`GovernorConfig`]: budgets, retry policy and clock.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvvm_hal::DeviceId;

use crate::clock::{Clock, SystemClock};
use crate::retry::RetryPolicy;

/// Configuration of a `Governor`.
#[derive(Debug, Clone)]
pub struct GovernorConfig {
    /// Budget of devices not listed in `devices` (`None`: unlimited).
    pub default_device_budget: Option<u64>,
    /// Per-device budgets in bytes.
    pub devices: BTreeMap<DeviceId, u64>,
    /// An optional budget over all devices together.
    pub process_budget: Option<u64>,
    /// How `retry_after` is estimated.
    pub retry: RetryPolicy,
    /// The clock for the release-rate estimate.
    pub clock: Arc<dyn Clock>,
}

impl Default for GovernorConfig {
    /// Unlimited budgets, the default retry policy, the system clock.
    fn default() -> Self {
        GovernorConfig {
            default_device_budget: None,
            devices: BTreeMap::new(),
            process_budget: None,
            retry: RetryPolicy::default(),
            clock: Arc::new(SystemClock),
        }
    }
}

impl GovernorConfig {
    /// Unlimited budgets.
    pub fn unlimited() -> Self {
        GovernorConfig::default()
    }

    /// Sets the budget of `device`.
    #[must_use]
    pub fn device_budget(mut self, device: DeviceId, bytes: u64) -> Self {
        self.devices.insert(device, bytes);
        self
    }

    /// Sets the budget of every device not given its own.
    #[must_use]
    pub fn default_device_budget(mut self, bytes: u64) -> Self {
        self.default_device_budget = Some(bytes);
        self
    }

    /// Sets a budget over all devices together.
    #[must_use]
    pub fn process_budget(mut self, bytes: u64) -> Self {
        self.process_budget = Some(bytes);
        self
    }

    /// Replaces the retry policy.
    #[must_use]
    pub fn retry_policy(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Replaces the clock.
    #[must_use]
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }
}
