//! Sequences in the slots of one strided reservation: a batch whose layers are strided arrays,
//! each sequence growing, sharing and releasing on its own; a slot is reused after release.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kvvm_hal::{DeviceId, ErrorKind, Operation, VirtualMemoryBackend};
use kvvm_kv::{
    KvCacheError, KvDtype, KvGeometry, KvLayout, LayoutPlan, PrefixCache, SequenceKv,
    SharedDevicePrefix,
};
use kvvm_sim::{FaultRule, LatencyMode, LatencyModel, SimBackend, SimConfig};
use kvvm_vmm::{GranularityChoice, VirtualMemory, VmmConfig};

const D0: DeviceId = DeviceId(0);

fn world(g: u64) -> (Arc<SimBackend>, VirtualMemory) {
    let sim = Arc::new(SimBackend::new(
        SimConfig::single(g, 4096 * g).with_latency(LatencyModel::zero(), LatencyMode::Account),
    ));
    let backend: Arc<dyn VirtualMemoryBackend> = sim.clone();
    let vm = VirtualMemory::new(
        backend,
        D0,
        kvvm_governor::Governor::unlimited(),
        VmmConfig::default()
            .pool_cap_bytes(0)
            .granularity(GranularityChoice::Minimum),
    )
    .unwrap();
    (sim, vm)
}

fn batch(vm: &VirtualMemory, plan: &LayoutPlan, n: u64, max_tokens: u64) -> Vec<SequenceKv> {
    vm.reserve_strided(n, plan.reservation_bytes())
        .unwrap()
        .into_iter()
        .map(|r| SequenceKv::in_reservation(vm, plan, max_tokens, r).unwrap())
        .collect()
}

fn token(geo: &KvGeometry, seed: u8) -> Vec<u8> {
    (0..geo.bytes_per_token())
        .map(|i| (i as u8) ^ seed)
        .collect()
}

#[test]
fn every_layer_of_a_batch_is_one_strided_array() {
    let g = 4096;
    let (_sim, vm) = world(g);
    for layout in KvLayout::ALL {
        let geo = KvGeometry::with_dtype(2, 2, 32, KvDtype::F16, 256).unwrap();
        let plan = LayoutPlan::new(geo, layout, g).unwrap();
        let seqs = batch(&vm, &plan, 4, 256);
        let stride = seqs[1].address().0 - seqs[0].address().0;
        assert_eq!(stride, plan.reservation_bytes());
        for l in 0..2 {
            let k0 = seqs[0].layer_pointers(l).unwrap().key.0;
            for (i, s) in seqs.iter().enumerate() {
                assert_eq!(s.layer_pointers(l).unwrap().key.0, k0 + i as u64 * stride);
            }
        }
    }
}

#[test]
fn slots_grow_independently_and_are_reused_after_release() {
    let g = 4096;
    let (sim, vm) = world(g);
    let geo = KvGeometry::with_dtype(2, 2, 32, KvDtype::F16, 256).unwrap();
    let plan = LayoutPlan::new(geo, KvLayout::TokenMajor, g).unwrap();
    let mut seqs = batch(&vm, &plan, 3, 256);
    seqs[0].ensure_tokens(20).unwrap();
    seqs[2].ensure_tokens(3).unwrap();
    assert_eq!(seqs[1].committed_bytes(), 0);
    let t = token(&geo, 7);
    seqs[0].write_token(19, &t).unwrap();
    let mut out = vec![0; t.len()];
    seqs[0].read_token(19, &mut out).unwrap();
    assert_eq!(out, t);
    assert!(seqs[1].is_empty() && !seqs[0].is_empty());
    seqs[0].release().unwrap();
    assert!(seqs[0].is_empty());
    seqs[0].ensure_tokens(5).unwrap();
    drop(seqs);
    assert!(sim.ledger().is_empty());
}

