//! Several devices in one process, on the simulator with 2, 4 and 8 devices: the behaviour
//! suite on every device, peer access as the topology allows, and the tensor-parallel commit
//! with every single and every ordered pair of faults (each rank's books equal the driver's).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::sync::Arc;

use kvvm_behaviour::{run_behaviour, BehaviourOptions, FaultDepth};
use kvvm_governor::{Governor, GovernorConfig};
use kvvm_hal::decorate::{FaultInjecting, Recording};
use kvvm_hal::{Access, AccessDescriptor, DeviceId, VirtualMemoryBackend};
use kvvm_kv::{KvDtype, KvGeometry, KvLayout, LayoutPlan, SequenceKv, TensorParallelSequence};
use kvvm_sim::{PeerLinks, SimBackend, SimConfig};
use kvvm_vmm::{GranularityChoice, VirtualMemory, VmmConfig, VmmError};

const G: u64 = 64 << 10;

fn sim(devices: u32, peers: PeerLinks) -> Arc<SimBackend> {
    Arc::new(SimBackend::new(
        SimConfig::uniform(devices, G, 64 << 20).with_peers(peers),
    ))
}

#[test]
fn the_behaviour_suite_passes_on_every_device() {
    for n in [2u32, 4, 8] {
        let backend: Arc<dyn VirtualMemoryBackend> = sim(n, PeerLinks::AllToAll);
        for d in 0..n {
            let options = BehaviourOptions {
                device: DeviceId(d),
                depth: if d == n - 1 {
                    FaultDepth::Pairs
                } else {
                    FaultDepth::Single
                },
                ..BehaviourOptions::default()
            };
            let report = run_behaviour(&backend, &options);
            assert_eq!(
                report.report.failed,
                0,
                "{n} devices, device {d}: {}",
                report.to_table()
            );
            assert!(report.faults_fired > 0);
        }
    }
}

fn manager(
    backend: &Arc<dyn VirtualMemoryBackend>,
    gov: &Governor,
    d: u32,
    peers: &[u32],
) -> Result<VirtualMemory, VmmError> {
    let mut access = vec![AccessDescriptor::read_write(DeviceId(d))];
    access.extend(peers.iter().map(|&p| AccessDescriptor {
        device: DeviceId(p),
        access: Access::Read,
    }));
    // No parking: a commit here always reaches the driver (the suite covers parking).
    let mut config = VmmConfig::default()
        .granularity(GranularityChoice::Minimum)
        .pool_cap_bytes(4 * G)
        .park_released(false);
    config.access = access;
    VirtualMemory::new(Arc::clone(backend), DeviceId(d), gov.clone(), config)
}

#[test]
fn peer_access_follows_the_topology() {
    // Pairs (0,1) and (2,3): device 0's memory may be read from 1, not from 2.
    let s = sim(4, PeerLinks::Pairs(vec![(0, 1), (2, 3)]));
    let backend: Arc<dyn VirtualMemoryBackend> = s.clone();
    assert!(backend.can_access_peer(DeviceId(0), DeviceId(1)).unwrap());
    assert!(!backend.can_access_peer(DeviceId(0), DeviceId(2)).unwrap());
    let gov = Governor::unlimited();
    let vm = manager(&backend, &gov, 0, &[1]).unwrap();
    let mut r = vm.reserve(4 * G).unwrap();
    r.commit(2 * G).unwrap();
    let m = s.ledger();
    let mapping = m
        .mappings
        .iter()
        .find(|x| x.address == r.address())
        .unwrap();
    assert_eq!(mapping.access[1].access, Access::Read, "{mapping:?}");
    drop(r);
    let refused = manager(&backend, &gov, 0, &[2]).unwrap_err();
    assert!(
        matches!(refused, VmmError::InvalidArgument { .. }),
        "{refused}"
    );
    drop(vm);
    assert!(s.ledger().is_empty());
    // With no links at all, the driver itself refuses a peer descriptor.
    let lonely = sim(2, PeerLinks::None);
    let err = manager(
        &(lonely.clone() as Arc<dyn VirtualMemoryBackend>),
        &gov,
        0,
        &[1],
    )
    .unwrap_err();
    assert!(matches!(err, VmmError::InvalidArgument { .. }));
}

