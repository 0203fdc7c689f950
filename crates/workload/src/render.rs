//! Presenting a report: an aligned text table and a hand-written SVG plot.

use std::fmt::Write as _;

use crate::report::SimulationReport;

fn gib(b: u64) -> String {
    format!("{:.2}", b as f64 / (1u64 << 30) as f64)
}

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
        "model: {} {} ({} KiB/token), max context {} tokens; budget {} GiB; backend {}, \
         granule {} MiB; decode step {} ms",
        report.model,
        report.dtype,
        report.bytes_per_token / 1024,
        report.max_context,
        gib(report.budget_bytes),
        report.backend,
        report.granule_bytes >> 20,
        report.step_ms
    );
    let _ = writeln!(out);
    let header = [
        "policy",
        "peak GiB",
        "mean GiB",
        "live GiB",
        "waste",
        "held GiB",
        "admitted",
        "deferred",
        "429s",
        "preempt",
        "driver calls",
        "driver ms",
        "queue ms",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|s| (*s).to_owned()).collect()];
    for p in &report.policies {
        rows.push(vec![
            p.name.clone(),
            gib(p.peak_committed_bytes),
            gib(p.mean_committed_bytes),
            gib(p.mean_live_bytes),
            format!("{:.1}%", p.waste_ratio * 100.0),
            gib(p.peak_held_bytes),
            p.admitted.to_string(),
            p.deferred.to_string(),
            p.refusals.to_string(),
            p.preemptions.to_string(),
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
    let _ = writeln!(
        out,
        "\npeak/mean = committed bytes; live = mean live KV bytes; waste = time-averaged \
         (committed - live) / committed;\nheld = peak physical bytes held (pools included); \
         429s = refusals (admission or growth); deferred = requests refused at least once;\nqueue = mean arrival-to-admission delay; driver ms from the H200 latency model{}",
        if report
            .policies
            .iter()
            .any(|p| p.driver_time_source == "measured")
        {
            " (* measured on the device)"
        } else {
            ""
        }
    );
    out
}

const COLORS: [&str; 10] = [
    "#d62728", "#ff7f0e", "#8c564b", "#1f77b4", "#17becf", "#2ca02c", "#98df8a", "#9467bd",
    "#c5b0d5", "#7f7f7f",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A "nice" tick step (1, 2 or 5 times a power of ten) giving about `n` ticks over `range`.
fn tick_step(range: f64, n: f64) -> f64 {
    if !(range.is_finite() && range > 0.0) {
        return 1.0;
    }
    let raw = range / n;
    let p = 10f64.powf(raw.log10().floor());
    let m = raw / p;
    let nice = if m <= 1.0 {
        1.0
    } else if m <= 2.0 {
        2.0
    } else if m <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * p
}

/// An SVG plot of committed memory over time, one step line per policy, with axes, the
/// budget as a dashed line and a legend. Written by hand (no plotting crate).
pub fn render_svg(report: &SimulationReport) -> String {
    let (w, h) = (1000.0f64, 560.0f64);
    let (left, right, top, bottom) = (70.0, 230.0, 40.0, 50.0);
    let pw = w - left - right;
    let ph = h - top - bottom;
    let t0 = report
        .policies
        .iter()
        .filter_map(|p| p.samples.first().map(|s| s.t_s))
        .fold(f64::INFINITY, f64::min);
    let t0 = if t0.is_finite() { t0 } else { 0.0 };
    let t1 = report
        .policies
        .iter()
        .filter_map(|p| p.samples.last().map(|s| s.t_s))
        .fold(t0 + 1.0, f64::max);
    let gib = (1u64 << 30) as f64;
    let ymax_bytes = report
        .policies
        .iter()
        .map(|p| p.peak_committed_bytes)
        .max()
        .unwrap_or(0)
        .max(report.budget_bytes) as f64;
    let ystep = tick_step(ymax_bytes / gib, 6.0);
    let ymax = ((ymax_bytes * 1.04 / gib) / ystep).ceil().max(1.0) * ystep;
    let x = |t: f64| left + (t - t0) / (t1 - t0) * pw;
    let y = |bytes: f64| top + ph - (bytes / gib) / ymax * ph;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let title = format!(
        "Committed KV memory over time: {} {}, {} requests, budget {:.0} GiB ({})",
        report.model,
        report.dtype,
        report.trace.requests,
        report.budget_bytes as f64 / gib,
        report.backend
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>"#,
        left + pw / 2.0,
        esc(&title)
    );
    // Grid and y ticks.
    let mut v = 0.0;
    while v <= ymax + 1e-9 {
        let yy = y(v * gib);
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            left + pw,
            left - 6.0,
            yy + 4.0,
            v
        );
        v += ystep;
    }
    // X ticks.
    let xstep = tick_step(t1 - t0, 8.0);
    let mut tv = (t0 / xstep).ceil() * xstep;
    while tv <= t1 + 1e-9 {
        let xx = x(tv);
        let _ = writeln!(
            s,
            r##"<line x1="{xx:.1}" y1="{:.1}" x2="{xx:.1}" y2="{:.1}" stroke="#333"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            top + ph,
            top + ph + 5.0,
            top + ph + 18.0,
            tv
        );
        tv += xstep;
    }
    // Axes and labels.
    let _ = writeln!(
        s,
        r##"<line x1="{left}" y1="{top}" x2="{left}" y2="{:.1}" stroke="#333"/><line x1="{left}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#333"/>"##,
        top + ph,
        top + ph,
        left + pw,
        top + ph
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">time (s)</text>"#,
        left + pw / 2.0,
        h - 12.0
    );
    let _ = writeln!(
        s,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">committed (GiB)</text>"#,
        top + ph / 2.0,
        top + ph / 2.0
    );
    // Budget.
    let yb = y(report.budget_bytes as f64);
    let _ = writeln!(
        s,
        r##"<line x1="{left}" y1="{yb:.1}" x2="{:.1}" y2="{yb:.1}" stroke="#000" stroke-dasharray="6 4"/><text x="{:.1}" y="{:.1}" text-anchor="end">budget</text>"##,
        left + pw,
        left + pw - 4.0,
        yb - 4.0
    );
    // One step polyline per policy, at most one vertex pair per pixel column.
    for (i, p) in report.policies.iter().enumerate() {
        let color = COLORS.get(i % COLORS.len()).copied().unwrap_or("#000");
        let mut pts: Vec<(f64, f64)> = Vec::new();
        let mut last_col = f64::NEG_INFINITY;
        let mut prev_y: Option<f64> = None;
        for smp in &p.samples {
            let xx = x(smp.t_s);
            let yy = y(smp.committed_bytes as f64);
            if let Some(py) = prev_y {
                if xx - last_col < 0.5 {
                    // Same column: keep the higher (smaller y) value.
                    if let Some(lp) = pts.last_mut() {
                        lp.1 = lp.1.min(yy);
                    }
                    prev_y = Some(yy);
                    continue;
                }
                pts.push((xx, py));
            }
            pts.push((xx, yy));
            last_col = xx;
            prev_y = Some(yy);
        }
        let mut poly = String::new();
        for (xx, yy) in pts {
            let _ = write!(poly, "{xx:.1},{yy:.1} ");
        }
        let dash = if p.name.ends_with("+prefix") {
            r#" stroke-dasharray="4 2""#
        } else {
            ""
        };
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5"{dash} points="{}"><title>{}</title></polyline>"#,
            poly.trim_end(),
            esc(&p.name)
        );
        let ly = top + 10.0 + i as f64 * 20.0;
        let lx = left + pw + 15.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="3"{dash}/><text x="{:.1}" y="{:.1}">{} ({} GiB)</text>"#,
            lx + 22.0,
            lx + 28.0,
            ly + 4.0,
            esc(&p.name),
            format_args!("{:.1}", p.peak_committed_bytes as f64 / gib)
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="{:.1}" font-size="11" fill="#555">legend: peak committed</text>"##,
        left + pw + 15.0,
        top + 10.0 + report.policies.len() as f64 * 20.0 + 6.0
    );
    s.push_str("</svg>\n");
    s
}
