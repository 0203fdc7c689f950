//! A report as an SVG plot (plotters, SVG backend): committed memory over time, one step
//! line per policy, the budget drawn last (on top), a legend beside the chart.
//!
//! Read at a glance: the canvas is sized from its texts, so no label is clipped; every
//! policy has its own colour and marker shape (markers of different policies sit at
//! different times, so curves that coincide stay visible); `+prefix` policies and any curve
//! identical to one drawn before it are dashed, and the legend names the curve it coincides
//! with; the axes carry their units.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::error::{WorkloadError, WorkloadResult};
use crate::report::{PolicyReport, Sample, SimulationReport};

const FONT: &str = "sans-serif";
/// Font sizes as given to plotters (the SVG's `font-size` is this / 1.24).
const TITLE_SIZE: f64 = 20.0;
const TEXT_SIZE: f64 = 16.0;
const NOTE_SIZE: f64 = 14.0;
const HEIGHT: u32 = 600;
const CHART_WIDTH: u32 = 820;
const ROW: i32 = 34;
const MARKERS_PER_SERIES: usize = 10;
const GIB: f64 = (1u64 << 30) as f64;

const COLORS: [RGBColor; 10] = [
    RGBColor(214, 39, 40),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
    RGBColor(31, 119, 180),
    RGBColor(23, 190, 207),
    RGBColor(44, 160, 44),
    RGBColor(188, 189, 34),
    RGBColor(148, 103, 189),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// The shape of a series' markers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Marker {
    Disc,
    Ring,
    Triangle,
    Cross,
    HollowTriangle,
}

const MARKERS: [Marker; 5] = [
    Marker::Disc,
    Marker::Triangle,
    Marker::Cross,
    Marker::Ring,
    Marker::HollowTriangle,
];

/// How one policy is drawn.
#[derive(Debug, Clone, PartialEq)]
struct SeriesStyle {
    color: RGBColor,
    dashed: bool,
    marker: Marker,
    /// The earlier policy whose curve this one repeats exactly, if any.
    same_as: Option<String>,
}

/// Width of `text` in pixels at SVG font size `px`, over-estimated (0.6 em a character, wider
/// than the average of a sans-serif face) so that what fits by this measure fits on screen.
pub(crate) fn text_width(text: &str, px: f64) -> f64 {
    text.chars().count() as f64 * 0.6 * px
}

/// The SVG font size of a plotters font size.
fn svg_px(size: f64) -> f64 {
    size / 1.24
}

fn styles(report: &SimulationReport) -> Vec<SeriesStyle> {
    let policies = &report.policies;
    policies
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let same_as = policies
                .iter()
                .take(i)
                .find(|q| q.samples == p.samples)
                .map(|q| q.name.clone());
            SeriesStyle {
                color: COLORS.get(i % COLORS.len()).copied().unwrap_or(BLACK),
                dashed: p.name.ends_with("+prefix") || same_as.is_some(),
                marker: MARKERS
                    .get(i % MARKERS.len())
                    .copied()
                    .unwrap_or(Marker::Disc),
                same_as,
            }
        })
        .collect()
}

fn legend_label(p: &PolicyReport) -> String {
    format!(
        "{} (peak {:.2} GiB)",
        p.name,
        p.peak_committed_bytes as f64 / GIB
    )
}

fn legend_note(style: &SeriesStyle) -> Option<String> {
    style
        .same_as
        .as_ref()
        .map(|other| format!("same curve as {other}"))
}

/// The committed bytes at time `t` of a step curve (the last sample at or before `t`).
fn value_at(samples: &[Sample], t: f64) -> f64 {
    let i = samples.partition_point(|s| s.t_s <= t);
    i.checked_sub(1)
        .and_then(|i| samples.get(i))
        .map_or(0.0, |s| s.committed_bytes as f64 / GIB)
}

/// The step line of `samples` in (seconds, GiB), at most one vertex pair per `columns`th of
/// the time range (the highest value of a column kept).
fn step_points(samples: &[Sample], t0: f64, t1: f64, columns: f64) -> Vec<(f64, f64)> {
    let mut pts: Vec<(f64, f64)> = Vec::new();
    let mut last_col = f64::NEG_INFINITY;
    let mut prev: Option<f64> = None;
    let span = (t1 - t0).max(f64::MIN_POSITIVE);
    for s in samples {
        let y = s.committed_bytes as f64 / GIB;
        let col = ((s.t_s - t0) / span * columns).floor();
        if let Some(py) = prev {
            if col <= last_col {
                if let Some(lp) = pts.last_mut() {
                    lp.1 = lp.1.max(y);
                }
                prev = Some(y);
                continue;
            }
            pts.push((s.t_s, py));
        }
        pts.push((s.t_s, y));
        last_col = col;
        prev = Some(y);
    }
    pts
}

