//! Side-by-side measurements of the manager against the raw driver sequence, on any backend.
//!
//! [`run_all`] measures, in one run:
//!
//! 1. a manager commit of `k` granules ([`Reservation::commit`]) against the minimal raw
//!    driver sequence (create and map per granule, one set access) for each `k` of
//!    [`BenchConfig::commit_granules`];
//! 2. a commit served from the handle pool (remap) and one served from windows parked in the
//!    same reservation ([`VmmConfig::park_released`]: no driver call) against a fresh commit,
//!    at [`BenchConfig::pool_granules`];
//! 3. growing a buffer of each size of [`BenchConfig::growth_sizes`] by one granule with the
//!    manager, against the raw create + map + set access of one granule, with a slot for the
//!    "realloc and copy" baseline (allocate size + granule, copy device to device, free the
//!    old buffer). The trait has no plain allocation nor device-to-device copy, so that
//!    baseline is supplied by a backend-specific closure ([`run_all_with_baseline`]); without
//!    one the slot stays empty and [`BenchReport::set_realloc_baseline`] can fill it later.
//!
//! Only the measured steps are timed; set-up and clean-up (release, unmap) are not. Sizes
//! that do not fit the device's free memory are skipped with a note. Results are medians and
//! 90th percentiles; [`BenchReport::to_markdown`] prints them with ratios.
//!
//! ```
//! use std::sync::Arc;
//! use kvvm_sim::{SimBackend, SimConfig};
//! use kvvm_vmm::bench::{run_all, BenchConfig};
//!
//! let g = 64 << 10;
//! let sim = Arc::new(SimBackend::new(SimConfig::single(g, 1 << 30)));
//! let report = run_all(sim.clone(), &BenchConfig::tiny(g)).unwrap();
//! assert!(report.to_markdown().contains("manager/raw"));
//! assert!(sim.ledger().is_empty());
//! ```

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvvm_governor::Governor;
use kvvm_hal::{
    AccessDescriptor, AllocationProperties, BackendError, DeviceAddress, DeviceId, PhysicalHandle,
    VirtualMemoryBackend,
};

use crate::error::{VmmError, VmmResult};
use crate::Reservation;
use crate::{GranularityChoice, VirtualMemory, VmmConfig};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// What to measure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchConfig {
    /// The device.
    pub device: DeviceId,
    /// Commit sizes in granules for the manager-vs-raw comparison.
    pub commit_granules: Vec<u64>,
    /// Commit size in granules for the pool-vs-fresh comparison (0: skip).
    pub pool_granules: u64,
    /// Buffer sizes in bytes grown by one granule.
    pub growth_sizes: Vec<u64>,
    /// Measured iterations per case.
    pub iterations: usize,
    /// Unmeasured iterations before each case.
    pub warmup: usize,
}

impl Default for BenchConfig {
    /// The issue's sizes: k = 1, 8, 64, 512; pool at 64; growth of 256 MiB, 1, 4, 16 GiB;
    /// 20 iterations after 2 of warm-up.
    fn default() -> Self {
        BenchConfig {
            device: DeviceId(0),
            commit_granules: vec![1, 8, 64, 512],
            pool_granules: 64,
            growth_sizes: vec![256 * MIB, GIB, 4 * GIB, 16 * GIB],
            iterations: 20,
            warmup: 2,
        }
    }
}

impl BenchConfig {
    /// Tiny sizes for a smoke run on the simulator: k = 1, 2, 4; pool at 4; growth of 4 and 16
    /// granules; 3 iterations.
    pub fn tiny(granule: u64) -> Self {
        BenchConfig {
            device: DeviceId(0),
            commit_granules: vec![1, 2, 4],
            pool_granules: 4,
            growth_sizes: vec![4 * granule, 16 * granule],
            iterations: 3,
            warmup: 1,
        }
    }
}

