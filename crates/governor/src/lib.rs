//! # kvvm-governor: the device-memory budget of kvvm
//!
//! The governor decides **whether** physical device memory may be committed; the manager
//! (`kvvm-vmm`) decides **how**. Committing is never unconditional: the manager first obtains
//! a [`MappedGrowthGrant`] from [`Governor::try_grant`] ("no grant, no commit"), performs the
//! driver calls, and then settles the grant:
//!
//! * on success the granted bytes become [`Bucket::Committed`] ([`MappedGrowthGrant::commit`],
//!   or piece by piece with [`MappedGrowthGrant::settle`]);
//! * on failure the grant is rolled back ([`MappedGrowthGrant::rollback`], or simply dropped):
//!   the budget deducted for it is returned.
//!
//! When a grant cannot be given the caller gets a typed [`Backpressure`] (bytes needed, bytes
//! available, and an estimated `retry_after`), never a crash: device-memory pressure is a
//! signal to retry or shed load (a server maps it to HTTP 429 + `Retry-After`).
//!
//! ## Accounting (DESIGN invariant 2)
//!
//! Per device, every byte of physical memory the process holds is in exactly one
//! [`Bucket`]:
//!
//! | bucket | what it is |
//! |---|---|
//! | [`Bucket::Committed`] | mapped in a reservation and owned by it |
//! | [`Bucket::Pooled`] | an unmapped handle kept by the manager's pool for reuse |
//! | [`Bucket::Shared`] | a handle shared by several mappings (a shared prefix), counted once |
//! | [`Bucket::Quarantined`] | memory that could not be proven idle or could not be released: never reused, never advertised as free |
//!
//! `used = committed + pooled + shared + quarantined` is the physical memory owned plus the
//! quarantined bytes, and is what the budget is charged with. Outstanding grants are
//! `pending`; `free = budget - used - pending`. The manager moves bytes between buckets with
//! [`Governor::transfer`] and gives them back with [`Governor::free`] when the driver has
//! released them; an accounting underflow is a typed [`GovernorError`], never a wrap.
//!
//! ## Evict before refusing
//!
//! Components that hold reclaimable memory (the manager's handle pool, later a prefix cache)
//! register a [`Reclaimer`]. Before refusing a grant, [`Governor::try_grant`] asks each
//! registered reclaimer, in registration order, to free the shortfall, and then checks again.
//! Reclaimers are held weakly, so registering does not keep their owner alive.
//!
//! ## How `retry_after` is estimated
//!
//! The governor records every [`Governor::free`] (bytes returned to the driver) with its time,
//! per device. When refusing, it computes the release rate over the last
//! [`RetryPolicy::window`] (bytes freed in the window divided by the window) and estimates the
//! time until the shortfall is freed:
//!
//! ```text
//! retry_after = clamp(shortfall / rate, floor, cap)     (cap when nothing was freed)
//! ```
//!
//! The estimate is a pure function ([`RetryPolicy::estimate`]) of the shortfall and the bytes
//! freed in the window; time comes from a [`Clock`] ([`ManualClock`] in tests), so it is
//! deterministic.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use kvvm_hal::DeviceId;

/// Where a byte of physical memory is accounted (see the crate docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bucket {
    /// Mapped in a reservation and owned by it.
    Committed,
    /// Unmapped, held by a handle pool for reuse.
    Pooled,
    /// Held once for several mappings (a shared prefix).
    Shared,
    /// Could not be proven idle or could not be released; never reused, never free.
    Quarantined,
}

impl Bucket {
    /// A short lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Bucket::Committed => "committed",
            Bucket::Pooled => "pooled",
            Bucket::Shared => "shared",
            Bucket::Quarantined => "quarantined",
        }
    }
}

impl fmt::Display for Bucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A grant was refused: not enough budget, even after reclaiming.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "backpressure on {device}: {needed} bytes needed, {available} available; retry after {retry_after:?}"
)]
pub struct Backpressure {
    /// The device the grant was asked for.
    pub device: DeviceId,
    /// Bytes asked for.
    pub needed: u64,
    /// Bytes that could have been granted (the tighter of the device and process budgets).
    pub available: u64,
    /// When a retry is likely to succeed (see the crate docs for the estimate).
    pub retry_after: Duration,
}

/// An accounting operation that does not fit the governor's books: a bug in the caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GovernorError {
    /// More bytes were taken out of a bucket than it holds.
    #[error("accounting underflow on {device}: {bytes} bytes out of {bucket}, which holds {held}")]
    Underflow {
        /// The device.
        device: DeviceId,
        /// The bucket.
        bucket: &'static str,
        /// Bytes asked.
        bytes: u64,
        /// Bytes held.
        held: u64,
    },
    /// A byte count overflowed `u64`.
    #[error("accounting overflow on {device}")]
    Overflow {
        /// The device.
        device: DeviceId,
    },
}

