//! [`Governor`]: grants growth within the budgets, asks reclaimers before refusing, keeps the
//! books (through its [`Ledger`]) and estimates `retry_after`.

use kvvm_hal::sync::lock;
use std::fmt;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kvvm_hal::DeviceId;

use crate::books::{Books, Ledger};
use crate::bucket::Bucket;
use crate::config::GovernorConfig;
use crate::error::{Backpressure, GovernorError, Limit, NeverFits, Refusal};
use crate::lease_source::Lease;
use crate::reclaim::Reclaimer;
use crate::snapshot::GovernorSnapshot;

pub(crate) mod grant;
pub(crate) mod lease;

use grant::MappedGrowthGrant;

pub(crate) struct Inner {
    pub(crate) config: GovernorConfig,
    pub(crate) ledger: Arc<Ledger>,
    pub(crate) reclaimers: Mutex<Vec<Weak<dyn Reclaimer>>>,
    pub(crate) lease: Option<Lease>,
}

/// The budget of a process's device memory. Cheap to clone: clones share the same books.
#[derive(Clone)]
pub struct Governor {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for Governor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Governor")
            .field("config", &self.inner.config)
            .field("snapshot", &self.snapshot())
            .finish()
    }
}

impl Default for Governor {
    fn default() -> Self {
        Governor::unlimited()
    }
}

impl Governor {
    /// A governor with `config`.
    pub fn new(config: GovernorConfig) -> Self {
        Governor {
            inner: Arc::new(Inner {
                config,
                ledger: Arc::new(Ledger::default()),
                reclaimers: Mutex::new(Vec::new()),
                lease: None,
            }),
        }
    }

    /// A governor that never refuses (it still keeps the books).
    pub fn unlimited() -> Self {
        Governor::new(GovernorConfig::unlimited())
    }

    /// A governor with one budget for every device.
    pub fn with_device_budget(bytes: u64) -> Self {
        Governor::new(GovernorConfig::default().default_device_budget(bytes))
    }

    /// The configuration.
    pub fn config(&self) -> &GovernorConfig {
        &self.inner.config
    }

    /// The budget of `device` (`None`: unlimited).
    pub fn device_budget(&self, device: DeviceId) -> Option<u64> {
        self.inner
            .config
            .devices
            .get(&device)
            .copied()
            .or(self.inner.config.default_device_budget)
    }

    /// Registers a reclaimer, asked to free memory before a grant is refused. It is held
    /// weakly: once its owner is dropped it is forgotten.
    pub fn register_reclaimer(&self, reclaimer: Weak<dyn Reclaimer>) {
        let mut r = lock(&self.inner.reclaimers);
        r.retain(|w| w.strong_count() > 0);
        r.push(reclaimer);
    }

    /// Bytes grantable on `device` right now, the tighter of its budget and the process budget.
    fn available(&self, books: &Books, device: DeviceId) -> u64 {
        let dev = match self.device_budget(device) {
            Some(b) => b.saturating_sub(Ledger::device_used(books, device)),
            None => u64::MAX,
        };
        let process = match self.inner.config.process_budget {
            Some(b) => b.saturating_sub(Ledger::process_used(books)),
            None => u64::MAX,
        };
        let lease = self
            .inner
            .lease
            .as_ref()
            .map_or(u64::MAX, |l| l.room(books, device));
        dev.min(process).min(lease)
    }

    /// The limit a requester that would hold `holdings` (bytes per device, at once) exceeds
    /// even if everything but the quarantine were freed, if any: a device's budget with that
    /// device's bytes, then the process budget with their sum.
    fn never_fits(&self, books: &Books, holdings: &[(DeviceId, u64)]) -> Option<NeverFits> {
        for &(device, bytes) in holdings {
            if let Some(budget) = self.device_budget(device) {
                let limit_bytes = budget.saturating_sub(Ledger::device_quarantined(books, device));
                if bytes > limit_bytes {
                    return Some(NeverFits {
                        device,
                        needed: bytes,
                        limit: Limit::DeviceBudget,
                        limit_bytes,
                    });
                }
            }
        }
        let budget = self.inner.config.process_budget?;
        let &(device, _) = holdings.first()?;
        let needed = holdings
            .iter()
            .map(|&(_, b)| b)
            .fold(0u64, u64::saturating_add);
        let limit_bytes = budget.saturating_sub(Ledger::process_quarantined(books));
        (needed > limit_bytes).then_some(NeverFits {
            device,
            needed,
            limit: Limit::ProcessBudget,
            limit_bytes,
        })
    }

