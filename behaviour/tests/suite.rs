//! The behaviour suite on the CPU backends, with every single and double fault: 0 failures.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kvvm_behaviour::{run_behaviour, BehaviourOptions, FaultDepth};
use kvvm_hal::VirtualMemoryBackend;
use kvvm_sim::{SimBackend, SimConfig, SimQuirks};

fn run(backend: Arc<dyn VirtualMemoryBackend>) {
    let report = run_behaviour(&backend, &BehaviourOptions::default());
    print!("{}", report.to_table());
    assert_eq!(report.report.failed, 0, "{}", report.to_table());
    assert_eq!(report.report.skipped, 0);
    assert!(report.faults.len() >= 20, "every fault scenario ran");
    assert!(
        report.faults.iter().all(|f| f.stats.steps > 0),
        "{:?}",
        report.faults
    );
    assert_eq!(report.depth, FaultDepth::Pairs);
    assert!(report.fault_runs > 100 && report.faults_fired > report.fault_runs);
    assert_eq!(report.driver_free_before, report.driver_free_after);
}

#[test]
fn sim_passes_with_every_pair_of_faults() {
    run(Arc::new(SimBackend::new(SimConfig::single(
        64 << 10,
        64 << 20,
    ))));
}

#[test]
fn sim_with_one_unmap_per_mapping_passes_with_every_pair_of_faults() {
    let config = SimConfig::single(64 << 10, 64 << 20).with_quirks(SimQuirks {
        multi_unmap_breaks_free: true,
        ..SimQuirks::default()
    });
    run(Arc::new(SimBackend::new(config)));
}

/// The host tier's scenarios on the simulator and the host backend: every step of the tier
/// (pinned memory, copies, events) fails alone and in pairs, the books on both sides stay
/// exact, no swap loses a byte, nothing is left after each run.
#[test]
fn the_host_tier_passes_with_every_pair_of_faults() {
    let host =
        kvvm_host::HostBackend::with_config(kvvm_host::HostConfig::default().capacity(64 << 20));
    let mut backends: Vec<Arc<dyn VirtualMemoryBackend>> = vec![Arc::new(SimBackend::new(
        SimConfig::single(64 << 10, 64 << 20),
    ))];
    match host {
        Ok(h) => backends.push(Arc::new(h)),
        Err(e) => println!("skipped: no host backend here ({e})"),
    }
    for backend in backends {
        let options = BehaviourOptions {
            filter: vec!["fault_tier_".to_owned()],
            ..BehaviourOptions::default()
        };
        let report = run_behaviour(&backend, &options);
        print!("{}", report.to_table());
        assert_eq!(report.report.failed, 0, "{}", report.to_table());
        assert_eq!(report.faults.len(), 9, "{:?}", report.faults);
        for f in &report.faults {
            // Every scenario has tier steps to fail, and pairs of them.
            println!("{f:?}");
            assert!(f.stats.steps >= 2, "{f:?}");
            assert!(f.stats.runs > f.stats.steps, "{f:?}");
        }
    }
}
