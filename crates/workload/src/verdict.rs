//! The conclusion of a replay: the best kvvm policy against the best of the others, in the
//! serving figures an operator reads (requests served, the wait at p99, memory held) and the
//! price paid in driver calls. The figures are the table's, formatted the same way.

use serde::Serialize;

use kvvm_num::format_size_fixed;

use crate::report::{PolicyReport, SimulationReport};

/// The widest line of the report's text.
pub const REPORT_COLUMNS: usize = 120;

/// The best kvvm policy of a run against the best of the other policies.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    /// The kvvm policy that served best (most requests, then the shortest wait at p99, then
    /// the least memory held).
    pub kvvm: String,
    /// The other policy that served best, by the same order.
    pub baseline: String,
    /// Requests in the trace.
    pub requests: usize,
    /// Requests each served (completed).
    pub served: [u64; 2],
    /// Each one's wait at p99, in milliseconds.
    pub wait_p99_ms: [f64; 2],
    /// Each one's peak physical bytes held.
    pub held_bytes: [u64; 2],
    /// The kvvm policy's driver calls and its driver time as a share of the makespan.
    pub driver_calls: u64,
    /// Driver time over makespan of the kvvm policy.
    pub driver_time_share: f64,
    /// The sentence the report ends with.
    pub text: String,
}

/// A wait as the table shows it: `0`, `340 ms`, `12.4 s`.
pub fn format_wait(ms: f64) -> String {
    if ms <= 0.0 {
        "0".to_owned()
    } else if ms < 1000.0 {
        format!("{ms:.0} ms")
    } else {
        format!("{:.1} s", ms / 1e3)
    }
}

/// A driver-time share as the table shows it: `0.3%`.
pub fn format_share(share: f64) -> String {
    format!("{:.1}%", share * 100.0)
}

/// The order of "served best": more requests served, a shorter wait at p99, less memory
/// held, less committed.
fn better(a: &PolicyReport, b: &PolicyReport) -> bool {
    let key = |p: &PolicyReport| {
        (
            std::cmp::Reverse(p.completed),
            p.queue_delay_p99_ms,
            p.peak_held_bytes,
            p.peak_committed_bytes,
        )
    };
    key(a).partial_cmp(&key(b)) == Some(std::cmp::Ordering::Less)
}

fn best<'a>(policies: impl Iterator<Item = &'a PolicyReport>) -> Option<&'a PolicyReport> {
    policies.fold(None, |acc, p| match acc {
        Some(b) if !better(p, b) => Some(b),
        _ => Some(p),
    })
}

/// Words wrapped at [`REPORT_COLUMNS`], continuation lines indented by two spaces.
pub fn wrap(text: &str) -> String {
    let mut out = String::new();
    let mut line = String::new();
    for word in text.split(' ') {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > REPORT_COLUMNS {
            out.push_str(line.trim_end());
            out.push('\n');
            line = "  ".to_owned();
        } else if !line.is_empty() && !line.ends_with("  ") {
            line.push(' ');
        }
        line.push_str(word);
    }
    out.push_str(line.trim_end());
    out.push('\n');
    out
}

/// The verdict of `report`, when it holds a kvvm policy and another one.
pub fn verdict(report: &SimulationReport) -> Option<Verdict> {
    let kvvm = best(report.policies.iter().filter(|p| p.through_manager))?;
    let base = best(report.policies.iter().filter(|p| !p.through_manager))?;
    let n = report.trace.requests;
    let mut gains = Vec::new();
    let mut losses = Vec::new();
    match kvvm.completed.cmp(&base.completed) {
        std::cmp::Ordering::Greater => gains.push(format!(
            "{} more requests served",
            kvvm.completed - base.completed
        )),
        std::cmp::Ordering::Less => losses.push(format!(
            "{} fewer requests served",
            base.completed - kvvm.completed
        )),
        std::cmp::Ordering::Equal => {}
    }
    let (w, bw) = (kvvm.queue_delay_p99_ms, base.queue_delay_p99_ms);
    if format_wait(w) != format_wait(bw) {
        let phrase = format!(
            "a p99 wait of {} instead of {}",
            format_wait(w),
            format_wait(bw)
        );
        if w < bw {
            gains.push(phrase);
        } else {
            losses.push(phrase);
        }
    }
    let (h, bh) = (kvvm.peak_held_bytes, base.peak_held_bytes);
    if h < bh {
        gains.push(format!("{} less memory held", format_size_fixed(bh - h)));
    } else if h > bh {
        losses.push(format!("{} more memory held", format_size_fixed(h - bh)));
    }
    let same = if kvvm.completed == base.completed && format_wait(w) == format_wait(bw) {
        "the same service, "
    } else {
        ""
    };
    let outcome = match (gains.is_empty(), losses.is_empty()) {
        (true, true) => "the same service and memory".to_owned(),
        (false, true) => format!("{same}{}", gains.join(", ")),
        (true, false) => format!("no gain: {}", losses.join(", ")),
        (false, false) => format!("{}, but {}", gains.join(", "), losses.join(", ")),
    };
    let text = format!(
        "verdict: {} served {} of {n} requests (wait p99 {}) holding at most {}; against {}, the \
         best of the others ({} served, wait p99 {}, {} held): {outcome}; at the price of {} \
         driver calls, {} of the run's time in the driver.",
        kvvm.name,
        kvvm.completed,
        format_wait(w),
        format_size_fixed(h).trim(),
        base.name,
        base.completed,
        format_wait(bw),
        format_size_fixed(bh).trim(),
        kvvm.driver_calls,
        format_share(kvvm.driver_time_share),
    );
    Some(Verdict {
        kvvm: kvvm.name.clone(),
        baseline: base.name.clone(),
        requests: n,
        served: [kvvm.completed, base.completed],
        wait_p99_ms: [w, bw],
        held_bytes: [h, bh],
        driver_calls: kvvm.driver_calls,
        driver_time_share: kvvm.driver_time_share,
        text,
    })
}
