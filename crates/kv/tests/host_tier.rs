//! The host tier: a sequence's tokens moved to page-locked host memory and back, byte-exact,
//! at the same address, billed to the governor's host budget while there; the prefixes it
//! maps kept on the device and mapped again; refusals that change nothing; copies waited for
//! before anything they touch is handed on. On the simulator and on the host backend (whose
//! "device" memory is host memory: the same code with a plain copy).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::{tier_host, tier_manager, tier_sim, tiny, tokens_bytes, D0, TIER_G};
use kvvm_hal::decorate::Forward;
use kvvm_hal::{DeviceId, EventHandle, VirtualMemoryBackend};
use kvvm_kv::{
    HostTier, HostTierConfig, KvCacheError, KvLayout, LayoutPlan, PrefixCache, SequenceKv,
    SwapPhase,
};
use kvvm_vmm::VirtualMemory;

const G: u64 = TIER_G;

fn plan(vm: &VirtualMemory, layout: KvLayout) -> LayoutPlan {
    LayoutPlan::new(tiny(2048), layout, vm.granule()).unwrap()
}

fn host_used(vm: &VirtualMemory) -> (u64, u64, u64) {
    let h = vm.governor().snapshot().device(DeviceId::HOST);
    (h.committed, h.pooled, h.quarantined)
}

/// Writes `n` tokens, swaps the first `n` out and back, and checks every byte, the address,
/// the books on both sides at every step, and that nothing is left after.
fn round_trip(backend: Arc<dyn VirtualMemoryBackend>, layout: KvLayout, n: u64) {
    let vm = tier_manager(backend, None, None);
    let p = plan(&vm, layout);
    let tier = HostTier::new(&vm, HostTierConfig::default().slab_windows(4)).unwrap();
    let mut seq = SequenceKv::new(&vm, &p, 2048).unwrap();
    seq.ensure_tokens(n).unwrap();
    let data = tokens_bytes(p.geometry(), 1, 0, n, 0);
    seq.write_tokens(0, &data).unwrap();
    let address = seq.address();
    let committed = seq.committed_bytes();
    let mut swap = seq.swap_out(&tier, n, None).unwrap();
    assert_eq!(swap.phase(), SwapPhase::CopyingOut);
    assert_eq!(swap.bytes(), committed, "every window moves");
    assert!(seq.has_copies_in_flight());
    assert_eq!(
        host_used(&vm).0,
        committed,
        "billed to the host while there"
    );
    assert!(swap.is_done().unwrap());
    let released = seq.finish_swap_out(&mut swap).unwrap();
    assert_eq!((released, seq.committed_bytes()), (committed, 0));
    assert_eq!(swap.phase(), SwapPhase::OnHost);
    assert_eq!(vm.governor().snapshot().device(D0).committed, 0);
    seq.swap_in(&mut swap).unwrap();
    assert_eq!(swap.phase(), SwapPhase::CopyingIn);
    assert_eq!(seq.finish_swap_in(&mut swap).unwrap(), committed);
    assert_eq!((swap.phase(), swap.bytes()), (SwapPhase::Done, 0));
    assert_eq!(seq.address(), address, "the pointer is unchanged");
    assert_eq!(seq.committed_tokens(), n);
    let mut back = vec![0u8; data.len()];
    seq.read_tokens(0, &mut back).unwrap();
    assert!(
        back == data,
        "{layout:?}: the bytes differ after the round trip"
    );
    let s = tier.stats();
    assert_eq!(
        (s.swaps_out, s.swaps_in, s.held_bytes, s.failed),
        (1, 1, 0, 0)
    );
    assert_eq!(s.bytes_out, committed);
    assert_eq!(
        host_used(&vm),
        (0, s.pooled_bytes, 0),
        "free chunks stay pooled"
    );
    drop((seq, swap));
    assert_eq!(tier.trim(0), s.pooled_bytes);
    assert_eq!(host_used(&vm), (0, 0, 0));
}

#[test]
fn round_trips_are_byte_exact_at_the_same_address_on_the_simulator() {
    for layout in [
        KvLayout::TokenMajor,
        KvLayout::SeqMajor,
        KvLayout::HeadMajor,
    ] {
        for n in [1, 129, 1000] {
            round_trip(tier_sim(), layout, n);
        }
    }
}