#[test]
fn teardown_synchronizes_every_device_given_access_before_it_unmaps() {
    use kvvm_hal::{ErrorKind, Operation};
    use kvvm_sim::FaultRule;
    let s = sim(2, PeerLinks::AllToAll);
    let backend: Arc<dyn VirtualMemoryBackend> = s.clone();
    let gov = Governor::unlimited();
    // Device 0's memory, readable from device 1: a clean teardown synchronizes both.
    let vm = manager(&backend, &gov, 0, &[1]).unwrap();
    let mut r = vm.reserve(4 * G).unwrap();
    r.commit(2 * G).unwrap();
    let before = s.calls(Operation::Synchronize);
    drop(r);
    assert_eq!(s.calls(Operation::Synchronize) - before, 2);
    assert!(vm.quarantine().is_empty());
    // The second synchronize (device 1's) fails: the memory cannot be proven idle, so
    // nothing is unmapped, released or freed; it is quarantined whole.
    let mut r = vm.reserve(4 * G).unwrap();
    r.commit(2 * G).unwrap();
    let address = r.address();
    s.inject(FaultRule::nth(
        Operation::Synchronize,
        2,
        ErrorKind::DeviceLost,
    ));
    drop(r);
    assert_eq!(vm.quarantined_bytes(), 2 * G);
    let ledger = s.ledger();
    assert!(
        ledger.mappings.iter().any(|m| m.address == address),
        "unmapped after a failed synchronize: {ledger:?}"
    );
    assert_eq!(gov.snapshot().quarantined(), 2 * G);
    // Without a peer, one synchronize.
    let alone = manager(&backend, &gov, 1, &[]).unwrap();
    let mut r = alone.reserve(G).unwrap();
    r.commit(G).unwrap();
    let before = s.calls(Operation::Synchronize);
    drop(r);
    assert_eq!(s.calls(Operation::Synchronize) - before, 1);
}

/// 1 layer x 2 KV heads x 64 dims fp16 per rank, token-major: 512 B a token, 128 a window.
fn plan() -> LayoutPlan {
    let geometry = KvGeometry::with_dtype(1, 2, 64, KvDtype::F16, 512).unwrap();
    LayoutPlan::new(geometry, KvLayout::TokenMajor, G).unwrap()
}

struct Group {
    recording: Arc<Recording>,
    faults: Arc<FaultInjecting>,
    gov: Governor,
    vms: Vec<VirtualMemory>,
    tp: TensorParallelSequence,
}

fn group(base: &Arc<SimBackend>, n: u32) -> Group {
    group_with(base, n, |_| 16)
}

fn group_with(base: &Arc<SimBackend>, n: u32, budget_windows: impl Fn(u32) -> u64) -> Group {
    let faults = Arc::new(FaultInjecting::new(base.clone()));
    let recording = Arc::new(Recording::new(faults.clone()));
    let backend: Arc<dyn VirtualMemoryBackend> = recording.clone();
    let mut config = GovernorConfig::default();
    for d in 0..n {
        config = config.device_budget(DeviceId(d), budget_windows(d) * G);
    }
    let gov = Governor::new(config);
    let vms: Vec<VirtualMemory> = (0..n)
        .map(|d| manager(&backend, &gov, d, &[]).unwrap())
        .collect();
    let p = plan();
    let ranks = vms
        .iter()
        .map(|vm| {
            let mut s = SequenceKv::new(vm, &p, 512).unwrap();
            s.ensure_tokens(100).unwrap();
            s
        })
        .collect();
    let tp = TensorParallelSequence::new(ranks)
        .unwrap()
        .with_parallel(false);
    Group {
        recording,
        faults,
        gov,
        vms,
        tp,
    }
}