/// A source of time for the release-rate estimate.
pub trait Clock: Send + Sync + fmt::Debug {
    /// The current instant.
    fn now(&self) -> Instant;
}

/// The system's monotonic clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that only moves when told to (for deterministic tests).
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<Instant>,
}

impl ManualClock {
    /// A clock standing at the current instant.
    pub fn new() -> Self {
        ManualClock {
            now: Mutex::new(Instant::now()),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let mut now = lock(&self.now);
        *now = now.checked_add(by).unwrap_or(*now);
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        *lock(&self.now)
    }
}

/// How `retry_after` is estimated (see the crate docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The window over which the release rate is measured.
    pub window: Duration,
    /// The shortest `retry_after` ever suggested.
    pub floor: Duration,
    /// The longest `retry_after` ever suggested (also used when nothing was freed recently).
    pub cap: Duration,
}

impl Default for RetryPolicy {
    /// A 1 s window, a 10 ms floor and a 5 s cap.
    fn default() -> Self {
        RetryPolicy {
            window: Duration::from_secs(1),
            floor: Duration::from_millis(10),
            cap: Duration::from_secs(5),
        }
    }
}

impl RetryPolicy {
    /// The estimate for a `shortfall` of bytes when `freed_in_window` bytes were freed during
    /// the last [`window`](Self::window): `clamp(shortfall / (freed / window), floor, cap)`,
    /// `cap` when nothing was freed, `floor` when there is no shortfall.
    pub fn estimate(&self, shortfall: u64, freed_in_window: u64) -> Duration {
        let (floor, cap) = (self.floor, self.cap.max(self.floor));
        if shortfall == 0 {
            return floor;
        }
        if freed_in_window == 0 {
            return cap;
        }
        // shortfall / rate = shortfall * window / freed, in nanoseconds, in u128 (no overflow).
        let window_ns = self.window.as_nanos();
        let ns = u128::from(shortfall)
            .saturating_mul(window_ns)
            .checked_div(u128::from(freed_in_window))
            .unwrap_or(u128::MAX);
        let ns = u64::try_from(ns).unwrap_or(u64::MAX);
        Duration::from_nanos(ns).clamp(floor, cap)
    }
}

/// Something that holds reclaimable device memory (a handle pool, a prefix cache) and can free
/// some of it when the governor is about to refuse a grant.
pub trait Reclaimer: Send + Sync {
    /// Frees up to `bytes` of physical memory on `device` (giving the bytes back through
    /// [`Governor::free`]) and returns how many bytes were freed. Called without any governor
    /// lock held; it may call the governor.
    fn reclaim(&self, device: DeviceId, bytes: u64) -> u64;
}

/// Configuration of a [`Governor`].
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

/// The governor's books for one device at one moment.
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

/// The governor's books for every device it has seen.
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