fn shape(style: &SeriesStyle, width: u32) -> ShapeStyle {
    ShapeStyle::from(&style.color).stroke_width(width)
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

fn draw_marker(area: &Area<'_>, at: (i32, i32), style: &SeriesStyle) -> WorkloadResult<()> {
    let line = shape(style, 2);
    let filled = ShapeStyle::from(&style.color).filled();
    let r = match style.marker {
        Marker::Disc => area.draw(&Circle::new(at, 5, filled)),
        Marker::Ring => area.draw(&Circle::new(at, 5, line)),
        Marker::Triangle => area.draw(&TriangleMarker::new(at, 6, filled)),
        Marker::HollowTriangle => area.draw(&TriangleMarker::new(at, 6, line)),
        Marker::Cross => area.draw(&Cross::new(at, 5, line)),
    };
    r.map_err(plot_error)
}

fn plot_error(e: impl std::fmt::Display) -> WorkloadError {
    WorkloadError::Plot(e.to_string())
}

fn text_style(size: f64, color: &RGBColor, anchor: Pos) -> TextStyle<'_> {
    TextStyle::from((FONT, size).into_font())
        .color(color)
        .pos(anchor)
}

/// Canvas width: the chart, then the legend as wide as its longest entry, and at least as
/// wide as the title.
fn canvas_width(report: &SimulationReport, styles: &[SeriesStyle], title: &str) -> u32 {
    let mut legend = text_width("policy (peak committed)", svg_px(TEXT_SIZE));
    for (p, s) in report.policies.iter().zip(styles) {
        legend = legend.max(50.0 + text_width(&legend_label(p), svg_px(TEXT_SIZE)));
        if let Some(note) = legend_note(s) {
            legend = legend.max(50.0 + text_width(&note, svg_px(NOTE_SIZE)));
        }
    }
    let legend = legend + 40.0;
    let title = text_width(title, svg_px(TITLE_SIZE)) + 40.0;
    (f64::from(CHART_WIDTH) + legend).max(title).ceil() as u32
}

