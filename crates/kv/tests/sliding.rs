//! A sliding window's oldest tokens forgotten (`SequenceKv::forget_tokens_before`): the windows
//! behind the window go back to the pool or the driver as a sequence grows, the books stay
//! exact (committed bytes = granule x the windows holding a byte of the tokens kept; the
//! governor's bytes = the driver's), the pointer never changes, forgotten tokens are refused,
//! and every unmap failure leaves the ledger equal to the driver's truth.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use common::{check_books, tokens_bytes, world, world_with, World, D0};
use kvvm_hal::decorate::FaultInjecting;
use kvvm_hal::{ErrorKind, Operation, VirtualMemoryBackend};
use kvvm_kv::precommit::{PrecommitConfig, Precommitter};
use kvvm_kv::{
    KvCacheError, KvDtype, KvGeometry, KvLayout, LayoutPlan, SequenceKv, SharedDevicePrefix,
};
use kvvm_sim::FaultRule;
use kvvm_vmm::{GranularityChoice, VirtualMemory, VmmConfig};
use proptest::prelude::*;

const G: u64 = 4096;

/// The windows (indices from the base) holding at least one byte of tokens `kept..end` in
/// some fragment of `plan`: what a sequence that forgot the tokens before `kept` and
/// committed `end` tokens must map, no more, no less (invariant 1 of a sliding window).
fn windows_of(plan: &LayoutPlan, kept: u64, end: u64) -> BTreeSet<u64> {
    let g = plan.granule();
    let mut out = BTreeSet::new();
    if end <= kept {
        return out;
    }
    for f in plan.fragments().unwrap() {
        let first = (f.offset + kept * f.bytes_per_token) / g;
        let last = (f.offset + end * f.bytes_per_token).div_ceil(g);
        out.extend(first..last);
    }
    out
}

/// The reservation's mapped windows, from its records.
fn mapped(s: &SequenceKv) -> BTreeSet<u64> {
    let base = s.address().0;
    let g = s.plan().granule();
    s.reservation()
        .mappings()
        .iter()
        .flat_map(|m| {
            let first = (m.address.0 - base) / g;
            first..first + m.size / g
        })
        .collect()
}

/// Invariants 1-3 for sequences that forgot: each maps exactly the windows of its kept
/// tokens, the driver maps what the records say, the governor counts what the driver holds.
fn check(w: &World, seqs: &[&SequenceKv]) {
    let ledger = w.sim.ledger();
    for s in seqs {
        let want = windows_of(s.plan(), s.forgotten_tokens(), s.committed_tokens());
        assert_eq!(
            mapped(s),
            want,
            "the windows of tokens {}..{}",
            s.forgotten_tokens(),
            s.committed_tokens()
        );
        assert_eq!(s.committed_bytes(), want.len() as u64 * s.plan().granule());
        assert_eq!(
            ledger.mapped_bytes_in(s.address(), s.reservation().size()),
            s.committed_bytes(),
            "the driver maps what the records say"
        );
    }
    books(w, seqs);
}

/// Invariant 2 with a handle pool: the governor counts the sequences' windows as committed
/// and the pool's as pooled, nothing else, and holds what the driver holds.
fn books(w: &World, seqs: &[&SequenceKv]) {
    let snap = w.gov.snapshot().device(D0);
    let owned: u64 = seqs.iter().map(|s| s.additional_owned_bytes()).sum();
    assert_eq!(snap.committed, owned, "{snap:?}");
    assert_eq!(snap.pooled, w.vm.pooled_bytes(), "{snap:?}");
    assert_eq!(
        (snap.pending, snap.shared, snap.quarantined),
        (0, 0, 0),
        "{snap:?}"
    );
    assert_eq!(
        snap.used(),
        w.sim.ledger().total_physical_bytes(),
        "governor vs driver"
    );
    assert_eq!(w.vm.accounting_errors(), 0);
}

/// 3 layers, 2 KV heads, head_dim 12, fp16: 288 B a token token-major (not a divisor of
/// the 4 KiB granule: windows hold 14.2 tokens), 48 B seq-major, 24 B head-major.
fn geometry(max_tokens: u64) -> KvGeometry {
    KvGeometry::with_dtype(3, 2, 12, KvDtype::F16, max_tokens).unwrap()
}

