//! A proptest state machine over random sequences of reserve, commit, release, truncate,
//! drop, out-of-memory and injected faults against a simple reference model, and a
//! multi-threaded stress test that must end with an empty ledger.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::{Arc, Barrier};

use common::{World, WorldConfig, D0};
use kvvm_hal::{DeviceAddress, ErrorKind, Operation, VirtualMemoryBackend};
use kvvm_sim::{FaultRule, SimBackend, SimConfig, SimQuirks};
use kvvm_vmm::{Governor, Reservation, VirtualMemory, VmmConfig, VmmError};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Reserve {
        granules: u64,
    },
    Commit {
        idx: usize,
        granules: u64,
    },
    CommitWithGrant {
        idx: usize,
        granules: u64,
    },
    Release {
        idx: usize,
    },
    Truncate {
        idx: usize,
        granules: u64,
    },
    Drop {
        idx: usize,
    },
    Fault {
        op: Operation,
        nth: u64,
        kind: ErrorKind,
    },
    FailSynchronize,
    ClearFaults,
    TrimPool {
        keep: u64,
    },
}

fn fault_op() -> impl Strategy<Value = Operation> {
    prop::sample::select(vec![
        Operation::Reserve,
        Operation::Create,
        Operation::Map,
        Operation::SetAccess,
        Operation::Unmap,
        Operation::Release,
        Operation::Free,
    ])
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1u64..12).prop_map(|granules| Op::Reserve { granules }),
        6 => (0usize..4, 0u64..6).prop_map(|(idx, granules)| Op::Commit { idx, granules }),
        2 => (0usize..4, 1u64..4).prop_map(|(idx, granules)| Op::CommitWithGrant { idx, granules }),
        2 => (0usize..4).prop_map(|idx| Op::Release { idx }),
        2 => (0usize..4, 0u64..6).prop_map(|(idx, granules)| Op::Truncate { idx, granules }),
        2 => (0usize..4).prop_map(|idx| Op::Drop { idx }),
        3 => (fault_op(), 1u64..4, prop::sample::select(vec![ErrorKind::OutOfMemory, ErrorKind::Other, ErrorKind::DeviceLost]))
            .prop_map(|(op, nth, kind)| Op::Fault { op, nth, kind }),
        1 => Just(Op::FailSynchronize),
        1 => Just(Op::ClearFaults),
        1 => (0u64..4).prop_map(|keep| Op::TrimPool { keep }),
    ]
}

#[derive(Debug, Clone)]
struct Setup {
    granule: u64,
    capacity: u64,
    budget: Option<u64>,
    pool: u64,
    per_mapping_unmap: bool,
    park: bool,
    /// `VmmConfig::max_handle_bytes` in granules (1: one handle per window).
    max_handle: u64,
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        prop::sample::select(vec![4u64 << 10, 64 << 10, 2 << 20, 1 << 30]),
        4u64..24,
        prop::option::of(2u64..20),
        0u64..6,
        any::<bool>(),
        any::<bool>(),
        prop::sample::select(vec![1u64, 2, 8, 64]),
    )
        .prop_map(
            |(granule, capacity, budget, pool, per_mapping_unmap, park, max_handle)| Setup {
                granule,
                capacity,
                budget,
                pool,
                per_mapping_unmap,
                park,
                max_handle,
            },
        )
}

/// The reference model of one reservation.
struct Model {
    res: Reservation,
    base: DeviceAddress,
    size: u64,
    /// Committed bytes the model expects (exact unless an unmap may have failed).
    committed: u64,
}

