//! A report as an aligned text table: sizes in binary units (the JSON has the exact bytes),
//! the fate of every request (completed, rejected, waited), refusals and driver costs.

use std::fmt::Write as _;

use kvvm_num::{format_size, format_size_fixed};

use crate::report::SimulationReport;

fn ms(us: u64) -> String {
    format!("{:.1}", us as f64 / 1e3)
}

/// The report as an aligned text table, with a header naming the trace, model and budget.
pub fn render_table(report: &SimulationReport) -> String {
    let mut out = String::new();
    let t = &report.trace;
    let source = match (&t.path, t.seed) {
        (Some(p), _) => format!("jsonl {p}"),
        (None, Some(seed)) => format!(
            "synthetic, seed {seed}, {} req/s",
            t.rate_per_s.unwrap_or(0.0)
        ),
        _ => t.kind.to_owned(),
    };
    let _ = writeln!(
        out,
        "trace: {source}; {} requests over {:.1} s, {} prompt + {} output tokens, \
         {} open with a {}-token system prompt",
        t.requests,
        t.duration_s,
        t.prompt_tokens,
        t.output_tokens,
        t.shared_prefix_requests,
        t.system_prompt_tokens
    );
    let _ = writeln!(
        out,
        "model: {} {} ({}/token), max context {} tokens; budget {}; backend {}, \
         granule {}; decode step {} ms",
        report.model,
        report.dtype,
        format_size(report.bytes_per_token),
        report.max_context,
        format_size(report.budget_bytes),
        report.backend,
        format_size(report.granule_bytes),
        report.step_ms
    );
    let _ = writeln!(out);
    let header = [
        "policy",
        "peak",
        "mean",
        "live",
        "waste",
        "held",
        "completed",
        "rejected",
        "waited",
        "429s",
        "preempt",
        "mappings",
        "handles",
        "driver calls",
        "driver ms",
        "queue ms",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|s| (*s).to_owned()).collect()];
    for p in &report.policies {
        rows.push(vec![
            p.name.clone(),
            format_size_fixed(p.peak_committed_bytes),
            format_size_fixed(p.mean_committed_bytes),
            format_size_fixed(p.mean_live_bytes),
            format!("{:.1}%", p.waste_ratio * 100.0),
            format_size_fixed(p.peak_held_bytes),
            p.completed.to_string(),
            p.rejected.to_string(),
            p.waited.to_string(),
            p.refusals.to_string(),
            p.preemptions.to_string(),
            p.mappings.to_string(),
            p.handles.to_string(),
            p.driver_calls.to_string(),
            format!(
                "{}{}",
                ms(p.driver_time_us),
                if p.driver_time_source == "measured" {
                    "*"
                } else {
                    ""
                }
            ),
            format!("{:.0}", p.mean_queue_delay_ms),
        ]);
    }
    let cols = header.len();
    let widths: Vec<usize> = (0..cols)
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
            let total: usize = widths.iter().sum::<usize>() + 2 * cols.saturating_sub(1);
            let _ = writeln!(out, "{}", "-".repeat(total));
        }
    }
    let notes: Vec<String> = report
        .policies
        .iter()
        .filter_map(|p| {
            p.prefix_refusal
                .as_ref()
                .map(|r| format!("{}: no sharing: {r}", p.name))
        })
        .collect();
    if !notes.is_empty() {
        let _ = writeln!(out);
        for n in notes {
            let _ = writeln!(out, "{n}");
        }
    }
    let rejected: Vec<String> = report
        .policies
        .iter()
        .filter(|p| p.rejected > 0)
        .map(|p| {
            format!(
                "{} rejected {} of {}",
                p.name, p.rejected, report.trace.requests
            )
        })
        .collect();
    if !rejected.is_empty() {
        let _ = writeln!(
            out,
            "\nrequests that never fit the budget ({}) even alone: {}",
            format_size(report.budget_bytes),
            rejected.join(", ")
        );
    }
    let _ = writeln!(
        out,
        "\npeak/mean = committed bytes; live = mean live KV bytes; waste = time-averaged \
         (committed - live) / committed;\nheld = peak physical bytes held (pools included); \
         rejected = requests that could not fit the budget even alone;\nwaited = requests \
         that queued at least one decode step before admission; 429s = refusals (admission or \
         growth, retries included);\nmappings, handles = mappings made and physical handles \
         created over the run (one each per allocation without virtual memory);\nqueue = mean \
         arrival-to-admission delay; driver ms estimated by the H200 latency model{}",
        if report
            .policies
            .iter()
            .any(|p| p.driver_time_source == "measured")
        {
            " (* measured on the device)"
        } else {
            ", not measured"
        }
    );
    out
}
