//! The plot as a reader sees it: every text inside the canvas, every policy of the legend
//! drawn (its line and its markers) with a style of its own, the budget on top.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashSet;
use std::sync::Arc;

use kvvm_sim::SimBackend;

use super::*;
use crate::{simulate, SimulationConfig, SyntheticTrace, Trace};

/// One element of the SVG: its tag, attributes, text content and position in the document.
#[derive(Debug)]
struct Element {
    tag: String,
    attrs: Vec<(String, String)>,
    text: String,
}

impl Element {
    fn attr(&self, name: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn num(&self, name: &str) -> f64 {
        self.attr(name)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} of {self:?}"))
    }

    /// The element's colour: its stroke, else its fill.
    fn color(&self) -> Option<String> {
        [self.attr("stroke"), self.attr("fill")]
            .into_iter()
            .flatten()
            .find(|c| c.starts_with('#'))
            .map(str::to_ascii_uppercase)
    }

    fn points(&self) -> Vec<(f64, f64)> {
        self.attr("points")
            .unwrap_or("")
            .split_whitespace()
            .filter_map(|p| {
                let (x, y) = p.split_once(',')?;
                Some((x.parse().ok()?, y.parse().ok()?))
            })
            .collect()
    }

    /// The leftmost x of the element (points, cx or x1).
    fn min_x(&self) -> f64 {
        match self.tag.as_str() {
            "polyline" | "polygon" => self
                .points()
                .iter()
                .map(|p| p.0)
                .fold(f64::INFINITY, f64::min),
            "circle" => self.num("cx"),
            "line" => self.num("x1").min(self.num("x2")),
            _ => self.attr("x").and_then(|v| v.parse().ok()).unwrap_or(0.0),
        }
    }
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

/// The elements of plotters' SVG output (one tag a line, attributes in double quotes).
fn parse(svg: &str) -> Vec<Element> {
    let mut out = Vec::new();
    let mut rest = svg;
    while let Some(start) = rest.find('<') {
        rest = &rest[start + 1..];
        if rest.starts_with('/') {
            continue;
        }
        let end = rest.find('>').expect("a closed tag");
        let head = &rest[..end];
        let tag: String = head.chars().take_while(|c| c.is_alphanumeric()).collect();
        let mut attrs = Vec::new();
        let mut a = &head[tag.len()..];
        while let Some(eq) = a.find("=\"") {
            let name = a[..eq].trim().to_owned();
            let after = &a[eq + 2..];
            let close = after.find('"').expect("a closed attribute");
            attrs.push((name, unescape(&after[..close])));
            a = &after[close + 1..];
        }
        let mut text = String::new();
        if tag == "text" {
            let body = &rest[end + 1..];
            let close = body.find("</text>").expect("a closed text");
            text = unescape(body[..close].trim());
        }
        out.push(Element { tag, attrs, text });
        rest = &rest[end + 1..];
    }
    out
}

fn report() -> SimulationReport {
    let trace = Trace::synthetic(&SyntheticTrace {
        requests: 60,
        ..SyntheticTrace::default()
    })
    .unwrap();
    let config = SimulationConfig {
        budget_bytes: 20 << 30,
        ..SimulationConfig::default()
    };
    simulate(&trace, Arc::new(SimBackend::h200()), &config, &mut |_| {}).unwrap()
}

#[test]
fn every_text_fits_the_canvas() {
    let svg = render_svg(&report()).unwrap();
    let els = parse(&svg);
    let root = els.iter().find(|e| e.tag == "svg").unwrap();
    let (w, h) = (root.num("width"), root.num("height"));
    let texts: Vec<&Element> = els.iter().filter(|e| e.tag == "text").collect();
    assert!(texts.len() > 20, "{}", texts.len());
    for t in texts {
        let width = text_width(&t.text, t.num("font-size"));
        let (x, y) = (t.num("x"), t.num("y"));
        let (lo, hi) = match t.attr("text-anchor") {
            Some("end") => (x - width, x),
            Some("middle") => (x - width / 2.0, x + width / 2.0),
            _ => (x, x + width),
        };
        if t.attr("transform").is_some_and(|r| r.contains("rotate")) {
            // A vertical label: its length runs along y.
            assert!(y - width / 2.0 >= 0.0 && y + width / 2.0 <= h, "{t:?}");
            continue;
        }
        assert!(
            lo >= 0.0 && hi <= w,
            "text {:?} spans {lo:.0}..{hi:.0} of {w}",
            t.text
        );
        assert!(y >= 0.0 && y <= h, "{t:?}");
    }
}

#[test]
fn every_policy_of_the_legend_is_drawn_in_a_style_of_its_own() {
    let report = report();
    let svg = render_svg(&report).unwrap();
    let els = parse(&svg);
    let chart_edge = f64::from(CHART_WIDTH);
    let styles = styles(&report);
    let distinct: HashSet<String> = styles
        .iter()
        .map(|s| format!("{:?}{}{:?}", s.color, s.dashed, s.marker))
        .collect();
    assert_eq!(distinct.len(), report.policies.len());
    let mut last_series = 0;
    for (p, style) in report.policies.iter().zip(&styles) {
        let label = els
            .iter()
            .find(|e| e.tag == "text" && e.text.starts_with(&format!("{} (peak ", p.name)))
            .unwrap_or_else(|| panic!("{} is not in the legend", p.name));
        assert!(label.num("x") >= chart_edge, "{label:?}");
        // The legend's sample line, at the label's height, gives the colour to look for.
        let y = label.num("y");
        let sample = els
            .iter()
            .find(|e| {
                e.tag == "polyline"
                    && e.min_x() >= chart_edge
                    && e.points().iter().all(|q| (q.1 - y).abs() < 1.0)
            })
            .unwrap_or_else(|| panic!("no legend line for {}", p.name));
        let color = sample.color().unwrap();
        let in_chart =
            |e: &&Element| e.min_x() < chart_edge && e.color().as_deref() == Some(&color);
        let lines: Vec<(usize, &Element)> = els
            .iter()
            .enumerate()
            .filter(|(_, e)| e.tag == "polyline" && in_chart(e))
            .collect();
        let points: usize = lines.iter().map(|(_, e)| e.points().len()).sum();
        assert!(points >= 4, "{} is not drawn ({points} points)", p.name);
        last_series = last_series.max(lines.last().map_or(0, |(i, _)| *i));
        let markers = els
            .iter()
            .filter(|e| matches!(e.tag.as_str(), "circle" | "polygon" | "line") && in_chart(e))
            .count();
        assert!(markers >= 2, "{} has {markers} markers", p.name);
        if let Some(other) = &style.same_as {
            assert!(style.dashed);
            assert!(
                els.iter()
                    .any(|e| e.text == format!("same curve as {other}")),
                "{} coincides with {other} without a note",
                p.name
            );
        }
    }
    // The budget (black dashes and its label) comes after every curve: it is drawn on top.
    let budget_label = format!("budget {:.2} GiB", report.budget_bytes as f64 / GIB);
    let label_at = els.iter().position(|e| e.text == budget_label).unwrap();
    let dashes_after = els[last_series..label_at]
        .iter()
        .filter(|e| e.tag == "polyline" && e.color().as_deref() == Some("#000000"))
        .count();
    assert!(
        dashes_after >= 10,
        "{dashes_after} budget dashes after the curves"
    );
}

#[test]
fn coinciding_curves_are_found() {
    let report = report();
    let styles = styles(&report);
    let same = |name: &str| {
        let i = report.policies.iter().position(|p| p.name == name).unwrap();
        styles[i].same_as.clone()
    };
    // Head-major cannot share the 2048-token prompt (its refusal is in the report), so its
    // +prefix variant repeats its curve exactly.
    assert_eq!(
        same("kvvm-head-major+prefix").as_deref(),
        Some("kvvm-head-major")
    );
    assert_eq!(same("static-max"), None);
}
