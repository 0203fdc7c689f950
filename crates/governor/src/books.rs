//! [`Ledger`]: the books behind a governor, one [`DeviceBooks`] per device, updated with
//! checked arithmetic (an underflow or overflow is a [`GovernorError`], never a wrap), and the
//! recent frees and releases the release rate is measured over (each a [`ReleaseWindow`]).

use kvvm_hal::sync::lock;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvvm_hal::DeviceId;

use crate::bucket::Bucket;
use crate::error::GovernorError;
use crate::release_window::ReleaseWindow;
use crate::snapshot::DeviceSnapshot;

/// One device's books.
#[derive(Debug, Default)]
pub(crate) struct DeviceBooks {
    committed: u64,
    pooled: u64,
    shared: u64,
    quarantined: u64,
    pending: u64,
    /// Recent frees (to the driver).
    pub(crate) frees: ReleaseWindow,
    /// Recent releases by consumers (to a pool or the driver).
    releases: ReleaseWindow,
}

impl DeviceBooks {
    fn bucket(&mut self, b: Bucket) -> &mut u64 {
        match b {
            Bucket::Committed => &mut self.committed,
            Bucket::Pooled => &mut self.pooled,
            Bucket::Shared => &mut self.shared,
            Bucket::Quarantined => &mut self.quarantined,
        }
    }

    fn used_and_pending(&self) -> u64 {
        self.committed
            .saturating_add(self.pooled)
            .saturating_add(self.shared)
            .saturating_add(self.quarantined)
            .saturating_add(self.pending)
    }
}

/// Every device's books.
#[derive(Default)]
pub(crate) struct Books {
    pub(crate) devices: BTreeMap<DeviceId, DeviceBooks>,
}

/// The books behind one governor and its grants.
#[derive(Default)]
pub(crate) struct Ledger {
    pub(crate) books: Mutex<Books>,
}

fn take(
    device: DeviceId,
    bucket: &'static str,
    slot: &mut u64,
    bytes: u64,
) -> Result<(), GovernorError> {
    *slot = slot.checked_sub(bytes).ok_or(GovernorError::Underflow {
        device,
        bucket,
        bytes,
        held: *slot,
    })?;
    Ok(())
}

fn put(device: DeviceId, slot: &mut u64, bytes: u64) -> Result<(), GovernorError> {
    *slot = slot
        .checked_add(bytes)
        .ok_or(GovernorError::Overflow { device })?;
    Ok(())
}

impl Ledger {
    /// Used plus pending bytes of `device`.
    pub(crate) fn device_used(books: &Books, device: DeviceId) -> u64 {
        books
            .devices
            .get(&device)
            .map_or(0, DeviceBooks::used_and_pending)
    }

    /// Used plus pending bytes of every device.
    pub(crate) fn process_used(books: &Books) -> u64 {
        books
            .devices
            .values()
            .map(DeviceBooks::used_and_pending)
            .fold(0u64, u64::saturating_add)
    }

    /// Quarantined bytes of `device`.
    pub(crate) fn device_quarantined(books: &Books, device: DeviceId) -> u64 {
        books.devices.get(&device).map_or(0, |d| d.quarantined)
    }

    /// Quarantined bytes of every device.
    pub(crate) fn process_quarantined(books: &Books) -> u64 {
        books
            .devices
            .values()
            .map(|d| d.quarantined)
            .fold(0u64, u64::saturating_add)
    }

    /// Adds `bytes` to the pending bytes of `device` (a grant was given).
    pub(crate) fn add_pending(books: &mut Books, device: DeviceId, bytes: u64) {
        let d = books.devices.entry(device).or_default();
        // Cannot overflow: bytes <= available <= budget - used - pending; unlimited budgets
        // saturate instead.
        d.pending = d.pending.saturating_add(bytes);
    }

    /// Bytes freed on `device` during the last `window` before `now`.
    pub(crate) fn freed_in_window(&self, device: DeviceId, now: Instant, window: Duration) -> u64 {
        let mut books = lock(&self.books);
        books.devices.get_mut(&device).map_or(0, |d| {
            d.frees.prune(now, window);
            d.frees.total(now, window)
        })
    }

    /// A consumer released `bytes` on `device` at `now` (whether they went back to the driver
    /// or to a pool, they are available to the next consumer).
    pub(crate) fn note_released(
        &self,
        device: DeviceId,
        bytes: u64,
        now: Instant,
        window: Duration,
    ) {
        let mut books = lock(&self.books);
        let d = books.devices.entry(device).or_default();
        d.releases.note(now, window, bytes);
    }

    /// Bytes consumers released on `device` during the last `window` before `now`.
    pub(crate) fn released_in_window(
        &self,
        device: DeviceId,
        now: Instant,
        window: Duration,
    ) -> u64 {
        let books = lock(&self.books);
        books
            .devices
            .get(&device)
            .map_or(0, |d| d.releases.total(now, window))
    }

    /// Moves `bytes` on `device` from one bucket to another.
    pub(crate) fn transfer(
        &self,
        device: DeviceId,
        from: Bucket,
        to: Bucket,
        bytes: u64,
    ) -> Result<(), GovernorError> {
        if bytes == 0 || from == to {
            return Ok(());
        }
        let mut books = lock(&self.books);
        let d = books.devices.entry(device).or_default();
        take(device, from.as_str(), d.bucket(from), bytes)?;
        if let Err(e) = put(device, d.bucket(to), bytes) {
            // Undo the take so the books stay whole.
            let _ = put(device, d.bucket(from), bytes);
            return Err(e);
        }
        Ok(())
    }

    /// `bytes` of `from` on `device` were released to the driver at `now`: they leave the
    /// books and count towards the release rate.
    pub(crate) fn free(
        &self,
        device: DeviceId,
        from: Bucket,
        bytes: u64,
        now: Instant,
        window: Duration,
    ) -> Result<(), GovernorError> {
        if bytes == 0 {
            return Ok(());
        }
        let mut books = lock(&self.books);
        let d = books.devices.entry(device).or_default();
        take(device, from.as_str(), d.bucket(from), bytes)?;
        d.frees.note(now, window, bytes);
        Ok(())
    }

    /// Settles `bytes` of a grant on `device`: out of pending, into `to` (or back to the
    /// budget when `None`).
    pub(crate) fn settle_pending(&self, device: DeviceId, bytes: u64, to: Option<Bucket>) {
        if bytes == 0 {
            return;
        }
        let mut books = lock(&self.books);
        let d = books.devices.entry(device).or_default();
        // A grant only settles what it holds, so pending always covers it; saturate anyway.
        d.pending = d.pending.saturating_sub(bytes);
        if let Some(b) = to {
            let slot = d.bucket(b);
            *slot = slot.saturating_add(bytes);
        }
    }

    /// One snapshot per device seen, with its budget.
    pub(crate) fn snapshot(&self, budget: impl Fn(DeviceId) -> Option<u64>) -> Vec<DeviceSnapshot> {
        let books = lock(&self.books);
        books
            .devices
            .iter()
            .map(|(id, d)| DeviceSnapshot {
                device: *id,
                budget: budget(*id),
                committed: d.committed,
                pooled: d.pooled,
                shared: d.shared,
                quarantined: d.quarantined,
                pending: d.pending,
            })
            .collect()
    }
}