#[test]
fn round_trips_are_byte_exact_at_the_same_address_on_the_host_backend() {
    let Some(b) = tier_host() else { return };
    let ledger = |b: &Arc<dyn VirtualMemoryBackend>| b.memory_info(D0).unwrap().free;
    let before = ledger(&b);
    for layout in [
        KvLayout::TokenMajor,
        KvLayout::SeqMajor,
        KvLayout::HeadMajor,
    ] {
        for n in [1, 129, 1000] {
            round_trip(Arc::clone(&b), layout, n);
        }
    }
    assert_eq!(ledger(&b), before);
}

#[test]
fn adjacent_windows_move_in_one_copy() {
    let vm = tier_manager(tier_sim(), None, None);
    let p = plan(&vm, KvLayout::TokenMajor);
    let tier = HostTier::new(&vm, HostTierConfig::default()).unwrap();
    let mut seq = SequenceKv::new(&vm, &p, 2048).unwrap();
    seq.ensure_tokens(1000).unwrap();
    // 1000 tokens of 512 B: 8 windows of 64 KiB, one run, into one new slab.
    let swap = seq.swap_out(&tier, 1000, None).unwrap();
    assert_eq!((swap.copies(), tier.stats().slabs), (1, 1));
    drop(swap);
    seq.release().unwrap();
    assert_eq!(host_used(&vm).0, 0);
}

#[test]
fn copies_are_cut_at_the_tiers_most_bytes_and_stay_byte_exact() {
    // 1000 tokens of 512 B: 8 windows of 64 KiB, adjacent on both sides.
    for (most, copies) in [
        (Some(3 * G), 3),
        (Some(3 * G + 1), 3),
        (Some(1), 8),
        (None, 1),
    ] {
        let vm = tier_manager(tier_sim(), None, None);
        let p = plan(&vm, KvLayout::TokenMajor);
        let tier = HostTier::new(&vm, HostTierConfig::default().max_copy_bytes(most)).unwrap();
        let mut seq = SequenceKv::new(&vm, &p, 2048).unwrap();
        seq.ensure_tokens(1000).unwrap();
        let data = tokens_bytes(p.geometry(), 1, 0, 1000, 0);
        seq.write_tokens(0, &data).unwrap();
        let mut swap = seq.swap_out(&tier, 1000, None).unwrap();
        assert_eq!(swap.copies(), copies, "{most:?}: copies out");
        seq.finish_swap_out(&mut swap).unwrap();
        seq.swap_in(&mut swap).unwrap();
        assert_eq!(swap.copies(), copies, "{most:?}: copies back");
        seq.finish_swap_in(&mut swap).unwrap();
        let mut back = vec![0u8; data.len()];
        seq.read_tokens(0, &mut back).unwrap();
        assert!(
            back == data,
            "{most:?}: the bytes differ after the round trip"
        );
        drop(swap);
        seq.release().unwrap();
        assert_eq!(host_used(&vm).0, 0);
    }
}

#[test]
fn a_mapped_prefix_stays_on_the_device_and_is_mapped_again() {
    let vm = tier_manager(tier_sim(), None, None);
    let p = plan(&vm, KvLayout::TokenMajor);
    let cache = PrefixCache::new(vm.clone(), p).unwrap();
    let tier = HostTier::new(&vm, HostTierConfig::default()).unwrap();
    let ids: Vec<u32> = (0..400).collect();
    let mut a = cache.admit(&ids, 2048).unwrap();
    let prompt = tokens_bytes(p.geometry(), 0, 0, 400, 400);
    a.sequence.write_tokens(0, &prompt).unwrap();
    cache.publish(&mut a.sequence).unwrap();
    drop(a);
    let mut b = cache.admit(&ids, 2048).unwrap();
    assert_eq!(b.hit_tokens, 400);
    b.sequence.ensure_tokens(600).unwrap();
    let mine = tokens_bytes(p.geometry(), 2, 400, 200, 0);
    b.sequence.write_tokens(400, &mine).unwrap();
    let shared = b.sequence.committed_bytes() - b.sequence.additional_owned_bytes();
    assert!(shared > 0);
    let mut swap = b.sequence.swap_out(&tier, 600, None).unwrap();
    assert_eq!(
        swap.bytes(),
        b.sequence.additional_owned_bytes(),
        "only private windows move"
    );
    b.sequence.finish_swap_out(&mut swap).unwrap();
    // The prefix is held by the swap: the cache cannot evict it (only its tail, which the
    // sequence had copied into its own windows).
    cache.evict(u64::MAX);
    assert_eq!(cache.stats().cached_entries, 1);
    b.sequence.swap_in(&mut swap).unwrap();
    b.sequence.finish_swap_in(&mut swap).unwrap();
    assert_eq!(
        b.sequence.committed_bytes() - b.sequence.additional_owned_bytes(),
        shared
    );
    assert_eq!(b.sequence.shared_tokens(), 400 * 512 / G * G / 512);
    let mut back = vec![0u8; 600 * 512];
    b.sequence.read_tokens(0, &mut back).unwrap();
    assert!(back[..400 * 512] == prompt[..] && back[400 * 512..] == mine[..]);
    // Once the swap is done the prefix is the cache's alone again.
    drop((b, swap));
    assert!(cache.evict(u64::MAX) > 0);
    assert_eq!(cache.stats().cached_entries, 0);
}

