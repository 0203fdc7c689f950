//! `kvvm conformance` as CI uses it: JUnit XML, `--require-pass`, checked `--device` and
//! `--case`, one line for a skip reason many cases share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

/// Runs `kvvm` with `args` and the environment variables `env`: (exit code, stdout, stderr).
fn kvvm_with(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvvm"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run kvvm");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn kvvm(args: &[&str]) -> (i32, String, String) {
    kvvm_with(args, &[])
}

fn temp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvvm-conf-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn junit_has_one_testcase_per_case_with_the_json_counts() {
    let xml = temp("sim.xml");
    let (code, stdout, stderr) = kvvm(&[
        "conformance",
        "--backend",
        "sim",
        "--json",
        "--junit",
        xml.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let text = std::fs::read_to_string(&xml).unwrap();
    let cases = v["cases"].as_array().unwrap().len();
    assert_eq!(text.matches("<testcase ").count(), cases);
    assert!(text.contains(&format!("tests=\"{cases}\"")), "{text}");
    assert!(
        text.contains(&format!("skipped=\"{}\"", v["skipped"])),
        "{text}"
    );
    assert!(text.contains("failures=\"0\""));
    assert_eq!(
        text.matches("<skipped ").count() as u64,
        v["skipped"].as_u64().unwrap()
    );
    let _ = std::fs::remove_file(&xml);
}

#[test]
fn a_device_the_backend_lacks_is_one_clear_error() {
    let (code, stdout, stderr) = kvvm(&["conformance", "--backend", "sim", "--device", "5"]);
    assert_eq!(code, 2);
    assert!(stdout.is_empty(), "{stdout}");
    assert_eq!(
        stderr.trim(),
        "kvvm: --device 5: backend sim has 1 device (0)"
    );
}

#[test]
fn a_case_filter_that_selects_nothing_is_an_error() {
    let (code, stdout, stderr) = kvvm(&["conformance", "--case", "nosuchcase"]);
    assert_eq!(code, 2);
    assert!(stdout.is_empty());
    assert!(
        stderr.contains("--case \"nosuchcase\" matches no case"),
        "{stderr}"
    );
    let (code, stdout, _) = kvvm(&["conformance", "--case", "granularity", "--json"]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert!(v["cases"].as_array().unwrap().len() >= 2);
}

#[test]
fn require_pass_fails_when_everything_was_skipped() {
    for backend in ["cuda", "hip"] {
        let (_, stdout, _) = kvvm(&["conformance", "--backend", backend, "--json"]);
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        if v["device"] != "none" {
            println!("skipped: {backend} is available here");
            continue;
        }
        let (code, stdout, stderr) = kvvm(&["conformance", "--backend", backend]);
        assert_eq!(code, 0, "{stderr}");
        // One line for the shared reason, not one per case; the summary is the last line.
        assert_eq!(stdout.matches("is unavailable").count(), 1, "{stdout}");
        let cases = v["cases"].as_array().map_or(0, Vec::len);
        assert!(cases >= 40, "{cases} cases");
        assert!(
            stdout
                .trim_end()
                .ends_with(&format!("0 passed, 0 failed, {cases} skipped")),
            "{stdout}"
        );
        assert!(stderr.contains("nothing was tested"), "{stderr}");
        let (code, _, stderr) = kvvm(&["conformance", "--backend", backend, "--require-pass"]);
        assert_eq!(code, 1, "{stderr}");
        assert!(stderr.contains("--require-pass"), "{stderr}");
    }
    let (code, _, stderr) = kvvm(&["conformance", "--backend", "sim", "--require-pass"]);
    assert_eq!(code, 0, "{stderr}");
}

/// `kvvm conformance --backend sim` over `KVVM_SIM_DEVICES` simulated devices.
fn sim_devices(devices: &str, args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["conformance", "--backend", "sim"];
    all.extend_from_slice(args);
    kvvm_with(&all, &[("KVVM_SIM_DEVICES", devices)])
}

#[test]
fn the_peer_cases_run_on_each_of_two_simulated_devices() {
    for device in ["0", "1"] {
        let (code, stdout, stderr) = sim_devices("2", &["--device", device, "--json"]);
        assert_eq!(code, 0, "{stderr}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(v["failed"], 0, "{stdout}");
        assert_eq!(v["skipped"], 0, "{stdout}");
        let peers: Vec<_> = v["cases"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["name"].as_str().unwrap().starts_with("peer_"))
            .collect();
        assert_eq!(peers.len(), 4, "{stdout}");
        assert!(peers.iter().all(|c| c["status"] == "pass"), "{peers:?}");
    }
    // A count outside 1..=8 leaves the backend unavailable, with the reason (every case is
    // skipped, so --require-pass fails), never guessed.
    for bad in ["0", "9", "two"] {
        let (code, stdout, stderr) = sim_devices(bad, &["--require-pass"]);
        assert_ne!(code, 0, "KVVM_SIM_DEVICES={bad}");
        assert!(
            format!("{stdout}{stderr}").contains("KVVM_SIM_DEVICES"),
            "{stdout}{stderr}"
        );
    }
}

#[test]
fn auto_without_a_gpu_opens_as_many_simulated_devices_as_sim() {
    let (code, stdout, stderr) = kvvm_with(
        &["info", "--backend", "auto", "--json"],
        &[("KVVM_SIM_DEVICES", "2")],
    );
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let report = &v.as_array().unwrap()[0];
    if report["backend"] != "sim" {
        eprintln!("skipped: auto opened {} (a GPU backend)", report["backend"]);
        return;
    }
    assert_eq!(report["devices"].as_array().unwrap().len(), 2, "{stdout}");
}
