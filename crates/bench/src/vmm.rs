//! Side-by-side measurements of the manager against the raw driver sequence, on any backend.
//!
//! [`run_all`] measures, in one run:
//!
//! 1. a manager commit of `k` granules ([`Reservation::commit`](kvvm::vmm::Reservation::commit)) against the minimal raw
//!    driver sequence (create and map per granule, one set access) for each `k` of
//!    [`BenchConfig::commit_granules`];
//! 2. runs of [`BenchConfig::run_sizes`] bytes (128 MiB, 512 MiB and 4 GiB by default): the
//!    manager's commit against one handle per run (the driver's limit: create one handle of
//!    the run's size, map it, set access once) and one handle per granule, and the teardown
//!    (unmap + release) of the same runs, side by side, and the manager again with handles
//!    exportable as POSIX fds where the backend can export;
//! 3. a commit served from the handle pool (remap) and one served from windows parked in the
//!    same reservation ([`VmmConfig::park_released`](kvvm::vmm::VmmConfig::park_released): no driver call) against a fresh commit,
//!    at [`BenchConfig::pool_granules`];
//! 4. giving a request `N` tokens (256, 4096 and 32768 of Llama-3.1-8B's 128 KiB by default,
//!    [`BenchConfig::gives`]) in one reservation, cold (the pool emptied first) and warm (the
//!    pool as the previous give left it) against one handle of the same bytes, with each
//!    give's driver calls timed one by one;
//! 5. growing a buffer of each size of [`BenchConfig::growth_sizes`] by one granule with the
//!    manager, against the raw create + map + set access of one granule, with a slot for the
//!    "realloc and copy" baseline (allocate size + granule, copy device to device, free the
//!    old buffer). The trait has no plain allocation nor device-to-device copy, so that
//!    baseline is supplied by a backend-specific closure ([`run_all_with_baseline`]); without
//!    one the slot stays empty and [`BenchReport::set_realloc_baseline`] can fill it later.
//!
//! Only the measured steps are timed; set-up and clean-up (release, unmap) are not, except
//! for the runs, whose teardown is measured. Sizes
//! that do not fit the device's free memory are skipped with a note. Results are medians and
//! 90th percentiles; [`BenchReport::to_markdown`] prints them with ratios.
//!
//! ```
//! use std::sync::Arc;
//! use kvvm::sim::{SimBackend, SimConfig};
//! use kvvm_bench::vmm::{run_all, BenchConfig};
//!
//! let g = 64 << 10;
//! let sim = Arc::new(SimBackend::new(SimConfig::single(g, 1 << 30)));
//! let report = run_all(sim.clone(), &BenchConfig::tiny(g)).unwrap();
//! assert!(report.to_markdown().contains("manager/raw"));
//! assert!(sim.ledger().is_empty());
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvvm::governor::Governor;
use kvvm::hal::{BackendError, DeviceId, ShareableHandleType, VirtualMemoryBackend};
use kvvm::vmm::{
    GranularityChoice, Reservation, VirtualMemory, VmmConfig, VmmError, VmmResult,
    DEFAULT_MAX_HANDLE_BYTES,
};

use crate::raw::RawRange;
pub use crate::stats::Stats;
pub use crate::vmm_give::{GiveCase, GiveConfig, GiveRow};
pub use crate::vmm_report::{BenchReport, CommitRow, GrowthRow, PoolRow};
use crate::vmm_runs::RunManagers;
pub use crate::vmm_runs::{RunCase, RunRow};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// What to measure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchConfig {
    /// The device.
    pub device: DeviceId,
    /// Commit sizes in granules for the manager-vs-raw comparison.
    pub commit_granules: Vec<u64>,
    /// Run sizes in bytes for the manager vs one handle per run vs one handle per granule
    /// (commit and teardown); a size that does not fit the device's free memory is skipped.
    pub run_sizes: Vec<u64>,
    /// The largest handle the manager's commits make (`VmmConfig::max_handle_bytes`).
    pub max_handle_bytes: u64,
    /// Whether the backend spends a latency model (reported with the timings).
    pub latency_spent: bool,
    /// Commit size in granules for the pool-vs-fresh comparison (0: skip).
    pub pool_granules: u64,
    /// The gives of a request's tokens, warm against cold (no token counts: skipped).
    pub gives: GiveConfig,
    /// Buffer sizes in bytes grown by one granule.
    pub growth_sizes: Vec<u64>,
    /// Measured iterations per case.
    pub iterations: usize,
    /// Unmeasured iterations before each case.
    pub warmup: usize,
}