#[test]
fn a_sliding_sequence_comes_back_without_its_forgotten_tokens() {
    let vm = tier_manager(tier_sim(), None, None);
    let p = plan(&vm, KvLayout::TokenMajor);
    let tier = HostTier::new(&vm, HostTierConfig::default()).unwrap();
    let mut seq = SequenceKv::new(&vm, &p, 2048).unwrap();
    seq.use_window_handles();
    seq.ensure_tokens(1000).unwrap();
    let data = tokens_bytes(p.geometry(), 3, 0, 1000, 0);
    seq.write_tokens(0, &data).unwrap();
    seq.forget_tokens_before(600).unwrap();
    let mut swap = seq.swap_out(&tier, 1000, None).unwrap();
    let held = seq.committed_bytes();
    assert_eq!(swap.bytes(), held);
    seq.finish_swap_out(&mut swap).unwrap();
    seq.swap_in(&mut swap).unwrap();
    seq.finish_swap_in(&mut swap).unwrap();
    assert_eq!((seq.forgotten_tokens(), seq.committed_bytes()), (600, held));
    let mut back = vec![0u8; 400 * 512];
    seq.read_tokens(600, &mut back).unwrap();
    assert!(back[..] == data[600 * 512..]);
    assert!(matches!(
        seq.read_tokens(0, &mut [0u8; 512]),
        Err(KvCacheError::Forgotten { .. })
    ));
}

#[test]
fn a_full_host_budget_refuses_and_changes_nothing() {
    let vm = tier_manager(tier_sim(), None, Some(4 * G));
    let p = plan(&vm, KvLayout::TokenMajor);
    let tier = HostTier::new(&vm, HostTierConfig::default()).unwrap();
    let mut seq = SequenceKv::new(&vm, &p, 2048).unwrap();
    seq.ensure_tokens(1000).unwrap();
    let e = seq.swap_out(&tier, 1000, None).unwrap_err();
    assert_eq!(
        e.never_fits().map(|n| n.device),
        Some(DeviceId::HOST),
        "{e}"
    );
    let mut small = SequenceKv::new(&vm, &p, 2048).unwrap();
    small.ensure_tokens(300).unwrap();
    let mut held = small.swap_out(&tier, 300, None).unwrap();
    small.finish_swap_out(&mut held).unwrap();
    let mut other = SequenceKv::new(&vm, &p, 2048).unwrap();
    other.ensure_tokens(200).unwrap();
    let e = other.swap_out(&tier, 200, None).unwrap_err();
    assert_eq!(
        e.backpressure().map(|b| b.device),
        Some(DeviceId::HOST),
        "{e}"
    );
    assert!(!other.has_copies_in_flight());
    assert_eq!(other.committed_tokens(), 200);
    assert_eq!(host_used(&vm).0, 3 * G);
    drop(held);
    assert_eq!(
        host_used(&vm).0,
        0,
        "a swap dropped on the host gives its chunks back"
    );
}

#[test]
fn a_swap_in_refused_for_memory_waits_on_the_host_and_comes_back_later() {
    let vm = tier_manager(tier_sim(), Some(10 * G), None);
    let p = plan(&vm, KvLayout::TokenMajor);
    let tier = HostTier::new(&vm, HostTierConfig::default()).unwrap();
    let mut seq = SequenceKv::new(&vm, &p, 2048).unwrap();
    seq.ensure_tokens(1000).unwrap();
    let data = tokens_bytes(p.geometry(), 4, 0, 1000, 0);
    seq.write_tokens(0, &data).unwrap();
    let mut swap = seq.swap_out(&tier, 1000, None).unwrap();
    seq.finish_swap_out(&mut swap).unwrap();
    let mut hog = SequenceKv::new(&vm, &p, 2048).unwrap();
    hog.ensure_tokens(1000).unwrap();
    let e = seq.swap_in(&mut swap).unwrap_err();
    assert!(e.backpressure().is_some(), "{e}");
    assert_eq!(
        (swap.phase(), seq.committed_bytes()),
        (SwapPhase::OnHost, 0)
    );
    drop(hog);
    seq.swap_in(&mut swap).unwrap();
    seq.finish_swap_in(&mut swap).unwrap();
    let mut back = vec![0u8; data.len()];
    seq.read_tokens(0, &mut back).unwrap();
    assert!(back == data);
}

