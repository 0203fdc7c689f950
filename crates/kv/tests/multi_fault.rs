//! Failures only several faults, or a driver call held in flight, reveal: a partial unmap
//! failure must not leave the KV layer's counts stale, and no lock a decode thread needs may
//! be held across a driver call.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use kvvm_governor::Governor;
use kvvm_hal::decorate::{CallHook, FaultInjecting};
use kvvm_hal::{DeviceId, ErrorKind, Operation, VirtualMemoryBackend};
use kvvm_kv::precommit::{PrecommitConfig, Precommitter};
use kvvm_kv::{KvDtype, KvGeometry, KvLayout, LayoutPlan, SequenceKv};
use kvvm_sim::{FaultRule, LatencyMode, LatencyModel, SimBackend, SimConfig};
use kvvm_vmm::{GranularityChoice, VirtualMemory, VmmConfig};

const D0: DeviceId = DeviceId(0);
const G: u64 = 64 << 10;

fn sim() -> Arc<SimBackend> {
    Arc::new(SimBackend::new(
        SimConfig::single(G, 1024 * G).with_latency(LatencyModel::zero(), LatencyMode::Account),
    ))
}

fn manager(backend: Arc<dyn VirtualMemoryBackend>, pool: u64, park: bool) -> VirtualMemory {
    VirtualMemory::new(
        backend,
        D0,
        Governor::unlimited(),
        VmmConfig::default()
            .pool_cap_bytes(pool * G)
            .park_released(park)
            .granularity(GranularityChoice::Minimum),
    )
    .unwrap()
}

/// 2 layers x 2 heads x 64 dims fp16; head-major: 8 fragments of 128 B a token, 512 tokens
/// a window.
fn head_major() -> LayoutPlan {
    let geometry = KvGeometry::with_dtype(2, 2, 64, KvDtype::F16, 4096).unwrap();
    LayoutPlan::new(geometry, KvLayout::SeqMajor, G).unwrap()
}

/// Every window of the sequence's committed tokens is mapped.
fn committed_is_mapped(s: &SequenceKv) -> bool {
    let windows = s.plan().windows_for_tokens(s.committed_tokens()).unwrap();
    windows
        .into_iter()
        .flatten()
        .all(|w| s.reservation().is_mapped(w * G))
}

/// A shrink or a release whose second unmap fails leaves a committed count that only covers
/// mapped windows, so the next `ensure_tokens` commits again and writes succeed.
#[test]
fn a_partial_unmap_failure_recounts_the_committed_tokens() {
    for release in [false, true] {
        let sim = sim();
        let vm = manager(sim.clone(), 0, false);
        let plan = head_major();
        let mut s = SequenceKv::new(&vm, &plan, 4096).unwrap();
        // 4 windows in each of 8 adjacent fragments: one run, a few large handles.
        s.ensure_tokens(2048).unwrap();
        let n = s.reservation().mappings().len();
        assert!((2..32).contains(&n), "{n} mappings");
        sim.inject(FaultRule::nth(Operation::Unmap, 2, ErrorKind::Other));
        let r = if release {
            s.release()
        } else {
            s.shrink_committed(0)
        };
        assert!(r.is_err());
        sim.clear_faults();
        assert!(s.reservation().mappings().len() < n);
        assert!(
            committed_is_mapped(&s),
            "release={release}: {} tokens reported over unmapped windows",
            s.committed_tokens()
        );
        assert!(s.committed_tokens() < 2048);
        let again = s.ensure_tokens(2048).unwrap();
        assert!(again > 0, "the lost windows are committed again");
        assert!(committed_is_mapped(&s));
        let bytes = vec![9u8; 64 * plan.geometry().bytes_per_token() as usize];
        s.write_tokens(64, &bytes).unwrap();
        let mut out = vec![0u8; bytes.len()];
        s.read_tokens(64, &mut out).unwrap();
        assert_eq!(out, bytes);
    }
}

/// Holds every call of one operation in flight until released, and says when one arrived.
struct Gate {
    state: Mutex<(bool, bool)>, // (armed, a call is waiting)
    changed: Condvar,
}

