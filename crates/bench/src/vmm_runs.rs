//! Runs of many windows (128 MiB, 512 MiB, 4 GiB by default): the manager's commit of a run
//! against the two raw driver sequences that bound it, one handle for the whole run (the
//! driver's limit: create one handle of the run's size, map it, set access once) and one
//! handle per granule (create and map each, set access once), and the teardown of the same
//! runs (unmap and release) measured the same way. Where the backend can export handles, the
//! manager's commit and teardown with exportable handles (`ShareableHandleType::PosixFd`, as a
//! manager leasing from a broker makes them) are measured too. All are measured side by side,
//! round by round, on the same backend.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use kvvm::hal::{DeviceId, VirtualMemoryBackend};
use kvvm::vmm::{Reservation, VirtualMemory, VmmResult};

use crate::raw::RawRange;
use crate::stats::Stats;
use crate::units::{fmt_bytes, ratio, us};

/// The commit and the teardown of one kind of run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunCase {
    /// Create + map + set access (the manager: `Reservation::commit`).
    pub commit: Stats,
    /// Unmap + release (the manager: `Reservation::release` with no pool).
    pub teardown: Stats,
}

/// One run size: the manager against one handle per run and one handle per granule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunRow {
    /// Bytes of the run.
    pub bytes: u64,
    /// Handles (one mapping each) the manager's commit made.
    pub manager_handles: u64,
    /// The manager (no pool, handles of at most `VmmConfig::max_handle_bytes`).
    pub manager: RunCase,
    /// One handle of the run's size: the driver's limit.
    pub one_handle: RunCase,
    /// One handle per granule.
    pub per_granule: RunCase,
    /// The manager again, its handles exportable as POSIX file descriptors; `None` where the
    /// backend cannot export.
    pub exportable: Option<RunCase>,
}

/// The managers a run is measured through: both with no pool and the same largest handle.
#[derive(Clone, Copy)]
pub(crate) struct RunManagers<'a> {
    /// Handles that are not exportable (the default).
    pub(crate) plain: &'a VirtualMemory,
    /// Handles exportable as POSIX file descriptors, where the backend can.
    pub(crate) exportable: Option<&'a VirtualMemory>,
}

/// Measures a run of each of `sizes` bytes on `backend`: the manager through `vms` (no pool),
/// the raw sequences through the backend directly. A size that is not a granule multiple, or
/// that does not fit the device's free memory, is skipped with a note in `notes`.
pub(crate) fn measure_runs(
    backend: &dyn VirtualMemoryBackend,
    vms: RunManagers<'_>,
    device: DeviceId,
    sizes: &[u64],
    rounds: (usize, usize),
    notes: &mut Vec<String>,
) -> VmmResult<Vec<RunRow>> {
    let mut rows = Vec::new();
    for &bytes in sizes {
        if let Some(why) = why_skipped(backend, vms.plain, device, bytes)? {
            notes.push(why);
            continue;
        }
        if let Some(row) = measure_run(backend, vms, device, bytes, rounds)? {
            rows.push(row);
        }
    }
    Ok(rows)
}

/// Why a run of `bytes` cannot be measured, if it cannot: not a whole number of `vm`'s
/// granules, or more than the device's free memory.
fn why_skipped(
    backend: &dyn VirtualMemoryBackend,
    vm: &VirtualMemory,
    device: DeviceId,
    bytes: u64,
) -> VmmResult<Option<String>> {
    let g = vm.granule();
    if bytes == 0 || !bytes.is_multiple_of(g) {
        return Ok(Some(format!(
            "run of {} skipped: not a whole number of granules ({})",
            fmt_bytes(bytes),
            fmt_bytes(g)
        )));
    }
    let free = backend.memory_info(device)?.free;
    if free < bytes {
        return Ok(Some(format!(
            "run of {} skipped: needs {} free, the device has {}",
            fmt_bytes(bytes),
            fmt_bytes(bytes),
            fmt_bytes(free)
        )));
    }
    Ok(None)
}

