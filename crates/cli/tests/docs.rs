//! The documentation shows what the commands print: the example report of
//! `docs/simulate.md` (table and JSON) is the output of the deterministic replay today.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn doc(name: &str) -> String {
    std::fs::read_to_string(format!("{}/../../docs/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

/// The body of the first fenced block of `lang` after `heading`.
fn block<'a>(text: &'a str, heading: &str, lang: &str) -> &'a str {
    let at = text.find(heading).expect("heading");
    let fence = format!("```{lang}\n");
    let start = at + text[at..].find(&fence).expect("block") + fence.len();
    let end = start + text[start..].find("```").expect("block end");
    &text[start..end]
}

fn simulate(extra: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(["simulate", "--backend", "sim"])
        .args(extra)
        .output()
        .expect("run kvvm");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_example_report_of_simulate_md_is_what_the_replay_prints() {
    let md = doc("simulate.md");
    let shown = block(&md, "## Example report", "text");
    let printed = simulate(&[]);
    // The doc stops before the wall-clock line.
    let printed: String = printed
        .lines()
        .take_while(|l| !l.starts_with("replayed in"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(
        shown, printed,
        "docs/simulate.md's example report is out of date"
    );
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
    assert_eq!(
        &shown, policy,
        "docs/simulate.md's JSON example is out of date"
    );
}