fn sliding(vm: &VirtualMemory, plan: &LayoutPlan, max_tokens: u64) -> SequenceKv {
    let mut s = SequenceKv::new(vm, plan, max_tokens).unwrap();
    s.use_window_handles();
    s
}

#[test]
fn a_sliding_window_holds_only_the_windows_of_its_last_tokens_in_every_layout() {
    let window = 100u64;
    let w = world(G, None);
    for layout in KvLayout::ALL {
        let geo = geometry(2048);
        let plan = LayoutPlan::new(geo, layout, G).unwrap();
        let mut s = sliding(&w.vm, &plan, 2048);
        let base = s.address();
        let bound = plan.committed_bytes_for_tokens(window + 1).unwrap() + plan.slice_count() * G;
        let mut peak = 0;
        for n in 1..=2048u64 {
            s.ensure_tokens(n).unwrap();
            s.write_tokens(n - 1, &tokens_bytes(&geo, 0, n - 1, 1, 0))
                .unwrap();
            // What the next step reads: the window's last tokens.
            s.forget_tokens_before((n + 1).saturating_sub(window))
                .unwrap();
            peak = peak.max(s.committed_bytes());
            if n % 97 == 0 {
                check(&w, &[&s]);
            }
        }
        assert_eq!(s.address(), base, "the pointer never changes");
        assert!(
            peak <= bound,
            "{layout}: {peak} B held, the window's windows are {bound} B"
        );
        assert!(peak < plan.committed_bytes_for_tokens(2048).unwrap() / 4);
        // The tokens kept read back; the forgotten ones are refused before any driver call.
        let kept = s.forgotten_tokens();
        assert_eq!(kept, 2048 + 1 - window);
        let mut back = vec![0u8; (window - 1) as usize * geo.bytes_per_token() as usize];
        s.read_tokens(kept, &mut back).unwrap();
        assert_eq!(back, tokens_bytes(&geo, 0, kept, window - 1, 0));
        let one = tokens_bytes(&geo, 0, 0, 1, 0);
        let err = s.write_tokens(kept - 1, &one).unwrap_err();
        assert_eq!(
            err,
            KvCacheError::Forgotten {
                token: kept - 1,
                forgotten: kept
            }
        );
        let mut out = vec![0u8; one.len()];
        assert!(matches!(
            s.read_tokens(0, &mut out),
            Err(KvCacheError::Forgotten { .. })
        ));
        check(&w, &[&s]);
        assert!(s.release().unwrap() > 0);
        assert_eq!(
            s.forgotten_tokens(),
            0,
            "a released sequence starts again from token 0"
        );
        check(&w, &[&s]);
    }
}

#[test]
fn growth_after_forgetting_never_maps_a_window_behind_again() {
    let w = world(G, None);
    let geo = geometry(4096);
    let plan = LayoutPlan::new(geo, KvLayout::TokenMajor, G).unwrap();
    let mut s = sliding(&w.vm, &plan, 4096);
    s.ensure_tokens(600).unwrap();
    let freed = s.forget_tokens_before(500).unwrap();
    // 500 x 288 B = 35.2 windows: the 35 windows wholly behind token 500 go.
    assert_eq!(freed, 35 * G);
    assert_eq!(
        s.forget_tokens_before(400).unwrap(),
        0,
        "forgetting less does nothing"
    );
    assert_eq!(s.forgotten_tokens(), 500);
    s.ensure_tokens(1000).unwrap();
    check(&w, &[&s]);
    s.shrink_committed(650).unwrap();
    check(&w, &[&s]);
    // Shrinking never reaches below the forgotten tokens (the window of token 500's first
    // bytes stays, ready for the next growth).
    s.shrink_committed(0).unwrap();
    assert_eq!(s.committed_tokens(), 500);
    assert_eq!(mapped(&s), BTreeSet::from([35]));
    books(&w, &[&s]);
}