#[derive(Debug, Default)]
struct DeviceBooks {
    committed: u64,
    pooled: u64,
    shared: u64,
    quarantined: u64,
    pending: u64,
    /// (time, bytes) of recent frees, oldest first.
    frees: VecDeque<(Instant, u64)>,
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

/// Most free events kept per device (older ones are merged into their neighbour).
const MAX_FREE_EVENTS: usize = 1024;

#[derive(Default)]
struct Books {
    devices: BTreeMap<DeviceId, DeviceBooks>,
}

struct Inner {
    config: GovernorConfig,
    books: Mutex<Books>,
    reclaimers: Mutex<Vec<Weak<dyn Reclaimer>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The books are plain integers updated in single statements; a panic elsewhere while the
    // lock was held cannot leave them half-written, so recover instead of panicking.
    m.lock().unwrap_or_else(|p| p.into_inner())
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
                books: Mutex::new(Books::default()),
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
            Some(b) => {
                let used = books
                    .devices
                    .get(&device)
                    .map_or(0, DeviceBooks::used_and_pending);
                b.saturating_sub(used)
            }
            None => u64::MAX,
        };
        let process = match self.inner.config.process_budget {
            Some(b) => {
                let used = books
                    .devices
                    .values()
                    .map(DeviceBooks::used_and_pending)
                    .fold(0u64, u64::saturating_add);
                b.saturating_sub(used)
            }
            None => u64::MAX,
        };
        dev.min(process)
    }

    fn try_grant_locked(&self, device: DeviceId, bytes: u64) -> Result<MappedGrowthGrant, u64> {
        let mut books = lock(&self.inner.books);
        let available = self.available(&books, device);
        if bytes > available {
            return Err(available);
        }
        let d = books.devices.entry(device).or_default();
        // Cannot overflow: bytes <= available <= budget - used - pending; unlimited budgets
        // saturate instead.
        d.pending = d.pending.saturating_add(bytes);
        Ok(MappedGrowthGrant {
            governor: self.clone(),
            device,
            bytes,
        })
    }

    /// Grants `bytes` of growth on `device`, or refuses with [`Backpressure`].
    ///
    /// When the budget is short, every registered [`Reclaimer`] is first asked to free the
    /// shortfall ("evict before refusing"); the grant is refused only if it still does not fit.
    pub fn try_grant(
        &self,
        device: DeviceId,
        bytes: u64,
    ) -> Result<MappedGrowthGrant, Backpressure> {
        let span = tracing::debug_span!("governor.try_grant", device = device.0, bytes);
        let _e = span.enter();
        let available = match self.try_grant_locked(device, bytes) {
            Ok(g) => return Ok(g),
            Err(available) => available,
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
            Err(available) => {
                let shortfall = bytes.saturating_sub(available);
                let retry_after = self.estimate_retry_after(device, shortfall);
                tracing::debug!(needed = bytes, available, ?retry_after, "grant refused");
                Err(Backpressure {
                    device,
                    needed: bytes,
                    available,
                    retry_after,
                })
            }
        }
    }

    /// The `retry_after` the governor would suggest now for a shortfall of `shortfall` bytes
    /// on `device` (see the crate docs).
    pub fn estimate_retry_after(&self, device: DeviceId, shortfall: u64) -> Duration {
        let policy = self.inner.config.retry;
        let now = self.inner.config.clock.now();
        let mut books = lock(&self.inner.books);
        let freed = books.devices.get_mut(&device).map_or(0, |d| {
            prune(&mut d.frees, now, policy.window);
            d.frees
                .iter()
                .map(|(_, b)| *b)
                .fold(0u64, u64::saturating_add)
        });
        policy.estimate(shortfall, freed)
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
        if bytes == 0 || from == to {
            return Ok(());
        }
        let mut books = lock(&self.inner.books);
        let d = books.devices.entry(device).or_default();
        take(device, from.as_str(), d.bucket(from), bytes)?;
        if let Err(e) = put(device, d.bucket(to), bytes) {
            // Undo the take so the books stay whole.
            let _ = put(device, d.bucket(from), bytes);
            return Err(e);
        }
        Ok(())
    }

    /// Records that `bytes` of `from` on `device` were released to the driver (they leave the
    /// books and count towards the release rate).
    pub fn free(&self, device: DeviceId, from: Bucket, bytes: u64) -> Result<(), GovernorError> {
        if bytes == 0 {
            return Ok(());
        }
        let now = self.inner.config.clock.now();
        let window = self.inner.config.retry.window;
        let mut books = lock(&self.inner.books);
        let d = books.devices.entry(device).or_default();
        take(device, from.as_str(), d.bucket(from), bytes)?;
        prune(&mut d.frees, now, window);
        if d.frees.len() >= MAX_FREE_EVENTS {
            // Merge the oldest event into the next one: the sum in the window is kept.
            if let Some((_, b)) = d.frees.pop_front() {
                if let Some(next) = d.frees.front_mut() {
                    next.1 = next.1.saturating_add(b);
                }
            }
        }
        d.frees.push_back((now, bytes));
        Ok(())
    }

    /// A copy of the books.
    pub fn snapshot(&self) -> GovernorSnapshot {
        let books = lock(&self.inner.books);
        let devices = books
            .devices
            .iter()
            .map(|(id, d)| DeviceSnapshot {
                device: *id,
                budget: self.device_budget(*id),
                committed: d.committed,
                pooled: d.pooled,
                shared: d.shared,
                quarantined: d.quarantined,
                pending: d.pending,
            })
            .collect();
        GovernorSnapshot {
            devices,
            process_budget: self.inner.config.process_budget,
        }
    }

    fn settle_pending(&self, device: DeviceId, bytes: u64, to: Option<Bucket>) {
        if bytes == 0 {
            return;
        }
        let mut books = lock(&self.inner.books);
        let d = books.devices.entry(device).or_default();
        // A grant only settles what it holds, so pending always covers it; saturate anyway.
        d.pending = d.pending.saturating_sub(bytes);
        if let Some(b) = to {
            let slot = d.bucket(b);
            *slot = slot.saturating_add(bytes);
        }
    }
}

