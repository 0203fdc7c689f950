//! Giving a request `N` tokens and taking them back, the way a serving engine recycles one
//! sequence's reservation: the manager's commit of `N` tokens' bytes in one reservation,
//! **cold** (the pool emptied just before, `trim_pool(0)`) and **warm** (the pool as the
//! previous give's release left it, up to its cap), against **one handle** of the same bytes
//! (create one handle, map it, set access: the driver's limit). The three are measured side
//! by side, round by round, in a rotating order, on the same backend. Each give's driver calls
//! are timed one by one ([`CallClock`]), so that the report says where warm and cold differ
//! (fewer creates, more or fewer mappings, a slower set access). Each give is followed by its
//! release (the take), timed apart.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvvm::governor::Governor;
use kvvm::hal::{DeviceId, Operation, VirtualMemoryBackend};
use kvvm::vmm::{Reservation, VirtualMemory, VmmConfig, VmmError, VmmResult};

use crate::call_clock::{CallClock, CallTimes};
use crate::raw::RawRange;
use crate::stats::Stats;
use crate::units::{fmt_bytes, ratio, us};

/// What the gives measure: token counts, the bytes of one token, the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GiveConfig {
    /// Tokens given to the request, one row each.
    pub tokens: Vec<u64>,
    /// Bytes of KV one token holds (128 KiB: Llama-3.1-8B, 32 layers x 8 KV heads x 128 x
    /// K and V x bf16).
    pub bytes_per_token: u64,
    /// The manager's pool cap (`VmmConfig::pool_cap_bytes`; 1 GiB, the default).
    pub pool_bytes: u64,
    /// The manager's largest handle (`VmmConfig::max_handle_bytes`; 512 MiB, the default).
    pub max_handle_bytes: u64,
    /// Whether each give (cold and warm) is preceded by an untimed query of the device's
    /// memory (`memory_info`, `cuMemGetInfo` on CUDA): a driver that defers the freeing of
    /// released handles to its next call then does it there, not in the give.
    pub settle: bool,
}

impl Default for GiveConfig {
    /// 256, 4096 and 32768 tokens of Llama-3.1-8B (32 MiB, 512 MiB, 4 GiB), the manager's
    /// defaults (a 1 GiB pool, handles of at most 512 MiB).
    fn default() -> Self {
        GiveConfig {
            tokens: vec![256, 4096, 32768],
            bytes_per_token: 128 << 10,
            pool_bytes: VmmConfig::default().pool_cap_bytes,
            max_handle_bytes: VmmConfig::default().max_handle_bytes,
            settle: false,
        }
    }
}

/// One give of the manager, measured: its time and its driver calls (mean per give).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GiveCase {
    /// The commit's time.
    pub time: Stats,
    /// The release that follows it (handles to the pool up to its cap, the rest released).
    pub take: Stats,
    /// Its driver calls and their time, per give (the mean over the measured rounds).
    pub calls: CallTimes,
    /// Mappings the commit made (`Commit::mappings`, the last round).
    pub mappings: u64,
    /// Bytes the pool supplied (the last round).
    pub from_pool_bytes: u64,
    /// Bytes pooled right before the give (the last round).
    pub pooled_before: u64,
}

/// One token count: cold and warm gives against one handle of the same bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GiveRow {
    /// Tokens given.
    pub tokens: u64,
    /// Their bytes, rounded up to the manager's granule.
    pub bytes: u64,
    /// The pool emptied first.
    pub cold: GiveCase,
    /// The pool as the previous give left it.
    pub warm: GiveCase,
    /// One handle of `bytes`: create, map, set access.
    pub one_handle: Stats,
    /// The manager's pool cap and largest handle.
    pub pool_and_max_handle: (u64, u64),
    /// Whether each give followed an untimed memory query ([`GiveConfig::settle`]).
    pub settled: bool,
}

impl GiveRow {
    /// Warm over cold, medians.
    pub fn warm_over_cold(&self) -> f64 {
        over(self.warm.time.median, self.cold.time.median)
    }