/// Every rank: the same committed count, its windows mapped; per device, the governor's used
/// bytes equal the driver's live bytes there; no driver rule broken.
fn check(g: &Group, expect_tokens: u64) {
    let rec = g.recording.record();
    assert!(rec.anomalies.is_empty(), "{:?}", rec.anomalies);
    for (i, r) in g.tp.ranks().iter().enumerate() {
        assert_eq!(r.committed_tokens(), expect_tokens, "rank {i}");
        for w in r
            .plan()
            .windows_for_tokens(expect_tokens)
            .unwrap()
            .into_iter()
            .flatten()
        {
            assert!(r.reservation().is_mapped(w * G), "rank {i} window {w}");
        }
        let d = r.vm().device();
        let snap = g.gov.snapshot().device(d);
        assert_eq!(snap.pending, 0);
        assert_eq!(
            snap.used(),
            rec.live_bytes_on(d),
            "rank {i} on {d}: {snap:?}"
        );
        assert_eq!(r.vm().accounting_errors(), 0);
    }
    let ours: BTreeSet<u64> =
        g.tp.ranks()
            .iter()
            .flat_map(|r| r.reservation().mappings())
            .chain(
                g.vms
                    .iter()
                    .flat_map(|vm| vm.quarantine())
                    .flat_map(|q| q.mappings),
            )
            .map(|b| b.address.0)
            .collect();
    let theirs: BTreeSet<u64> = rec.mappings.iter().map(|m| m.address.0).collect();
    assert_eq!(ours, theirs, "mappings");
}

/// Drops the group, gives back what injected faults quarantined, and checks nothing is left.
fn finish(g: Group) {
    let Group {
        recording,
        vms,
        tp,
        gov,
        ..
    } = g;
    drop(tp);
    let quarantine: Vec<_> = vms.iter().flat_map(|vm| vm.quarantine()).collect();
    drop(vms);
    let q_bytes: u64 = quarantine.iter().map(|q| q.bytes).sum();
    assert_eq!(gov.snapshot().used(), q_bytes);
    let mut handles = BTreeSet::new();
    for q in &quarantine {
        for b in &q.mappings {
            recording.unmap(b.address, b.size).unwrap();
            handles.insert(b.handle);
        }
        handles.extend(q.handles.iter().copied());
    }
    for h in handles {
        recording.release(h).unwrap();
    }
    for q in &quarantine {
        if let Some((a, s)) = q.range {
            recording.free(a, s).unwrap();
        }
    }
    let rec = recording.record();
    assert!(rec.is_empty(), "{rec:?}");
}

#[test]
fn the_tensor_parallel_commit_is_all_or_nothing_under_every_pair_of_faults() {
    for n in [2u32, 4, 8] {
        let base = sim(n, PeerLinks::AllToAll);
        // No fault: count the steps, and every rank grows.
        let mut g = group(&base, n);
        g.faults.arm(&FaultInjecting::STEPS, &[]);
        let bytes = g.tp.ensure_tokens(300).unwrap();
        let steps = g.faults.counted();
        g.faults.disarm();
        assert_eq!(bytes, u64::from(n) * 2 * G, "one window more per rank");
        check(&g, 300);
        finish(g);
        let mut runs = 0u64;
        for i in 1..=steps {
            let mut g = group(&base, n);
            g.faults.arm(&FaultInjecting::STEPS, &[i]);
            let r = g.tp.ensure_tokens(300);
            let steps_i = g.faults.counted();
            g.faults.disarm();
            check(&g, if r.is_ok() { 300 } else { 100 });
            finish(g);
            runs += 1;
            for j in i + 1..=steps_i {
                let mut g = group(&base, n);
                g.faults.arm(&FaultInjecting::STEPS, &[i, j]);
                let r = g.tp.ensure_tokens(300);
                g.faults.disarm();
                check(&g, if r.is_ok() { 300 } else { 100 });
                finish(g);
                runs += 1;
            }
        }
        assert!(
            runs >= steps,
            "{n} ranks: {runs} fault runs over {steps} steps"
        );
        assert!(base.ledger().is_empty(), "{n} ranks: {:?}", base.ledger());
    }
}

#[test]
fn the_ranks_commit_in_parallel_and_release_together() {
    let base = sim(4, PeerLinks::AllToAll);
    // Device 3 may hold 3 windows and another reservation there holds one: growing to 300
    // tokens (3 windows a rank) does not fit there now (backpressure), and growing to 400
    // never does (a rank would hold 4 windows).
    let g = group_with(&base, 4, |d| if d == 3 { 3 } else { 16 });
    let Group { vms, tp, gov, .. } = g;
    let mut tp = TensorParallelSequence::new(tp.into_ranks()).unwrap();
    let mut outside = vms[3].reserve(G).unwrap();
    outside.commit(G).unwrap();
    let err = tp.ensure_tokens(300).unwrap_err();
    assert!(err.backpressure().is_some(), "{err}");
    assert_eq!(tp.committed_tokens(), 100);
    let err = tp.ensure_tokens(400).unwrap_err();
    assert!(err.never_fits().is_some(), "{err}");
    assert_eq!(tp.committed_tokens(), 100);
    drop(outside);
    for d in 0..4 {
        assert_eq!(
            gov.snapshot().device(DeviceId(d)).committed,
            G,
            "device {d} rolled back"
        );
    }
    // Within every budget: all ranks grow, on one thread each.
    assert_eq!(tp.ensure_tokens(300).unwrap(), 4 * 2 * G);
    assert!(tp.ranks().iter().all(|r| r.committed_tokens() == 300));
    assert!(tp.release().unwrap() > 0);
    assert_eq!(tp.committed_tokens(), 0);
    drop(tp);
    drop(vms);
    assert!(base.ledger().is_empty());
}

