//! `/metrics` after traffic of every kind (2xx, 4xx, 429, 404) is valid Prometheus text
//! exposition format 0.0.4, checked strictly here (names, labels, escapes, one HELP and TYPE
//! per family before its samples, no duplicate series, cumulative histograms ending in
//! `+Inf` = `_count`), and by `promtool check metrics` where promtool is installed.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{HashMap, HashSet};

use common::{TestServer, MIB2};

fn valid_name(n: &str) -> bool {
    let mut chars = n.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// Splits `name{k="v",...} value` into its parts, checking the label syntax.
fn sample(line: &str) -> (String, Vec<(String, String)>, f64) {
    let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line:?}"));
    let value: f64 = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line:?}")),
    };
    let (name, labels) = match series.split_once('{') {
        None => (series.to_owned(), Vec::new()),
        Some((name, rest)) => {
            let inner = rest.strip_suffix('}').unwrap_or_else(|| panic!("{line:?}"));
            let mut labels = Vec::new();
            let mut rest = inner;
            while !rest.is_empty() {
                let (k, after) = rest.split_once("=\"").unwrap_or_else(|| panic!("{line:?}"));
                assert!(valid_name(k) && !k.contains(':'), "label {k:?} in {line:?}");
                let mut v = String::new();
                let mut it = after.char_indices();
                let end = loop {
                    match it.next() {
                        Some((i, '"')) => break i,
                        Some((_, '\\')) => match it.next() {
                            Some((_, c @ ('\\' | '"'))) => v.push(c),
                            Some((_, 'n')) => v.push('\n'),
                            other => panic!("bad escape {other:?} in {line:?}"),
                        },
                        Some((_, c)) => {
                            assert!(c != '\n', "{line:?}");
                            v.push(c)
                        }
                        None => panic!("unterminated label value in {line:?}"),
                    }
                };
                labels.push((k.to_owned(), v));
                rest = &after[end + 1..];
                rest = rest.strip_prefix(',').unwrap_or(rest);
            }
            (name.to_owned(), labels)
        }
    };
    assert!(valid_name(&name), "{name:?}");
    (name, labels, value)
}

fn check_exposition(text: &str) {
    assert!(text.ends_with('\n'));
    let mut types: HashMap<String, String> = HashMap::new();
    let mut helps = HashSet::new();
    let mut series = HashSet::new();
    let mut buckets: HashMap<String, Vec<(f64, f64)>> = HashMap::new();
    let mut counts: HashMap<String, f64> = HashMap::new();
    for line in text.lines() {
        assert!(!line.is_empty(), "empty line in the exposition");
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap();
            assert!(valid_name(name) && helps.insert(name.to_owned()), "{line}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "{line}"
            );
            assert!(
                types.insert(name.to_owned(), kind.to_owned()).is_none(),
                "{line}"
            );
            continue;
        }
        assert!(!line.starts_with('#'), "{line}");
        let (name, labels, value) = sample(line);
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .filter(|f| types.get(*f).is_some_and(|t| t == "histogram"))
            .unwrap_or(&name)
            .to_owned();
        let kind = types
            .get(&family)
            .unwrap_or_else(|| panic!("sample before its TYPE: {line}"));
        if kind == "counter" {
            assert!(name.ends_with("_total") && value >= 0.0, "{line}");
        }
        let key = format!("{name}{labels:?}");
        assert!(series.insert(key), "duplicate series {line}");
        let others: Vec<_> = labels.iter().filter(|(k, _)| k != "le").cloned().collect();
        let id = format!("{family}{others:?}");
        if name.ends_with("_bucket") {
            let le = labels
                .iter()
                .find(|(k, _)| k == "le")
                .expect("le")
                .1
                .clone();
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap()
            };
            buckets.entry(id).or_default().push((le, value));
        } else if kind == "histogram" && name.ends_with("_count") {
            counts.insert(id, value);
        }
    }
    assert!(!buckets.is_empty(), "no histogram");
    for (id, b) in &buckets {
        assert!(
            b.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1),
            "{id}: {b:?}"
        );
        let last = b.last().unwrap();
        assert_eq!(last.0, f64::INFINITY, "{id}");
        assert_eq!(Some(&last.1), counts.get(id), "{id}");
    }
}

#[test]
fn metrics_are_valid_prometheus_text_after_every_kind_of_answer() {
    let server = TestServer::start(Some(64 * 2 * MIB2));
    assert_eq!(
        server
            .post("/v1/sequences", r#"{"prompt_tokens": 100}"#)
            .status,
        201
    );
    assert_eq!(
        server
            .post("/v1/sequences", r#"{"prompt_tokens": 100}"#)
            .status,
        201
    );
    assert_eq!(
        server
            .post("/v1/sequences", r#"{"prompt_tokens": 100}"#)
            .status,
        429
    );
    assert_eq!(server.post("/v1/sequences", "{").status, 400);
    assert_eq!(server.get("/nowhere").status, 404);
    assert_eq!(server.get("/v1/sequences/1").status, 200);
    let r = server.get("/metrics");
    assert_eq!(r.status, 200);
    let text = r.body;
    check_exposition(&text);
    for (name, _, _) in kvvm_server::metrics::METRICS {
        assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing");
    }
    assert!(text.contains(
        "kvvm_http_requests_total{route=\"/v1/sequences\",method=\"POST\",status=\"429\"} 1\n"
    ));
    assert_eq!(server.metric("kvvm_grants_refused_total"), 1);
    assert_eq!(server.metric("kvvm_internal_errors_total"), 0);
    match std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        Err(_) => println!("skipped: no promtool (the strict check above ran)"),
        Ok(mut child) => {
            use std::io::Write;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(text.as_bytes())
                .unwrap();
            let out = child.wait_with_output().unwrap();
            let said = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                out.status.success() && said.trim().is_empty(),
                "promtool: {said}"
            );
            println!("promtool check metrics: clean");
        }
    }
}
