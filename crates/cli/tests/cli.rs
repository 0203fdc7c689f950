//! The `kvvm` binary, run as a user would.
#![allow(clippy::unwrap_used, clippy::expect_used)]

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

#[test]
fn conformance_sim_json_has_the_documented_shape_and_passes() {
    let (code, stdout, stderr) = kvvm(&["conformance", "--backend", "sim", "--json"]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["backend"], "sim");
    assert_eq!(v["failed"], 0);
    let cases = v["cases"].as_array().unwrap();
    assert!(cases.len() >= 30);
    assert_eq!(
        v["passed"].as_u64().unwrap() + v["skipped"].as_u64().unwrap(),
        cases.len() as u64
    );
    for c in cases {
        let status = c["status"].as_str().unwrap();
        assert!(["pass", "skip"].contains(&status), "{c}");
        assert!(c["micros"].is_u64());
        assert!(c["name"].is_string());
        if status == "pass" {
            assert!(c["reason"].is_null());
        }
    }
}

#[test]
fn conformance_on_a_missing_gpu_backend_skips_everything_and_exits_0() {
    for backend in ["cuda", "hip"] {
        let (code, stdout, stderr) = kvvm(&["conformance", "--backend", backend, "--json"]);
        assert_eq!(code, 0, "{stderr}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        if v["device"] == "none" {
            assert_eq!(v["passed"], 0);
            assert_eq!(v["failed"], 0);
            let reason = v["cases"][0]["reason"].as_str().unwrap();
            assert!(reason.starts_with("skipped:"), "{reason}");
            println!("skipped: no {backend} device ({reason})");
        }
    }
}