fn prune(frees: &mut VecDeque<(Instant, u64)>, now: Instant, window: Duration) {
    while let Some((t, _)) = frees.front() {
        if now.saturating_duration_since(*t) > window {
            frees.pop_front();
        } else {
            break;
        }
    }
}

/// Permission to commit `bytes` more physical memory on one device.
///
/// The granted bytes are deducted from the budget (as *pending*) until the grant is settled:
/// [`commit`](Self::commit) or [`settle`](Self::settle) turn them into a bucket,
/// [`rollback`](Self::rollback) or dropping the grant return them.
#[must_use = "a grant that is dropped is rolled back"]
pub struct MappedGrowthGrant {
    governor: Governor,
    device: DeviceId,
    bytes: u64,
}

impl fmt::Debug for MappedGrowthGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MappedGrowthGrant")
            .field("device", &self.device)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl MappedGrowthGrant {
    /// The device the grant is for.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// The bytes still held by the grant.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether `governor` issued this grant.
    pub fn is_from(&self, governor: &Governor) -> bool {
        Arc::ptr_eq(&self.governor.inner, &governor.inner)
    }

    /// Turns `bytes` of the grant into `bucket` (physical memory now exists for them).
    /// Fails, changing nothing, if the grant holds fewer bytes.
    pub fn settle(&mut self, bytes: u64, bucket: Bucket) -> Result<(), GovernorError> {
        let rest = self
            .bytes
            .checked_sub(bytes)
            .ok_or(GovernorError::Underflow {
                device: self.device,
                bucket: "grant",
                bytes,
                held: self.bytes,
            })?;
        self.governor
            .settle_pending(self.device, bytes, Some(bucket));
        self.bytes = rest;
        Ok(())
    }

    /// Returns `bytes` of the grant to the budget (they were not needed). Fails, changing
    /// nothing, if the grant holds fewer bytes.
    pub fn give_back(&mut self, bytes: u64) -> Result<(), GovernorError> {
        let rest = self
            .bytes
            .checked_sub(bytes)
            .ok_or(GovernorError::Underflow {
                device: self.device,
                bucket: "grant",
                bytes,
                held: self.bytes,
            })?;
        self.governor.settle_pending(self.device, bytes, None);
        self.bytes = rest;
        Ok(())
    }

    /// A successful commit: every byte still held becomes [`Bucket::Committed`].
    pub fn commit(mut self) {
        let bytes = std::mem::take(&mut self.bytes);
        self.governor
            .settle_pending(self.device, bytes, Some(Bucket::Committed));
    }

    /// A failed commit: every byte still held returns to the budget.
    pub fn rollback(mut self) {
        let bytes = std::mem::take(&mut self.bytes);
        self.governor.settle_pending(self.device, bytes, None);
    }
}

impl Drop for MappedGrowthGrant {
    fn drop(&mut self) {
        let bytes = std::mem::take(&mut self.bytes);
        self.governor.settle_pending(self.device, bytes, None);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    const D0: DeviceId = DeviceId(0);
    const D1: DeviceId = DeviceId(1);
    const MIB: u64 = 1 << 20;

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
        let err = g.try_grant(D0, 1).unwrap_err();
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
        let e = g.try_grant(D1, 6 * MIB).unwrap_err();
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
        let e = g.try_grant(D0, 2 * MIB).unwrap_err();
        assert_eq!(e.retry_after, RetryPolicy::default().cap);
        // 4 MiB freed within the window: 4 MiB/s. Asking 6 MiB with 4 MiB free: 2 MiB short,
        // so 500 ms.
        g.free(D0, Bucket::Committed, 4 * MIB).unwrap();
        clock.advance(Duration::from_millis(100));
        let e = g.try_grant(D0, 6 * MIB).unwrap_err();
        assert_eq!((e.needed, e.available), (6 * MIB, 4 * MIB));
        assert_eq!(e.retry_after, Duration::from_millis(500));
        // Once the window has passed, the free no longer counts.
        clock.advance(Duration::from_secs(2));
        let e = g.try_grant(D0, 6 * MIB).unwrap_err();
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
        let e = g.try_grant(D0, 2 * MIB).unwrap_err();
        assert_eq!(e.available, MIB);
        assert_eq!(pool.calls.load(Ordering::SeqCst), 2);
        // The reclaimer is held weakly.
        drop(pool);
        assert!(g.try_grant(D0, 2 * MIB).is_err());
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
        let books = lock(&g.inner.books);
        let d = books.devices.get(&D0).unwrap();
        assert!(d.frees.len() <= MAX_FREE_EVENTS);
        assert_eq!(
            d.frees.iter().map(|(_, b)| b).sum::<u64>(),
            4 * MAX_FREE_EVENTS as u64
        );
    }
}
