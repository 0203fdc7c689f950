//! Results of a conformance run: a table for people, JSON for machines.

use serde::Serialize;

/// The outcome of one case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// The backend behaved as every backend must.
    Pass,
    /// It did not; `reason` says how.
    Fail,
    /// The case could not run here (a capability is missing, or the backend is unavailable);
    /// `reason` says why. A skip is never counted as a pass.
    Skip,
}

impl Status {
    /// `"pass"`, `"fail"` or `"skip"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Fail => "fail",
            Status::Skip => "skip",
        }
    }
}

/// One case's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CaseResult {
    /// The case's name.
    pub name: String,
    /// Its outcome.
    pub status: Status,
    /// Why it failed or was skipped (`null` on a pass).
    pub reason: Option<String>,
    /// Wall-clock time of the case in microseconds.
    pub micros: u64,
}

/// A whole run, in exactly the JSON shape `kvvm conformance --json` prints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The backend's name.
    pub backend: String,
    /// The device the cases ran on (`"none"` when the backend is unavailable).
    pub device: String,
    /// Cases passed.
    pub passed: u64,
    /// Cases failed.
    pub failed: u64,
    /// Cases skipped.
    pub skipped: u64,
    /// Every case, in suite order.
    pub cases: Vec<CaseResult>,
}

impl Report {
    /// A report from case results (the counts are computed).
    pub fn new(
        backend: impl Into<String>,
        device: impl Into<String>,
        cases: Vec<CaseResult>,
    ) -> Self {
        let count = |s: Status| cases.iter().filter(|c| c.status == s).count() as u64;
        Report {
            backend: backend.into(),
            device: device.into(),
            passed: count(Status::Pass),
            failed: count(Status::Fail),
            skipped: count(Status::Skip),
            cases,
        }
    }

    /// The result of the case named `name`.
    pub fn case(&self, name: &str) -> Option<&CaseResult> {
        self.cases.iter().find(|c| c.name == name)
    }

    /// The report as one line of JSON.
    pub fn to_json(&self) -> String {
        // Serializing plain strings and integers cannot fail; fall back to an error object
        // rather than panicking all the same.
        serde_json::to_string(self)
            .unwrap_or_else(|e| format!("{{\"error\": \"cannot serialize report: {e}\"}}"))
    }

    /// The reasons shared by two skipped cases or more, with their counts, in order of first
    /// appearance.
    pub fn shared_skip_reasons(&self) -> Vec<(&str, usize)> {
        let mut reasons: Vec<(&str, usize)> = Vec::new();
        for c in self.cases.iter().filter(|c| c.status == Status::Skip) {
            let r = c.reason.as_deref().unwrap_or("");
            match reasons.iter_mut().find(|(x, _)| *x == r) {
                Some((_, n)) => *n += 1,
                None => reasons.push((r, 1)),
            }
        }
        reasons.retain(|(_, n)| *n >= 2);
        reasons
    }

    /// The report as an aligned text table. A skip reason shared by several cases is printed
    /// once, under the table, with its count (`[1] 3 cases: ...`), and the rows refer to it;
    /// when every case was skipped for one reason (an unavailable backend) the rows are left
    /// out. The last line is the summary, `N passed, N failed, N skipped`.
    pub fn to_table(&self) -> String {
        let shared = self.shared_skip_reasons();
        let mut out = format!("backend: {}   device: {}\n", self.backend, self.device);
        let all_one_reason = !self.cases.is_empty()
            && shared.len() == 1
            && shared.first().map(|(_, n)| *n) == Some(self.cases.len());
        if all_one_reason {
            if let Some((reason, n)) = shared.first() {
                let reason = reason.strip_prefix("skipped: ").unwrap_or(reason);
                out.push_str(&format!("every case ({n}) skipped: {reason}\n"));
            }
        } else {
            let width = self
                .cases
                .iter()
                .map(|c| c.name.len())
                .max()
                .unwrap_or(4)
                .max(4);
            out.push_str(&format!(
                "{:<width$}  {:<6} {:>10}  reason\n",
                "case", "status", "micros"
            ));
            for c in &self.cases {
                let reason = c.reason.as_deref().unwrap_or("");
                let shown = match shared.iter().position(|(r, _)| *r == reason) {
                    Some(i) if c.status == Status::Skip => format!("[{}]", i + 1),
                    _ => reason.to_owned(),
                };
                out.push_str(
                    format!(
                        "{:<width$}  {:<6} {:>10}  {}",
                        c.name,
                        c.status.as_str(),
                        c.micros,
                        shown
                    )
                    .trim_end(),
                );
                out.push('\n');
            }
            for (i, (reason, n)) in shared.iter().enumerate() {
                out.push_str(&format!("[{}] {n} cases skipped: {reason}\n", i + 1));
            }
        }
        out.push_str(&format!(
            "{} passed, {} failed, {} skipped\n",
            self.passed, self.failed, self.skipped
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_exactly_the_documented_shape() {
        let r = Report::new(
            "sim",
            "Simulated GPU 0",
            vec![
                CaseResult {
                    name: "a".into(),
                    status: Status::Pass,
                    reason: None,
                    micros: 3,
                },
                CaseResult {
                    name: "b".into(),
                    status: Status::Skip,
                    reason: Some("no kernels".into()),
                    micros: 0,
                },
            ],
        );
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        let obj = v.as_object().unwrap();
        let mut keys: Vec<_> = obj.keys().cloned().collect();
        keys.sort();
        assert_eq!(
            keys,
            ["backend", "cases", "device", "failed", "passed", "skipped"]
        );
        assert_eq!(v["passed"], 1);
        assert_eq!(v["skipped"], 1);
        assert_eq!(v["failed"], 0);
        assert_eq!(v["cases"][0]["reason"], serde_json::Value::Null);
        assert_eq!(v["cases"][1]["status"], "skip");
        let mut case_keys: Vec<_> = v["cases"][1].as_object().unwrap().keys().cloned().collect();
        case_keys.sort();
        assert_eq!(case_keys, ["micros", "name", "reason", "status"]);
        assert!(r.to_table().ends_with("1 passed, 0 failed, 1 skipped\n"));
    }

    fn case(name: &str, status: Status, reason: Option<&str>) -> CaseResult {
        CaseResult {
            name: name.into(),
            status,
            reason: reason.map(str::to_owned),
            micros: 1,
        }
    }

    #[test]
    fn a_shared_skip_reason_is_printed_once() {
        let r = Report::new(
            "host",
            "host memory",
            vec![
                case("a", Status::Pass, None),
                case("b", Status::Skip, Some("no kernels")),
                case("c", Status::Skip, Some("no kernels")),
                case("d", Status::Skip, Some("no POSIX fd")),
            ],
        );
        let t = r.to_table();
        assert_eq!(t.matches("no kernels").count(), 1, "{t}");
        assert!(t.contains("[1] 2 cases skipped: no kernels\n"), "{t}");
        assert!(t.contains("no POSIX fd"), "{t}");
        assert!(t.ends_with("1 passed, 0 failed, 3 skipped\n"), "{t}");
    }

    #[test]
    fn an_unavailable_backend_is_one_line() {
        let cases = (0..40)
            .map(|i| {
                case(
                    &format!("c{i}"),
                    Status::Skip,
                    Some("backend cuda is unavailable"),
                )
            })
            .collect();
        let t = Report::new("cuda", "none", cases).to_table();
        assert_eq!(
            t,
            "backend: cuda   device: none\nevery case (40) skipped: backend cuda is unavailable\n0 passed, 0 failed, 40 skipped\n"
        );
    }
}