impl Default for BenchConfig {
    /// The reference sizes: k = 1, 8, 64, 512; runs of 128 MiB, 512 MiB and 4 GiB; pool at
    /// 64; gives of 256, 4096 and 32768 tokens of 128 KiB with a 1 GiB pool; growth of
    /// 256 MiB, 1, 4, 16 GiB; handles of at most 512 MiB; 20 iterations after 2 of warm-up.
    fn default() -> Self {
        BenchConfig {
            device: DeviceId(0),
            commit_granules: vec![1, 8, 64, 512],
            run_sizes: vec![128 * MIB, 512 * MIB, 4 * GIB],
            max_handle_bytes: DEFAULT_MAX_HANDLE_BYTES,
            latency_spent: false,
            pool_granules: 64,
            gives: GiveConfig::default(),
            growth_sizes: vec![256 * MIB, GIB, 4 * GIB, 16 * GIB],
            iterations: 20,
            warmup: 2,
        }
    }
}

impl BenchConfig {
    /// Tiny sizes for a smoke run on the simulator: k = 1, 2, 4; runs of 8 and 32 granules;
    /// pool at 4; gives of 1, 4 and 16 granules; growth of 4 and 16 granules; 3 iterations.
    pub fn tiny(granule: u64) -> Self {
        BenchConfig {
            device: DeviceId(0),
            commit_granules: vec![1, 2, 4],
            run_sizes: vec![8 * granule, 32 * granule],
            max_handle_bytes: DEFAULT_MAX_HANDLE_BYTES,
            latency_spent: false,
            pool_granules: 4,
            gives: GiveConfig {
                tokens: vec![1, 4, 16],
                bytes_per_token: granule,
                ..GiveConfig::default()
            },
            growth_sizes: vec![4 * granule, 16 * granule],
            iterations: 3,
            warmup: 1,
        }
    }
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
        run_config(config),
    )?;
    let bench = Bench {
        backend: &backend,
        config,
        fresh_vm: &fresh_vm,
        g: fresh_vm.granule(),
        rounds: config.warmup.saturating_add(config.iterations),
    };
    let mut report = BenchReport {
        backend: backend.name().to_owned(),
        device,
        granule: bench.g,
        iterations: config.iterations,
        commit: Vec::new(),
        runs: Vec::new(),
        max_handle_bytes: config.max_handle_bytes,
        latency_spent: config.latency_spent,
        pool: None,
        gives: Vec::new(),
        growth: Vec::new(),
        notes: Vec::new(),
    };
    for &k in &config.commit_granules {
        if let Some(row) = bench.commit_row(k, &mut report.notes)? {
            report.commit.push(row);
        }
    }
    let exportable_vm = exportable_manager(&backend, config, &mut report.notes)?;
    let managers = RunManagers {
        plain: &fresh_vm,
        exportable: exportable_vm.as_ref(),
    };
    report.runs = crate::vmm_runs::measure_runs(
        &*backend,
        managers,
        device,
        &config.run_sizes,
        (config.warmup, config.iterations),
        &mut report.notes,
    )?;
    if config.pool_granules > 0 {
        report.pool = bench.pool_row(config.pool_granules, &mut report.notes)?;
    }
    report.gives = crate::vmm_give::measure_gives(
        &backend,
        device,
        &config.gives,
        (config.warmup, config.iterations),
        &mut report.notes,
    )?;
    for &size in &config.growth_sizes {
        let row = bench.growth_row(size, realloc.as_mut())?;
        report.growth.push(row);
    }
    Ok(report)
}

/// A manager like the runs' plain one whose handles are exportable as POSIX file descriptors
/// (what a manager leasing from a broker makes), or `None` with a note where the backend
/// cannot export.
fn exportable_manager(
    backend: &Arc<dyn VirtualMemoryBackend>,
    config: &BenchConfig,
    notes: &mut Vec<String>,
) -> VmmResult<Option<VirtualMemory>> {
    if !backend.capabilities().posix_fd_handles {
        notes.push(format!(
            "exportable handles not measured: the {} backend cannot export handles",
            backend.name()
        ));
        return Ok(None);
    }
    let mut vmm = run_config(config);
    vmm.handle_type = ShareableHandleType::PosixFd;
    VirtualMemory::new(backend.clone(), config.device, Governor::unlimited(), vmm).map(Some)
}

/// The configuration of the managers the runs are measured through: no pool, the minimum
/// granularity, handles of at most `config.max_handle_bytes`.
fn run_config(config: &BenchConfig) -> VmmConfig {
    VmmConfig::default()
        .pool_cap_bytes(0)
        .granularity(GranularityChoice::Minimum)
        .max_handle_bytes(config.max_handle_bytes)
}

/// What every measurement of one run works with.
struct Bench<'a> {
    backend: &'a Arc<dyn VirtualMemoryBackend>,
    config: &'a BenchConfig,
    /// The manager with no pool: every commit is fresh.
    fresh_vm: &'a VirtualMemory,
    /// Its granule.
    g: u64,
    /// Rounds per case, warm-up included.
    rounds: usize,
}