    /// The cold give over one handle, medians.
    pub fn cold_over_one_handle(&self) -> f64 {
        over(self.cold.time.median, self.one_handle.median)
    }
}

fn over(a: Duration, b: Duration) -> f64 {
    if b.is_zero() {
        f64::NAN
    } else {
        a.as_secs_f64() / b.as_secs_f64()
    }
}

/// Measures a row per token count of `config` on `backend` (`warmup` then `iterations`
/// rounds); a count whose bytes and as much again for the pool (at most its cap) do not fit
/// the free memory is skipped with a note.
pub(crate) fn measure_gives(
    backend: &Arc<dyn VirtualMemoryBackend>,
    device: DeviceId,
    config: &GiveConfig,
    (warmup, iterations): (usize, usize),
    notes: &mut Vec<String>,
) -> VmmResult<Vec<GiveRow>> {
    let clock = Arc::new(CallClock::new(Arc::clone(backend)));
    let timed: Arc<dyn VirtualMemoryBackend> = clock.clone();
    let vm = VirtualMemory::new(
        timed,
        device,
        Governor::unlimited(),
        VmmConfig::default()
            .pool_cap_bytes(config.pool_bytes)
            .max_handle_bytes(config.max_handle_bytes),
    )?;
    let mut sizes = Vec::new();
    for &tokens in &config.tokens {
        let raw = tokens
            .checked_mul(config.bytes_per_token)
            .ok_or(VmmError::SizeOverflow { what: "give size" })?;
        let bytes = vm.round_up(raw.max(1))?;
        // The give, and what the pool may hold beside it (at most as much again).
        let needed = bytes.saturating_add(config.pool_bytes.min(bytes));
        let free = backend.memory_info(device)?.free;
        if free < needed {
            notes.push(format!(
                "give of {tokens} tokens skipped: needs {} free, the device has {}",
                fmt_bytes(needed),
                fmt_bytes(free)
            ));
            continue;
        }
        sizes.push((tokens, bytes));
    }
    let Some(largest) = sizes.iter().map(|s| s.1).max() else {
        return Ok(Vec::new());
    };
    let mut res = vm.reserve(largest)?;
    let raw = RawRange::reserve(&**backend, device, largest)?;
    let mut rows = Vec::new();
    let measure = Measure {
        vm: &vm,
        clock: &clock,
        raw: &raw,
        rounds: (warmup, iterations),
        pool_and_max_handle: (config.pool_bytes, config.max_handle_bytes),
        settle: config.settle.then_some(device),
    };
    for (tokens, bytes) in sizes {
        if let Some(row) = measure.row(&mut res, tokens, bytes)? {
            rows.push(row);
        }
    }
    drop(res);
    vm.trim_pool(0);
    raw.free()?;
    Ok(rows)
}

/// What every row is measured with.
struct Measure<'a> {
    vm: &'a VirtualMemory,
    clock: &'a CallClock,
    raw: &'a RawRange<'a>,
    rounds: (usize, usize),
    pool_and_max_handle: (u64, u64),
    /// The device to query before each give, when the gives settle.
    settle: Option<DeviceId>,
}

/// One case's samples over the measured rounds.
#[derive(Default)]
struct Samples {
    times: Vec<Duration>,
    takes: Vec<Duration>,
    calls: CallTimes,
    last: (u64, u64, u64),
}

impl Samples {
    fn case(self, rounds: usize) -> Option<GiveCase> {
        let n = u64::try_from(rounds).unwrap_or(u64::MAX);
        let take = Stats::from_samples(self.takes)?;
        Stats::from_samples(self.times).map(|time| GiveCase {
            time,
            take,
            calls: self.calls.per(n),
            mappings: self.last.0,
            from_pool_bytes: self.last.1,
            pooled_before: self.last.2,
        })
    }
}

