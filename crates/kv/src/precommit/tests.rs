//! Unit tests of the pre-committer's claims, with the interleavings forced (a closure that
//! runs under the sequence's lock waits for the other thread's claim), not left to timing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvvm_governor::{Governor, Reclaimer};
use kvvm_hal::{DeviceId, VirtualMemoryBackend};
use kvvm_sim::{LatencyMode, LatencyModel, SimBackend, SimConfig};
use kvvm_vmm::{VirtualMemory, VmmConfig};

use super::{Ensured, PrecommitConfig, Precommitter};
use crate::{KvDtype, KvGeometry, KvLayout, LayoutPlan, SequenceKv};

const G: u64 = 64 << 10;
const D0: DeviceId = DeviceId(0);

/// Token-major, 1 KiB a token: 64 tokens a window.
fn setup() -> (Arc<SimBackend>, VirtualMemory, LayoutPlan) {
    let sim = Arc::new(SimBackend::new(
        SimConfig::single(G, 1024 * G).with_latency(LatencyModel::zero(), LatencyMode::Account),
    ));
    let backend: Arc<dyn VirtualMemoryBackend> = sim.clone();
    let vm = VirtualMemory::new(
        backend,
        D0,
        Governor::unlimited(),
        VmmConfig::default().pool_cap_bytes(0),
    )
    .unwrap();
    let geometry = KvGeometry::with_dtype(2, 2, 64, KvDtype::F16, 4096).unwrap();
    let plan = LayoutPlan::new(geometry, KvLayout::TokenMajor, G).unwrap();
    (sim, vm, plan)
}

/// Headroom 64 tokens (one window), at most 64 windows ahead.
fn config() -> PrecommitConfig {
    PrecommitConfig {
        headroom_tokens: 64,
        max_headroom_bytes: 64 * G,
        poll_interval: Duration::from_millis(1),
    }
}

/// A decode thread's claim made while another thread holds the sequence (`with_sequence`,
/// here shrinking it) is kept: the claim's inline commit, made once the lock is free, is not
/// given back by the next reclaim. The claim used to be lowered to what `with_sequence` left
/// committed, and the reclaim then unmapped windows of tokens the decode thread had been
/// promised.
#[test]
fn a_claim_made_while_the_sequence_is_held_survives_a_reclaim() {
    let (sim, vm, plan) = setup();
    let pre = Precommitter::start(&vm, config()).unwrap();
    // No worker: every commit below is the decode path's own.
    pre.shutdown();
    let mut s = SequenceKv::new(&vm, &plan, 4096).unwrap();
    s.ensure_tokens(64).unwrap();
    let seq = Arc::new(pre.attach(s));
    assert!(matches!(seq.ensure_tokens(256), Ok(Ensured::Inline(_))));
    let decoder = Arc::clone(&seq);
    let joined = seq.with_sequence(|s| {
        // Another thread asks for 300 tokens while this one holds the sequence: it claims
        // them, finds nothing ready (`with_sequence` answers no Ready) and waits for the lock.
        let cell = Arc::clone(&seq.cell);
        let thread = std::thread::spawn(move || decoder.ensure_tokens(300));
        while cell.live.load(Ordering::SeqCst) != 300 {
            std::thread::yield_now();
        }
        s.shrink_committed(64).unwrap();
        thread
    });
    // The decode thread got its 300 tokens, committed inline once the lock was free.
    assert!(matches!(joined.join().unwrap(), Ok(Ensured::Inline(_))));
    assert_eq!(seq.committed_tokens(), 300);
    // Memory pressure: the pre-committer gives back what lies ahead of the claims.
    let freed = pre.inner.reclaim(D0, 64 * G);
    assert_eq!(freed, 0, "nothing lies ahead of the claim of 300 tokens");
    assert_eq!(
        seq.committed_tokens(),
        300,
        "the promised tokens stay committed"
    );
    assert!(seq.with_sequence(|s| s.committed_tokens()) >= 300);
    drop(seq);
    drop(pre);
    drop(vm);
    assert!(sim.ledger().is_empty());
}

/// The pre-committer's list of sequences drops a sequence's entry once the sequence is gone
/// (at the next scan of the list, a reclaim's here), so that a long-lived pre-committer
/// serving sequence after sequence keeps one entry per live sequence, not one per sequence it
/// ever held.
#[test]
fn a_dropped_sequence_leaves_the_list_at_the_next_scan() {
    let (_sim, vm, plan) = setup();
    let pre = Precommitter::start(&vm, config()).unwrap();
    pre.shutdown();
    let attached: Vec<_> = (0..3)
        .map(|_| pre.attach(SequenceKv::new(&vm, &plan, 4096).unwrap()))
        .collect();
    assert_eq!(super::lock(&pre.inner.cells).len(), 3);
    let kept = attached.into_iter().next().unwrap();
    assert_eq!(pre.inner.reclaimable(D0), 0);
    assert_eq!(
        super::lock(&pre.inner.cells).len(),
        1,
        "the two dropped sequences' entries are gone"
    );
    drop(kept);
}
