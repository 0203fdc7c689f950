//! Unit tests of `precommit.rs`: a claim made while a release holds the group,
//! the interleaving forced from inside the release's driver call (not left to timing).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kvvm_governor::Governor;
use kvvm_hal::decorate::FaultInjecting;
use kvvm_hal::{DeviceId, Operation, VirtualMemoryBackend};
use kvvm_sim::{LatencyMode, LatencyModel, SimBackend, SimConfig};
use kvvm_vmm::{VirtualMemory, VmmConfig};

use super::PrecommittedGroup;
use crate::precommit::Ensured;
use crate::tensor_parallel::TensorParallelSequence;
use crate::{KvCacheError, KvDtype, KvGeometry, KvLayout, LayoutPlan, SequenceKv};

const G: u64 = 64 << 10;

type Decoder = Mutex<Option<JoinHandle<Result<Ensured, KvCacheError>>>>;

/// A decode thread claims 300 tokens while a release holds the group (its unmap in flight):
/// the claim's inline commit, made once the release is done, is kept by `shrink_to_live`. The
/// release used to set the claims to what it left (nothing), and the shrink then unmapped the
/// tokens the decode thread had just been promised.
#[test]
fn a_claim_made_during_a_release_survives_shrink_to_live() {
    let sim = Arc::new(SimBackend::new(
        SimConfig::single(G, 1024 * G).with_latency(LatencyModel::zero(), LatencyMode::Account),
    ));
    let faults = Arc::new(FaultInjecting::new(sim.clone()));
    let backend: Arc<dyn VirtualMemoryBackend> = faults.clone();
    let vm = VirtualMemory::new(
        backend,
        DeviceId(0),
        Governor::unlimited(),
        VmmConfig::default().pool_cap_bytes(0),
    )
    .unwrap();
    let geometry = KvGeometry::with_dtype(2, 2, 64, KvDtype::F16, 4096).unwrap();
    let plan = LayoutPlan::new(geometry, KvLayout::TokenMajor, G).unwrap();
    let mut rank = SequenceKv::new(&vm, &plan, 4096).unwrap();
    rank.ensure_tokens(64).unwrap();
    let tp = TensorParallelSequence::new(vec![rank]).unwrap();
    // The worker looks only when woken (an hour between polls); headroom of one token.
    let pre = Arc::new(PrecommittedGroup::start(tp, 1, Duration::from_secs(3600)).unwrap());
    let decoder: Arc<Decoder> = Arc::new(Mutex::new(None));
    let fired = Arc::new(AtomicBool::new(false));
    {
        let (pre, decoder, fired) = (Arc::clone(&pre), Arc::clone(&decoder), fired.clone());
        faults.set_hook(Some(Arc::new(move |op| {
            if op != Operation::Unmap || fired.swap(true, Ordering::SeqCst) {
                return;
            }
            // Inside the release, which holds the group: a decode thread claims 300 tokens,
            // finds nothing ready and waits for the group.
            let p = Arc::clone(&pre);
            *decoder.lock().unwrap() = Some(std::thread::spawn(move || p.ensure_tokens(300)));
            while pre.shared.live.load(Ordering::SeqCst) != 300 {
                std::thread::yield_now();
            }
        })));
    }
    pre.release().unwrap();
    faults.set_hook(None);
    assert!(fired.load(Ordering::SeqCst));
    let got = decoder.lock().unwrap().take().unwrap().join().unwrap();
    assert!(matches!(got, Ok(Ensured::Inline(_))), "{got:?}");
    assert!(pre.committed_tokens() >= 300);
    // Giving back what lies ahead of the claims keeps the 300 promised tokens.
    pre.shrink_to_live().unwrap();
    assert!(pre.committed_tokens() >= 300, "{}", pre.committed_tokens());
    pre.with_ranks(|r| assert!(r[0].committed_tokens() >= 300));
    let tp = Arc::try_unwrap(pre).unwrap().stop();
    drop(tp);
    drop(vm);
    assert!(sim.ledger().is_empty());
}