    pub(crate) fn try_grant_locked(
        &self,
        device: DeviceId,
        bytes: u64,
    ) -> Result<MappedGrowthGrant, Result<u64, NeverFits>> {
        let mut books = lock(&self.inner.ledger.books);
        if let Some(n) = self.never_fits(&books, &[(device, bytes)]) {
            return Err(Err(n));
        }
        let available = self.available(&books, device);
        if bytes > available {
            return Err(Ok(available));
        }
        Ledger::add_pending(&mut books, device, bytes);
        Ok(MappedGrowthGrant::new(
            Arc::clone(&self.inner.ledger),
            device,
            bytes,
        ))
    }

    /// Refuses, in O(1) and without reclaiming anything, a requester that would hold `bytes`
    /// on `device` that no freeing could ever let through ([`NeverFits`]): more than a budget
    /// less its quarantine, the only bytes of the books that never come back. `bytes` is
    /// everything the requester would hold at once, not what it still has to be granted:
    /// memory it keeps (its mappings) or takes from a pool is inside the budget already, so
    /// subtracting it would answer a request that can never fit with [`Backpressure`] forever.
    /// A request that passes may still meet [`Backpressure`] in [`try_grant`](Self::try_grant).
    pub fn check_fits(&self, device: DeviceId, bytes: u64) -> Result<(), NeverFits> {
        self.check_fits_all(&[(device, bytes)])
    }

    /// [`check_fits`](Self::check_fits) for a requester that would hold memory on several
    /// devices at once (`holdings`: bytes per device), such as a tensor-parallel sequence over
    /// its ranks: each device's bytes against its budget, and their sum against the process
    /// budget (a request whose every device fits may still exceed the process budget for
    /// good). A process-budget refusal names the first device of `holdings`.
    pub fn check_fits_all(&self, holdings: &[(DeviceId, u64)]) -> Result<(), NeverFits> {
        let books = lock(&self.inner.ledger.books);
        self.never_fits(&books, holdings).map_or(Ok(()), Err)
    }

    /// Whether `other` is this governor or a clone of it (the same books and budgets).
    pub fn same_books(&self, other: &Governor) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Grants `bytes` of growth on `device`, or refuses.
    ///
    /// A request larger than a limit freeing cannot raise is [`Refusal::NeverFits`] at once,
    /// with nothing reclaimed. When the budget is only short now, every registered
    /// [`Reclaimer`] is first asked to free the shortfall ("evict before refusing"); the grant
    /// is refused with [`Refusal::Backpressure`] only if it still does not fit.
    pub fn try_grant(&self, device: DeviceId, bytes: u64) -> Result<MappedGrowthGrant, Refusal> {
        let span = tracing::debug_span!("governor.try_grant", device = device.0, bytes);
        let _e = span.enter();
        let first = self.try_grant_locked(device, bytes);
        self.note_lease_grant(first.is_ok());
        let available = match first {
            Ok(g) => return Ok(g),
            Err(Err(never)) => {
                tracing::debug!(%never, "grant refused for good");
                return Err(never.into());
            }
            Err(Ok(available)) => available,
        };
        if let Some(g) = self.top_up_lease(device, bytes, available)? {
            return Ok(g);
        }
        let mut shortfall = bytes.saturating_sub(available);
        for r in self.reclaimers() {
            if shortfall == 0 {
                break;
            }
            let freed = r.reclaim(device, shortfall);
            shortfall = shortfall.saturating_sub(freed);
        }
        match self.try_grant_locked(device, bytes) {
            Ok(g) => Ok(g),
            Err(Err(never)) => Err(never.into()),
            Err(Ok(available)) => {
                // The reclaimers gave back what they could: what is left free is what
                // `available_bytes` counts at this moment.
                let shortfall = bytes.saturating_sub(available);
                let retry_after = self
                    .lease_retry_after(device)
                    .unwrap_or_else(|| self.estimate_retry_after(device, shortfall));
                tracing::debug!(needed = bytes, available, ?retry_after, "grant refused");
                Err(Backpressure {
                    device,
                    needed: bytes,
                    available,
                    retry_after,
                }
                .into())
            }
        }
    }

