//! The whole suite against the simulated driver, at several granularities, and proof that the
//! suite fails on a simulator with wrong semantics.

use kvvm_conformance::{run_suite, Report, RunOptions, Status};
use kvvm_hal::decorate::Forward;
use kvvm_hal::{BackendResult, DeviceAddress, VirtualMemoryBackend};
use kvvm_sim::{SimBackend, SimConfig, SimQuirks, GIB, MIB};

const KIB: u64 = 1024;

/// The cases that need a second device and are therefore skipped on a one-device simulator.
/// (The simulator launches probe kernels, so the kernel cases run, in process: its faults
/// are recoverable.)
const PEER_CASES: [&str; 4] = [
    "peer_access_is_reported_consistently",
    "peer_reads_through_a_shared_mapping",
    "peer_writes_through_read_write_access",
    "peer_store_through_read_access_faults",
];

fn run(config: SimConfig) -> Report {
    let sim = SimBackend::new(config);
    let report = run_suite(&sim, &RunOptions::default());
    assert!(
        sim.ledger().is_empty(),
        "the suite left resources behind: {:?}",
        sim.ledger()
    );
    report
}

fn assert_clean(report: &Report) {
    assert!(
        report.cases.len() >= 30,
        "only {} cases",
        report.cases.len()
    );
    for c in &report.cases {
        let expected = if PEER_CASES.contains(&c.name.as_str()) {
            Status::Skip
        } else {
            Status::Pass
        };
        assert_eq!(c.status, expected, "{}: {:?}", c.name, c.reason);
        if c.status == Status::Skip {
            assert!(c.reason.as_deref().is_some_and(|r| !r.is_empty()));
        }
    }
    assert_eq!(report.failed, 0);
}

#[test]
fn suite_passes_at_4_kib() {
    assert_clean(&run(SimConfig::single(4 * KIB, 64 * MIB)));
}

#[test]
fn suite_passes_at_64_kib() {
    assert_clean(&run(SimConfig::single(64 * KIB, 256 * MIB)));
}

#[test]
fn suite_passes_at_2_mib_h200() {
    assert_clean(&run(SimConfig::default()));
}

#[test]
fn suite_passes_at_512_mib() {
    assert_clean(&run(SimConfig::single(512 * MIB, 16 * GIB)));
}

#[test]
fn suite_passes_on_a_second_device() {
    let sim = SimBackend::new(SimConfig::uniform(2, 2 * MIB, GIB));
    let options = RunOptions {
        device: kvvm_hal::DeviceId(1),
        ..RunOptions::default()
    };
    let report = run_suite(&sim, &options);
    assert_eq!(report.failed, 0, "{}", report.to_table());
    assert!(sim.ledger().is_empty());
}

fn failing(quirks: SimQuirks) -> Vec<String> {
    let report = run(SimConfig::single(64 * KIB, 256 * MIB).with_quirks(quirks));
    report
        .cases
        .iter()
        .filter(|c| c.status == Status::Fail)
        .map(|c| c.name.clone())
        .collect()
}

#[test]
fn suite_fails_when_release_frees_mapped_memory() {
    let failed = failing(SimQuirks {
        release_frees_mapped: true,
        ..SimQuirks::default()
    });
    assert!(
        failed.contains(&"release_while_mapped_defers_free".to_owned()),
        "{failed:?}"
    );
}

#[test]
fn suite_fails_when_double_unmap_is_reported() {
    let failed = failing(SimQuirks {
        report_double_unmap: true,
        ..SimQuirks::default()
    });
    assert!(
        failed.contains(&"unmap_twice_is_not_reported".to_owned()),
        "{failed:?}"
    );
}

#[test]
fn suite_fails_when_read_only_is_not_enforced() {
    let failed = failing(SimQuirks {
        ignore_read_only: true,
        ..SimQuirks::default()
    });
    for case in [
        "read_alias_refuses_writes",
        "kernel_store_through_read_alias_faults",
    ] {
        assert!(failed.contains(&case.to_owned()), "{case}: {failed:?}");
    }
    // With a second device, the peer's store through its Read access completes too.
    let sim = SimBackend::new(
        SimConfig::uniform(2, 64 * KIB, 256 * MIB).with_quirks(SimQuirks {
            ignore_read_only: true,
            ..SimQuirks::default()
        }),
    );
    let report = run_suite(&sim, &RunOptions::default());
    let c = report
        .case("peer_store_through_read_access_faults")
        .unwrap();
    assert_eq!(c.status, Status::Fail, "{:?}", c.reason);
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
}

