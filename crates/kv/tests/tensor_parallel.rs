//! A tensor-parallel sequence's growth is decided never-fits against everything its ranks
//! would hold together: ranks that each fit their device may together exceed the process
//! budget for good, and then retrying never helps.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kvvm_governor::{Governor, GovernorConfig, Limit};
use kvvm_hal::{DeviceId, VirtualMemoryBackend};
use kvvm_kv::{KvDtype, KvGeometry, KvLayout, LayoutPlan, SequenceKv, TensorParallelSequence};
use kvvm_sim::{LatencyMode, LatencyModel, SimBackend, SimConfig};
use kvvm_vmm::{VirtualMemory, VmmConfig};

const G: u64 = 64 << 10;

#[test]
fn ranks_that_fit_their_devices_but_not_the_process_budget_never_fit() {
    let sim = Arc::new(SimBackend::new(
        SimConfig::uniform(2, G, 64 * G).with_latency(LatencyModel::zero(), LatencyMode::Account),
    ));
    let backend: Arc<dyn VirtualMemoryBackend> = sim.clone();
    // 8 windows per device, 10 over both.
    let gov = Governor::new(
        GovernorConfig::default()
            .default_device_budget(8 * G)
            .process_budget(10 * G),
    );
    let vms: Vec<VirtualMemory> = (0..2)
        .map(|d| {
            VirtualMemory::new(
                backend.clone(),
                DeviceId(d),
                gov.clone(),
                VmmConfig::default().pool_cap_bytes(0),
            )
            .unwrap()
        })
        .collect();
    // Token-major, 1 KiB a token: 64 tokens a window.
    let geometry = KvGeometry::with_dtype(2, 2, 64, KvDtype::F16, 1024).unwrap();
    let plan = LayoutPlan::new(geometry, KvLayout::TokenMajor, G).unwrap();
    let ranks = vms
        .iter()
        .map(|vm| {
            let mut s = SequenceKv::new(vm, &plan, 1024).unwrap();
            s.ensure_tokens(64).unwrap();
            s
        })
        .collect();
    let mut tp = TensorParallelSequence::new(ranks).unwrap();
    // 6 windows a rank: each fits its device's 8, together 12 of a process budget of 10.
    for _ in 0..2 {
        let e = tp.ensure_tokens(384).unwrap_err();
        assert!(!e.is_retryable(), "{e}");
        let n = e.never_fits().unwrap();
        assert_eq!(
            (n.needed, n.limit, n.limit_bytes),
            (12 * G, Limit::ProcessBudget, 10 * G)
        );
        assert_eq!(tp.committed_tokens(), 64);
        assert_eq!(gov.snapshot().used(), 2 * G, "nothing was granted");
    }
    // Memory another reservation holds can be freed: backpressure.
    let mut outside = vms[0].reserve(2 * G).unwrap();
    outside.commit(2 * G).unwrap();
    let e = tp.ensure_tokens(320).unwrap_err();
    assert!(e.backpressure().is_some(), "{e}");
    assert_eq!(tp.committed_tokens(), 64);
    drop(outside);
    // 5 windows a rank: exactly the process budget.
    tp.ensure_tokens(320).unwrap();
    assert_eq!(gov.snapshot().used(), 10 * G);
    drop(tp);
    drop(vms);
    assert!(sim.ledger().is_empty());
}