#[test]
fn forgetting_what_is_not_committed_or_shared_is_refused_before_any_driver_call() {
    let w = world(G, None);
    let geo = geometry(1024);
    let plan = LayoutPlan::new(geo, KvLayout::TokenMajor, G).unwrap();
    let mut s = sliding(&w.vm, &plan, 1024);
    s.ensure_tokens(100).unwrap();
    assert_eq!(
        s.forget_tokens_before(101).unwrap_err(),
        KvCacheError::NotCommitted {
            first: 0,
            end: 101,
            committed: 100
        }
    );
    assert_eq!(s.forgotten_tokens(), 0);
    // A shared prefix's windows are the prefix's: its owner forgets nothing.
    let (prefix, mut owner) =
        SharedDevicePrefix::reserve_unwritten(&w.vm, &plan, 64, 1024).unwrap();
    let calls = w.sim.calls(Operation::Unmap);
    assert!(matches!(
        owner.forget_tokens_before(30),
        Err(KvCacheError::NotShareable { .. })
    ));
    assert_eq!(w.sim.calls(Operation::Unmap), calls);
    assert_eq!(owner.forgotten_tokens(), 0);
    check_books(&w, &[&s, &owner], &[&prefix]);
}

#[test]
fn a_multi_window_handle_behind_the_window_stays_until_it_is_wholly_behind() {
    // Without one handle per window, a commit maps buddy handles: a handle goes only whole.
    let w = world(G, None);
    let geo = geometry(4096);
    let plan = LayoutPlan::new(geo, KvLayout::TokenMajor, G).unwrap();
    let mut s = SequenceKv::new(&w.vm, &plan, 4096).unwrap();
    s.ensure_tokens(1000).unwrap(); // 71 windows: handles of 64, 4, 2, 1
    assert_eq!(
        s.forget_tokens_before(500).unwrap(),
        0,
        "the 64-window handle reaches past token 500"
    );
    assert_eq!(s.committed_bytes(), 71 * G);
    assert_eq!(s.forget_tokens_before(950).unwrap(), 64 * G);
    check_books(&w, &[&s], &[]);
}

#[test]
fn the_pool_takes_the_windows_behind_and_the_governor_is_credited() {
    let w = world_with(G, 4096, Some(64 * G), 16 * G);
    let geo = geometry(8192);
    let plan = LayoutPlan::new(geo, KvLayout::TokenMajor, G).unwrap();
    let mut s = sliding(&w.vm, &plan, 8192);
    // 8192 tokens are 576 windows, far more than the budget's 64: only a window of 256
    // tokens (about 19 windows) fits, and only because the windows behind come back.
    for n in (64..=8192u64).step_by(64) {
        s.forget_tokens_before(n.saturating_sub(256 + 64)).unwrap();
        s.ensure_tokens(n).unwrap();
    }
    let snap = w.gov.snapshot().device(D0);
    assert!(snap.used() <= 64 * G);
    assert!(
        w.sim.calls(Operation::Create) < 40,
        "pooled windows are reused"
    );
    check(&w, &[&s]);
    s.release().unwrap();
    check(&w, &[&s]);
}

/// A world whose unmaps fail on demand: a fault-injecting decorator over the simulator.
fn faulty() -> (World, Arc<FaultInjecting>) {
    let base = world(G, None);
    let injector = Arc::new(FaultInjecting::new(base.sim.clone()));
    let backend: Arc<dyn VirtualMemoryBackend> = injector.clone();
    let vm = VirtualMemory::new(
        backend,
        D0,
        base.gov.clone(),
        VmmConfig::default()
            .pool_cap_bytes(0)
            .granularity(GranularityChoice::Minimum),
    )
    .unwrap();
    (
        World {
            sim: base.sim,
            gov: base.gov,
            vm,
        },
        injector,
    )
}