#[test]
fn multi_unmap_quirk_is_skipped_not_failed() {
    // A backend that declares it cannot unmap several mappings at once skips that case.
    let sim = SimBackend::new(
        SimConfig::single(64 * KIB, 256 * MIB).with_quirks(SimQuirks {
            multi_unmap_breaks_free: true,
            ..SimQuirks::default()
        }),
    );
    let report = run_suite(&sim, &RunOptions::default());
    let case = report.case("unmap_spanning_mappings").unwrap();
    assert_eq!(case.status, Status::Skip);
    assert_eq!(report.failed, 0, "{}", report.to_table());
}

#[test]
fn filter_selects_cases() {
    let sim = SimBackend::new(SimConfig::single(64 * KIB, 256 * MIB));
    let options = RunOptions {
        filter: vec!["read_alias".into()],
        ..RunOptions::default()
    };
    let report = run_suite(&sim, &options);
    assert!(report.cases.len() >= 3);
    assert!(report.cases.iter().all(|c| c.name.contains("read_alias")));
}

#[test]
fn unavailable_backend_skips_every_case() {
    let report = kvvm_conformance::unavailable_report("cuda", "no CUDA driver");
    assert_eq!(report.skipped as usize, report.cases.len());
    assert_eq!(report.failed, 0);
    assert!(report
        .cases
        .iter()
        .all(|c| c.reason.as_deref() == Some("no CUDA driver")));
}

#[test]
fn peer_cases_pass_on_several_devices_and_skip_without_links() {
    use kvvm_hal::DeviceId;
    use kvvm_sim::PeerLinks;
    for devices in [2u32, 4, 8] {
        for d in 0..devices {
            let sim = SimBackend::new(SimConfig::uniform(devices, 64 * KIB, 256 * MIB));
            let options = RunOptions {
                device: DeviceId(d),
                ..RunOptions::default()
            };
            let report = run_suite(&sim, &options);
            assert_eq!(
                report.failed,
                0,
                "{devices} devices, device {d}: {}",
                report.to_table()
            );
            for name in PEER_CASES {
                let c = report.case(name).unwrap();
                assert_eq!(c.status, Status::Pass, "{name}: {:?}", c.reason);
            }
            assert!(sim.ledger().is_empty());
        }
    }
    let lonely =
        SimBackend::new(SimConfig::uniform(2, 64 * KIB, 256 * MIB).with_peers(PeerLinks::None));
    let report = run_suite(&lonely, &RunOptions::default());
    assert_eq!(report.failed, 0, "{}", report.to_table());
    for name in &PEER_CASES[1..] {
        let c = report.case(name).unwrap();
        assert_eq!(c.status, Status::Skip, "{name}");
        assert!(c
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("no peer access")));
    }
}

/// A simulator whose first `taken` hinted reservations find their address just taken, as by
/// another thread of the process mapping into a range the caller has just freed: the
/// neighbour reserves the hinted range first and gives it back after the caller's reserve.
struct Neighbour {
    sim: SimBackend,
    taken: std::sync::atomic::AtomicUsize,
}

impl Forward for Neighbour {
    fn inner(&self) -> &dyn VirtualMemoryBackend {
        &self.sim
    }

    fn reserve(
        &self,
        size: u64,
        alignment: u64,
        fixed_address: Option<DeviceAddress>,
    ) -> BackendResult<DeviceAddress> {
        use std::sync::atomic::Ordering;
        let steal = fixed_address.is_some()
            && self
                .taken
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        let stolen = match fixed_address {
            Some(hint) if steal => Some(self.sim.reserve(size, 0, Some(hint))?),
            _ => None,
        };
        let got = self.sim.reserve(size, alignment, fixed_address);
        if let Some(s) = stolen {
            self.sim.free(s, size)?;
        }
        got
    }
}

fn hint_case(taken: usize) -> (Status, String) {
    let neighbour = Neighbour {
        sim: SimBackend::new(SimConfig::single(64 * KIB, 256 * MIB)),
        taken: taken.into(),
    };
    let options = RunOptions {
        filter: vec!["reserve_fixed_address_hint".into()],
        ..RunOptions::default()
    };
    let report = run_suite(&neighbour, &options);
    assert!(
        neighbour.sim.ledger().is_empty(),
        "{:?}",
        neighbour.sim.ledger()
    );
    assert_eq!(report.cases.len(), 1, "{:?}", report.cases);
    let case = &report.cases[0];
    (case.status, case.reason.clone().unwrap_or_default())
}

#[test]
fn a_hinted_address_taken_by_a_neighbour_is_tried_afresh_and_one_always_taken_fails() {
    assert_eq!(hint_case(0).0, Status::Pass);
    assert_eq!(
        hint_case(1).0,
        Status::Pass,
        "the next free address is honoured"
    );
    assert_eq!(hint_case(3).0, Status::Pass);
    let (status, reason) = hint_case(usize::MAX);
    assert_eq!(status, Status::Fail, "{reason}");
    assert_eq!(
        reason.matches("asked for the free address").count(),
        4,
        "{reason}"
    );
}