#[test]
fn info_names_every_backend() {
    let (code, stdout, _) = kvvm(&["info"]);
    assert_eq!(code, 0);
    for name in ["cuda:", "hip:", "sim: available"] {
        assert!(stdout.contains(name), "{stdout}");
    }
    let (code, stdout, _) = kvvm(&["info", "--json", "--backend", "sim"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v[0]["devices"][0]["granularity_minimum"], 2 << 20);
}

#[test]
fn unknown_backend_is_a_usage_error() {
    let (code, _, stderr) = kvvm(&["conformance", "--backend", "metal"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("unknown backend"), "{stderr}");
}

#[test]
fn plan_json_reports_the_worked_table() {
    for (layout, min) in [
        ("head-major", 8192),
        ("seq-major", 1024),
        ("token-major", 16),
    ] {
        let (code, stdout, stderr) = kvvm(&[
            "plan",
            "--model",
            "llama-3-8b",
            "--layout",
            layout,
            "--prefix",
            "4096",
            "--json",
        ]);
        assert_eq!(code, 0, "{stderr}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        for key in [
            "shareable",
            "refusal_reason",
            "fragment_bytes",
            "fragments",
            "shareable_granules_per_fragment",
            "multi_map_ops",
        ] {
            assert!(v.get(key).is_some(), "{key} missing in {v}");
        }
        assert_eq!(v["min_shareable_prefix"], min);
        assert_eq!(v["shareable"], 4096 >= min);
        assert_eq!(v["refusal_reason"].is_null(), 4096 >= min);
        // 4096 tokens in handles of up to 512 MiB: 512 fragments of one window, 64 runs of
        // four windows (one 8 MiB handle each), one run of 256 windows (one 512 MiB handle).
        let (windows, handles) = match layout {
            "head-major" => (512, 512),
            "seq-major" => (256, 64),
            _ => (256, 1),
        };
        assert_eq!(v["commit_lower_bound_windows"], windows, "{v}");
        assert_eq!(v["commit_handles"], handles, "{v}");
        assert_eq!(v["commit_mappings"], handles, "{v}");
        assert_eq!(v["max_handle_bytes"], 512u64 << 20);
        let shared = if 4096 >= min { handles } else { 0 };
        assert_eq!(v["shared_prefix_handles"], shared, "{v}");
    }
    // One handle per granule.
    let (code, stdout, stderr) = kvvm(&[
        "plan",
        "--model",
        "llama-3-8b",
        "--layout",
        "seq-major",
        "--tokens",
        "4096",
        "--max-handle",
        "2MiB",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["commit_handles"], 256, "{v}");
}

#[test]
fn plan_rejects_bad_input_with_a_message() {
    let (code, _, stderr) = kvvm(&["plan", "--model", "gpt-17", "--prefix", "1"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("llama-3-8b"), "{stderr}");
    let (code, _, stderr) = kvvm(&["plan", "--model", "llama-3-8b", "--layout", "diagonal"]);
    assert_eq!(code, 2);
    assert!(!stderr.is_empty());
}

#[test]
fn info_says_in_one_short_line_why_a_backend_is_unavailable() {
    let (code, stdout, _) = kvvm(&["info"]);
    assert_eq!(code, 0);
    for line in stdout.lines().filter(|l| l.contains(": unavailable")) {
        assert!(line.contains("; fix: "), "{line}");
        assert!(line.contains("code"), "{line}");
        assert!(!line.contains("load failed: unavailable"), "{line}");
        assert!(line.len() < 300, "{} characters: {line}", line.len());
    }
    let (_, stdout, _) = kvvm(&["info", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    for b in v.as_array().unwrap() {
        if b["available"] == false {
            for key in ["summary", "code", "fix", "reason"] {
                assert!(b[key].is_string(), "{key} missing in {b}");
            }
        }
    }
}

#[test]
fn off_a_terminal_a_long_run_prints_periodic_progress_lines() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args([
            "simulate",
            "--backend",
            "sim",
            "--requests",
            "200",
            "--json",
        ])
        .env("KVVM_PROGRESS_INTERVAL_S", "0.05")
        .output()
        .expect("run kvvm");
    assert_eq!(out.status.code(), Some(0));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("kvvm simulate: "))
        .collect();
    assert!(!lines.is_empty(), "no progress line: {stderr}");
    for l in &lines {
        assert!(l.contains("% (policy ") && l.ends_with(" s elapsed"), "{l}");
        assert!(!l.contains('\r'), "{l:?}");
    }
    // stdout is still exactly the JSON.
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v.is_object());
    let quiet = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(["simulate", "--backend", "sim", "--requests", "20", "--json"])
        .env("KVVM_PROGRESS_INTERVAL_S", "0")
        .output()
        .expect("run kvvm");
    assert!(
        quiet.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&quiet.stderr)
    );
}

#[test]
fn bench_vmm_reports_warm_and_cold_gives_against_one_handle() {
    let (code, stdout, stderr) = kvvm(&[
        "bench",
        "vmm",
        "--backend",
        "sim",
        "--quick",
        "--give-tokens",
        "256,4096",
        "--bytes-per-token",
        "128KiB",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let gives = v["gives"].as_array().unwrap();
    let bytes: Vec<u64> = gives.iter().map(|g| g["bytes"].as_u64().unwrap()).collect();
    assert_eq!(bytes, vec![32 << 20, 512 << 20], "{v}");
    for g in gives {
        let p50 = |case: &str| {
            let t = if case == "one_handle" {
                &g[case]
            } else {
                &g[case]["time"]
            };
            t["p50_us"].as_f64().unwrap()
        };
        let got = g["warm_over_cold"].as_f64().unwrap();
        let want = p50("warm") / p50("cold");
        assert!((got - want).abs() <= 1e-9 * got.abs().max(1.0), "{g}");
        let got = g["cold_over_one_handle"].as_f64().unwrap();
        let want = p50("cold") / p50("one_handle");
        assert!((got - want).abs() <= 1e-9 * got.abs().max(1.0), "{g}");
        // One handle each, and the warm give takes it from the pool: no create.
        assert_eq!(g["cold"]["mappings"], 1, "{g}");
        assert_eq!(g["warm"]["from_pool_bytes"], g["bytes"], "{g}");
        assert_eq!(g["cold"]["calls_per_give"]["create"]["calls"], 1, "{g}");
        assert_eq!(g["warm"]["calls_per_give"]["create"]["calls"], 0, "{g}");
        assert_eq!(g["cold"]["first_call"]["op"], "create", "{g}");
        assert_eq!(g["warm"]["first_call"]["op"], "map", "{g}");
        assert!(g["warm"]["take"]["p50_us"].as_f64().unwrap() > 0.0, "{g}");
    }
}

#[test]
fn bench_vmm_reports_runs_against_one_handle_and_one_handle_per_granule() {
    let (code, stdout, stderr) = kvvm(&[
        "bench",
        "vmm",
        "--backend",
        "sim",
        "--quick",
        "--runs",
        "16MiB,64MiB,1TiB",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["latency_spent"], true);
    assert_eq!(v["max_handle_bytes"], 512u64 << 20);
    let runs = v["runs"].as_array().unwrap();
    // 1 TiB does not fit the simulated H200: skipped with a note.
    assert_eq!(runs.len(), 2, "{v}");
    assert!(
        v["notes"].to_string().contains("run of 1024 GiB skipped"),
        "{v}"
    );
    for r in runs {
        assert_eq!(r["manager_handles"], 1);
        // The simulator exports handles: the manager with exportable handles is measured too.
        for case in ["manager", "one_handle", "per_granule", "exportable"] {
            for step in ["commit", "teardown"] {
                assert!(r[case][step]["p50_us"].as_f64().unwrap() > 0.0, "{r}");
            }
        }
        // The ratios are of the p50s beside them (what they are worth is the benchmark's to
        // say, not a test's: timed on a busy machine, three samples can go either way).
        let p50 = |case: &str, step: &str| r[case][step]["p50_us"].as_f64().unwrap();
        for (ratio, over, under) in [
            (
                "commit_manager_over_one_handle",
                p50("manager", "commit"),
                p50("one_handle", "commit"),
            ),
            (
                "commit_per_granule_over_manager",
                p50("per_granule", "commit"),
                p50("manager", "commit"),
            ),
            (
                "teardown_manager_over_one_handle",
                p50("manager", "teardown"),
                p50("one_handle", "teardown"),
            ),
            (
                "teardown_per_granule_over_manager",
                p50("per_granule", "teardown"),
                p50("manager", "teardown"),
            ),
            (
                "commit_exportable_over_manager",
                p50("exportable", "commit"),
                p50("manager", "commit"),
            ),
            (
                "teardown_exportable_over_manager",
                p50("exportable", "teardown"),
                p50("manager", "teardown"),
            ),
        ] {
            let got = r[ratio].as_f64().unwrap();
            assert!(
                (got - over / under).abs() <= 1e-9 * got.abs().max(1.0),
                "{ratio}: {r}"
            );
        }
    }
    let (code, _, stderr) = kvvm(&[
        "bench",
        "vmm",
        "--backend",
        "sim",
        "--latency-model",
        "h100",
    ]);
    assert_ne!(code, 0);
    assert!(stderr.contains("expected h200 or none"), "{stderr}");
}