#[test]
fn a_slot_in_use_or_of_the_wrong_size_is_refused() {
    let g = 4096;
    let (_sim, vm) = world(g);
    let geo = KvGeometry::with_dtype(2, 2, 32, KvDtype::F16, 256).unwrap();
    let plan = LayoutPlan::new(geo, KvLayout::SeqMajor, g).unwrap();
    let small = vm.reserve(g).unwrap();
    assert!(matches!(
        SequenceKv::in_reservation(&vm, &plan, 256, small),
        Err(KvCacheError::PlanMismatch { .. })
    ));
    let mut r = vm.reserve(plan.reservation_bytes()).unwrap();
    r.commit(g).unwrap();
    assert!(matches!(
        SequenceKv::in_reservation(&vm, &plan, 256, r),
        Err(KvCacheError::PlanMismatch { .. })
    ));
}

#[test]
fn a_prefix_is_owned_and_attached_inside_slots() {
    let g = 4096;
    let (sim, vm) = world(g);
    // 512 B per token, 1 fragment: 8 tokens per window.
    let geo = KvGeometry::with_dtype(2, 2, 32, KvDtype::F16, 256).unwrap();
    let plan = LayoutPlan::new(geo, KvLayout::TokenMajor, g).unwrap();
    let mut seqs = batch(&vm, &plan, 3, 256);
    let prefix = SharedDevicePrefix::own_in(&mut seqs[0], 32).unwrap();
    let t = token(&geo, 3);
    let mut all = Vec::new();
    for _ in 0..32 {
        all.extend_from_slice(&t);
    }
    seqs[0].write_tokens(0, &all).unwrap();
    seqs[0].seal_prefix().unwrap();
    for s in &mut seqs[1..] {
        prefix.attach_to(s).unwrap();
        assert_eq!(s.additional_owned_bytes(), 0);
        let mut out = vec![0; all.len()];
        s.read_tokens(0, &mut out).unwrap();
        assert_eq!(out, all);
        assert!(matches!(
            s.write_token(0, &t),
            Err(KvCacheError::WriteIntoSharedPrefix { .. })
        ));
    }
    // Attaching to a slot in use is refused, with nothing changed.
    let before = sim.ledger().mappings.len();
    assert!(prefix.attach_to(&mut seqs[1]).is_err());
    assert_eq!(sim.ledger().mappings.len(), before);
    drop(seqs);
    drop(prefix);
    assert!(sim.ledger().is_empty());
}

#[test]
fn admit_into_a_slot_undoes_itself_on_a_driver_fault() {
    let g = 4096;
    let (sim, vm) = world(g);
    let geo = KvGeometry::with_dtype(2, 2, 32, KvDtype::F16, 256).unwrap();
    let plan = LayoutPlan::new(geo, KvLayout::TokenMajor, g).unwrap();
    let cache = PrefixCache::new(vm.clone(), plan).unwrap();
    let mut seqs = batch(&vm, &plan, 2, 256);
    let ids: Vec<u32> = (0..40).collect();
    sim.inject(FaultRule::nth(Operation::Map, 2, ErrorKind::OutOfMemory));
    assert!(cache.admit_into(&ids, &mut seqs[0]).is_err());
    assert!(seqs[0].is_empty(), "{:?}", seqs[0]);
    sim.clear_faults();
    let a = cache.admit_into(&ids, &mut seqs[0]).unwrap();
    assert_eq!(a.hit_tokens, 0);
    assert_eq!(seqs[0].committed_tokens(), 40);
    let t = token(&geo, 1);
    let mut all = Vec::new();
    for _ in 0..40 {
        all.extend_from_slice(&t);
    }
    seqs[0].write_tokens(0, &all).unwrap();
    cache.publish(&mut seqs[0]).unwrap();
    let b = cache.admit_into(&ids, &mut seqs[1]).unwrap();
    assert!(b.hit_tokens >= 32, "{b:?}");
    assert!(b.shared_bytes > 0);
    drop(seqs);
    cache.clear();
    drop(cache);
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
}
