//! Flags are checked, never clamped: each value a command cannot honour is an error (exit 2)
//! that names the flag and the allowed range; sizes take one syntax everywhere.
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
fn values_a_command_cannot_honour_are_errors_naming_the_flag_and_the_range() {
    let cases: &[(&[&str], &str, &str)] = &[
        (
            &["bench", "vmm", "--iterations", "0"],
            "--iterations",
            "allowed 1..=100000",
        ),
        (
            &["bench", "host", "--iterations", "0"],
            "--iterations",
            "allowed 1..=100000",
        ),
        (
            &["bench", "decode", "--sequences", "0"],
            "--sequences",
            "allowed 1..=4096",
        ),
        (
            &["bench", "decode", "--steps", "0"],
            "--steps",
            "allowed 1..=1000000",
        ),
        (
            &["bench", "kv", "--sequences", "0"],
            "--sequences",
            "allowed 1..=4096",
        ),
        (
            &["bench", "kv", "--prompt-tokens", "0"],
            "--prompt-tokens",
            "allowed 1..=",
        ),
        (
            &["bench", "host", "--bytes", "3MiB"],
            "--bytes",
            "multiple of the host granule",
        ),
        (
            &[
                "plan",
                "--model",
                "llama-3-8b",
                "--prefix",
                "4096",
                "--max-tokens",
                "1024",
            ],
            "--prefix 4096 exceeds --max-tokens 1024",
            "allowed 0..=1024",
        ),
        (
            &[
                "plan",
                "--model",
                "llama-3-8b",
                "--tokens",
                "5000",
                "--max-tokens",
                "1024",
            ],
            "--tokens 5000 exceeds --max-tokens 1024",
            "allowed 1..=1024",
        ),
        (
            &["plan", "--model", "llama-3-8b", "--granule", "3"],
            "--granule",
            "allowed 4 KiB..=1 GiB",
        ),
        (
            &["plan", "--model", "llama-3-8b", "--granule", "3MiB"],
            "--granule",
            "power of two",
        ),
        (
            &["serve", "--budget-bytes", "0"],
            "--budget-bytes",
            "allowed at least 1 B",
        ),
        (
            &["serve", "--backend", "sim", "--budget-bytes", "99999TiB"],
            "--budget-bytes",
            "allowed 1 B..=139.28 GiB",
        ),
        (
            &["simulate", "--max-context", "0"],
            "--max-context",
            "allowed 1..=",
        ),
        (
            &["simulate", "--max-context", "1000"],
            "--max-context 1000 leaves no room for --system-prompt-tokens 2048",
            "allowed 2050..=",
        ),
        (
            &["simulate", "--requests", "0"],
            "--requests",
            "allowed 1..=",
        ),
        (&["simulate", "--rate", "0"], "--rate", "greater than 0"),
        (
            &["simulate", "--shared-prefix-share", "1.5"],
            "--shared-prefix-share",
            "0..=1",
        ),
        (
            &["simulate", "--step-ms", "0"],
            "--step-ms",
            "allowed 1..=60000",
        ),
        (
            &["simulate", "--budget-bytes", "8GB"],
            "--budget-bytes",
            "unknown unit",
        ),
        (
            &["simulate", "--backend", "sim", "--budget-bytes", "1PiB"],
            "--budget-bytes",
            "exceeds the memory of device 0",
        ),
        (&["simulate", "--plot", "x.png"], "--plot x.png", "only SVG"),
        (&["conformance", "--device", "-1"], "--device", "negative"),
        (
            &["bench", "vmm", "--iterations", "-5"],
            "--iterations",
            "-5 is negative: allowed 1..=100000",
        ),
        (&["simulate", "--requests", "-5"], "--requests", "negative"),
        (
            &["serve", "--budget-bytes", "-5"],
            "--budget-bytes",
            "negative",
        ),
        (
            &["serve", "--budget-bytes", "1e99"],
            "--budget-bytes",
            "exponents are not accepted",
        ),
    ];
    for (args, flag, range) in cases {
        let (code, stdout, stderr) = kvvm(args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stdout.is_empty(), "{args:?}: {stdout}");
        assert!(
            stderr.contains(flag),
            "{args:?} does not name {flag}: {stderr}"
        );
        assert!(
            stderr.contains(range),
            "{args:?} does not give {range}: {stderr}"
        );
        assert!(
            !stderr.contains("unexpected argument"),
            "{args:?}: {stderr}"
        );
        assert!(
            !stderr.contains("auto:"),
            "{args:?}: the notice came first: {stderr}"
        );
    }
}

#[test]
fn synthetic_trace_flags_conflict_with_a_trace_file() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/traces/small.jsonl"
    );
    let (code, _, stderr) = kvvm(&["simulate", "--trace", trace, "--requests", "5"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("--requests"), "{stderr}");
}

#[test]
fn every_size_flag_takes_units() {
    let (code, stdout, stderr) = kvvm(&[
        "simulate",
        "--backend",
        "sim",
        "--budget-bytes",
        "8GiB",
        "--requests",
        "20",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["budget_bytes"], 8u64 << 30);
    let (code, stdout, stderr) = kvvm(&[
        "plan",
        "--model",
        "llama-3-8b",
        "--granule",
        "64KiB",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["granule"], 65536);
    assert_eq!(v["max_tokens"], 32768);
    let (code, stdout, stderr) = kvvm(&["plan", "--model", "llama-3-8b", "--granule", "65536"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("granule 64 KiB"), "{stdout}");
}

#[test]
fn help_lists_every_bench_and_defaults_in_units() {
    let (code, stdout, _) = kvvm(&["bench", "--help"]);
    assert_eq!(code, 0);
    // The summary line names every benchmark the subcommand list holds.
    let summary = stdout.lines().next().unwrap_or_default();
    for name in ["vmm", "kv", "decode", "host", "tp"] {
        assert!(
            stdout.contains(&format!("\n  {name} ")),
            "{name} missing from the list: {stdout}"
        );
        assert!(summary.contains(&format!("`{name}`")), "{name}: {summary}");
    }
    let (code, stdout, _) = kvvm(&["--help"]);
    assert_eq!(code, 0);
    assert!(stdout.contains("`tp`"), "{stdout}");
    let (code, stdout, _) = kvvm(&["serve", "--help"]);
    assert_eq!(code, 0);
    assert!(stdout.contains("[default: 64TiB]"), "{stdout}");
    assert!(!stdout.contains("70368744177664"), "{stdout}");
}