    /// Bytes a new request could be granted on `device` now: what the budgets leave free
    /// plus what the registered reclaimers (the handle pool, idle cached prefixes) would give
    /// back when asked ([`Reclaimer::reclaimable`]); `u64::MAX` when no budget limits it.
    /// It is what a refusal reports as available ([`Backpressure::available`]), so one
    /// figure means "available" everywhere.
    pub fn available_bytes(&self, device: DeviceId) -> u64 {
        let free = {
            let books = lock(&self.inner.ledger.books);
            self.available(&books, device)
        };
        if free == u64::MAX {
            return free;
        }
        self.reclaimers()
            .iter()
            .map(|r| r.reclaimable(device))
            .fold(free, u64::saturating_add)
    }

    pub(crate) fn reclaimers(&self) -> Vec<Arc<dyn Reclaimer>> {
        lock(&self.inner.reclaimers)
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }

    /// The `retry_after` the governor would suggest now for a shortfall of `shortfall` bytes
    /// on `device` (see the crate docs).
    pub fn estimate_retry_after(&self, device: DeviceId, shortfall: u64) -> Duration {
        self.estimate_from(device, shortfall, Ledger::freed_in_window)
    }

    /// The retry policy applied to `shortfall` and the bytes `in_window` counts on `device`
    /// in the policy's window ending now.
    fn estimate_from(
        &self,
        device: DeviceId,
        shortfall: u64,
        in_window: impl FnOnce(&Ledger, DeviceId, Instant, Duration) -> u64,
    ) -> Duration {
        let policy = self.inner.config.retry;
        let now = self.inner.config.clock.now();
        let bytes = in_window(&self.inner.ledger, device, now, policy.window);
        policy.estimate(shortfall, bytes)
    }

    /// Records that a consumer (a server's sequence, say) released `bytes` on `device` now,
    /// whether they went back to the driver or to a pool: the release rate of
    /// [`estimate_retry_after_released`](Self::estimate_retry_after_released).
    pub fn note_released(&self, device: DeviceId, bytes: u64) {
        let now = self.inner.config.clock.now();
        let window = self.inner.config.retry.window;
        self.inner.ledger.note_released(device, bytes, now, window);
    }

    /// The [`RetryPolicy`](crate::RetryPolicy) applied to the bytes consumers released on
    /// `device` during the last window ([`note_released`](Self::note_released)): most of them
    /// go to a pool, which the driver-side estimate ([`estimate_retry_after`](Self::estimate_retry_after))
    /// does not see.
    pub fn estimate_retry_after_released(&self, device: DeviceId, shortfall: u64) -> Duration {
        self.estimate_from(device, shortfall, Ledger::released_in_window)
    }

    /// Moves `bytes` on `device` from one bucket to another (a handle returned to the pool,
    /// taken from the pool, quarantined, ...).
    pub fn transfer(
        &self,
        device: DeviceId,
        from: Bucket,
        to: Bucket,
        bytes: u64,
    ) -> Result<(), GovernorError> {
        self.inner.ledger.transfer(device, from, to, bytes)
    }

    /// Records that `bytes` of `from` on `device` were released to the driver (they leave the
    /// books and count towards the release rate).
    pub fn free(&self, device: DeviceId, from: Bucket, bytes: u64) -> Result<(), GovernorError> {
        let now = self.inner.config.clock.now();
        let window = self.inner.config.retry.window;
        self.inner.ledger.free(device, from, bytes, now, window)?;
        self.trim_lease(device);
        Ok(())
    }

    /// A copy of the books.
    pub fn snapshot(&self) -> GovernorSnapshot {
        GovernorSnapshot {
            devices: self.inner.ledger.snapshot(|d| self.device_budget(d)),
            process_budget: self.inner.config.process_budget,
        }
    }
}

impl MappedGrowthGrant {
    /// Whether `governor` issued this grant.
    pub fn is_from(&self, governor: &Governor) -> bool {
        Arc::ptr_eq(self.ledger(), &governor.inner.ledger)
    }
}

#[cfg(test)]
mod tests;
