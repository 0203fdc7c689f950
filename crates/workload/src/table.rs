//! A report as an aligned text table: sizes in binary units (the JSON has the exact bytes).
//! The default table holds what an operator reads first (requests served, the wait, the
//! concurrency reached, memory committed and held, refusals, preemptions, the driver's share
//! of the time) and fits [`REPORT_COLUMNS`]; the wide one adds every other figure. Both end
//! with the [verdict](crate::verdict::verdict).

use std::fmt::Write as _;

use kvvm_num::{format_size, format_size_fixed};

use crate::report::{PolicyReport, SimulationReport};
use crate::verdict::{format_share, format_wait, verdict, wrap};

/// Which figures a table shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableWidth {
    /// The operator's figures, within 120 columns.
    Narrow,
    /// Every figure (`--wide`).
    Wide,
}

fn ms(us: u64) -> String {
    format!("{:.1}", us as f64 / 1e3)
}

fn driver_share(p: &PolicyReport) -> String {
    let mark = if p.driver_time_source == "measured" {
        "*"
    } else {
        ""
    };
    format!("{}{mark}", format_share(p.driver_time_share))
}

/// A column: its header and how a policy's cell reads.
type Column = (&'static str, fn(&PolicyReport) -> String);

const NARROW: [Column; 11] = [
    ("policy", |p| p.name.clone()),
    ("served", |p| p.completed.to_string()),
    ("wait p50", |p| format_wait(p.queue_delay_p50_ms)),
    ("wait p99", |p| format_wait(p.queue_delay_p99_ms)),
    ("in flight", |p| p.peak_running.to_string()),
    ("peak", |p| format_size_fixed(p.peak_committed_bytes)),
    ("held", |p| format_size_fixed(p.peak_held_bytes)),
    ("waste", |p| format!("{:.1}%", p.waste_ratio * 100.0)),
    ("429s", |p| p.refusals.to_string()),
    ("preempt", |p| p.preemptions.to_string()),
    ("driver %", driver_share),
];

const WIDE: [Column; 21] = [
    ("policy", |p| p.name.clone()),
    ("served", |p| p.completed.to_string()),
    ("rejected", |p| p.rejected.to_string()),
    ("waited", |p| p.waited.to_string()),
    ("wait p50", |p| format_wait(p.queue_delay_p50_ms)),
    ("wait p99", |p| format_wait(p.queue_delay_p99_ms)),
    ("wait mean", |p| format_wait(p.mean_queue_delay_ms)),
    ("in flight", |p| p.peak_running.to_string()),
    ("live", |p| format_size_fixed(p.mean_live_bytes)),
    ("peak", |p| format_size_fixed(p.peak_committed_bytes)),
    ("mean", |p| format_size_fixed(p.mean_committed_bytes)),
    ("stored", |p| format_size_fixed(p.mean_stored_live_bytes)),
    ("waste", |p| format!("{:.1}%", p.waste_ratio * 100.0)),
    ("held", |p| format_size_fixed(p.peak_held_bytes)),
    ("429s", |p| p.refusals.to_string()),
    ("preempt", |p| p.preemptions.to_string()),
    ("mappings", |p| p.mappings.to_string()),
    ("handles", |p| p.handles.to_string()),
    ("driver calls", |p| p.driver_calls.to_string()),
    ("driver ms", |p| {
        let mark = if p.driver_time_source == "measured" {
            "*"
        } else {
            ""
        };
        format!("{}{mark}", ms(p.driver_time_us))
    }),
    ("driver %", driver_share),
];

const NARROW_LEGEND: &str = "served = requests completed; wait = from the decode step a request \
     arrived in to its admission (p50, p99 of the admitted requests); in flight = most requests \
     running at once; peak = committed bytes; held = peak physical bytes held (pools included); \
     waste = time-averaged share of committed bytes that hold no live KV; 429s = refusals \
     (admission or growth, retries included); preempt = running requests evicted and recomputed \
     later; driver % = driver time over the run's time";

const WIDE_LEGEND: &str = "served = requests completed; rejected = requests that could not fit \
     the budget even alone; waited = requests that queued at least one decode step; wait = from \
     the decode step a request arrived in to its admission; in flight = most requests running at \
     once; live = mean KV bytes of the tokens in flight; peak/mean = committed bytes; stored = \
     mean live bytes the memory holds (a shared prefix once); waste = time-averaged (committed - \
     stored) / committed; held = peak physical bytes held (pools included); 429s = refusals \
     (admission or growth, retries included); preempt = running requests evicted and recomputed \
     later; mappings, handles = mappings made and physical handles created (one each per \
     allocation without virtual memory); driver % = driver time over the run's time";

/// The header lines: the trace, the model and the budget.
fn header(report: &SimulationReport, out: &mut String) {
    let t = &report.trace;
    let source = match (&t.path, t.seed) {
        (Some(p), _) => format!("jsonl {p}"),
        (None, Some(seed)) => format!(
            "synthetic, seed {seed}, {} req/s",
            t.rate_per_s.unwrap_or(0.0)
        ),
        _ => t.kind.to_owned(),
    };
    let mut trace = format!(
        "trace: {source}; {} requests over {:.1} s, {} prompt + {} output tokens",
        t.requests, t.duration_s, t.prompt_tokens, t.output_tokens,
    );
    if t.system_prompt_tokens > 0 {
        let _ = write!(
            trace,
            ", {} open with a {}-token system prompt",
            t.shared_prefix_requests, t.system_prompt_tokens
        );
    }
    out.push_str(&wrap(&trace));
    let _ = writeln!(
        out,
        "model: {} {} ({}/token), max context {} tokens; backend {}, granule {}; decode step {} ms",
        report.model,
        report.dtype,
        format_size(report.bytes_per_token),
        report.max_context,
        report.backend,
        format_size(report.granule_bytes),
        report.step_ms
    );
    let _ = writeln!(
        out,
        "budget: {} for every policy",
        format_size(report.budget_bytes)
    );
}

/// The rows of `columns`, aligned: the first column left, the others right.
fn grid(report: &SimulationReport, columns: &[Column], out: &mut String) {
    let mut rows: Vec<Vec<String>> = vec![columns.iter().map(|c| c.0.to_owned()).collect()];
    for p in &report.policies {
        rows.push(columns.iter().map(|c| (c.1)(p)).collect());
    }
    let widths: Vec<usize> = (0..columns.len())
        .map(|c| {
            rows.iter()
                .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    for (i, row) in rows.iter().enumerate() {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            let w = widths.get(c).copied().unwrap_or(0);
            if c == 0 {
                let _ = write!(line, "{cell:<w$}");
            } else {
                let _ = write!(line, "  {cell:>w$}");
            }
        }
        let _ = writeln!(out, "{}", line.trim_end());
        if i == 0 {
            let total: usize = widths.iter().sum::<usize>() + 2 * columns.len().saturating_sub(1);
            let _ = writeln!(out, "{}", "-".repeat(total));
        }
    }
}

/// The report as an aligned text table, with a header naming the trace, model and budget,
/// the notes, a legend and the verdict last.
pub fn render_table(report: &SimulationReport, width: TableWidth) -> String {
    let mut out = String::new();
    header(report, &mut out);
    let _ = writeln!(out);
    let (columns, legend): (&[Column], &str) = match width {
        TableWidth::Narrow => (&NARROW, NARROW_LEGEND),
        TableWidth::Wide => (&WIDE, WIDE_LEGEND),
    };
    grid(report, columns, &mut out);
    let mut notes: Vec<String> = report
        .policies
        .iter()
        .filter_map(|p| {
            p.prefix_refusal
                .as_ref()
                .map(|r| format!("{}: no sharing: {r}", p.name))
        })
        .collect();
    let rejected: Vec<String> = report
        .policies
        .iter()
        .filter(|p| p.rejected > 0)
        .map(|p| format!("{} {} of {}", p.name, p.rejected, report.trace.requests))
        .collect();
    if !rejected.is_empty() {
        notes.push(format!(
            "rejected, never fitting the budget ({}) even alone: {}",
            format_size(report.budget_bytes),
            rejected.join(", ")
        ));
    }
    let _ = writeln!(out);
    for n in notes {
        out.push_str(&wrap(&n));
    }
    let measured = report
        .policies
        .iter()
        .any(|p| p.driver_time_source == "measured");
    let source = if measured {
        " (* measured on the device, the others from the H200 latency model)."
    } else {
        " (the H200 latency model, not measured)."
    };
    out.push_str(&wrap(&format!("{legend}{source}")));
    if width == TableWidth::Narrow {
        out.push_str("more figures: --wide (a wider table) or --json (exact bytes)\n");
    }
    out
}

/// The verdict line (wrapped at 120 columns), or a line saying why there is none.
pub fn render_verdict(report: &SimulationReport) -> String {
    match verdict(report) {
        Some(v) => wrap(&v.text),
        None => "verdict: none (the run needs a kvvm policy and another one to compare)\n".into(),
    }
}