#[test]
fn misuse_is_refused_before_any_copy() {
    let vm = tier_manager(tier_sim(), None, None);
    let p = plan(&vm, KvLayout::TokenMajor);
    let tier = HostTier::new(&vm, HostTierConfig::default()).unwrap();
    let mut seq = SequenceKv::new(&vm, &p, 2048).unwrap();
    seq.ensure_tokens(100).unwrap();
    assert!(matches!(
        seq.swap_out(&tier, 101, None),
        Err(KvCacheError::NotCommitted { .. })
    ));
    let mut swap = seq.swap_out(&tier, 100, None).unwrap();
    assert!(matches!(
        seq.swap_out(&tier, 100, None),
        Err(KvCacheError::Swap { .. })
    ));
    assert!(matches!(
        seq.swap_in(&mut swap),
        Err(KvCacheError::Swap { .. })
    ));
    let mut other = SequenceKv::new(&vm, &p, 2048).unwrap();
    assert!(matches!(
        other.finish_swap_out(&mut swap),
        Err(KvCacheError::Swap { .. })
    ));
    seq.finish_swap_out(&mut swap).unwrap();
    other.ensure_tokens(1).unwrap();
    assert!(matches!(
        other.swap_in(&mut swap),
        Err(KvCacheError::InUse { .. })
    ));
    other.release().unwrap();
    // Into another empty sequence of the plan: allowed (the address is that sequence's).
    other.swap_in(&mut swap).unwrap();
    other.finish_swap_in(&mut swap).unwrap();
    assert!(matches!(
        other.finish_swap_in(&mut swap),
        Err(KvCacheError::Swap { .. })
    ));
    let foreign = tier_manager(tier_sim(), None, None);
    let far = HostTier::new(&foreign, HostTierConfig::default()).unwrap();
    assert!(matches!(
        other.swap_out(&far, 1, None),
        Err(KvCacheError::OtherManager { .. })
    ));
}

/// Events that say "not done" until released, counting the waits: copies that are really in
/// flight, as on a GPU.
struct Slow {
    inner: Arc<dyn VirtualMemoryBackend>,
    waits: AtomicU64,
}

impl Forward for Slow {
    fn inner(&self) -> &dyn VirtualMemoryBackend {
        &*self.inner
    }
    fn event_query(&self, event: EventHandle) -> kvvm_hal::BackendResult<bool> {
        self.inner.event_query(event).map(|_| false)
    }
    fn event_wait(&self, event: EventHandle) -> kvvm_hal::BackendResult<()> {
        self.waits.fetch_add(1, Ordering::SeqCst);
        self.inner.event_wait(event)
    }
}

#[test]
fn copies_in_flight_are_waited_for_before_their_memory_is_handed_on() {
    let slow = Arc::new(Slow {
        inner: tier_sim(),
        waits: AtomicU64::new(0),
    });
    let vm = tier_manager(slow.clone(), None, None);
    let p = plan(&vm, KvLayout::TokenMajor);
    let tier = HostTier::new(&vm, HostTierConfig::default()).unwrap();
    let mut seq = SequenceKv::new(&vm, &p, 2048).unwrap();
    seq.ensure_tokens(500).unwrap();
    let swap = seq.swap_out(&tier, 500, None).unwrap();
    assert!(!swap.is_done().unwrap());
    // Releasing the sequence waits for the copies reading it.
    seq.release().unwrap();
    assert_eq!(slow.waits.load(Ordering::SeqCst), 1);
    assert!(!seq.has_copies_in_flight());
    // A swap dropped with its copies in flight waits for them before its chunks go back.
    seq.ensure_tokens(500).unwrap();
    let swap2 = seq.swap_out(&tier, 500, None).unwrap();
    drop(swap);
    drop(swap2);
    assert_eq!(slow.waits.load(Ordering::SeqCst), 2);
    assert_eq!(host_used(&vm).0, 0);
    seq.release().unwrap();
}