/// The background pre-committer of a group: the worker grows every rank ahead in one
/// transaction; at every `Ready` the window of the last token is mapped on every rank, while
/// another thread keeps giving the headroom back; a worker whose commits fail rolls back on
/// every rank and the decode path commits inline.
#[test]
fn the_group_pre_committer_is_ready_only_over_mapped_windows() {
    use kvvm_kv::precommit::Ensured;
    use kvvm_kv::PrecommittedGroup;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    let base = sim(2, PeerLinks::AllToAll);
    let g = group(&base, 2);
    let Group {
        recording,
        faults,
        vms,
        tp,
        gov,
    } = g;
    let pre = Arc::new(PrecommittedGroup::start(tp, 64, Duration::from_micros(100)).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let (p2, stop2) = (Arc::clone(&pre), Arc::clone(&stop));
    let shrinker = std::thread::spawn(move || {
        while !stop2.load(Ordering::Relaxed) {
            let _ = p2.shrink_to_live();
            std::thread::yield_now();
        }
    });
    let bases: Vec<u64> = pre.with_ranks(|r| r.iter().map(|s| s.address().0).collect());
    let mut readies = 0u64;
    for round in 0..10 {
        for n in (101..=512u64).step_by(7) {
            std::thread::sleep(Duration::from_micros(50));
            if let Ok(Ensured::Ready) = pre.ensure_tokens(n) {
                readies += 1;
                let window = (n - 1) * 512 / G * G;
                let rec = recording.record();
                for b in &bases {
                    assert!(
                        rec.mappings.iter().any(|m| m.address.0 <= b + window && b + window < m.address.0 + m.size),
                        "round {round}: Ready for {n} tokens over an unmapped window"
                    );
                }
            }
        }
        pre.release().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    shrinker.join().unwrap();
    // How often the worker got ahead above depends on the schedule (the shrinker gives the
    // headroom back as fast as it can). With the shrinker stopped it gets ahead by
    // construction: a background commit and a Ready over mapped windows, whatever the
    // schedule was.
    pre.ensure_tokens(101).unwrap();
    pre.wait_idle();
    assert_eq!(pre.ensure_tokens(102).unwrap(), Ensured::Ready);
    readies += 1;
    let window = 101 * 512 / G * G;
    let rec = recording.record();
    for b in &bases {
        assert!(rec
            .mappings
            .iter()
            .any(|m| m.address.0 <= b + window && b + window < m.address.0 + m.size));
    }
    assert!(readies > 0);
    assert!(pre.stats().background_commits > 0, "{:?}", pre.stats());
    let pre = Arc::try_unwrap(pre).unwrap();
    let mut tp = pre.stop();
    // With the worker stopped: a parallel transaction whose maps all fail rolls back on both
    // ranks.
    let before = tp.committed_tokens();
    faults.arm(
        &[kvvm_hal::Operation::Map],
        &(1..=256).collect::<Vec<u64>>(),
    );
    let r = tp.ensure_tokens(512);
    let fired = faults.disarm();
    assert!(
        r.is_err() && !fired.is_empty(),
        "{r:?} {fired:?} before {before}"
    );
    assert_eq!(tp.committed_tokens(), before);
    let rec = recording.record();
    assert!(rec.anomalies.is_empty(), "{:?}", rec.anomalies);
    for d in 0..2 {
        assert_eq!(
            gov.snapshot().device(DeviceId(d)).used(),
            rec.live_bytes_on(DeviceId(d))
        );
    }
    tp.release().unwrap();
    drop(tp);
    drop(vms);
    assert!(base.ledger().is_empty());
}
