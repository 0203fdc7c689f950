//! The parts the books are made of: [`DeviceBytes`] (bytes per device, no entry for a device
//! at 0), what one client holds ([`ClientBooks`]), what one tenant holds and may hold
//! ([`TenantBooks`], with the governor's [`TenantBounds`]).

use std::collections::{BTreeMap, BTreeSet};

use kvvm_governor::{TenantBounds, TenantId};

/// Bytes per device. A device at 0 has no entry, so what a client or tenant once held and
/// gave back leaves nothing behind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct DeviceBytes(BTreeMap<u32, u64>);

impl DeviceBytes {
    /// Bytes on `device`.
    pub(crate) fn get(&self, device: u32) -> u64 {
        self.0.get(&device).copied().unwrap_or(0)
    }

    /// Adds `bytes` on `device` (saturating; nothing is entered for 0).
    pub(crate) fn add(&mut self, device: u32, bytes: u64) {
        if bytes > 0 {
            let h = self.0.entry(device).or_default();
            *h = h.saturating_add(bytes);
        }
    }

    /// Takes `bytes` on `device` away (down to 0 at most; the entry goes at 0).
    pub(crate) fn sub(&mut self, device: u32, bytes: u64) {
        if let Some(h) = self.0.get_mut(&device) {
            *h = h.saturating_sub(bytes);
            if *h == 0 {
                self.0.remove(&device);
            }
        }
    }

    /// Whether every device is at 0.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The devices above 0: how many entries there are.
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// (device, bytes) of every device above 0.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.0.iter().map(|(d, b)| (*d, *b))
    }
}

/// One client's holdings.
#[derive(Debug, Clone)]
pub(crate) struct ClientBooks {
    /// Its tenant, resolved from the name it gave at its hello.
    pub(crate) tenant: TenantId,
    pub(crate) held: DeviceBytes,
}

/// A tenant the books know now: one with a client, or bytes (leases, prefixes, bytes kept
/// for its clients' claims after a restart). A tenant with none of these is forgotten.
#[derive(Debug, Clone)]
pub(crate) struct TenantBooks {
    /// Its floor and ceiling on every device.
    pub(crate) limits: TenantBounds,
    pub(crate) clients: BTreeSet<u64>,
    /// Its clients' leases, its prefixes and what is kept for its claims, per device.
    pub(crate) held: DeviceBytes,
}

impl TenantBooks {
    pub(crate) fn new(limits: TenantBounds) -> Self {
        TenantBooks {
            limits,
            clients: BTreeSet::new(),
            held: DeviceBytes::default(),
        }
    }

    /// Whether nothing is left to remember of the tenant.
    pub(crate) fn is_idle(&self) -> bool {
        self.clients.is_empty() && self.held.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_at_zero_leaves_no_entry() {
        let mut d = DeviceBytes::default();
        d.add(3, 0);
        assert!(d.is_empty(), "nothing entered for 0 bytes");
        d.add(3, 10);
        d.add(3, u64::MAX);
        assert_eq!(d.get(3), u64::MAX, "saturating");
        d.sub(3, u64::MAX - 1);
        assert_eq!(d.get(3), 1);
        d.sub(4, 1);
        assert_eq!(d.len(), 1, "taking from an absent device adds nothing");
        d.sub(3, 5);
        assert!(d.is_empty() && d.get(3) == 0, "at 0 the entry goes");
    }
}