impl Gate {
    fn new() -> Arc<Gate> {
        Arc::new(Gate {
            state: Mutex::new((false, false)),
            changed: Condvar::new(),
        })
    }

    fn hook(self: &Arc<Self>, op: Operation) -> CallHook {
        let gate = Arc::clone(self);
        Arc::new(move |o| {
            if o != op {
                return;
            }
            let mut s = gate.state.lock().unwrap();
            if !s.0 {
                return;
            }
            s.1 = true;
            gate.changed.notify_all();
            while s.0 {
                s = gate.changed.wait(s).unwrap();
            }
        })
    }

    fn arm(&self) {
        self.state.lock().unwrap().0 = true;
    }

    fn wait_for_call(&self) {
        let mut s = self.state.lock().unwrap();
        while !s.1 {
            s = self.changed.wait(s).unwrap();
        }
    }

    fn open(&self) {
        self.state.lock().unwrap().0 = false;
        self.changed.notify_all();
    }
}

/// Runs `f` on another thread and says whether it finished within `limit`.
fn finishes_within<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

/// While the pre-commit worker's map call is in flight, the decode thread writes and reads
/// its committed tokens without waiting for it.
#[test]
fn the_pre_committer_holds_no_sequence_lock_across_a_driver_call() {
    let injector = Arc::new(FaultInjecting::new(sim()));
    let gate = Gate::new();
    injector.set_hook(Some(gate.hook(Operation::Map)));
    let vm = manager(injector.clone(), 0, false);
    let geometry = KvGeometry::with_dtype(2, 2, 64, KvDtype::F16, 4096).unwrap();
    let plan = LayoutPlan::new(geometry, KvLayout::TokenMajor, G).unwrap();
    let mut s = SequenceKv::new(&vm, &plan, 4096).unwrap();
    s.ensure_tokens(8).unwrap();
    let config = PrecommitConfig {
        headroom_tokens: 64,
        max_headroom_bytes: 16 * G,
        poll_interval: Duration::from_millis(1),
    };
    let pre = Precommitter::start(&vm, config).unwrap();
    gate.arm();
    let seq = Arc::new(pre.attach(s));
    gate.wait_for_call();
    let writer = Arc::clone(&seq);
    let wrote = finishes_within(Duration::from_secs(10), move || {
        let bytes = vec![5u8; 8 * 1024];
        writer.write_tokens(0, &bytes).unwrap();
        let mut out = vec![0u8; bytes.len()];
        writer.read_tokens(0, &mut out).unwrap();
        out == bytes
    });
    gate.open();
    assert_eq!(
        wrote,
        Some(true),
        "the write waited behind the worker's map call"
    );
    pre.wait_idle();
    assert!(seq.committed_tokens() > 8);
}

/// While the pool gives a parked window back to the driver (its unmap in flight), a commit in
/// the same reservation takes another parked window back without waiting.
#[test]
fn unparking_holds_no_lock_a_commit_needs_across_a_driver_call() {
    let injector = Arc::new(FaultInjecting::new(sim()));
    let gate = Gate::new();
    injector.set_hook(Some(gate.hook(Operation::Unmap)));
    let vm = manager(injector.clone(), 8, true);
    let mut r = vm.reserve(4 * G).unwrap();
    // Four commits of one window: four one-window handles, parked separately.
    for _ in 0..4 {
        r.commit(G).unwrap();
    }
    r.release().unwrap();
    assert_eq!(r.parked().len(), 4);
    gate.arm();
    let trimmer = vm.clone();
    let trim = std::thread::spawn(move || trimmer.trim_pool(0));
    gate.wait_for_call();
    // The reclaimer is unmapping the highest parked window; window 0 is still parked.
    let committed = finishes_within(Duration::from_secs(10), move || {
        let c = r.commit(G).unwrap();
        (c.from_pool, r)
    });
    gate.open();
    let released = trim.join().unwrap();
    let (from_pool, r) = committed.expect("the commit waited behind the reclaimer's unmap");
    assert_eq!(from_pool, 1, "window 0 was taken back as it was");
    assert!(r.is_mapped(0));
    assert!(released > 0);
    drop(r);
    drop(vm);
}
