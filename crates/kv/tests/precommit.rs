//! The background pre-committer: hot path, fault injection in the worker, reclaim under
//! pressure, shutdown, a random state machine, and deferred reclaim through the pool.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use kvvm_governor::Governor;
use kvvm_hal::{DeviceId, ErrorKind, Operation};
use kvvm_kv::precommit::{Ensured, PrecommitConfig, PrecommittedSequence, Precommitter};
use kvvm_kv::{HostTier, HostTierConfig, KvDtype, KvGeometry, KvLayout, LayoutPlan, SequenceKv};
use kvvm_sim::{FaultRule, SimBackend};
use kvvm_vmm::VirtualMemory;
use proptest::prelude::*;

const D0: DeviceId = DeviceId(0);
const G: u64 = 64 << 10;

struct World {
    sim: Arc<SimBackend>,
    gov: Governor,
    vm: VirtualMemory,
    plan: LayoutPlan,
}

/// Token-major, 2 layers x 2 heads x 64 dims fp16 = 1 KiB a token: 64 tokens a window.
fn world(budget_windows: Option<u64>, pool_windows: u64) -> World {
    let common::World { sim, gov, vm } =
        common::world_with(G, 1024, budget_windows.map(|b| b * G), pool_windows * G);
    let geometry = KvGeometry::with_dtype(2, 2, 64, KvDtype::F16, 4096).unwrap();
    let plan = LayoutPlan::new(geometry, KvLayout::TokenMajor, G).unwrap();
    World { sim, gov, vm, plan }
}

fn config(headroom_tokens: u64, max_windows: u64) -> PrecommitConfig {
    PrecommitConfig {
        headroom_tokens,
        max_headroom_bytes: max_windows * G,
        poll_interval: Duration::from_millis(1),
    }
}

/// A pre-committer (headroom 64 tokens, bound 16 windows) and a sequence of one token
/// attached to it, once the worker has grown it.
fn one_token_attached(w: &World) -> (Precommitter, PrecommittedSequence) {
    one_token_attached_with(w, 64)
}

/// [`one_token_attached`] with `headroom_tokens` of headroom.
fn one_token_attached_with(
    w: &World,
    headroom_tokens: u64,
) -> (Precommitter, PrecommittedSequence) {
    let pre = Precommitter::start(&w.vm, config(headroom_tokens, 16)).unwrap();
    let mut s = SequenceKv::new(&w.vm, &w.plan, 4096).unwrap();
    s.ensure_tokens(1).unwrap();
    let seq = pre.attach(s);
    pre.wait_idle();
    (pre, seq)
}

/// Invariant 2 (no commit in flight): governor used = the driver's physical bytes.
fn check_books(w: &World) {
    let snap = w.gov.snapshot().device(D0);
    assert_eq!(snap.pending, 0, "{snap:?}");
    assert_eq!(
        snap.used(),
        w.sim.ledger().total_physical_bytes(),
        "governor used vs driver {snap:?}"
    );
    assert_eq!(w.vm.accounting_errors(), 0);
}

#[test]
fn the_worker_commits_ahead_and_the_hot_path_finds_it() {
    let w = world(None, 0);
    let (pre, seq) = one_token_attached(&w);
    // Committed up to live + 2 x headroom = 129 tokens: 3 windows.
    assert!(seq.committed_tokens() >= 129, "{}", seq.committed_tokens());
    assert!(pre.stats().peak_headroom_bytes <= 16 * G);
    // Stop the worker so that nothing else calls the driver, then walk the hot path.
    pre.shutdown();
    let calls = w.sim.driver_calls();
    for n in 2..=129 {
        assert_eq!(seq.ensure_tokens(n).unwrap(), Ensured::Ready, "token {n}");
    }
    assert_eq!(
        w.sim.driver_calls(),
        calls,
        "no driver call on the hot path"
    );
    assert!(pre.stats().ready >= 128);
    check_books(&w);
    // Writes go through the sequence.
    let bytes = vec![7u8; 1024];
    seq.with_sequence(|s| s.write_token(5, &bytes)).unwrap();
    drop(seq);
    assert!(w.sim.ledger().is_empty());
}

