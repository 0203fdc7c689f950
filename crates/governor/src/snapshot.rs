//! [`GovernorSnapshot`] and [`DeviceSnapshot`]: a copy of the books at one moment.

use kvvm_hal::DeviceId;

/// The governor's books for one device at one moment.
///
/// Every quantity reads the same way on a device and on the whole governor: a method
/// (`committed()`, `pooled()`, `shared()`, `quarantined()`, `pending()`, `used()`, `free()`);
/// the fields are public so that a snapshot can be built and matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceSnapshot {
    /// The device.
    pub device: DeviceId,
    /// Its budget (`None`: unlimited).
    pub budget: Option<u64>,
    /// Bytes mapped in reservations and owned by them.
    pub committed: u64,
    /// Bytes held by handle pools.
    pub pooled: u64,
    /// Bytes of shared handles, each counted once.
    pub shared: u64,
    /// Bytes in quarantine.
    pub quarantined: u64,
    /// Bytes granted but not yet settled.
    pub pending: u64,
}

impl DeviceSnapshot {
    /// Bytes mapped in reservations and owned by them (the field, read like
    /// [`GovernorSnapshot::committed`]).
    pub fn committed(&self) -> u64 {
        self.committed
    }

    /// Bytes held by handle pools.
    pub fn pooled(&self) -> u64 {
        self.pooled
    }

    /// Bytes of shared handles, each counted once.
    pub fn shared(&self) -> u64 {
        self.shared
    }

    /// Bytes in quarantine.
    pub fn quarantined(&self) -> u64 {
        self.quarantined
    }

    /// Bytes granted but not yet settled.
    pub fn pending(&self) -> u64 {
        self.pending
    }

    /// Physical bytes owned plus quarantined bytes: `committed + pooled + shared + quarantined`.
    pub fn used(&self) -> u64 {
        self.committed
            .saturating_add(self.pooled)
            .saturating_add(self.shared)
            .saturating_add(self.quarantined)
    }

    /// Bytes that could still be granted on this device alone (`u64::MAX` when unlimited).
    pub fn free(&self) -> u64 {
        match self.budget {
            Some(b) => b.saturating_sub(self.used()).saturating_sub(self.pending),
            None => u64::MAX,
        }
    }
}

/// The governor's books for every device it has seen (sums over the devices; see
/// [`DeviceSnapshot`] for one device).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GovernorSnapshot {
    /// One entry per device, by device id.
    pub devices: Vec<DeviceSnapshot>,
    /// The process-wide budget, if any.
    pub process_budget: Option<u64>,
}

impl GovernorSnapshot {
    /// The snapshot of `device` (all zero if the governor has not seen it).
    pub fn device(&self, device: DeviceId) -> DeviceSnapshot {
        self.devices
            .iter()
            .find(|d| d.device == device)
            .copied()
            .unwrap_or(DeviceSnapshot {
                device,
                ..DeviceSnapshot::default()
            })
    }

    fn sum(&self, f: impl Fn(&DeviceSnapshot) -> u64) -> u64 {
        self.devices.iter().map(f).fold(0u64, u64::saturating_add)
    }

    /// Used bytes over all devices.
    pub fn used(&self) -> u64 {
        self.sum(DeviceSnapshot::used)
    }

    /// Committed bytes over all devices.
    pub fn committed(&self) -> u64 {
        self.sum(|d| d.committed)
    }

    /// Pooled bytes over all devices.
    pub fn pooled(&self) -> u64 {
        self.sum(|d| d.pooled)
    }

    /// Shared bytes over all devices.
    pub fn shared(&self) -> u64 {
        self.sum(|d| d.shared)
    }

    /// Quarantined bytes over all devices.
    pub fn quarantined(&self) -> u64 {
        self.sum(|d| d.quarantined)
    }

    /// Pending (granted, unsettled) bytes over all devices.
    pub fn pending(&self) -> u64 {
        self.sum(|d| d.pending)
    }

    /// Bytes that could still be granted under the process budget (`u64::MAX` when none).
    pub fn process_free(&self) -> u64 {
        match self.process_budget {
            Some(b) => b.saturating_sub(self.used()).saturating_sub(self.pending()),
            None => u64::MAX,
        }
    }
}