#[test]
fn every_failed_unmap_of_a_forget_leaves_the_ledger_equal_to_the_driver() {
    // Forgetting 20 windows of a seq-major sequence (6 fragments) unmaps runs of windows:
    // fail each unmap call in turn, then every call at once.
    let geo = geometry(1024);
    let plan = LayoutPlan::new(geo, KvLayout::SeqMajor, G).unwrap();
    let mut fail_sets: Vec<Vec<u64>> = (1..=8).map(|k| vec![k]).collect();
    fail_sets.push((1..=64).collect());
    for fail in fail_sets {
        let (w, inj) = faulty();
        let mut s = sliding(&w.vm, &plan, 1024);
        s.ensure_tokens(1024).unwrap();
        s.write_tokens(0, &tokens_bytes(&geo, 1, 0, 1024, 0))
            .unwrap();
        inj.arm(&[Operation::Unmap], &fail);
        let r = s.forget_tokens_before(400);
        let fired = inj.disarm();
        assert_eq!(
            r.is_err(),
            !fired.is_empty(),
            "{fail:?}: an error exactly when a fault fired"
        );
        assert!(fail.len() == 1 || !fired.is_empty(), "every unmap failed");
        assert_eq!(
            s.forgotten_tokens(),
            400,
            "forgotten whatever the driver said"
        );
        // The ledger: the records hold every window the driver still maps, no more.
        let ledger = w.sim.ledger();
        assert_eq!(
            ledger.mapped_bytes_in(s.address(), s.reservation().size()),
            s.committed_bytes()
        );
        check_books(&w, &[&s], &[]);
        // The kept tokens are intact; the next forget unmaps what the failure left behind.
        let mut back = vec![0u8; 624 * geo.bytes_per_token() as usize];
        s.read_tokens(400, &mut back).unwrap();
        assert_eq!(back, tokens_bytes(&geo, 1, 400, 624, 0));
        s.forget_tokens_before(401).unwrap();
        check(&w, &[&s]);
        s.release().unwrap();
        check(&w, &[&s]);
    }
}

#[test]
fn a_failed_commit_after_forgetting_rolls_back_to_the_kept_windows() {
    let w = world(G, None);
    let geo = geometry(2048);
    let plan = LayoutPlan::new(geo, KvLayout::HeadMajor, G).unwrap();
    let mut s = sliding(&w.vm, &plan, 2048);
    s.ensure_tokens(800).unwrap();
    s.forget_tokens_before(700).unwrap();
    for op in [Operation::Create, Operation::Map, Operation::SetAccess] {
        w.sim.inject(FaultRule::nth(op, 2, ErrorKind::Other));
        assert!(s.ensure_tokens(1500).is_err());
        w.sim.clear_faults();
        assert_eq!(s.committed_tokens(), 800, "{op:?}");
        check(&w, &[&s]);
    }
    s.ensure_tokens(1500).unwrap();
    check(&w, &[&s]);
}

#[test]
fn a_pre_committed_sequence_forgets_and_the_worker_commits_only_ahead() {
    let w = world_with(G, 4096, None, 8 * G);
    let geo = geometry(8192);
    let plan = LayoutPlan::new(geo, KvLayout::TokenMajor, G).unwrap();
    let config = PrecommitConfig {
        headroom_tokens: 32,
        max_headroom_bytes: 64 * G,
        poll_interval: Duration::from_millis(1),
    };
    let pre = Precommitter::start(&w.vm, config).unwrap();
    let seq = pre.attach(sliding(&w.vm, &plan, 8192));
    let window = 200u64;
    for n in 1..=3000u64 {
        seq.ensure_tokens(n).unwrap();
        if n % 50 == 0 {
            let kept = (n + 1).saturating_sub(window);
            seq.with_sequence(|s| s.forget_tokens_before(kept)).unwrap();
        }
    }
    pre.wait_idle();
    pre.shutdown();
    seq.with_sequence(|s| {
        assert_eq!(s.forgotten_tokens(), 3001 - window);
        // The worker's commits ahead start where the kept tokens are, never behind them.
        assert!(s.committed_tokens() >= 3000);
        check(&w, &[s]);
    });
}

