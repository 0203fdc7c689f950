//! The documentation shows what the commands print: the example report of
//! `docs/simulate.md` (table, verdict and JSON) is the output of the deterministic replay
//! today. Run with `KVVM_BLESS_DOCS=1` to write the current output into the document instead
//! of comparing (then review the diff); without it a stale document fails.
//!
//! And the default run ends with a verdict whose figures are the table's.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

fn doc_path(name: &str) -> String {
    format!("{}/../../docs/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn doc(name: &str) -> String {
    std::fs::read_to_string(doc_path(name)).unwrap()
}

fn bless() -> bool {
    std::env::var_os("KVVM_BLESS_DOCS").is_some_and(|v| v == "1")
}

/// Where the body of the first fenced block of `lang` after `heading` lies in `text`.
fn block_span(text: &str, heading: &str, lang: &str) -> (usize, usize) {
    let at = text.find(heading).expect("heading");
    let fence = format!("```{lang}\n");
    let start = at + text[at..].find(&fence).expect("block") + fence.len();
    let end = start + text[start..].find("```").expect("block end");
    (start, end)
}

fn block<'a>(text: &'a str, heading: &str, lang: &str) -> &'a str {
    let (start, end) = block_span(text, heading, lang);
    &text[start..end]
}

/// Blessing rewrites a document in place: one test at a time.
static BLESSING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Compares the block with `printed`, or writes `printed` into it when blessing.
fn check_block(name: &str, heading: &str, lang: &str, printed: &str) {
    let _one = BLESSING.lock().unwrap_or_else(|p| p.into_inner());
    let md = doc(name);
    if bless() {
        let (start, end) = block_span(&md, heading, lang);
        let updated = format!("{}{printed}{}", &md[..start], &md[end..]);
        std::fs::write(doc_path(name), updated).unwrap();
        return;
    }
    assert_eq!(
        block(&md, heading, lang),
        printed,
        "docs/{name} ({heading}) is out of date: run `KVVM_BLESS_DOCS=1 cargo test -p kvvm-cli \
         --test docs` and review the diff"
    );
}

fn kvvm(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(args)
        .output()
        .expect("run kvvm");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn simulate(extra: &[&str]) -> String {
    let mut args = vec!["simulate", "--backend", "sim"];
    args.extend_from_slice(extra);
    kvvm(&args)
}

#[test]
fn the_example_report_of_simulate_md_is_what_the_replay_prints() {
    check_block("simulate.md", "## Example report", "text", &simulate(&[]));
}

#[test]
fn the_example_policy_json_of_simulate_md_is_what_the_replay_prints() {
    let md = doc("simulate.md");
    let shown: serde_json::Value =
        serde_json::from_str(block(&md, "One policy of `--json`", "json")).unwrap();
    let printed: serde_json::Value = serde_json::from_str(&simulate(&["--json"])).unwrap();
    let policy = printed["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == shown["name"])
        .unwrap();
    let text = format!("{}\n", serde_json::to_string_pretty(policy).unwrap());
    check_block("simulate.md", "One policy of `--json`", "json", &text);
    let verdict = format!(
        "{}\n",
        serde_json::to_string_pretty(&printed["verdict"]).unwrap()
    );
    check_block("simulate.md", "The verdict of `--json`", "json", &verdict);
}

/// The cells of a table row (columns are two or more spaces apart; a cell holds at most one
/// space in a row, as in `19.4 s`).
fn cells(line: &str) -> Vec<String> {
    line.split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The row of `policy` in `table`, by header.
fn row(table: &str, policy: &str) -> std::collections::HashMap<String, String> {
    let header = table
        .lines()
        .find(|l| l.starts_with("policy "))
        .expect("header");
    let line = table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(policy))
        .unwrap_or_else(|| panic!("{policy} not in the table"));
    cells(header).into_iter().zip(cells(line)).collect()
}

/// `text` after `before` up to `after`.
fn between<'a>(text: &'a str, before: &str, after: &str) -> &'a str {
    let start = text
        .find(before)
        .unwrap_or_else(|| panic!("{before:?} in {text}"))
        + before.len();
    let end = start
        + text[start..]
            .find(after)
            .unwrap_or_else(|| panic!("{after:?} in {text}"));
    &text[start..end]
}

#[test]
fn the_default_run_ends_with_a_verdict_whose_figures_are_the_tables() {
    let out = kvvm(&["simulate"]);
    let width = out.lines().map(|l| l.chars().count()).max().unwrap_or(0);
    assert!(width <= 120, "{width} columns:\n{out}");
    // The verdict is the last paragraph: one sentence from "verdict:", wrapped.
    let at = out.rfind("\nverdict: ").expect("a verdict") + 1;
    let verdict = out[at..].split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(verdict.ends_with("in the driver."), "{verdict}");
    let kvvm_name = between(&verdict, "verdict: ", " served ");
    let base = between(&verdict, "; against ", ", the best of the others");
    assert!(
        kvvm_name.starts_with("kvvm-") && !base.starts_with("kvvm-"),
        "{verdict}"
    );
    let (k, b) = (row(&out, kvvm_name), row(&out, base));
    assert_eq!(between(&verdict, " served ", " of "), k["served"]);
    let flat = out.split_whitespace().collect::<Vec<_>>().join(" ");
    let requests = between(&flat, "; ", " requests over ");
    assert_eq!(between(&verdict, " of ", " requests"), requests);
    assert_eq!(between(&verdict, "(wait p99 ", ")"), k["wait p99"]);
    assert_eq!(between(&verdict, "holding at most ", ";"), k["held"]);
    let others = between(&verdict, "the best of the others (", ")");
    assert_eq!(
        others,
        format!(
            "{} served, wait p99 {}, {} held",
            b["served"], b["wait p99"], b["held"]
        )
    );
    assert_eq!(
        between(&verdict, "driver calls, ", " of the run's time"),
        k["driver %"]
    );
    let wide = kvvm(&["simulate", "--wide"]);
    assert_eq!(
        between(&verdict, "at the price of ", " driver calls"),
        row(&wide, kvvm_name)["driver calls"]
    );
    // Under the default budget the policies serve differently: somebody waits.
    let rows: Vec<Vec<String>> = out
        .lines()
        .skip_while(|l| !l.starts_with("---"))
        .skip(1)
        .take_while(|l| !l.is_empty())
        .map(cells)
        .collect();
    assert!(rows.len() >= 2, "{out}");
    assert!(
        rows.iter().any(|r| r.get(3).is_some_and(|w| w != "0")),
        "{out}"
    );
    let served =
        |r: &std::collections::HashMap<String, String>| -> u64 { r["served"].parse().unwrap() };
    assert!(served(&k) >= served(&b), "{verdict}");
}

/// What a newcomer meets before any code runs is said where they look first: `pip install .`
/// is silent while cargo builds (and `-v` shows it), and newer transformers take the cache as
/// `cache=` (with the helper that picks the keyword).
#[test]
fn the_python_install_and_the_cache_keyword_are_documented_where_users_look() {
    let readme =
        std::fs::read_to_string(format!("{}/../../README.md", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let python = doc("python.md");
    for (name, text) in [("README.md", &readme), ("docs/python.md", &python)] {
        assert!(
            text.contains("pip install -v ."),
            "{name}: the silent build"
        );
        assert!(
            text.contains("about two minutes"),
            "{name}: the build's length"
        );
        assert!(
            text.contains("5.24") && text.contains("`cache=`"),
            "{name}: cache="
        );
        assert!(text.contains("cache_argument(model)"), "{name}: the helper");
    }
}
