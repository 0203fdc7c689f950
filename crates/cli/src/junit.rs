//! JUnit XML reports (`--junit FILE`), the format CI systems ingest: one `<testsuite>` per
//! run, one `<testcase>` per case, `<failure>` and `<skipped>` with their reasons. Written
//! for any suite from a list of [`JunitCase`]s ([`render`]), or straight from a suite
//! [`Report`] of pass/fail/skip cases ([`write_report`]).

use std::fmt::Write as _;
use std::path::Path;

use kvvm_conformance::{Report, Status};

use crate::error::{CliError, CliResult};

/// The outcome of one case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JunitOutcome {
    /// Passed.
    Passed,
    /// Failed, with the reason.
    Failed(String),
    /// Skipped, with the reason.
    Skipped(String),
}

/// One case of a report.
#[derive(Debug, Clone, PartialEq)]
pub struct JunitCase {
    /// The case's name.
    pub name: String,
    /// Its class (a dotted group: `kvvm.conformance.sim`).
    pub classname: String,
    /// Seconds it took.
    pub seconds: f64,
    /// How it ended.
    pub outcome: JunitOutcome,
}

/// Text escaped for an XML attribute or element; characters XML 1.0 cannot hold at all
/// (most control characters) become U+FFFD.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\n' => out.push_str("&#10;"),
            '\t' => out.push_str("&#9;"),
            '\r' => out.push_str("&#13;"),
            c if (c as u32) < 0x20 => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// The report of suite `name` with `properties` (backend, device, ...) as XML text.
pub fn render(name: &str, properties: &[(&str, String)], cases: &[JunitCase]) -> String {
    let count = |f: fn(&JunitOutcome) -> bool| cases.iter().filter(|c| f(&c.outcome)).count();
    let failures = count(|o| matches!(o, JunitOutcome::Failed(_)));
    let skipped = count(|o| matches!(o, JunitOutcome::Skipped(_)));
    let time: f64 = cases.iter().map(|c| c.seconds).sum();
    let mut x = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        x,
        "<testsuites name=\"{}\" tests=\"{}\" failures=\"{failures}\" errors=\"0\" skipped=\"{skipped}\" time=\"{time:.6}\">",
        esc(name),
        cases.len()
    );
    let _ = writeln!(
        x,
        "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{failures}\" errors=\"0\" skipped=\"{skipped}\" time=\"{time:.6}\">",
        esc(name),
        cases.len()
    );
    if !properties.is_empty() {
        x.push_str("    <properties>\n");
        for (k, v) in properties {
            let _ = writeln!(
                x,
                "      <property name=\"{}\" value=\"{}\"/>",
                esc(k),
                esc(v)
            );
        }
        x.push_str("    </properties>\n");
    }
    for c in cases {
        let head = format!(
            "    <testcase name=\"{}\" classname=\"{}\" time=\"{:.6}\"",
            esc(&c.name),
            esc(&c.classname),
            c.seconds
        );
        match &c.outcome {
            JunitOutcome::Passed => {
                let _ = writeln!(x, "{head}/>");
            }
            JunitOutcome::Failed(m) => {
                let _ = writeln!(
                    x,
                    "{head}>\n      <failure message=\"{}\">{}</failure>\n    </testcase>",
                    esc(m),
                    esc(m)
                );
            }
            JunitOutcome::Skipped(m) => {
                let _ = writeln!(
                    x,
                    "{head}>\n      <skipped message=\"{}\"/>\n    </testcase>",
                    esc(m)
                );
            }
        }
    }
    x.push_str("  </testsuite>\n</testsuites>\n");
    x
}

/// The cases of a suite report (`classname` `kvvm.<suite>.<backend>`).
pub fn cases_of(suite: &str, report: &Report) -> Vec<JunitCase> {
    let classname = format!("kvvm.{suite}.{}", report.backend);
    report
        .cases
        .iter()
        .map(|c| {
            let reason = c.reason.clone().unwrap_or_default();
            JunitCase {
                name: c.name.clone(),
                classname: classname.clone(),
                seconds: c.micros as f64 / 1e6,
                outcome: match c.status {
                    Status::Pass => JunitOutcome::Passed,
                    Status::Fail => JunitOutcome::Failed(reason),
                    Status::Skip => JunitOutcome::Skipped(reason),
                },
            }
        })
        .collect()
}

/// Writes `report` of suite `suite` (titled `title`) to `path` as JUnit XML.
pub fn write_report(path: &Path, title: &str, suite: &str, report: &Report) -> CliResult<()> {
    let xml = render(
        title,
        &[
            ("backend", report.backend.clone()),
            ("device", report.device.clone()),
        ],
        &cases_of(suite, report),
    );
    std::fs::write(path, xml)
        .map_err(|e| CliError::Failed(format!("cannot write {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_escapes() {
        let cases = vec![
            JunitCase {
                name: "a".into(),
                classname: "kvvm.conformance.sim".into(),
                seconds: 0.5,
                outcome: JunitOutcome::Passed,
            },
            JunitCase {
                name: "b<&>".into(),
                classname: "kvvm.conformance.sim".into(),
                seconds: 0.25,
                outcome: JunitOutcome::Failed("got \"x\" & \u{1}".into()),
            },
            JunitCase {
                name: "c".into(),
                classname: "kvvm.conformance.sim".into(),
                seconds: 0.0,
                outcome: JunitOutcome::Skipped("no kernels".into()),
            },
        ];
        let x = render("kvvm conformance", &[("backend", "sim".into())], &cases);
        assert!(x.starts_with("<?xml version=\"1.0\""));
        assert!(x.contains(
            "<testsuite name=\"kvvm conformance\" tests=\"3\" failures=\"1\" errors=\"0\" skipped=\"1\" time=\"0.750000\">"
        ));
        assert!(x.contains("name=\"b&lt;&amp;&gt;\""));
        assert!(x.contains("message=\"got &quot;x&quot; &amp; \u{fffd}\""));
        assert!(x.contains("<skipped message=\"no kernels\"/>"));
        assert!(x.contains("<property name=\"backend\" value=\"sim\"/>"));
        assert_eq!(x.matches("<testcase ").count(), 3);
        assert!(x.ends_with("</testsuites>\n"));
    }
}