/// Summary of the samples of one case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    /// Number of samples.
    pub samples: usize,
    /// Fastest sample.
    pub min: Duration,
    /// Median (nearest rank).
    pub median: Duration,
    /// 90th percentile (nearest rank).
    pub p90: Duration,
}

impl Stats {
    /// Summarises samples (`None` if there are none).
    pub fn from_samples(mut samples: Vec<Duration>) -> Option<Stats> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_unstable();
        let n = samples.len();
        let rank = |p: usize| {
            // Nearest rank: ceil(p/100 * n), 1-based.
            let r = (p.saturating_mul(n)).div_ceil(100).clamp(1, n);
            samples.get(r - 1).copied().unwrap_or_default()
        };
        Some(Stats {
            samples: n,
            min: samples.first().copied().unwrap_or_default(),
            median: rank(50),
            p90: rank(90),
        })
    }
}

/// Manager commit against the raw driver sequence, for one `k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitRow {
    /// Granules per commit.
    pub granules: u64,
    /// Bytes per commit.
    pub bytes: u64,
    /// The manager's commit (pool disabled).
    pub manager: Stats,
    /// The raw sequence: create + map per granule, one set access.
    pub raw: Stats,
}

/// Commit served from the pool against a fresh commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolRow {
    /// Granules per commit.
    pub granules: u64,
    /// Every handle from the free-handle pool (map + one set access).
    pub from_pool: Stats,
    /// Every window parked by the previous release of the same reservation
    /// ([`VmmConfig::park_released`]): no driver call.
    pub from_parked: Stats,
    /// Every handle created.
    pub fresh: Stats,
}

/// Growth of a buffer of `size` bytes by one granule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrowthRow {
    /// The buffer's size before growing.
    pub size: u64,
    /// The manager's commit of one more granule (pointer unchanged).
    pub manager: Option<Stats>,
    /// The raw create + map + set access of one granule.
    pub raw: Option<Stats>,
    /// Allocate size + granule, copy, free (pointer changes): filled by a backend-specific
    /// function, `None` until then.
    pub realloc_copy: Option<Stats>,
    /// Why the size was skipped, if it was.
    pub skipped: Option<String>,
}

/// Everything [`run_all`] measured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchReport {
    /// The backend's name.
    pub backend: String,
    /// The device.
    pub device: DeviceId,
    /// The granule used.
    pub granule: u64,
    /// Measured iterations per case.
    pub iterations: usize,
    /// Manager vs raw commits.
    pub commit: Vec<CommitRow>,
    /// Pool vs fresh.
    pub pool: Option<PoolRow>,
    /// Growth by one granule.
    pub growth: Vec<GrowthRow>,
    /// Remarks (skipped cases, ...).
    pub notes: Vec<String>,
}

/// A backend-specific "realloc and copy" measurement: given the buffer size and the granule,
/// allocate `size + granule`, copy `size` bytes device to device, free the old buffer, and
/// return the time it took.
pub type ReallocBaseline<'a> = &'a mut dyn FnMut(u64, u64) -> Result<Duration, BackendError>;

/// Runs every measurement of `config` on `backend` (no realloc baseline).
pub fn run_all(
    backend: Arc<dyn VirtualMemoryBackend>,
    config: &BenchConfig,
) -> VmmResult<BenchReport> {
    run_all_with_baseline(backend, config, None)
}