fn run_case(s: &Setup, ops: &[Op]) {
    let mut c = WorldConfig::new(s.granule);
    c.capacity_granules = s.capacity;
    c.budget_granules = s.budget;
    c.pool_granules = s.pool;
    c.park = s.park;
    c.max_handle_granules = s.max_handle;
    c.quirks = SimQuirks {
        multi_unmap_breaks_free: s.per_mapping_unmap,
        ..SimQuirks::default()
    };
    let w = World::new(c);
    let g = w.g;
    let mut live: Vec<Model> = Vec::new();
    // Whether an unmap fault may still fire: then a failed commit may leave a block mapped and
    // a failed release may leave several.
    let mut unmap_fault_armed = false;
    for op in ops {
        match op {
            Op::Reserve { granules } => {
                if live.len() < 4 {
                    if let Ok(res) = w.vm.reserve(granules * g) {
                        assert_eq!(res.size(), granules * g);
                        let (base, size) = (res.address(), res.size());
                        live.push(Model {
                            res,
                            base,
                            size,
                            committed: 0,
                        });
                    }
                }
            }
            Op::Commit { idx, granules } | Op::CommitWithGrant { idx, granules } => {
                let n = live.len();
                if let Some(m) = live.get_mut(idx % n.max(1)) {
                    let end_before = m.res.committed_end();
                    let committed_before = m.res.committed_bytes();
                    // A commit fills holes below the committed end first, lowest first (a
                    // zero-byte commit does nothing and reports the committed end).
                    let first_free = (0..)
                        .take_while(|_| *granules > 0)
                        .map(|w| w * g)
                        .find(|&o| o >= end_before || !m.res.is_mapped(o))
                        .unwrap_or(end_before);
                    let result = match op {
                        Op::Commit { .. } => m.res.commit(granules * g),
                        _ => match w.vm.try_grant(granules * g) {
                            Ok(grant) => m.res.commit_with_grant(grant),
                            Err(e) => Err(e),
                        },
                    };
                    match result {
                        Ok(c) => {
                            assert_eq!(c.bytes, granules * g);
                            assert_eq!(c.address.0, m.base.0 + first_free);
                            m.committed += granules * g;
                        }
                        Err(VmmError::OutOfBounds { .. }) => {
                            assert!(committed_before + granules * g > m.size);
                        }
                        Err(_) => {}
                    }
                    if unmap_fault_armed {
                        assert!(m.res.committed_bytes() >= m.committed);
                        m.committed = m.res.committed_bytes();
                    }
                    assert_eq!(m.res.committed_bytes(), m.committed);
                }
            }
            Op::Release { idx } | Op::Truncate { idx, .. } => {
                let n = live.len();
                if let Some(m) = live.get_mut(idx % n.max(1)) {
                    let keep = match op {
                        Op::Truncate { granules, .. } => granules * g,
                        _ => 0,
                    };
                    // A mapping starting below `keep` stays whole (a multi-window handle that
                    // straddles `keep` included); every other one goes.
                    let kept_below: u64 = m
                        .res
                        .mappings()
                        .iter()
                        .filter(|b| b.address.0 - m.base.0 < keep)
                        .map(|b| b.size)
                        .sum();
                    let result = m.res.truncate(keep);
                    if result.is_ok() || !unmap_fault_armed {
                        // Every mapping starting at or past `keep` was unmapped (a release
                        // failure only quarantines the handle).
                        assert_eq!(m.res.committed_bytes(), kept_below, "{result:?}");
                    } else {
                        assert!(m.res.committed_bytes() >= kept_below);
                    }
                    m.committed = m.res.committed_bytes();
                }
            }
            Op::Drop { idx } => {
                let n = live.len();
                if n > 0 {
                    live.remove(idx % n);
                }
            }
            Op::Fault { op, nth, kind } => {
                if *op == Operation::Unmap {
                    unmap_fault_armed = true;
                }
                w.sim.inject(FaultRule::nth(*op, *nth, *kind));
            }
            Op::FailSynchronize => w.sim.inject(FaultRule::failing_synchronize()),
            Op::ClearFaults => {
                w.sim.clear_faults();
                unmap_fault_armed = false;
            }
            Op::TrimPool { keep } => {
                w.vm.trim_pool(keep * g);
            }
        }
        for m in &live {
            assert_eq!(m.res.address(), m.base, "invariant 5");
            // Every handle: a power-of-two number of windows, at most the maximum, aligned to
            // its size from the base.
            for b in m.res.mappings() {
                let (at, n) = ((b.address.0 - m.base.0) / g, b.size / g);
                assert!(
                    n.is_power_of_two() && n <= s.max_handle && at % n == 0,
                    "{b:?}"
                );
            }
        }
        let refs: Vec<&Reservation> = live.iter().map(|m| &m.res).collect();
        w.check(&refs);
        let snap = w.gov.snapshot().device(D0);
        if let Some(b) = s.budget {
            assert!(
                snap.used() <= b * g,
                "the governor never grants past the budget: {snap:?}"
            );
        }
    }
    // Teardown with no faults: only the quarantine may be left.
    w.sim.clear_faults();
    drop(live);
    w.vm.trim_pool(0);
    w.check(&[]);
    let q = w.vm.quarantine();
    let ledger = w.sim.ledger();
    if q.is_empty() {
        assert!(ledger.is_empty(), "{ledger:?}");
    }
    assert_eq!(ledger.total_physical_bytes(), w.vm.quarantined_bytes());
}

