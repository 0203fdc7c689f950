//! [`Governor`]: grants growth within the budgets, asks reclaimers before refusing, keeps the
//! books (through its [`Ledger`]) and estimates `retry_after`.

use std::fmt;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kvvm_hal::DeviceId;

use crate::books::{lock, Books, Ledger};
use crate::bucket::Bucket;
use crate::config::GovernorConfig;
use crate::error::{Backpressure, GovernorError, Limit, NeverFits, Refusal};
use crate::grant::MappedGrowthGrant;
use crate::reclaim::Reclaimer;
use crate::snapshot::GovernorSnapshot;

struct Inner {
    config: GovernorConfig,
    ledger: Arc<Ledger>,
    reclaimers: Mutex<Vec<Weak<dyn Reclaimer>>>,
}

/// The budget of a process's device memory. Cheap to clone: clones share the same books.
#[derive(Clone)]
pub struct Governor {
    inner: Arc<Inner>,
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
        dev.min(process)
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

    fn try_grant_locked(
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
        let available = match self.try_grant_locked(device, bytes) {
            Ok(g) => return Ok(g),
            Err(Err(never)) => {
                tracing::debug!(%never, "grant refused for good");
                return Err(never.into());
            }
            Err(Ok(available)) => available,
        };
        let mut shortfall = bytes.saturating_sub(available);
        let reclaimers: Vec<Arc<dyn Reclaimer>> = lock(&self.inner.reclaimers)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for r in reclaimers {
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
                let shortfall = bytes.saturating_sub(available);
                let retry_after = self.estimate_retry_after(device, shortfall);
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

    /// The `retry_after` the governor would suggest now for a shortfall of `shortfall` bytes
    /// on `device` (see the crate docs).
    pub fn estimate_retry_after(&self, device: DeviceId, shortfall: u64) -> Duration {
        let policy = self.inner.config.retry;
        let now = self.inner.config.clock.now();
        let freed = self
            .inner
            .ledger
            .freed_in_window(device, now, policy.window);
        policy.estimate(shortfall, freed)
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
        let policy = self.inner.config.retry;
        let now = self.inner.config.clock.now();
        let released = self
            .inner
            .ledger
            .released_in_window(device, now, policy.window);
        policy.estimate(shortfall, released)
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
        self.inner.ledger.free(device, from, bytes, now, window)
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
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::books::MAX_FREE_EVENTS;
    use crate::{GovernorConfig, ManualClock, RetryPolicy};
    use std::sync::atomic::{AtomicU64, Ordering};

    const D0: DeviceId = DeviceId(0);
    const D1: DeviceId = DeviceId(1);
    const MIB: u64 = 1 << 20;

    fn bp(r: Result<MappedGrowthGrant, Refusal>) -> Backpressure {
        match r {
            Err(Refusal::Backpressure(b)) => b,
            other => panic!("expected backpressure, got {other:?}"),
        }
    }

    fn governor(budget: u64) -> (Governor, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new());
        let g = Governor::new(
            GovernorConfig::default()
                .default_device_budget(budget)
                .clock(clock.clone()),
        );
        (g, clock)
    }

    #[test]
    fn grant_commit_and_rollback_keep_books() {
        let (g, _) = governor(10 * MIB);
        let a = g.try_grant(D0, 4 * MIB).unwrap();
        assert_eq!(g.snapshot().device(D0).pending, 4 * MIB);
        assert_eq!(g.snapshot().device(D0).free(), 6 * MIB);
        a.commit();
        let s = g.snapshot().device(D0);
        assert_eq!((s.committed, s.pending, s.used()), (4 * MIB, 0, 4 * MIB));
        let b = g.try_grant(D0, 6 * MIB).unwrap();
        let err = bp(g.try_grant(D0, 1));
        assert_eq!((err.needed, err.available), (1, 0));
        b.rollback();
        {
            let _c = g.try_grant(D0, 6 * MIB).unwrap();
            assert_eq!(g.snapshot().device(D0).pending, 6 * MIB);
        }
        assert_eq!(g.snapshot().device(D0).pending, 0, "drop rolls back");
    }

    #[test]
    fn partial_settle_and_give_back() {
        let (g, _) = governor(10 * MIB);
        let mut a = g.try_grant(D0, 8 * MIB).unwrap();
        a.settle(2 * MIB, Bucket::Committed).unwrap();
        a.settle(MIB, Bucket::Pooled).unwrap();
        a.give_back(MIB).unwrap();
        assert!(a.settle(5 * MIB, Bucket::Committed).is_err());
        assert_eq!(a.bytes(), 4 * MIB);
        drop(a);
        let s = g.snapshot().device(D0);
        assert_eq!((s.committed, s.pooled, s.pending), (2 * MIB, MIB, 0));
    }

    #[test]
    fn transfer_free_and_underflow() {
        let (g, _) = governor(10 * MIB);
        g.try_grant(D0, 4 * MIB).unwrap().commit();
        g.transfer(D0, Bucket::Committed, Bucket::Pooled, MIB)
            .unwrap();
        g.transfer(D0, Bucket::Committed, Bucket::Quarantined, MIB)
            .unwrap();
        g.transfer(D0, Bucket::Committed, Bucket::Shared, MIB)
            .unwrap();
        let s = g.snapshot().device(D0);
        assert_eq!(
            (s.committed, s.pooled, s.shared, s.quarantined),
            (MIB, MIB, MIB, MIB)
        );
        assert_eq!(s.used(), 4 * MIB);
        let e = g
            .transfer(D0, Bucket::Pooled, Bucket::Committed, 2 * MIB)
            .unwrap_err();
        assert!(matches!(e, GovernorError::Underflow { .. }));
        assert_eq!(
            g.snapshot().device(D0),
            s,
            "a failed transfer changes nothing"
        );
        g.free(D0, Bucket::Pooled, MIB).unwrap();
        assert!(g.free(D0, Bucket::Pooled, 1).is_err());
        assert_eq!(g.snapshot().device(D0).used(), 3 * MIB);
    }

    #[test]
    fn process_budget_spans_devices() {
        let g = Governor::new(
            GovernorConfig::default()
                .default_device_budget(8 * MIB)
                .process_budget(10 * MIB),
        );
        g.try_grant(D0, 6 * MIB).unwrap().commit();
        let e = bp(g.try_grant(D1, 6 * MIB));
        assert_eq!((e.device, e.needed, e.available), (D1, 6 * MIB, 4 * MIB));
        g.try_grant(D1, 4 * MIB).unwrap().commit();
        assert_eq!(g.snapshot().used(), 10 * MIB);
        assert_eq!(g.snapshot().process_free(), 0);
    }

    #[test]
    fn unlimited_never_refuses() {
        let g = Governor::unlimited();
        g.try_grant(D0, u64::MAX / 2).unwrap().commit();
        g.try_grant(D0, u64::MAX / 2).unwrap().commit();
        assert_eq!(g.snapshot().device(D0).free(), u64::MAX);
    }

    #[test]
    fn retry_estimate_is_clamped_rate() {
        let p = RetryPolicy {
            window: Duration::from_secs(1),
            floor: Duration::from_millis(10),
            cap: Duration::from_secs(5),
        };
        assert_eq!(p.estimate(0, 0), p.floor);
        assert_eq!(p.estimate(MIB, 0), p.cap);
        assert_eq!(p.estimate(50 * MIB, 100 * MIB), Duration::from_millis(500));
        assert_eq!(
            p.estimate(MIB, 1000 * MIB),
            Duration::from_millis(10),
            "floor"
        );
        assert_eq!(p.estimate(1000 * MIB, MIB), Duration::from_secs(5), "cap");
        assert_eq!(
            p.estimate(u64::MAX, 1),
            Duration::from_secs(5),
            "no overflow"
        );
    }

    #[test]
    fn retry_after_follows_recent_release_rate() {
        let (g, clock) = governor(10 * MIB);
        g.try_grant(D0, 10 * MIB).unwrap().commit();
        // Nothing freed yet: the cap.
        let e = bp(g.try_grant(D0, 2 * MIB));
        assert_eq!(e.retry_after, RetryPolicy::default().cap);
        // 4 MiB freed within the window: 4 MiB/s. Asking 6 MiB with 4 MiB free: 2 MiB short,
        // so 500 ms.
        g.free(D0, Bucket::Committed, 4 * MIB).unwrap();
        clock.advance(Duration::from_millis(100));
        let e = bp(g.try_grant(D0, 6 * MIB));
        assert_eq!((e.needed, e.available), (6 * MIB, 4 * MIB));
        assert_eq!(e.retry_after, Duration::from_millis(500));
        // Once the window has passed, the free no longer counts.
        clock.advance(Duration::from_secs(2));
        let e = bp(g.try_grant(D0, 6 * MIB));
        assert_eq!(e.retry_after, RetryPolicy::default().cap);
    }

    struct Pool {
        g: Governor,
        held: AtomicU64,
        calls: AtomicU64,
    }

    impl Reclaimer for Pool {
        fn reclaim(&self, device: DeviceId, bytes: u64) -> u64 {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let n = bytes.min(self.held.load(Ordering::SeqCst));
            self.held.fetch_sub(n, Ordering::SeqCst);
            self.g.free(device, Bucket::Pooled, n).unwrap();
            n
        }
    }

    #[test]
    fn evicts_before_refusing() {
        let (g, _) = governor(10 * MIB);
        g.try_grant(D0, 10 * MIB).unwrap().commit();
        g.transfer(D0, Bucket::Committed, Bucket::Pooled, 3 * MIB)
            .unwrap();
        let pool = Arc::new(Pool {
            g: g.clone(),
            held: AtomicU64::new(3 * MIB),
            calls: AtomicU64::new(0),
        });
        let weak: Weak<dyn Reclaimer> = Arc::downgrade(&(pool.clone() as Arc<dyn Reclaimer>));
        g.register_reclaimer(weak);
        let grant = g.try_grant(D0, 2 * MIB).unwrap();
        assert_eq!(pool.calls.load(Ordering::SeqCst), 1);
        assert_eq!(g.snapshot().device(D0).pooled, MIB);
        grant.commit();
        // Only 1 MiB left to reclaim: refused after trying.
        let e = bp(g.try_grant(D0, 2 * MIB));
        assert_eq!(e.available, MIB);
        assert_eq!(pool.calls.load(Ordering::SeqCst), 2);
        // The reclaimer is held weakly.
        drop(pool);
        assert!(g.try_grant(D0, 2 * MIB).is_err());
    }

    #[test]
    fn dropped_reclaimers_are_forgotten_when_another_registers() {
        let (g, _) = governor(10 * MIB);
        let live: Arc<dyn Reclaimer> = Arc::new(Pool {
            g: g.clone(),
            held: AtomicU64::new(0),
            calls: AtomicU64::new(0),
        });
        for _ in 0..8 {
            let gone: Arc<dyn Reclaimer> = Arc::new(Pool {
                g: g.clone(),
                held: AtomicU64::new(0),
                calls: AtomicU64::new(0),
            });
            g.register_reclaimer(Arc::downgrade(&gone));
        }
        g.register_reclaimer(Arc::downgrade(&live));
        assert_eq!(
            lock(&g.inner.reclaimers).len(),
            1,
            "only the live one is kept"
        );
    }

    #[test]
    fn free_events_are_bounded() {
        let (g, _) = governor(u64::MAX);
        g.try_grant(D0, 4 * MAX_FREE_EVENTS as u64)
            .unwrap()
            .commit();
        for _ in 0..(4 * MAX_FREE_EVENTS) {
            g.free(D0, Bucket::Committed, 1).unwrap();
        }
        let books = lock(&g.inner.ledger.books);
        let d = books.devices.get(&D0).unwrap();
        assert!(d.frees.len() <= MAX_FREE_EVENTS);
        assert_eq!(
            d.frees.iter().map(|(_, b)| b).sum::<u64>(),
            4 * MAX_FREE_EVENTS as u64
        );
    }

    #[test]
    fn a_request_over_a_limit_never_fits_and_reclaims_nothing() {
        struct Counting(AtomicU64);
        impl Reclaimer for Counting {
            fn reclaim(&self, _device: DeviceId, _bytes: u64) -> u64 {
                self.0.fetch_add(1, Ordering::Relaxed);
                0
            }
        }
        let (g, _) = governor(10 * MIB);
        let counting = Arc::new(Counting(AtomicU64::new(0)));
        let r: Arc<dyn Reclaimer> = counting.clone();
        g.register_reclaimer(Arc::downgrade(&r));
        let n = g.try_grant(D0, 11 * MIB).unwrap_err();
        assert_eq!(
            counting.0.load(Ordering::Relaxed),
            0,
            "never-fits reclaims nothing"
        );
        let n = n.never_fits().cloned().unwrap();
        assert_eq!(
            (n.limit, n.limit_bytes, n.needed),
            (Limit::DeviceBudget, 10 * MIB, 11 * MIB)
        );
        assert_eq!(g.check_fits(D0, 11 * MIB), Err(n));
        assert!(g.check_fits(D0, 10 * MIB).is_ok());
        // Quarantined bytes never come back: they lower the ceiling.
        g.try_grant(D0, 2 * MIB)
            .unwrap()
            .settle(2 * MIB, Bucket::Quarantined)
            .unwrap();
        let n = g.try_grant(D0, 9 * MIB).unwrap_err();
        assert_eq!(n.never_fits().map(|n| n.limit_bytes), Some(8 * MIB));
        // Committed bytes can be freed: a request under the ceiling is backpressure.
        g.try_grant(D0, 4 * MIB).unwrap().commit();
        let b = bp(g.try_grant(D0, 6 * MIB));
        assert_eq!((b.needed, b.available), (6 * MIB, 4 * MIB));
        assert_eq!(
            counting.0.load(Ordering::Relaxed),
            1,
            "backpressure asked the reclaimer"
        );
        drop(r);
        // Process budget.
        let p = Governor::new(GovernorConfig::default().process_budget(3 * MIB));
        let n = p.try_grant(D1, 4 * MIB).unwrap_err();
        assert_eq!(n.never_fits().map(|n| n.limit), Some(Limit::ProcessBudget));
        assert!(Governor::unlimited().check_fits(D0, u64::MAX).is_ok());
    }

    #[test]
    fn a_request_over_several_devices_is_priced_against_the_process_budget_too() {
        let g = Governor::new(
            GovernorConfig::default()
                .default_device_budget(8 * MIB)
                .process_budget(10 * MIB),
        );
        assert!(g.check_fits_all(&[(D0, 5 * MIB), (D1, 5 * MIB)]).is_ok());
        let n = g
            .check_fits_all(&[(D0, 6 * MIB), (D1, 6 * MIB)])
            .unwrap_err();
        assert_eq!(
            (n.device, n.needed, n.limit, n.limit_bytes),
            (D0, 12 * MIB, Limit::ProcessBudget, 10 * MIB)
        );
        let n = g.check_fits_all(&[(D0, MIB), (D1, 9 * MIB)]).unwrap_err();
        assert_eq!((n.device, n.limit), (D1, Limit::DeviceBudget));
        assert!(g.same_books(&g.clone()));
        assert!(!g.same_books(&Governor::unlimited()));
    }
}