/// The plot of `report` as SVG text.
pub fn render_svg(report: &SimulationReport) -> WorkloadResult<String> {
    let styles = styles(report);
    let title = format!(
        "Committed KV memory over time: {} {}, {} requests, budget {:.2} GiB ({})",
        report.model,
        report.dtype,
        report.trace.requests,
        report.budget_bytes as f64 / GIB,
        report.backend
    );
    let width = canvas_width(report, &styles, &title);
    let notes = styles.iter().filter(|s| s.same_as.is_some()).count() as i32;
    let legend_height = 80 + ROW * (styles.len() as i32 + 2) + notes * (ROW / 2 + 2);
    let height = HEIGHT.max(u32::try_from(legend_height).unwrap_or(HEIGHT));
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        root.draw(&Text::new(
            title.clone(),
            (20, 12),
            text_style(TITLE_SIZE, &BLACK, Pos::new(HPos::Left, VPos::Top)),
        ))
        .map_err(plot_error)?;
        let (chart_area, legend_area) = root.split_horizontally(CHART_WIDTH);
        draw_chart(&root, &chart_area.margin(50, 10, 10, 20), report, &styles)?;
        draw_legend(&legend_area.margin(60, 10, 10, 10), report, &styles)?;
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

fn time_range(report: &SimulationReport) -> (f64, f64) {
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
    (t0, t1)
}

/// Draws the chart in `area`; markers and labels placed by pixel go on `root` (whose pixel
/// coordinates are the backend's).
fn draw_chart(
    root: &Area<'_>,
    area: &Area<'_>,
    report: &SimulationReport,
    styles: &[SeriesStyle],
) -> WorkloadResult<()> {
    let (t0, t1) = time_range(report);
    let peak = report
        .policies
        .iter()
        .map(|p| p.peak_committed_bytes)
        .max()
        .unwrap_or(0)
        .max(report.budget_bytes) as f64
        / GIB;
    let ymax = (peak * 1.08).max(1e-6);
    let mut chart = ChartBuilder::on(area)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(t0..t1, 0.0..ymax)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc("time since the first arrival (s)")
        .y_desc("committed KV memory (GiB)")
        .label_style((FONT, TEXT_SIZE))
        .axis_desc_style((FONT, TEXT_SIZE))
        .light_line_style(TRANSPARENT)
        .bold_line_style(RGBColor(225, 225, 225))
        .draw()
        .map_err(plot_error)?;
    let n = styles.len().max(1);
    for (i, (p, style)) in report.policies.iter().zip(styles).enumerate() {
        let pts = step_points(&p.samples, t0, t1, 1600.0);
        if style.dashed {
            chart
                .draw_series(DashedLineSeries::new(pts, 9, 6, shape(style, 2)))
                .map_err(plot_error)?;
        } else {
            chart
                .draw_series(LineSeries::new(pts, shape(style, 2)))
                .map_err(plot_error)?;
        }
        // Markers at times staggered by series, so coinciding curves show every marker.
        let end = p.samples.last().map_or(t1, |s| s.t_s);
        let plotting = chart.plotting_area();
        for k in 0..MARKERS_PER_SERIES {
            let frac = (k as f64 + (i as f64 + 0.5) / n as f64) / MARKERS_PER_SERIES as f64;
            let t = t0 + frac * (t1 - t0);
            if t > end {
                break;
            }
            let at = plotting.map_coordinate(&(t, value_at(&p.samples, t)));
            draw_marker(root, at, style)?;
        }
    }
    // The budget last, on top of every curve.
    let budget = report.budget_bytes as f64 / GIB;
    chart
        .draw_series(DashedLineSeries::new(
            [(t0, budget), (t1, budget)],
            12,
            6,
            ShapeStyle::from(&BLACK).stroke_width(2),
        ))
        .map_err(plot_error)?;
    let plotting = chart.plotting_area();
    let (bx, by) = plotting.map_coordinate(&(t1, budget));
    root.draw(&Text::new(
        format!("budget {:.2} GiB", budget),
        (bx - 6, by - 4),
        text_style(TEXT_SIZE, &BLACK, Pos::new(HPos::Right, VPos::Bottom)),
    ))
    .map_err(plot_error)?;
    Ok(())
}

fn draw_legend(
    area: &Area<'_>,
    report: &SimulationReport,
    styles: &[SeriesStyle],
) -> WorkloadResult<()> {
    let left = Pos::new(HPos::Left, VPos::Center);
    area.draw(&Text::new(
        "policy (peak committed)",
        (0, 0),
        text_style(TEXT_SIZE, &RGBColor(80, 80, 80), left),
    ))
    .map_err(plot_error)?;
    let mut y = ROW;
    let sample = |y: i32, style: &ShapeStyle, dashed: bool| -> WorkloadResult<()> {
        let segments: &[(i32, i32)] = if dashed {
            &[(0, 12), (20, 32)]
        } else {
            &[(0, 32)]
        };
        for &(a, b) in segments {
            area.draw(&PathElement::new(vec![(a, y), (b, y)], *style))
                .map_err(plot_error)?;
        }
        Ok(())
    };
    for (p, style) in report.policies.iter().zip(styles) {
        sample(y, &shape(style, 3), style.dashed)?;
        draw_marker(area, (16, y), style)?;
        area.draw(&Text::new(
            legend_label(p),
            (42, y),
            text_style(TEXT_SIZE, &BLACK, left),
        ))
        .map_err(plot_error)?;
        if let Some(note) = legend_note(style) {
            y += ROW / 2 + 2;
            area.draw(&Text::new(
                note,
                (42, y),
                text_style(NOTE_SIZE, &RGBColor(90, 90, 90), left),
            ))
            .map_err(plot_error)?;
        }
        y += ROW;
    }
    sample(y, &ShapeStyle::from(&BLACK).stroke_width(2), true)?;
    area.draw(&Text::new(
        format!("budget ({:.2} GiB)", report.budget_bytes as f64 / GIB),
        (42, y),
        text_style(TEXT_SIZE, &BLACK, left),
    ))
    .map_err(plot_error)?;
    Ok(())
}

#[cfg(test)]
#[path = "plot_tests.rs"]
mod tests;