/// The run's configuration: seeded (the same cases on every run, so a failure is a fixed case
/// and not a flake; found failures are kept in `state_machine.proptest-regressions`), 1000
/// cases, or `KVVM_PROPTEST_CASES` cases and `KVVM_PROPTEST_SEED` as the seed when set (more
/// cases on demand).
fn config() -> ProptestConfig {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let cases = env("KVVM_PROPTEST_CASES").unwrap_or(1000);
    let seed = env("KVVM_PROPTEST_SEED").unwrap_or(0x6b76_766d_5eed);
    ProptestConfig {
        cases: u32::try_from(cases).unwrap_or(u32::MAX),
        rng_seed: proptest::test_runner::RngSeed::Fixed(seed),
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn random_operation_sequences_keep_the_invariants(
        s in setup(),
        ops in prop::collection::vec(op(), 1..24),
    ) {
        run_case(&s, &ops);
    }
}

// ---------------------------------------------------------------- stress

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

#[test]
fn stress_8_threads_x_10000_ops_end_empty() {
    stress_run(false);
}

#[test]
fn stress_8_threads_x_10000_ops_with_parking_end_empty() {
    stress_run(true);
}

/// 8 threads share one manager under a budget below the device's capacity. Every assertion
/// holds whatever the schedule: how many of the random phase's commits meet backpressure
/// depends on how the threads overlap (on two cores they may hardly overlap at all), so the
/// contention the test needs is made by construction first.
fn stress_run(park: bool) {
    const THREADS: u64 = 8;
    const OPS: u64 = 10_000;
    let g = 64 << 10;
    let sim = Arc::new(SimBackend::new(SimConfig::single(g, 512 * g).with_latency(
        kvvm_sim::LatencyModel::zero(),
        kvvm_sim::LatencyMode::Account,
    )));
    // The budget is below the device's capacity: both backpressure and pool eviction happen.
    let gov = Governor::with_device_budget(48 * g);
    let backend: Arc<dyn VirtualMemoryBackend> = sim.clone();
    let vm = VirtualMemory::new(
        backend,
        D0,
        gov.clone(),
        VmmConfig::default()
            .pool_cap_bytes(32 * g)
            .park_released(park),
    )
    .unwrap();
    let barrier = Arc::new(Barrier::new(THREADS as usize));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let vm = vm.clone();
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                // Designed contention. Every thread commits 4 granules (32 of the 48 in all)
                // and waits for the others; then each asks for 4 more while every thread
                // holds its first 4: 64 granules asked of 48, nothing pooled and nothing
                // released until the second barrier. Grants are decided under the governor's
                // lock, so exactly 4 of these 8 commits are granted and 4 refused, in any
                // order of the threads.
                let mut first = vm.reserve(16 * g).unwrap();
                first.commit(4 * g).unwrap();
                barrier.wait();
                let designed_refused = match first.commit(4 * g) {
                    Ok(_) => 0u64,
                    Err(VmmError::Backpressure(_)) => 1,
                    Err(e) => panic!("{e}"),
                };
                barrier.wait();
                drop(first);
                // The random phase: its outcomes depend on the schedule, its books do not.
                let mut rng = XorShift(0x9E37_79B9_7F4A_7C15 ^ (t + 1));
                let mut mine: Vec<Reservation> = Vec::new();
                let (mut ok, mut backpressure) = (0u64, 0u64);
                for _ in 0..OPS {
                    let r = rng.next();
                    let pick = (r >> 8) as usize;
                    match r % 8 {
                        0 if mine.len() < 4 => {
                            mine.push(vm.reserve((1 + (r >> 16) % 16) * g).unwrap())
                        }
                        0..=3 => {
                            if let Some(res) = {
                                let n = mine.len().max(1);
                                mine.get_mut(pick % n)
                            } {
                                match res.commit((1 + (r >> 16) % 4) * g) {
                                    Ok(_) => ok += 1,
                                    Err(VmmError::Backpressure(_)) => backpressure += 1,
                                    Err(VmmError::OutOfBounds { .. }) => {}
                                    Err(e) => panic!("{e}"),
                                }
                            }
                        }
                        4 | 5 => {
                            if let Some(res) = {
                                let n = mine.len().max(1);
                                mine.get_mut(pick % n)
                            } {
                                res.release().unwrap();
                            }
                        }
                        6 => {
                            if let Some(res) = {
                                let n = mine.len().max(1);
                                mine.get_mut(pick % n)
                            } {
                                res.truncate(((r >> 16) % 8) * g).unwrap();
                            }
                        }
                        _ => {
                            if !mine.is_empty() {
                                mine.swap_remove(pick % mine.len());
                            }
                        }
                    }
                }
                (designed_refused, ok, backpressure)
            })
        })
        .collect();
    let (mut designed_refused, mut ok, mut backpressure) = (0, 0, 0);
    for h in handles {
        let (d, o, b) = h.join().unwrap();
        designed_refused += d;
        ok += o;
        backpressure += b;
    }
    assert_eq!(designed_refused, 4, "64 granules asked of a budget of 48");
    eprintln!("random phase: {ok} commits, {backpressure} refused");
    assert_eq!(vm.accounting_errors(), 0);
    assert!(vm.quarantine().is_empty(), "{:?}", vm.quarantine());
    let snap = gov.snapshot().device(D0);
    assert_eq!(snap.pending, 0);
    assert_eq!(snap.committed, 0);
    assert_eq!(snap.used(), vm.pooled_bytes());
    assert_eq!(sim.ledger().total_physical_bytes(), vm.pooled_bytes());
    drop(vm);
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    assert_eq!(gov.snapshot().device(D0).used(), 0);
}