/// Runs every measurement of `config` on `backend`, measuring the realloc-and-copy baseline
/// of each growth size with `realloc` when given.
pub fn run_all_with_baseline(
    backend: Arc<dyn VirtualMemoryBackend>,
    config: &BenchConfig,
    mut realloc: Option<ReallocBaseline<'_>>,
) -> VmmResult<BenchReport> {
    let span = tracing::info_span!("vmm.bench", backend = backend.name());
    let _e = span.enter();
    let device = config.device;
    let fresh_vm = VirtualMemory::new(
        backend.clone(),
        device,
        Governor::unlimited(),
        VmmConfig::default()
            .pool_cap_bytes(0)
            .granularity(GranularityChoice::Minimum),
    )?;
    let g = fresh_vm.granule();
    let mut report = BenchReport {
        backend: backend.name().to_owned(),
        device,
        granule: g,
        iterations: config.iterations,
        commit: Vec::new(),
        pool: None,
        growth: Vec::new(),
        notes: Vec::new(),
    };
    let rounds = config.warmup.saturating_add(config.iterations);
    let free_memory = |b: &dyn VirtualMemoryBackend| b.memory_info(device).map(|m| m.free);

    for &k in &config.commit_granules {
        let bytes = k.checked_mul(g).ok_or(VmmError::SizeOverflow {
            what: "bench commit size",
        })?;
        if k == 0 || free_memory(&*backend)? < bytes {
            report.notes.push(format!(
                "commit of {k} granules skipped: does not fit free memory"
            ));
            continue;
        }
        let mut res = fresh_vm.reserve(bytes)?;
        let raw = RawRange::reserve(&*backend, device, bytes)?;
        let (mut manager, mut raw_samples) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let t = time_commit(&mut res, bytes)?;
            let r = raw.time_commit(k, g);
            let r = r?;
            if round >= config.warmup {
                manager.push(t);
                raw_samples.push(r);
            }
        }
        drop(res);
        raw.free()?;
        if let (Some(manager), Some(raw)) = (
            Stats::from_samples(manager),
            Stats::from_samples(raw_samples),
        ) {
            report.commit.push(CommitRow {
                granules: k,
                bytes,
                manager,
                raw,
            });
        }
    }

    let k = config.pool_granules;
    if k > 0 {
        let bytes = k.checked_mul(g).ok_or(VmmError::SizeOverflow {
            what: "bench pool size",
        })?;
        if free_memory(&*backend)? < bytes {
            report.notes.push(format!(
                "pool case of {k} granules skipped: does not fit free memory"
            ));
        } else {
            let pool_vm = VirtualMemory::new(
                backend.clone(),
                device,
                Governor::unlimited(),
                VmmConfig::default()
                    .pool_cap_bytes(bytes)
                    .granularity(GranularityChoice::Minimum),
            )?;
            let park_vm = VirtualMemory::new(
                backend.clone(),
                device,
                Governor::unlimited(),
                VmmConfig::default()
                    .pool_cap_bytes(bytes)
                    .granularity(GranularityChoice::Minimum)
                    .park_released(true),
            )?;
            let mut pooled_res = pool_vm.reserve(bytes)?;
            pooled_res.commit(bytes)?;
            pooled_res.release()?;
            let mut parked_res = park_vm.reserve(bytes)?;
            parked_res.commit(bytes)?;
            parked_res.release()?;
            let mut fresh_res = fresh_vm.reserve(bytes)?;
            let (mut pooled, mut parked, mut fresh) = (Vec::new(), Vec::new(), Vec::new());
            for round in 0..rounds {
                let p = time_commit(&mut pooled_res, bytes)?;
                let q = time_commit(&mut parked_res, bytes)?;
                let f = time_commit(&mut fresh_res, bytes)?;
                if round >= config.warmup {
                    pooled.push(p);
                    parked.push(q);
                    fresh.push(f);
                }
            }
            drop(pooled_res);
            drop(parked_res);
            drop(fresh_res);
            pool_vm.trim_pool(0);
            park_vm.trim_pool(0);
            if let (Some(from_pool), Some(from_parked), Some(fresh)) = (
                Stats::from_samples(pooled),
                Stats::from_samples(parked),
                Stats::from_samples(fresh),
            ) {
                report.pool = Some(PoolRow {
                    granules: k,
                    from_pool,
                    from_parked,
                    fresh,
                });
            }
        }
    }

    for &size in &config.growth_sizes {
        let mut row = GrowthRow {
            size,
            manager: None,
            raw: None,
            realloc_copy: None,
            skipped: None,
        };
        let base = fresh_vm.round_up(size)?;
        // Room for the buffer, one more granule, and (for the baseline) a second copy.
        let needed = base
            .checked_mul(2)
            .and_then(|b| b.checked_add(g.saturating_mul(2)))
            .ok_or(VmmError::SizeOverflow {
                what: "bench growth size",
            })?;
        if free_memory(&*backend)? < needed {
            row.skipped = Some(format!("needs {needed} bytes free, the device has less"));
            report.growth.push(row);
            continue;
        }
        let mut res = fresh_vm.reserve(base.saturating_add(g))?;
        res.commit(base)?;
        let tail = res
            .address()
            .checked_add(base)
            .ok_or(VmmError::SizeOverflow {
                what: "bench growth tail",
            })?;
        let raw = RawRange {
            backend: &*backend,
            device,
            base: tail,
            size: g,
            owned: false,
        };
        let (mut manager, mut raw_samples) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let t0 = Instant::now();
            res.commit(g)?;
            let t = t0.elapsed();
            res.truncate(base)?;
            // The raw growth maps the same tail granule the manager just released.
            let r = raw.time_commit(1, g)?;
            if round >= config.warmup {
                manager.push(t);
                raw_samples.push(r);
            }
        }
        drop(res);
        row.manager = Stats::from_samples(manager);
        row.raw = Stats::from_samples(raw_samples);
        if let Some(f) = realloc.as_mut() {
            let mut samples = Vec::new();
            for round in 0..rounds {
                let t = f(size, g)?;
                if round >= config.warmup {
                    samples.push(t);
                }
            }
            row.realloc_copy = Stats::from_samples(samples);
        }
        report.growth.push(row);
    }
    Ok(report)
}

