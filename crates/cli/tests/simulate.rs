//! `kvvm simulate`, run as a user would.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::Command;

fn kvvm(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(args)
        .output()
        .expect("run kvvm");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn example(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/traces")
        .join(name)
        .display()
        .to_string()
}

fn policy<'a>(v: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    v["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no policy {name}"))
}

#[test]
fn simulate_json_on_the_sim_meets_the_acceptance_orderings() {
    let (code, stdout, stderr) = kvvm(&["simulate", "--backend", "sim", "--json"]);
    assert_eq!(code, 0, "{stderr}");
    // stdout holds exactly one JSON object.
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert!(v.is_object());
    assert_eq!(v["backend"], "sim");
    assert_eq!(v["model"], "llama-3-8b");
    assert_eq!(v["ledger_empty_after_run"], true);
    assert!(v["budget_bytes"].as_u64().unwrap() > 0);
    assert_eq!(v["trace"]["kind"], "synthetic");
    assert_eq!(v["trace"]["requests"], 200);
    let policies = v["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 10);
    for p in policies {
        for key in [
            "name",
            "peak_committed_bytes",
            "waste_ratio",
            "admitted",
            "deferred",
            "driver_calls",
        ] {
            assert!(!p[key].is_null(), "{key} missing in {p}");
        }
    }
    let waste = |n: &str| policy(&v, n)["waste_ratio"].as_f64().unwrap();
    assert!(waste("kvvm-token-major") < waste("kvvm-seq-major"));
    assert!(waste("kvvm-seq-major") < waste("kvvm-head-major"));
    let peak = |p: &serde_json::Value| p["peak_committed_bytes"].as_u64().unwrap();
    let static_peak = peak(policy(&v, "static-max"));
    for p in policies.iter().filter(|p| p["through_manager"] == true) {
        assert!(peak(p) <= static_peak, "{p}");
    }
    // The default budget (8 GiB) is where the policies serve differently: static-max makes
    // requests wait longest, head-major waits, token-major with sharing serves everyone at
    // the step they arrive.
    assert_eq!(v["budget_bytes"], 8u64 << 30);
    let p99 = |n: &str| policy(&v, n)["queue_delay_p99_ms"].as_f64().unwrap();
    assert!(policy(&v, "static-max")["deferred"].as_u64().unwrap() > 0);
    assert!(p99("static-max") > p99("kvvm-head-major"));
    assert!(p99("kvvm-head-major") > p99("kvvm-seq-major"));
    assert_eq!(p99("kvvm-token-major+prefix"), 0.0);
    assert_eq!(policy(&v, "static-max")["peak_running"], 2);
    // And the JSON holds the verdict.
    assert_eq!(v["verdict"]["kvvm"], "kvvm-token-major+prefix");
    assert_eq!(v["verdict"]["baseline"], "paged-16+prefix");
    assert!(v["verdict"]["text"]
        .as_str()
        .unwrap()
        .starts_with("verdict: "));
}

#[test]
fn simulate_prints_a_table_and_writes_a_plot_for_a_jsonl_trace() {
    let dir = std::env::temp_dir().join(format!("kvvm-sim-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("plot.svg");
    let (code, stdout, stderr) = kvvm(&[
        "simulate",
        "--backend",
        "sim",
        "--trace",
        &example("small.jsonl"),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("trace: jsonl"), "{stdout}");
    assert!(stdout.contains("40 requests"), "{stdout}");
    for name in [
        "static-max",
        "paged-16",
        "paged-16+prefix",
        "kvvm-token-major+prefix",
    ] {
        assert!(stdout.contains(name), "{stdout}");
    }
    assert!(stdout.contains("ledger after the run: empty"), "{stdout}");
    // No progress bar when stderr is not a terminal.
    assert!(!stderr.contains('['), "{stderr}");
    for key in [
        "served",
        "wait p50",
        "wait p99",
        "in flight",
        "preempt",
        "driver %",
    ] {
        assert!(stdout.contains(key), "{key}: {stdout}");
    }
    assert!(stdout.contains("\nverdict: kvvm-"), "{stdout}");
    assert!(stdout.lines().all(|l| l.chars().count() <= 120), "{stdout}");
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg"));
    for name in [
        "static-max",
        "paged-16",
        "paged-16+prefix",
        "kvvm-token-major+prefix",
    ] {
        assert!(
            plot.contains(&format!("{name} (peak ")),
            "{name} not in the legend"
        );
    }
    assert!(plot.contains("budget 8.00 GiB"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn simulate_options_select_policies_and_the_seed_is_deterministic() {
    let args = [
        "simulate",
        "--backend",
        "sim",
        "--json",
        "--requests",
        "30",
        "--seed",
        "9",
        "--rate",
        "8",
        "--shared-prefix-share",
        "1",
        "--budget-bytes",
        "8589934592",
        "--policies",
        "paged-16,kvvm-token-major",
    ];
    let (code, a, stderr) = kvvm(&args);
    assert_eq!(code, 0, "{stderr}");
    let (_, b, _) = kvvm(&args);
    let strip = |s: &str| {
        let mut v: serde_json::Value = serde_json::from_str(s).unwrap();
        v.as_object_mut().unwrap().remove("elapsed_s");
        v
    };
    let (va, vb) = (strip(&a), strip(&b));
    assert_eq!(va, vb);
    assert_eq!(va["policies"].as_array().unwrap().len(), 2);
    assert_eq!(va["budget_bytes"], 8_589_934_592u64);
    assert_eq!(va["trace"]["shared_prefix_requests"], 30);
    assert_eq!(va["trace"]["rate_per_s"], 8.0);
}

#[test]
fn simulate_reports_bad_input_clearly() {
    let dir = std::env::temp_dir().join(format!("kvvm-sim-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"arrival_s\": 0, \"prompt_tokens\": 5, \"output_tokens\": 5}\n{\"arrival_s\": 1}\n",
    )
    .unwrap();
    let (code, stdout, stderr) = kvvm(&[
        "simulate",
        "--backend",
        "sim",
        "--trace",
        bad.to_str().unwrap(),
    ]);
    assert_eq!(code, 2);
    assert!(stdout.is_empty());
    assert!(stderr.contains("trace line 2"), "{stderr}");
    // What a newcomer writes: a JSON array, a file saved with a byte-order mark, a request
    // too long for the context on line 3 that arrives first.
    let request = "{\"arrival_s\": 1, \"prompt_tokens\": 5, \"output_tokens\": 5}";
    let cases = [
        (
            format!("[{request}, {request}]\n"),
            2,
            "trace line 1: a JSON array: a JSONL trace holds one JSON object per line",
        ),
        (format!("\u{feff}{request}\n{request}\n"), 0, ""),
        (
            format!(
                "{request}\n{request}\n{{\"arrival_s\": 0.5, \"prompt_tokens\": 40000, \"output_tokens\": 9}}\n"
            ),
            2,
            "trace line 3: the request needs 40009 tokens (prompt 40000 + output 9), more than \
             the maximum context of 32768 tokens (raise --max-context or shorten the trace)",
        ),
        (
            "{\"arrival_s\": 1, \"prompt_tokens\": 5, \"output_tokens\": -1}\n".to_owned(),
            2,
            "trace line 1: output_tokens must be a whole number >= 1, not -1",
        ),
    ];
    for (i, (text, want_code, want)) in cases.iter().enumerate() {
        let path = dir.join(format!("case{i}.jsonl"));
        std::fs::write(&path, text).unwrap();
        let (code, _, stderr) = kvvm(&[
            "simulate",
            "--backend",
            "sim",
            "--policies",
            "paged-16",
            "--trace",
            path.to_str().unwrap(),
        ]);
        assert_eq!(code, *want_code, "{text}: {stderr}");
        assert!(stderr.contains(want), "{text}: {stderr}");
    }
    let (code, _, stderr) = kvvm(&["simulate", "--backend", "sim", "--policies", "nope"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("unknown policy"), "{stderr}");
    let (code, _, stderr) = kvvm(&["simulate", "--backend", "nope"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("unknown backend"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