#[test]
fn stress_8_threads_x_10000_ops_with_random_faults_keeps_the_books() {
    const THREADS: u64 = 8;
    const OPS: u64 = 10_000;
    let g = 4 << 10;
    let sim = Arc::new(SimBackend::new(SimConfig::single(g, 256 * g).with_latency(
        kvvm_sim::LatencyModel::zero(),
        kvvm_sim::LatencyMode::Account,
    )));
    let gov = Governor::with_device_budget(96 * g);
    let backend: Arc<dyn VirtualMemoryBackend> = sim.clone();
    let vm = VirtualMemory::new(
        backend,
        D0,
        gov.clone(),
        VmmConfig::default().pool_cap_bytes(16 * g),
    )
    .unwrap();
    // The first map of the run fails, whichever thread makes it: at least one operation
    // fails whatever the schedule (the first grant asked cannot be refused, and its commit
    // fails at its create or at that map).
    sim.inject(FaultRule::nth(Operation::Map, 1, ErrorKind::Other));
    // 1% of creates, maps, set accesses, unmaps, releases, synchronizes and frees fail.
    sim.inject(FaultRule::random(
        7,
        0.01,
        vec![
            Operation::Create,
            Operation::Map,
            Operation::SetAccess,
            Operation::Unmap,
            Operation::Release,
            Operation::Synchronize,
            Operation::Free,
        ],
        ErrorKind::Other,
    ));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let vm = vm.clone();
            std::thread::spawn(move || {
                let mut rng = XorShift(0xD1B5_4A32_D192_ED03 ^ (t + 1));
                let mut mine: Vec<Reservation> = Vec::new();
                let mut failures = 0u64;
                for _ in 0..OPS {
                    let r = rng.next();
                    let n = mine.len().max(1);
                    let pick = (r >> 8) as usize % n;
                    let result = match r % 8 {
                        0 if mine.len() < 4 => vm.reserve((1 + (r >> 16) % 16) * g).map(|res| {
                            mine.push(res);
                        }),
                        0..=3 => match mine.get_mut(pick) {
                            Some(res) => res.commit((1 + (r >> 16) % 4) * g).map(|_| ()),
                            None => Ok(()),
                        },
                        4 | 5 => match mine.get_mut(pick) {
                            Some(res) => res.release().map(|_| ()),
                            None => Ok(()),
                        },
                        6 => match mine.get_mut(pick) {
                            Some(res) => res.truncate(((r >> 16) % 8) * g).map(|_| ()),
                            None => Ok(()),
                        },
                        _ => {
                            if !mine.is_empty() {
                                mine.swap_remove(pick);
                            }
                            Ok(())
                        }
                    };
                    match result {
                        Ok(()) => {}
                        Err(VmmError::Accounting(e)) => panic!("{e}"),
                        Err(_) => failures += 1,
                    }
                }
                (mine, failures)
            })
        })
        .collect();
    let mut left = Vec::new();
    let mut failures = 0;
    for w in workers {
        let (mine, f) = w.join().unwrap();
        left.extend(mine);
        failures += f;
    }
    sim.clear_faults();
    assert!(failures > 0, "no fault fired");
    assert_eq!(vm.accounting_errors(), 0);
    let refs: Vec<&Reservation> = left.iter().collect();
    common::check(&sim, &vm, &gov, &refs);
    drop(refs);
    drop(left);
    vm.trim_pool(0);
    common::check(&sim, &vm, &gov, &[]);
    let ledger = sim.ledger();
    assert_eq!(ledger.total_physical_bytes(), vm.quarantined_bytes());
    eprintln!(
        "{failures} failed operations, {} quarantine entries",
        vm.quarantine().len()
    );
}