impl Measure<'_> {
    /// The rounds of one token count: cold, warm and one handle in a rotating order.
    fn row(&self, res: &mut Reservation, tokens: u64, bytes: u64) -> VmmResult<Option<GiveRow>> {
        let (warmup, iterations) = self.rounds;
        let (mut cold, mut warm) = (Samples::default(), Samples::default());
        let mut one = Vec::new();
        for round in 0..warmup.saturating_add(iterations) {
            let measured = round >= warmup;
            for case in [round % 3, (round + 1) % 3, (round + 2) % 3] {
                match case {
                    0 => self.give(res, bytes, true, measured.then_some(&mut cold))?,
                    1 => self.give(res, bytes, false, measured.then_some(&mut warm))?,
                    _ => {
                        let (t, _) = self.raw.time_run(bytes, 1)?;
                        if measured {
                            one.push(t);
                        }
                    }
                }
            }
        }
        let (Some(cold), Some(warm), Some(one_handle)) = (
            cold.case(iterations),
            warm.case(iterations),
            Stats::from_samples(one),
        ) else {
            return Ok(None);
        };
        Ok(Some(GiveRow {
            tokens,
            bytes,
            cold,
            warm,
            one_handle,
            pool_and_max_handle: self.pool_and_max_handle,
            settled: self.settle.is_some(),
        }))
    }

    /// One give of `bytes` in `res` (the pool emptied first when `cold`), then its release
    /// (timed apart); recorded into `into` when measured.
    fn give(
        &self,
        res: &mut Reservation,
        bytes: u64,
        cold: bool,
        into: Option<&mut Samples>,
    ) -> VmmResult<()> {
        if cold {
            self.vm.trim_pool(0);
        }
        if let Some(device) = self.settle {
            VirtualMemoryBackend::memory_info(self.clock, device)?;
        }
        let pooled_before = self.vm.pooled_bytes();
        self.clock.take();
        let t0 = Instant::now();
        let commit = res.commit(bytes)?;
        let took = t0.elapsed();
        let calls = self.clock.take();
        let t1 = Instant::now();
        res.release()?;
        let take = t1.elapsed();
        if let Some(s) = into {
            s.times.push(took);
            s.takes.push(take);
            s.calls.add(&calls);
            let from_pool = commit.from_pool.saturating_mul(self.vm.granule());
            s.last = (commit.mappings, from_pool, pooled_before);
        }
        Ok(())
    }
}

/// A give's driver calls as `creates / maps / set accesses` with the time of each kind,
/// then its first call and that call's time.
fn calls_cell(c: &CallTimes) -> String {
    let part = |op: Operation| {
        let (n, t) = c.of(op);
        format!("{n} ({})", us(t))
    };
    let first = c
        .first
        .map_or_else(|| "-".to_owned(), |(op, t)| format!("{op} {}", us(t)));
    format!(
        "{} / {} / {}; first: {first}",
        part(Operation::Create),
        part(Operation::Map),
        part(Operation::SetAccess)
    )
}

