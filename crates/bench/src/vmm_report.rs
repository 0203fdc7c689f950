//! [`BenchReport`]: what the manager benchmark measured, and its Markdown table.

use std::fmt::Write as _;
use std::time::Duration;

use kvvm::hal::DeviceId;

use crate::stats::Stats;
use crate::units::{fmt_bytes, ratio, us};
use crate::vmm_runs::{runs_markdown, RunRow};

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
    /// (`VmmConfig::park_released`): no driver call.
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

/// Everything `run_all` measured.
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
    /// Runs: the manager vs one handle per run vs one handle per granule, commit and
    /// teardown.
    pub runs: Vec<RunRow>,
    /// The largest handle the manager's commits made (`VmmConfig::max_handle_bytes`).
    pub max_handle_bytes: u64,
    /// Whether the backend spent a latency model (the simulator's H200 model): the timings
    /// then follow the model.
    pub latency_spent: bool,
    /// Pool vs fresh.
    pub pool: Option<PoolRow>,
    /// Growth by one granule.
    pub growth: Vec<GrowthRow>,
    /// Remarks (skipped cases, ...).
    pub notes: Vec<String>,
}

fn opt(s: Option<Stats>, f: impl Fn(Stats) -> Duration) -> String {
    s.map_or_else(|| "-".to_owned(), |s| us(f(s)))
}

/// One `| label | p50 | p90 |` row of a Markdown table.
fn percentile_row(s: &mut String, label: &str, stats: Stats) {
    let _ = writeln!(s, "| {label} | {} | {} |", us(stats.median), us(stats.p90));
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
        if let Some(note) = crate::timing::simulated_timing_note(&self.backend, self.latency_spent)
        {
            let _ = writeln!(s, "{note}\n");
        }
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
        runs_markdown(&mut s, &self.runs, self.max_handle_bytes);
        if let Some(p) = &self.pool {
            let _ = writeln!(
                s,
                "\n### Commit of {} granules: from the pool vs fresh\n",
                p.granules
            );
            let _ = writeln!(s, "| case | p50 | p90 |");
            let _ = writeln!(s, "|---|---|---|");
            percentile_row(&mut s, "from pool", p.from_pool);
            percentile_row(
                &mut s,
                "from parked windows (same reservation)",
                p.from_parked,
            );
            percentile_row(&mut s, "fresh", p.fresh);
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