#[test]
fn a_released_sequence_is_not_grown_again_until_tokens_are_asked_for() {
    let w = world(None, 0);
    let (pre, seq) = one_token_attached_with(&w, 16);
    assert!(seq.committed_tokens() >= 33);
    assert!(seq.release().unwrap() > 0);
    // Several worker passes: the released memory stays released.
    for _ in 0..5 {
        pre.wait_idle();
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(seq.committed_tokens(), 0);
    assert_eq!(seq.with_sequence(|s| s.committed_bytes()), 0);
    assert_eq!(w.gov.snapshot().device(D0).committed, 0);
    // Asked for again, it is grown ahead again.
    seq.ensure_tokens(1).unwrap();
    pre.wait_idle();
    assert!(seq.committed_tokens() >= 33, "{}", seq.committed_tokens());
    pre.shutdown();
    drop(seq);
    assert!(w.sim.ledger().is_empty());
}

#[test]
fn a_sequence_swapped_to_the_host_is_not_grown_again_until_it_comes_back() {
    let w = world(None, 0);
    let tier = HostTier::new(&w.vm, HostTierConfig::default()).unwrap();
    let pre = Precommitter::start(&w.vm, config(16, 16)).unwrap();
    let mut s = SequenceKv::new(&w.vm, &w.plan, 4096).unwrap();
    s.ensure_tokens(40).unwrap();
    let data = vec![9u8; 40 * 1024];
    s.write_tokens(0, &data).unwrap();
    let seq = pre.attach(s);
    pre.wait_idle();
    let mut swap = seq.with_sequence(|s| s.swap_out(&tier, 40, None)).unwrap();
    let released = seq
        .with_sequence_releasing(|s| s.finish_swap_out(&mut swap))
        .unwrap();
    assert!(released > 0);
    // A full scan of the worker finds nothing to commit: the sequence's tokens are on the
    // host, and no window is mapped ahead into it.
    pre.wait_idle();
    assert_eq!(seq.committed_tokens(), 0);
    assert_eq!(seq.with_sequence(|s| s.committed_bytes()), 0);
    assert_eq!(w.gov.snapshot().device(D0).committed, 0);
    // Back at the same address, byte-exact; asked for tokens again, it is grown again.
    seq.with_sequence(|s| s.swap_in(&mut swap)).unwrap();
    seq.with_sequence_releasing(|s| s.finish_swap_in(&mut swap))
        .unwrap();
    assert_eq!(seq.ensure_tokens(40).unwrap(), Ensured::Ready);
    pre.wait_idle();
    assert!(seq.committed_tokens() >= 56, "{}", seq.committed_tokens());
    let mut back = vec![0u8; data.len()];
    seq.read_tokens(0, &mut back).unwrap();
    assert_eq!(back, data);
    pre.shutdown();
    drop(seq);
    drop(swap);
    drop(tier);
    assert!(w.sim.ledger().is_empty());
}

#[test]
fn a_step_that_leaves_tokens_does_not_stop_the_growth() {
    // Only a sequence left empty goes dormant: one shrunk below its headroom, its live
    // tokens kept, is grown again by the worker.
    let w = world(None, 0);
    let (pre, seq) = one_token_attached_with(&w, 32);
    seq.ensure_tokens(40).unwrap();
    pre.wait_idle();
    assert!(seq.committed_tokens() >= 104, "{}", seq.committed_tokens());
    seq.with_sequence_releasing(|s| s.shrink_committed(40))
        .unwrap();
    assert_eq!(seq.committed_tokens(), 40, "shrunk to the live tokens");
    pre.wait_idle();
    assert!(seq.committed_tokens() >= 104, "{}", seq.committed_tokens());
    pre.shutdown();
    drop(seq);
    assert!(w.sim.ledger().is_empty());
}

#[test]
fn headroom_is_bounded() {
    let w = world(None, 0);
    let pre = Precommitter::start(&w.vm, config(256, 6)).unwrap();
    let seqs: Vec<PrecommittedSequence> = (0..4)
        .map(|_| pre.attach(SequenceKv::new(&w.vm, &w.plan, 4096).unwrap()))
        .collect();
    for s in &seqs {
        s.ensure_tokens(1).unwrap();
    }
    pre.wait_idle();
    let stats = pre.stats();
    assert!(stats.headroom_bytes <= 6 * G, "{stats:?}");
    assert!(stats.peak_headroom_bytes <= 6 * G, "{stats:?}");
    assert!(stats.headroom_capped > 0, "the bound was hit: {stats:?}");
    check_books(&w);
}

#[test]
fn a_failure_at_every_driver_step_of_the_worker_rolls_back_and_is_reported() {
    // The worker's first pass commits up to 1 + 2 x 128 = 257 tokens: windows 1-4 (window 0
    // is already committed) as buddy-aligned handles of 1, 2 and 1 windows: 3 creates, 3 maps,
    // 1 set access over the contiguous run.
    for (op, calls) in [
        (Operation::Create, 3),
        (Operation::Map, 3),
        (Operation::SetAccess, 1),
    ] {
        for n in 1..=calls {
            let w = world(None, 0);
            let mut s = SequenceKv::new(&w.vm, &w.plan, 4096).unwrap();
            s.ensure_tokens(1).unwrap();
            let pre = Precommitter::start(&w.vm, config(128, 16)).unwrap();
            w.sim.inject(FaultRule::nth(op, n, ErrorKind::Other));
            let seq = pre.attach(s);
            pre.wait_idle();
            let stats = pre.stats();
            assert!(stats.background_failures >= 1, "{op} {n}: {stats:?}");
            assert!(pre.last_error().is_some(), "{op} {n}: reported");
            // Rolled back (a later pass may have succeeded): the manager's windows are the
            // driver's, and the books match.
            let ours = seq.with_sequence(|s| s.reservation().mappings().len());
            assert_eq!(w.sim.ledger().mappings.len(), ours, "{op} {n}");
            check_books(&w);
            // The decode path still gets its tokens (inline, or from a later worker pass).
            seq.ensure_tokens(100).unwrap();
            pre.shutdown();
            drop(seq);
            assert!(w.sim.ledger().is_empty(), "{op} {n}: {:?}", w.sim.ledger());
            assert_eq!(w.gov.snapshot().device(D0).used(), 0);
        }
    }
}

#[test]
fn refused_grants_in_the_worker_are_counted_and_harmless() {
    let w = world(Some(2), 0);
    let (_pre, seq) = one_token_attached(&w);
    // Budget of 2 windows: 3 (up to 129 tokens) were refused whole; the smaller headroom
    // (up to 65 tokens, 2 windows) fits.
    assert_eq!(seq.committed_tokens(), 65);
    assert_eq!(w.sim.ledger().mappings.len(), 2);
    check_books(&w);
}

#[test]
fn precommitted_windows_are_given_back_first_under_pressure() {
    let w = world(Some(4), 0);
    let (pre, a) = one_token_attached(&w);
    assert_eq!(a.committed_tokens(), 129, "3 windows: 1 live + 2 ahead");
    assert_eq!(w.sim.ledger().mappings.len(), 3);
    pre.shutdown();
    // Another sequence needs 2 windows: the budget has 1 free; the pre-committer gives back
    // the windows ahead of `a`'s live end before the governor refuses.
    let mut b = SequenceKv::new(&w.vm, &w.plan, 4096).unwrap();
    b.ensure_tokens(128).unwrap();
    let stats = pre.stats();
    assert!(stats.reclaimed_bytes >= G, "{stats:?}");
    assert_eq!(a.committed_tokens(), 1, "back to the live window");
    assert_eq!(a.ensure_tokens(1).unwrap(), Ensured::Ready);
    check_books(&w);
}

#[test]
fn shutdown_joins_the_worker_and_everything_is_released() {
    let w = world(None, 8);
    let pre = Precommitter::start(&w.vm, config(64, 64)).unwrap();
    let seqs: Vec<PrecommittedSequence> = (0..8)
        .map(|_| pre.attach(SequenceKv::new(&w.vm, &w.plan, 4096).unwrap()))
        .collect();
    for (i, s) in seqs.iter().enumerate() {
        s.ensure_tokens(1 + i as u64 * 50).unwrap();
    }
    pre.shutdown();
    // After shutdown, growth still works (inline).
    assert!(matches!(
        seqs[0].ensure_tokens(1000).unwrap(),
        Ensured::Inline(_)
    ));
    drop(seqs);
    drop(pre);
    w.vm.trim_pool(0);
    assert!(w.sim.ledger().is_empty(), "{:?}", w.sim.ledger());
    assert_eq!(w.gov.snapshot().device(D0).used(), 0);
}

#[test]
fn steady_state_serving_reuses_pooled_windows() {
    // Deferred reclaim: finished sequences' windows go to the pool, new ones take them first.
    let w = world(None, 64);
    let mut creates_per_round = Vec::new();
    for _round in 0..6 {
        let before = w.sim.calls(Operation::Create);
        let seqs: Vec<SequenceKv> = (0..4)
            .map(|_| {
                let mut s = SequenceKv::new(&w.vm, &w.plan, 4096).unwrap();
                s.ensure_tokens(300).unwrap();
                s
            })
            .collect();
        drop(seqs);
        creates_per_round.push(w.sim.calls(Operation::Create) - before);
    }
    // 5 windows per sequence, as handles of 4 and 1 windows.
    assert_eq!(
        creates_per_round[0],
        4 * 2,
        "first round creates every handle"
    );
    assert!(
        creates_per_round[1..].iter().all(|c| *c == 0),
        "later rounds create nothing: {creates_per_round:?}"
    );
    check_books(&w);
}

#[derive(Debug, Clone)]
enum Op {
    Grow(usize, u64),
    Fault(u8),
    Idle,
    Release(usize),
    Drop(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, 1..200u64).prop_map(|(s, n)| Op::Grow(s, n)),
        1 => (0..3u8).prop_map(Op::Fault),
        2 => Just(Op::Idle),
        1 => (0..3usize).prop_map(Op::Release),
        1 => (0..3usize).prop_map(Op::Drop),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_sequences_keep_the_books(ops in proptest::collection::vec(op(), 1..20)) {
        let w = world(Some(24), 4);
        let pre = Precommitter::start(&w.vm, config(64, 8)).unwrap();
        let mut seqs: Vec<Option<PrecommittedSequence>> = (0..3)
            .map(|_| Some(pre.attach(SequenceKv::new(&w.vm, &w.plan, 4096).unwrap())))
            .collect();
        let mut live = [0u64; 3];
        for op in ops {
            match op {
                Op::Grow(i, by) => {
                    if let Some(s) = &seqs[i] {
                        let n = (live[i] + by).min(4096);
                        match s.ensure_tokens(n) {
                            Ok(_) => {
                                live[i] = n;
                                prop_assert!(s.committed_tokens() >= n);
                            }
                            // Refused for now, for good (the sequence would hold more than
                            // the budget), or an injected fault.
                            Err(e) => prop_assert!(
                                e.is_retryable()
                                    || e.never_fits().is_some()
                                    || e.to_string().contains("injected"),
                                "{e}"
                            ),
                        }
                    }
                }
                Op::Fault(k) => {
                    let op = [Operation::Create, Operation::Map, Operation::SetAccess][k as usize];
                    w.sim.inject(FaultRule::nth(op, 1, ErrorKind::Other));
                }
                Op::Idle => {
                    pre.wait_idle();
                    check_books(&w);
                }
                Op::Release(i) => {
                    if let Some(s) = &seqs[i] {
                        if s.release().is_ok() {
                            live[i] = 0;
                        }
                    }
                }
                Op::Drop(i) => {
                    seqs[i] = None;
                    live[i] = 0;
                }
            }
        }
        pre.shutdown();
        w.sim.clear_faults();
        check_books(&w);
        drop(seqs);
        drop(pre);
        w.vm.trim_pool(0);
        prop_assert!(w.sim.ledger().is_empty(), "{:?}", w.sim.ledger());
        prop_assert_eq!(w.gov.snapshot().device(D0).used(), 0);
    }
}

/// Two sequences whose headroom cannot both fit the budget: the worker's own commits must not
/// take one sequence's headroom to give it to the other (they would trade it back at every
/// scan and `wait_idle` would never return); the worker's commit is refused instead.
#[test]
fn headroom_is_never_reclaimed_to_make_headroom() {
    // 4 windows of budget; each sequence uses 1 and wants 2 more (headroom 64 tokens, up to 128).
    let w = world(Some(4), 0);
    let pre = Arc::new(Precommitter::start(&w.vm, config(64, 64)).unwrap());
    let a = pre.attach(SequenceKv::new(&w.vm, &w.plan, 4096).unwrap());
    let b = pre.attach(SequenceKv::new(&w.vm, &w.plan, 4096).unwrap());
    a.ensure_tokens(1).unwrap();
    b.ensure_tokens(1).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = Arc::clone(&pre);
    std::thread::spawn(move || {
        waiter.wait_idle();
        let _ = tx.send(());
    });
    assert!(
        rx.recv_timeout(Duration::from_secs(20)).is_ok(),
        "wait_idle did not return: the worker keeps trading headroom between sequences"
    );
    let stats = pre.stats();
    assert_eq!(stats.reclaimed_bytes, 0, "{stats:?}");
    check_books(&w);
    // The decode path still takes headroom back under pressure: it is not the worker.
    let c = SequenceKv::new(&w.vm, &w.plan, 4096).unwrap();
    let c = pre.attach(c);
    let _ = c.ensure_tokens(1);
    pre.shutdown();
    check_books(&w);
}

/// Windows mapped in the driver's books, and the mappings holding them.
fn mapped(w: &World) -> (u64, usize) {
    let l = w.sim.ledger();
    (
        l.mappings.iter().map(|m| m.size / G).sum(),
        l.mappings.len(),
    )
}

/// A pre-committer of `config` whose sequences may hold 13 windows ahead beyond their
/// headroom (64 tokens: one headroom is up to 3 windows ahead): up to 16 windows each.
fn growing(w: &World, config: PrecommitConfig) -> Precommitter {
    let pre = Precommitter::start(&w.vm, config).unwrap();
    pre.set_grow_ahead_bytes(13 * G);
    assert_eq!(pre.grow_ahead_bytes(), 13 * G);
    pre
}

#[test]
fn the_worker_grows_in_buddy_aligned_handles_within_its_bound() {
    let w = world(None, 0);
    let pre = growing(&w, config(64, 16));
    let mut s = SequenceKv::new(&w.vm, &w.plan, 4096).unwrap();
    s.ensure_tokens(4 * 64).unwrap();
    assert_eq!(mapped(&w), (4, 1), "windows 0-3: one handle");
    let seq = pre.attach(s);
    pre.wait_idle();
    // The headroom asks up to 256 + 128 tokens (6 windows); the committed end, window 4, can
    // start a handle of 4 windows: up to 8 windows (512 tokens), in one mapping.
    assert_eq!(seq.committed_tokens(), 512);
    assert_eq!(mapped(&w), (8, 2));
    for n in 257..=2048 {
        assert_eq!(seq.ensure_tokens(n).unwrap(), Ensured::Ready, "token {n}");
        if n % 32 == 0 {
            pre.wait_idle();
        }
    }
    let stats = pre.stats();
    assert_eq!(stats.inline_commits, 0, "{stats:?}");
    assert!(stats.peak_headroom_bytes <= 16 * G, "{stats:?}");
    // Handles of 8 and 16 windows after the first ones, each one commit: windows 0-47 in
    // 5 mappings (one per granule would be 48).
    let (windows, mappings) = mapped(&w);
    assert_eq!(
        (windows, mappings),
        (48, 5),
        "{:?}",
        w.sim.ledger().mappings
    );
    check_books(&w);
    pre.shutdown();
    drop(seq);
    assert!(w.sim.ledger().is_empty());

    // Without room to grow, the same decode commits what the headroom asks, a window or two
    // at a time.
    let w = world(None, 0);
    let pre = Precommitter::start(&w.vm, config(64, 16)).unwrap();
    let mut s = SequenceKv::new(&w.vm, &w.plan, 4096).unwrap();
    s.ensure_tokens(4 * 64).unwrap();
    let seq = pre.attach(s);
    for n in 257..=2048 {
        if n % 32 == 0 {
            pre.wait_idle();
        }
        seq.ensure_tokens(n).unwrap();
    }
    pre.wait_idle();
    let (windows, mappings) = mapped(&w);
    assert!(
        mappings * 2 > windows as usize,
        "{windows} windows in {mappings} mappings"
    );
    pre.shutdown();
}

#[test]
fn a_tight_bound_keeps_the_growth_to_what_the_headroom_asks() {
    let w = world(None, 0);
    let pre = growing(&w, config(64, 3));
    let mut s = SequenceKv::new(&w.vm, &w.plan, 4096).unwrap();
    s.ensure_tokens(4 * 64).unwrap();
    let seq = pre.attach(s);
    pre.wait_idle();
    // A 4-window handle would put 4 windows ahead, over the bound of 3: up to 384 tokens
    // (windows 4-5, one handle of 2).
    assert_eq!(seq.committed_tokens(), 384);
    assert_eq!(mapped(&w), (6, 2));
    assert!(pre.stats().peak_headroom_bytes <= 3 * G);
    check_books(&w);
}

#[test]
fn a_handle_holding_the_live_end_stays_counted_as_headroom_after_a_reclaim() {
    // 10 windows of budget: the sequence grows to 8 (windows 4-7 one handle ahead).
    let w = world(Some(10), 0);
    let pre = growing(&w, config(64, 16));
    let mut s = SequenceKv::new(&w.vm, &w.plan, 4096).unwrap();
    s.ensure_tokens(4 * 64).unwrap();
    let a = pre.attach(s);
    pre.wait_idle();
    assert_eq!(mapped(&w), (8, 2));
    assert_eq!(a.ensure_tokens(300).unwrap(), Ensured::Ready);
    pre.shutdown();
    // Windows 5-7 lie ahead but in the handle holding the live end: 2 free, none available
    // beyond them.
    assert_eq!(w.gov.available_bytes(D0), 2 * G);
    // Another sequence needs 4 windows, 2 are free: the pre-committer is asked for headroom,
    // but windows 5-7 lie in the handle that holds the live end (window 4): given back only
    // whole, so nothing is freed and the commit is refused.
    let mut b = SequenceKv::new(&w.vm, &w.plan, 4096).unwrap();
    let err = b.ensure_tokens(256).unwrap_err();
    assert!(err.is_retryable(), "{err}");
    let stats = pre.stats();
    assert_eq!(stats.reclaimed_bytes, 0, "{stats:?}");
    // What is still mapped ahead of the live end (3 windows) is still counted against the
    // bound.
    assert_eq!(stats.headroom_bytes, 3 * G, "{stats:?}");
    assert_eq!(mapped(&w), (8, 2));
    assert_eq!(a.ensure_tokens(300).unwrap(), Ensured::Ready);
    check_books(&w);
}

/// The governor's `available_bytes` counts the windows the pre-committer holds ahead of the
/// live ends that a reclaim would give back, and only those: a reclaim asked for everything
/// then gives back exactly that much (windows ahead inside the handle that holds a live end
/// are headroom but not available: `a_handle_holding_the_live_end_stays_counted_as_headroom_after_a_reclaim`).
#[test]
fn available_bytes_counts_what_a_reclaim_would_give_back() {
    // Two windows ahead in handles of their own: 1 free + 2 reclaimable.
    let w = world(Some(4), 0);
    let (pre, a) = one_token_attached(&w);
    pre.shutdown();
    assert_eq!(a.committed_tokens(), 129);
    assert_eq!(w.gov.available_bytes(D0), 3 * G);
    let mut b = SequenceKv::new(&w.vm, &w.plan, 4096).unwrap();
    b.ensure_tokens(192).unwrap();
    assert_eq!(
        pre.stats().reclaimed_bytes,
        2 * G,
        "the reclaim gave back what was counted"
    );
    assert_eq!(w.gov.available_bytes(D0), 0);
    check_books(&w);
}