/// Measures a run of `bytes`, `warmup` rounds then `iterations` measured ones: the row, or
/// `None` without measured rounds.
fn measure_run(
    backend: &dyn VirtualMemoryBackend,
    vms: RunManagers<'_>,
    device: DeviceId,
    bytes: u64,
    (warmup, iterations): (usize, usize),
) -> VmmResult<Option<RunRow>> {
    let mut res = vms.plain.reserve(bytes)?;
    let mut exp = vms.exportable.map(|vm| vm.reserve(bytes)).transpose()?;
    let raw = RawRange::reserve(backend, device, bytes)?;
    let mut samples: [Vec<Duration>; 8] = Default::default();
    let mut manager_handles = 0;
    for round in 0..warmup.saturating_add(iterations) {
        let took;
        (took, manager_handles) = time_round(
            (&mut res, exp.as_mut()),
            &raw,
            vms.plain.granule(),
            bytes,
            round,
        )?;
        if round >= warmup {
            // Without an exportable manager its two slots stay empty (no samples, no row).
            let measured = if exp.is_some() { 8 } else { 6 };
            for (v, d) in samples.iter_mut().zip(took).take(measured) {
                v.push(d);
            }
        }
    }
    drop((res, exp));
    raw.free()?;
    let [mc, mt, oc, ot, pc, pt, ec, et] = samples.map(Stats::from_samples);
    let case = |c: Option<Stats>, t: Option<Stats>| {
        c.zip(t)
            .map(|(commit, teardown)| RunCase { commit, teardown })
    };
    let (Some(manager), Some(one_handle), Some(per_granule)) =
        (case(mc, mt), case(oc, ot), case(pc, pt))
    else {
        return Ok(None);
    };
    Ok(Some(RunRow {
        bytes,
        manager_handles,
        manager,
        one_handle,
        per_granule,
        exportable: case(ec, et),
    }))
}

/// One round of a run of `bytes`: the commit and teardown of the manager (through `res.0`), of
/// one handle and of one handle per granule `g` (through `raw`) and of the exportable manager
/// (through `res.1`, where there is one) in slots 0-1, 2-3, 4-5, 6-7, and the handles the
/// manager's commit made.
///
/// The plain manager, the one-handle sequence and the exportable manager rotate which goes
/// first; the per-granule sequence goes last and is followed by an untimed one-handle commit
/// and teardown, so that none of the others is measured right after the teardown of
/// thousands of handles (which leaves the driver's state cold).
fn time_round(
    res: (&mut Reservation, Option<&mut Reservation>),
    raw: &RawRange<'_>,
    g: u64,
    bytes: u64,
    round: usize,
) -> VmmResult<([Duration; 8], u64)> {
    let (plain, mut exportable) = res;
    let mut took = [Duration::ZERO; 8];
    let mut manager_handles = 0;
    for case in [round % 3, (round + 1) % 3, (round + 2) % 3, 3] {
        match case {
            0 => (took[0], took[1], manager_handles) = commit_and_release(plain, bytes)?,
            1 => (took[2], took[3]) = raw.time_run(bytes, 1)?,
            2 => {
                if let Some(res) = exportable.as_deref_mut() {
                    (took[6], took[7], _) = commit_and_release(res, bytes)?;
                }
            }
            _ => {
                (took[4], took[5]) = raw.time_run(g, bytes / g)?;
                raw.time_run(bytes, 1)?;
            }
        }
    }
    Ok((took, manager_handles))
}

/// The manager's commit of `bytes` in `res` and its release: both times and the handles the
/// commit made.
fn commit_and_release(res: &mut Reservation, bytes: u64) -> VmmResult<(Duration, Duration, u64)> {
    let t0 = Instant::now();
    let commit = res.commit(bytes)?;
    let commit_took = t0.elapsed();
    let t1 = Instant::now();
    res.release()?;
    Ok((commit_took, t1.elapsed(), commit.mappings))
}

/// The runs as two Markdown tables (commit, teardown): p50, p90 and the two ratios.
pub(crate) fn runs_markdown(s: &mut String, rows: &[RunRow], max_handle_bytes: u64) {
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "\n### Runs: the manager (handles of at most {}) vs one handle per run (the driver's \
         limit) vs one handle per granule; the manager with exportable (POSIX fd) handles\n",
        fmt_bytes(max_handle_bytes)
    );
    for (title, pick) in [
        ("commit (create + map + set access)", 0),
        ("teardown (unmap + release)", 1),
    ] {
        let get = |c: &RunCase| if pick == 0 { c.commit } else { c.teardown };
        let _ = writeln!(s, "{title}:\n");
        let _ = writeln!(
            s,
            "| run | manager handles | manager p50 | manager p90 | one handle p50 | one handle p90 | per granule p50 | per granule p90 | manager / one handle | per granule / manager | exportable p50 | exportable / manager |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|");
        for r in rows {
            let (m, o, p) = (get(&r.manager), get(&r.one_handle), get(&r.per_granule));
            let (e50, e_over_m) = match r.exportable.as_ref().map(get) {
                Some(e) => (us(e.median), ratio(e.median, m.median)),
                None => ("not exportable".to_owned(), "-".to_owned()),
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                fmt_bytes(r.bytes),
                r.manager_handles,
                us(m.median),
                us(m.p90),
                us(o.median),
                us(o.p90),
                us(p.median),
                us(p.p90),
                ratio(m.median, o.median),
                ratio(p.median, m.median),
                e50,
                e_over_m
            );
        }
        let _ = writeln!(s);
    }
}