impl Bench<'_> {
    fn free_memory(&self) -> VmmResult<u64> {
        Ok(self.backend.memory_info(self.config.device)?.free)
    }

    /// Whether `round` is measured (past the warm-up).
    fn measured(&self, round: usize) -> bool {
        round >= self.config.warmup
    }

    /// A manager commit of `k` granules against the raw driver sequence; `None` with a note
    /// when it does not fit free memory.
    fn commit_row(&self, k: u64, notes: &mut Vec<String>) -> VmmResult<Option<CommitRow>> {
        let g = self.g;
        let bytes = k.checked_mul(g).ok_or(VmmError::SizeOverflow {
            what: "bench commit size",
        })?;
        if k == 0 || self.free_memory()? < bytes {
            notes.push(format!(
                "commit of {k} granules skipped: does not fit free memory"
            ));
            return Ok(None);
        }
        let mut res = self.fresh_vm.reserve(bytes)?;
        let raw = RawRange::reserve(&**self.backend, self.config.device, bytes)?;
        let (mut manager, mut raw_samples) = (Vec::new(), Vec::new());
        for round in 0..self.rounds {
            let t = time_commit(&mut res, bytes)?;
            let r = raw.time_commit(k, g);
            let r = r?;
            if self.measured(round) {
                manager.push(t);
                raw_samples.push(r);
            }
        }
        drop(res);
        raw.free()?;
        let (Some(manager), Some(raw)) = (
            Stats::from_samples(manager),
            Stats::from_samples(raw_samples),
        ) else {
            return Ok(None);
        };
        Ok(Some(CommitRow {
            granules: k,
            bytes,
            manager,
            raw,
        }))
    }

    /// A commit of `k` granules served from the pool and one served from windows parked in
    /// the same reservation, against a fresh commit; `None` with a note when it does not fit
    /// free memory.
    fn pool_row(&self, k: u64, notes: &mut Vec<String>) -> VmmResult<Option<PoolRow>> {
        let bytes = k.checked_mul(self.g).ok_or(VmmError::SizeOverflow {
            what: "bench pool size",
        })?;
        if self.free_memory()? < bytes {
            notes.push(format!(
                "pool case of {k} granules skipped: does not fit free memory"
            ));
            return Ok(None);
        }
        let pool_vm = self.pooling_manager(bytes, false)?;
        let park_vm = self.pooling_manager(bytes, true)?;
        let mut pooled_res = committed_then_released(&pool_vm, bytes)?;
        let mut parked_res = committed_then_released(&park_vm, bytes)?;
        let mut fresh_res = self.fresh_vm.reserve(bytes)?;
        let (mut pooled, mut parked, mut fresh) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..self.rounds {
            let p = time_commit(&mut pooled_res, bytes)?;
            let q = time_commit(&mut parked_res, bytes)?;
            let f = time_commit(&mut fresh_res, bytes)?;
            if self.measured(round) {
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
        let (Some(from_pool), Some(from_parked), Some(fresh)) = (
            Stats::from_samples(pooled),
            Stats::from_samples(parked),
            Stats::from_samples(fresh),
        ) else {
            return Ok(None);
        };
        Ok(Some(PoolRow {
            granules: k,
            from_pool,
            from_parked,
            fresh,
        }))
    }

    /// A manager whose pool holds `bytes`, parking released windows in their reservation
    /// when `park`.
    fn pooling_manager(&self, bytes: u64, park: bool) -> VmmResult<VirtualMemory> {
        let config = VmmConfig::default()
            .pool_cap_bytes(bytes)
            .granularity(GranularityChoice::Minimum);
        let config = if park {
            config.park_released(true)
        } else {
            config
        };
        VirtualMemory::new(
            self.backend.clone(),
            self.config.device,
            Governor::unlimited(),
            config,
        )
    }

    /// Growth of a buffer of `size` bytes by one granule, through the manager and the raw
    /// driver sequence, and with `realloc` when given; skipped when the buffer, one more
    /// granule and a second copy do not fit free memory.
    fn growth_row(
        &self,
        size: u64,
        realloc: Option<&mut ReallocBaseline<'_>>,
    ) -> VmmResult<GrowthRow> {
        let g = self.g;
        let mut row = GrowthRow {
            size,
            manager: None,
            raw: None,
            realloc_copy: None,
            skipped: None,
        };
        let base = self.fresh_vm.round_up(size)?;
        // Room for the buffer, one more granule, and (for the baseline) a second copy.
        let needed = base
            .checked_mul(2)
            .and_then(|b| b.checked_add(g.saturating_mul(2)))
            .ok_or(VmmError::SizeOverflow {
                what: "bench growth size",
            })?;
        if self.free_memory()? < needed {
            row.skipped = Some(format!("needs {needed} bytes free, the device has less"));
            return Ok(row);
        }
        (row.manager, row.raw) = self.time_growth(base)?;
        if let Some(f) = realloc {
            let mut samples = Vec::new();
            for round in 0..self.rounds {
                let t = f(size, g)?;
                if self.measured(round) {
                    samples.push(t);
                }
            }
            row.realloc_copy = Stats::from_samples(samples);
        }
        Ok(row)
    }

    /// The manager's commit of one granule past a committed buffer of `base` bytes (then
    /// truncated back), against the raw create + map + set access of the same tail granule.
    fn time_growth(&self, base: u64) -> VmmResult<(Option<Stats>, Option<Stats>)> {
        let g = self.g;
        let mut res = self.fresh_vm.reserve(base.saturating_add(g))?;
        res.commit(base)?;
        let tail = res
            .address()
            .checked_add(base)
            .ok_or(VmmError::SizeOverflow {
                what: "bench growth tail",
            })?;
        let raw = RawRange {
            backend: &**self.backend,
            device: self.config.device,
            base: tail,
            size: g,
            owned: false,
        };
        let (mut manager, mut raw_samples) = (Vec::new(), Vec::new());
        for round in 0..self.rounds {
            let t0 = Instant::now();
            res.commit(g)?;
            let t = t0.elapsed();
            res.truncate(base)?;
            // The raw growth maps the same tail granule the manager just released.
            let r = raw.time_commit(1, g)?;
            if self.measured(round) {
                manager.push(t);
                raw_samples.push(r);
            }
        }
        drop(res);
        Ok((
            Stats::from_samples(manager),
            Stats::from_samples(raw_samples),
        ))
    }
}

/// A reservation of `bytes` on `vm`, committed once and released (into the pool, or parked).
fn committed_then_released(vm: &VirtualMemory, bytes: u64) -> VmmResult<Reservation> {
    let mut res = vm.reserve(bytes)?;
    res.commit(bytes)?;
    res.release()?;
    Ok(res)
}

fn time_commit(res: &mut Reservation, bytes: u64) -> VmmResult<Duration> {
    let t0 = Instant::now();
    res.commit(bytes)?;
    let t = t0.elapsed();
    res.release()?;
    Ok(t)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use kvvm::sim::{LatencyMode, LatencyModel, SimBackend, SimConfig};

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
        // Gives of 1, 4 and 16 granules, each warm one from the pool.
        let pooled: Vec<u64> = report
            .gives
            .iter()
            .map(|r| r.warm.from_pool_bytes / g)
            .collect();
        assert_eq!(pooled, vec![1, 4, 16]);
        assert_eq!(report.growth.len(), 3);
        assert!(report.growth[2].skipped.is_some());
        assert_eq!(
            report.growth[1].realloc_copy.unwrap().median,
            Duration::from_micros(16)
        );
        let md = report.to_markdown();
        for needle in [
            "manager/raw",
            "from pool",
            "realloc/manager",
            "skipped",
            "warm / cold",
        ] {
            assert!(md.contains(needle), "{needle} missing from {md}");
        }
        assert!(md.contains("| 4 | 256 KiB |"), "{md}");
        assert!(md.contains("fresh/pool"), "{md}");
        assert!(md.contains("| 1 MiB |"), "{md}");
        // Runs of 8 and 32 granules: the manager makes one handle of each.
        assert_eq!(report.runs.len(), 2);
        assert_eq!(report.runs[1].bytes, 32 * g);
        assert_eq!(report.runs[1].manager_handles, 1);
        assert!(report.runs.iter().all(|r| r.exportable.is_some()));
        for needle in [
            "one handle per run",
            "manager / one handle",
            "teardown (unmap + release)",
        ] {
            assert!(md.contains(needle), "{needle} missing from {md}");
        }
        let stats = report.growth[0].manager.unwrap();
        report.set_realloc_baseline(4 * g, stats);
        assert_eq!(report.growth[0].realloc_copy, Some(stats));
    }

    #[test]
    fn a_backend_that_cannot_export_is_measured_without_the_exportable_case() {
        let g = 64 << 10;
        let mut cfg =
            SimConfig::single(g, 256 * g).with_latency(LatencyModel::zero(), LatencyMode::Account);
        for d in &mut cfg.devices {
            d.posix_fd = false;
        }
        let sim = Arc::new(SimBackend::new(cfg));
        let report = run_all(sim.clone(), &BenchConfig::tiny(g)).unwrap();
        assert_eq!(report.runs.len(), 2);
        assert!(report.runs.iter().all(|r| r.exportable.is_none()));
        assert!(
            report.notes.iter().any(|n| n.contains("cannot export")),
            "{:?}",
            report.notes
        );
        assert!(report.to_markdown().contains("| not exportable | - |"));
        assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    }
}
