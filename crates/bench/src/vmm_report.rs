//! [`BenchReport`]: what the manager benchmark measured, and its Markdown table.

use std::fmt::Write as _;
use std::time::Duration;

use kvvm::hal::DeviceId;

use crate::stats::Stats;
use crate::units::{fmt_bytes, ratio, us};
use crate::vmm_give::{gives_markdown, GiveRow};
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
    /// A request's give, warm vs cold vs one handle.
    pub gives: Vec<GiveRow>,
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
        self.header_markdown(&mut s);
        self.commit_markdown(&mut s);
        runs_markdown(&mut s, &self.runs, self.max_handle_bytes);
        if let Some(p) = &self.pool {
            pool_markdown(&mut s, p);
        }
        gives_markdown(&mut s, &self.gives);
        self.growth_markdown(&mut s);
        for n in &self.notes {
            let _ = writeln!(s, "\nnote: {n}");
        }
        s
    }

    /// The title (backend, device, granule, iterations) and the simulated-timings note.
    fn header_markdown(&self, s: &mut String) {
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
    }

    /// The table of manager commits against the raw driver sequence.
    fn commit_markdown(&self, s: &mut String) {
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
    }

    /// The table of growth by one granule, and a remark when the backend measured no
    /// realloc-and-copy baseline.
    fn growth_markdown(&self, s: &mut String) {
        let _ = writeln!(s, "\n### Growing a buffer by one granule\n");
        let _ = writeln!(
            s,
            "| size | manager p50 | manager p90 | raw VMM p50 | raw VMM p90 | realloc+copy p50 | realloc+copy p90 | realloc/manager |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
        for r in &self.growth {
            growth_row_markdown(s, r);
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
    }
}

/// The pool-vs-fresh table and its ratios.
fn pool_markdown(s: &mut String, p: &PoolRow) {
    let _ = writeln!(
        s,
        "\n### Commit of {} granules: from the pool vs fresh\n",
        p.granules
    );
    let _ = writeln!(s, "| case | p50 | p90 |");
    let _ = writeln!(s, "|---|---|---|");
    percentile_row(s, "from pool", p.from_pool);
    percentile_row(s, "from parked windows (same reservation)", p.from_parked);
    percentile_row(s, "fresh", p.fresh);
    let _ = writeln!(
        s,
        "\nfresh/pool = {}, fresh/parked = {}",
        ratio(p.fresh.median, p.from_pool.median),
        ratio(p.fresh.median, p.from_parked.median)
    );
}

/// One row of the growth table (or why its size was skipped).
fn growth_row_markdown(s: &mut String, r: &GrowthRow) {
    if let Some(why) = &r.skipped {
        let _ = writeln!(s, "| {} | skipped: {why} | | | | | | |", fmt_bytes(r.size));
        return;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmm_runs::RunCase;

    fn stats(median_us: u64, p90_us: u64) -> Stats {
        Stats {
            median: Duration::from_micros(median_us),
            p90: Duration::from_micros(p90_us),
            samples: 20,
            min: Duration::from_micros(median_us / 2),
        }
    }

    /// A report with a row of every kind: commits, runs, the pool, growth measured, growth
    /// without its baseline, growth skipped, and notes.
    fn report(latency_spent: bool) -> BenchReport {
        let run = |c: u64, t: u64| RunCase {
            commit: stats(c, c + 5),
            teardown: stats(t, t + 3),
        };
        BenchReport {
            backend: "sim".to_owned(),
            device: DeviceId(0),
            granule: 2 << 20,
            iterations: 20,
            commit: vec![
                CommitRow {
                    granules: 1,
                    bytes: 2 << 20,
                    manager: stats(12, 15),
                    raw: stats(10, 11),
                },
                CommitRow {
                    granules: 64,
                    bytes: 128 << 20,
                    manager: stats(700, 760),
                    raw: stats(650, 700),
                },
            ],
            runs: vec![RunRow {
                bytes: 128 << 20,
                manager_handles: 1,
                manager: run(300, 200),
                one_handle: run(280, 190),
                per_granule: run(6000, 4000),
                exportable: Some(run(330, 210)),
            }],
            max_handle_bytes: 512 << 20,
            latency_spent,
            pool: Some(PoolRow {
                granules: 64,
                from_pool: stats(200, 230),
                from_parked: stats(1, 2),
                fresh: stats(700, 760),
            }),
            gives: Vec::new(),
            growth: vec![
                GrowthRow {
                    size: 256 << 20,
                    manager: Some(stats(12, 14)),
                    raw: Some(stats(11, 13)),
                    realloc_copy: Some(stats(900, 950)),
                    skipped: None,
                },
                GrowthRow {
                    size: 1 << 30,
                    manager: Some(stats(12, 14)),
                    raw: None,
                    realloc_copy: None,
                    skipped: None,
                },
                GrowthRow {
                    size: 16 << 30,
                    manager: None,
                    raw: None,
                    realloc_copy: None,
                    skipped: Some("needs 34359738368 bytes free, the device has less".to_owned()),
                },
            ],
            notes: vec!["run of 4 GiB skipped".to_owned(), "second note".to_owned()],
        }
    }

    #[test]
    fn the_tables_are_pinned() {
        assert_eq!(report(true).to_markdown(), FULL);
        let bare = BenchReport {
            backend: "cuda".to_owned(),
            runs: Vec::new(),
            pool: None,
            growth: Vec::new(),
            notes: Vec::new(),
            ..report(false)
        };
        assert_eq!(bare.to_markdown(), BARE);
    }

    const FULL: &str = r#"## kvvm vmm bench: backend `sim`, device 0, granule 2 MiB, 20 iterations

simulated timings: backend sim spends the H200 latency model's cost for each driver call; the figures follow the model, they are not measured on a GPU

### Commit of k granules: manager vs raw driver sequence

| k | bytes | manager p50 | manager p90 | raw p50 | raw p90 | manager/raw |
|---|---|---|---|---|---|---|
| 1 | 2 MiB | 12.0 us | 15.0 us | 10.0 us | 11.0 us | 1.20x |
| 64 | 128 MiB | 700.0 us | 760.0 us | 650.0 us | 700.0 us | 1.08x |

### Runs: the manager (handles of at most 512 MiB) vs one handle per run (the driver's limit) vs one handle per granule; the manager with exportable (POSIX fd) handles

commit (create + map + set access):

| run | manager handles | manager p50 | manager p90 | one handle p50 | one handle p90 | per granule p50 | per granule p90 | manager / one handle | per granule / manager | exportable p50 | exportable / manager |
|---|---|---|---|---|---|---|---|---|---|---|---|
| 128 MiB | 1 | 300.0 us | 305.0 us | 280.0 us | 285.0 us | 6000.0 us | 6005.0 us | 1.07x | 20.00x | 330.0 us | 1.10x |

teardown (unmap + release):

| run | manager handles | manager p50 | manager p90 | one handle p50 | one handle p90 | per granule p50 | per granule p90 | manager / one handle | per granule / manager | exportable p50 | exportable / manager |
|---|---|---|---|---|---|---|---|---|---|---|---|
| 128 MiB | 1 | 200.0 us | 203.0 us | 190.0 us | 193.0 us | 4000.0 us | 4003.0 us | 1.05x | 20.00x | 210.0 us | 1.05x |


### Commit of 64 granules: from the pool vs fresh

| case | p50 | p90 |
|---|---|---|
| from pool | 200.0 us | 230.0 us |
| from parked windows (same reservation) | 1.0 us | 2.0 us |
| fresh | 700.0 us | 760.0 us |

fresh/pool = 3.50x, fresh/parked = 700.00x

### Growing a buffer by one granule

| size | manager p50 | manager p90 | raw VMM p50 | raw VMM p90 | realloc+copy p50 | realloc+copy p90 | realloc/manager |
|---|---|---|---|---|---|---|---|
| 256 MiB | 12.0 us | 14.0 us | 11.0 us | 13.0 us | 900.0 us | 950.0 us | 75.00x |
| 1 GiB | 12.0 us | 14.0 us | - | - | - | - | - |
| 16 GiB | skipped: needs 34359738368 bytes free, the device has less | | | | | | |

realloc+copy: not measured by this backend (needs a device allocation and a device-to-device copy, outside the VMM trait).

note: run of 4 GiB skipped

note: second note
"#;
    const BARE: &str = r#"## kvvm vmm bench: backend `cuda`, device 0, granule 2 MiB, 20 iterations

### Commit of k granules: manager vs raw driver sequence

| k | bytes | manager p50 | manager p90 | raw p50 | raw p90 | manager/raw |
|---|---|---|---|---|---|---|
| 1 | 2 MiB | 12.0 us | 15.0 us | 10.0 us | 11.0 us | 1.20x |
| 64 | 128 MiB | 700.0 us | 760.0 us | 650.0 us | 700.0 us | 1.08x |

### Growing a buffer by one granule

| size | manager p50 | manager p90 | raw VMM p50 | raw VMM p90 | realloc+copy p50 | realloc+copy p90 | realloc/manager |
|---|---|---|---|---|---|---|---|
"#;
}