/// The gives as a Markdown table: cold, warm and one handle (p50 and p90), the two ratios,
/// the mappings and the driver calls of each give.
pub(crate) fn gives_markdown(s: &mut String, rows: &[GiveRow]) {
    if rows.is_empty() {
        return;
    }
    let (pool, max_handle) = rows.first().map_or((0, 0), |r| r.pool_and_max_handle);
    let settled = if rows.first().is_some_and(|r| r.settled) {
        ", each give after an untimed memory query"
    } else {
        ""
    };
    let _ = writeln!(
        s,
        "\n### Giving a request N tokens: cold (pool emptied first) vs warm (the pool as the \
         last give left it) vs one handle of the same bytes (pool cap {}, handles of at most \
         {}{settled})\n",
        fmt_bytes(pool),
        fmt_bytes(max_handle)
    );
    let _ = writeln!(
        s,
        "| tokens | bytes | cold p50 | cold p90 | warm p50 | warm p90 | one handle p50 | warm / cold | cold / one handle | take p50 cold / warm | mappings cold / warm | pooled before warm | from pool (warm) | cold: creates / maps / set accesses | warm: creates / maps / set accesses |"
    );
    let _ = writeln!(
        s,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} / {} | {} | {} | {} | {} |",
            r.tokens,
            fmt_bytes(r.bytes),
            us(r.cold.time.median),
            us(r.cold.time.p90),
            us(r.warm.time.median),
            us(r.warm.time.p90),
            us(r.one_handle.median),
            ratio(r.warm.time.median, r.cold.time.median),
            ratio(r.cold.time.median, r.one_handle.median),
            us(r.cold.take.median),
            us(r.warm.take.median),
            r.cold.mappings,
            r.warm.mappings,
            fmt_bytes(r.warm.pooled_before),
            fmt_bytes(r.warm.from_pool_bytes),
            calls_cell(&r.cold.calls),
            calls_cell(&r.warm.calls),
        );
    }
    let _ = writeln!(
        s,
        "\nCalls are per give: count (time spent in them), and the first call with its time (a \
         driver that defers the work of earlier calls, such as the releases of the last take, \
         to its next call shows it there); the rest of a give is the manager's own work."
    );
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kvvm::sim::{LatencyMode, LatencyModel, SimBackend, SimConfig};

    /// On the simulator spending the H200 model, the warm give is no slower than the cold one
    /// at any size and makes the same mappings; the cold give makes the pieces the manager
    /// cuts (one 512 MiB handle for 4096 tokens, eight for 32768).
    #[test]
    fn gives_on_the_simulator_report_every_size_and_leave_nothing() {
        let sim = Arc::new(SimBackend::new(
            SimConfig::default().with_latency(LatencyModel::h200(), LatencyMode::Account),
        ));
        let backend: Arc<dyn VirtualMemoryBackend> = sim.clone();
        let mut notes = Vec::new();
        let config = GiveConfig {
            tokens: vec![256, 4096, 32768, 1 << 30],
            ..GiveConfig::default()
        };
        let rows = measure_gives(&backend, DeviceId(0), &config, (1, 3), &mut notes).unwrap();
        assert_eq!(rows.len(), 3);
        assert!(notes.iter().any(|n| n.contains("skipped")), "{notes:?}");
        let mib = 1 << 20;
        let shape: Vec<(u64, u64, u64, u64)> = rows
            .iter()
            .map(|r| {
                (
                    r.bytes / mib,
                    r.cold.mappings,
                    r.warm.mappings,
                    r.warm.from_pool_bytes / mib,
                )
            })
            .collect();
        assert_eq!(
            shape,
            vec![(32, 1, 1, 32), (512, 1, 1, 512), (4096, 8, 8, 1024)]
        );
        for r in &rows {
            assert_eq!(r.cold.calls.of(Operation::Map).0, r.cold.mappings);
            assert_eq!(r.cold.calls.of(Operation::SetAccess).0, 1);
            assert!(r.warm.calls.of(Operation::Create).0 < r.cold.calls.of(Operation::Create).0);
        }
        let settled = GiveConfig {
            tokens: vec![256],
            settle: true,
            ..GiveConfig::default()
        };
        let calls = sim.calls(Operation::MemoryInfo);
        let one = measure_gives(&backend, DeviceId(0), &settled, (0, 2), &mut notes).unwrap();
        // One query per give (2 rounds of cold and warm), one for the size check and one by
        // the manager when it is made.
        assert_eq!(sim.calls(Operation::MemoryInfo) - calls, 6);
        assert!(one[0].settled);
        let mut s = String::new();
        gives_markdown(&mut s, &one);
        assert!(s.contains("untimed memory query"), "{s}");
        let mut s = String::new();
        gives_markdown(&mut s, &rows);
        assert!(s.contains("| 32768 | 4 GiB |"), "{s}");
        assert!(s.contains("warm / cold"), "{s}");
        assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    }
}