fn time_commit(res: &mut Reservation, bytes: u64) -> VmmResult<Duration> {
    let t0 = Instant::now();
    res.commit(bytes)?;
    let t = t0.elapsed();
    res.release()?;
    Ok(t)
}

/// A range driven with raw driver calls (the baseline).
struct RawRange<'a> {
    backend: &'a dyn VirtualMemoryBackend,
    device: DeviceId,
    base: DeviceAddress,
    size: u64,
    /// Whether this range reserved its address space (and frees it).
    owned: bool,
}

impl<'a> RawRange<'a> {
    fn reserve(
        backend: &'a dyn VirtualMemoryBackend,
        device: DeviceId,
        size: u64,
    ) -> VmmResult<Self> {
        let base = backend.reserve(size, 0, None)?;
        Ok(RawRange {
            backend,
            device,
            base,
            size,
            owned: true,
        })
    }

    /// Times create + map of `k` granules and one set access, then (untimed) unmaps and
    /// releases them.
    fn time_commit(&self, k: u64, g: u64) -> VmmResult<Duration> {
        let props = AllocationProperties::device(self.device);
        let access = [AccessDescriptor::read_write(self.device)];
        let mut handles: Vec<PhysicalHandle> = Vec::new();
        let mut mapped = 0u64;
        let t0 = Instant::now();
        let mut result: Result<(), BackendError> = Ok(());
        for i in 0..k {
            let addr = DeviceAddress(self.base.0.saturating_add(i.saturating_mul(g)));
            match self.backend.create(g, &props) {
                Ok(h) => {
                    handles.push(h);
                    if let Err(e) = self.backend.map(addr, g, h) {
                        result = Err(e);
                        break;
                    }
                    mapped = mapped.saturating_add(1);
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        if result.is_ok() {
            result = self
                .backend
                .set_access(self.base, k.saturating_mul(g), &access);
        }
        let elapsed = t0.elapsed();
        // Clean up (untimed), whatever happened.
        let mut cleanup: Result<(), BackendError> = Ok(());
        if self.backend.capabilities().unmap_spans_mappings && mapped > 0 {
            if let Err(e) = self.backend.unmap(self.base, mapped.saturating_mul(g)) {
                cleanup = Err(e);
            }
        } else {
            for i in (0..mapped).rev() {
                let addr = DeviceAddress(self.base.0.saturating_add(i.saturating_mul(g)));
                if let Err(e) = self.backend.unmap(addr, g) {
                    cleanup = cleanup.and(Err(e));
                }
            }
        }
        for h in handles {
            if let Err(e) = self.backend.release(h) {
                cleanup = cleanup.and(Err(e));
            }
        }
        result?;
        cleanup?;
        Ok(elapsed)
    }

    fn free(self) -> VmmResult<()> {
        if self.owned {
            self.backend.free(self.base, self.size)?;
        }
        Ok(())
    }
}

fn fmt_bytes(b: u64) -> String {
    let multiple = |unit: u64| b >= unit && b.checked_rem(unit) == Some(0);
    if multiple(GIB) {
        format!("{} GiB", b / GIB)
    } else if multiple(MIB) {
        format!("{} MiB", b / MIB)
    } else if multiple(1024) {
        format!("{} KiB", b / 1024)
    } else {
        format!("{b} B")
    }
}

fn us(d: Duration) -> String {
    format!("{:.1} us", d.as_secs_f64() * 1e6)
}

fn ratio(a: Duration, b: Duration) -> String {
    if b.is_zero() {
        "-".to_owned()
    } else {
        format!("{:.2}x", a.as_secs_f64() / b.as_secs_f64())
    }
}

fn opt(s: Option<Stats>, f: impl Fn(Stats) -> Duration) -> String {
    s.map_or_else(|| "-".to_owned(), |s| us(f(s)))
}

impl BenchReport {
    /// Fills the realloc-and-copy slot of the growth row of `size`.
    pub fn set_realloc_baseline(&mut self, size: u64, stats: Stats) {
        if let Some(row) = self.growth.iter_mut().find(|r| r.size == size) {
            row.realloc_copy = Some(stats);
        }
    }

    /// The report as Markdown tables: medians, 90th percentiles and ratios.
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "## kvvm vmm bench: backend `{}`, {}, granule {}, {} iterations\n",
            self.backend,
            self.device,
            fmt_bytes(self.granule),
            self.iterations
        );
        let _ = writeln!(
            s,
            "### Commit of k granules: manager vs raw driver sequence\n"
        );
        let _ = writeln!(
            s,
            "| k | bytes | manager p50 | manager p90 | raw p50 | raw p90 | manager/raw |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|");
        for r in &self.commit {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} |",
                r.granules,
                fmt_bytes(r.bytes),
                us(r.manager.median),
                us(r.manager.p90),
                us(r.raw.median),
                us(r.raw.p90),
                ratio(r.manager.median, r.raw.median)
            );
        }
        if let Some(p) = &self.pool {
            let _ = writeln!(
                s,
                "\n### Commit of {} granules: from the pool vs fresh\n",
                p.granules
            );
            let _ = writeln!(s, "| case | p50 | p90 |");
            let _ = writeln!(s, "|---|---|---|");
            let _ = writeln!(
                s,
                "| from pool | {} | {} |",
                us(p.from_pool.median),
                us(p.from_pool.p90)
            );
            let _ = writeln!(
                s,
                "| from parked windows (same reservation) | {} | {} |",
                us(p.from_parked.median),
                us(p.from_parked.p90)
            );
            let _ = writeln!(
                s,
                "| fresh | {} | {} |",
                us(p.fresh.median),
                us(p.fresh.p90)
            );
            let _ = writeln!(
                s,
                "\nfresh/pool = {}, fresh/parked = {}",
                ratio(p.fresh.median, p.from_pool.median),
                ratio(p.fresh.median, p.from_parked.median)
            );
        }
        let _ = writeln!(s, "\n### Growing a buffer by one granule\n");
        let _ = writeln!(
            s,
            "| size | manager p50 | manager p90 | raw VMM p50 | raw VMM p90 | realloc+copy p50 | realloc+copy p90 | realloc/manager |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
        for r in &self.growth {
            if let Some(why) = &r.skipped {
                let _ = writeln!(s, "| {} | skipped: {why} | | | | | | |", fmt_bytes(r.size));
                continue;
            }
            let rr = match (r.realloc_copy, r.manager) {
                (Some(a), Some(m)) => ratio(a.median, m.median),
                _ => "-".to_owned(),
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                fmt_bytes(r.size),
                opt(r.manager, |x| x.median),
                opt(r.manager, |x| x.p90),
                opt(r.raw, |x| x.median),
                opt(r.raw, |x| x.p90),
                opt(r.realloc_copy, |x| x.median),
                opt(r.realloc_copy, |x| x.p90),
                rr
            );
        }
        if self
            .growth
            .iter()
            .any(|r| r.realloc_copy.is_none() && r.skipped.is_none())
        {
            let _ = writeln!(
                s,
                "\nrealloc+copy: not measured by this backend (needs a device allocation and a \
                 device-to-device copy, outside the VMM trait)."
            );
        }
        for n in &self.notes {
            let _ = writeln!(s, "\nnote: {n}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use kvvm_sim::{LatencyMode, LatencyModel, SimBackend, SimConfig};

    #[test]
    fn stats_nearest_rank() {
        let v: Vec<Duration> = (1..=10).map(Duration::from_micros).collect();
        let s = Stats::from_samples(v).unwrap();
        assert_eq!(
            (s.samples, s.min, s.median, s.p90),
            (
                10,
                Duration::from_micros(1),
                Duration::from_micros(5),
                Duration::from_micros(9)
            )
        );
        assert_eq!(Stats::from_samples(Vec::new()), None);
        let one = Stats::from_samples(vec![Duration::from_micros(7)]).unwrap();
        assert_eq!(
            (one.median, one.p90),
            (Duration::from_micros(7), Duration::from_micros(7))
        );
    }

    #[test]
    fn runs_on_the_sim_and_leaves_nothing() {
        let g = 64 << 10;
        let sim = Arc::new(SimBackend::new(
            SimConfig::single(g, 256 * g).with_latency(LatencyModel::zero(), LatencyMode::Account),
        ));
        let mut calls = 0;
        let mut realloc = |size: u64, granule: u64| {
            calls += 1;
            assert_eq!(granule, g);
            Ok(Duration::from_micros(size / g))
        };
        let mut cfg = BenchConfig::tiny(g);
        cfg.growth_sizes.push(1 << 40); // does not fit: skipped
        let mut report = run_all_with_baseline(sim.clone(), &cfg, Some(&mut realloc)).unwrap();
        assert_eq!(calls, 2 * (cfg.iterations + cfg.warmup));
        assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
        assert_eq!(report.commit.len(), 3);
        assert_eq!(report.commit[2].granules, 4);
        assert!(report.pool.is_some());
        assert_eq!(report.growth.len(), 3);
        assert!(report.growth[2].skipped.is_some());
        assert_eq!(
            report.growth[1].realloc_copy.unwrap().median,
            Duration::from_micros(16)
        );
        let md = report.to_markdown();
        for needle in ["manager/raw", "from pool", "realloc/manager", "skipped"] {
            assert!(md.contains(needle), "{needle} missing from {md}");
        }
        assert!(md.contains("| 4 | 256 KiB |"), "{md}");
        assert!(md.contains("fresh/pool"), "{md}");
        assert!(md.contains("| 1 MiB |"), "{md}");
        let stats = report.growth[0].manager.unwrap();
        report.set_realloc_baseline(4 * g, stats);
        assert_eq!(report.growth[0].realloc_copy, Some(stats));
    }
}