fn any_layout() -> impl Strategy<Value = KvLayout> {
    prop_oneof![
        Just(KvLayout::HeadMajor),
        Just(KvLayout::SeqMajor),
        Just(KvLayout::TokenMajor)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Random geometries (a few bytes to several windows a token), layouts and sequences of
    /// growth and forgetting: the windows mapped are exactly those of the kept tokens, and
    /// the governor's bytes are the driver's.
    #[test]
    fn forgetting_keeps_exactly_the_windows_of_the_kept_tokens(
        layers in 1u32..4,
        heads in 1u32..4,
        dim in prop_oneof![Just(2u32), Just(24), Just(100), Just(700)],
        layout in any_layout(),
        steps in proptest::collection::vec((1u64..200, 0u64..300), 1..12),
    ) {
        let max_tokens = 2400;
        let w = world_with(G, 1 << 16, None, 0);
        let geo = KvGeometry::with_dtype(layers, heads, dim, KvDtype::F16, max_tokens).unwrap();
        let plan = LayoutPlan::new(geo, layout, G).unwrap();
        let mut s = sliding(&w.vm, &plan, max_tokens);
        let mut n = 0u64;
        for (grow, keep) in steps {
            n = (n + grow).min(max_tokens);
            s.ensure_tokens(n).unwrap();
            s.forget_tokens_before(n.saturating_sub(keep)).unwrap();
            let want = windows_of(&plan, s.forgotten_tokens(), s.committed_tokens());
            prop_assert_eq!(mapped(&s), want);
        }
        check(&w, &[&s]);
        s.release().unwrap();
        check(&w, &[&s]);
        prop_assert!(w.sim.ledger().mappings.is_empty());
    }
}

/// A sliding window's layers take only the last tokens of a shared prefix: nothing mapped
/// read-only, the tokens from `first` on copied into windows of their own, those before
/// forgotten from the start; then they grow and forget as any sliding sequence, in every
/// layout, with the prefix's tokens straddling windows.
#[test]
fn a_sliding_sequence_takes_the_last_tokens_of_a_prefix_by_copy_and_forgets_on() {
    for layout in KvLayout::ALL {
        let w = world(G, None);
        let geo = geometry(1024);
        let plan = LayoutPlan::new(geo, layout, G).unwrap();
        let prefix_len = 300;
        let (prefix, owner) = SharedDevicePrefix::reserve_and_map_shared_prefix(
            &w.vm,
            &plan,
            prefix_len,
            1024,
            |t, buf| {
                let n = buf.len() as u64 / geo.bytes_per_token();
                buf.copy_from_slice(&tokens_bytes(&geo, 0, t, n, prefix_len));
            },
        )
        .unwrap();
        for first in [0, 1, 137, prefix_len - 1, prefix_len] {
            let mut s = sliding(&w.vm, &plan, 1024);
            let copied = prefix.attach_from(&mut s, first).unwrap();
            assert_eq!(
                s.reservation()
                    .mappings()
                    .iter()
                    .filter(|m| m.kind != kvvm_vmm::BlockKind::Owned)
                    .count(),
                0
            );
            assert_eq!(s.forgotten_tokens(), first, "{layout}");
            assert_eq!(s.written_tokens(), prefix_len);
            assert_eq!(
                copied,
                (prefix_len - first) * geo.bytes_per_token(),
                "{layout} {first}"
            );
            assert_eq!(
                mapped(&s),
                windows_of(&plan, s.forgotten_tokens(), s.committed_tokens())
            );
            check_books(&w, &[&owner, &s], &[&prefix]);
            let n = prefix_len - first;
            let mut back = vec![0u8; (n * geo.bytes_per_token()) as usize];
            s.read_tokens(first, &mut back).unwrap();
            assert_eq!(
                back,
                tokens_bytes(&geo, 0, first, n, prefix_len),
                "{layout} {first}"
            );
            if first > 0 {
                let mut one = vec![0u8; geo.bytes_per_token() as usize];
                assert!(matches!(
                    s.read_tokens(first - 1, &mut one),
                    Err(KvCacheError::Forgotten { .. })
                ));
            }
            // It grows and forgets on, as any sliding sequence.
            s.ensure_tokens(prefix_len + 40).unwrap();
            s.forget_tokens_before(prefix_len + 10).unwrap();
            assert_eq!(
                mapped(&s),
                windows_of(&plan, s.forgotten_tokens(), s.committed_tokens())
            );
            check_books(&w, &[&owner, &s], &[&prefix]);
        }
        check_books(&w, &[&owner], &[&prefix]);
        drop((prefix, owner));
        drop(w.vm);
        assert!(w.sim.ledger().is_empty(), "{layout}");
    }
}
