//! The prefix cache's host level: an evicted prefix copied to the host tier (billed to the
//! host's budget while there) and copied back at a later hit, byte-exact, then published and
//! shared read-only again; the least recently used host entry dropped for room; a failed copy
//! back falling back to a prefill; nothing held after. On the simulator and the host backend.
//! And the origin of a hit's bytes (`AdmissionInfo::hit_origin`): one for every hit of one
//! prefill's bytes, whatever entry or level they come from, another for the same tokens
//! prefilled again or put together from two prefills.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::{tier_host, tier_manager, tier_sim, tiny, D0, TIER_G};
use kvvm_hal::decorate::FaultInjecting;
use kvvm_hal::{DeviceId, Operation, VirtualMemoryBackend};
use kvvm_kv::{
    HostTier, HostTierConfig, KvCacheError, KvLayout, LayoutPlan, PrefixCache, PublishOutcome,
    SequenceKv,
};
use kvvm_vmm::VirtualMemory;

const G: u64 = TIER_G;

/// A cache with a host level over `vm` (512 bytes a token: 128 tokens a window token-major).
fn cache(vm: &VirtualMemory, layout: KvLayout) -> (Arc<PrefixCache>, Arc<HostTier>) {
    let plan = LayoutPlan::new(tiny(2048), layout, vm.granule()).unwrap();
    let tier = HostTier::new(vm, HostTierConfig::default().slab_windows(4)).unwrap();
    let cache = PrefixCache::new(vm.clone(), plan).unwrap();
    cache.attach_host_tier(Arc::clone(&tier)).unwrap();
    (cache, tier)
}

/// Bytes of tokens `first..first + n`: a pattern that differs from token to token.
fn pattern(first: u64, n: u64) -> Vec<u8> {
    (first * 512..(first + n) * 512)
        .map(|i| (i % 251) as u8 ^ 0x5a)
        .collect()
}

fn read(seq: &SequenceKv, first: u64, n: u64) -> Vec<u8> {
    let mut out = vec![0u8; (n * 512) as usize];
    seq.read_tokens(first, &mut out).unwrap();
    out
}

/// Admits `ids`, writes their bytes past the hit, publishes; returns the sequence.
fn published(cache: &PrefixCache, ids: &[u32]) -> SequenceKv {
    let n = ids.len() as u64;
    let mut a = cache.admit(ids, 2048).unwrap();
    let hit = a.hit_tokens;
    a.sequence
        .write_tokens(hit, &pattern(hit, n - hit))
        .unwrap();
    assert!(matches!(
        cache.publish(&mut a.sequence).unwrap(),
        PublishOutcome::Published { .. }
    ));
    a.sequence
}

/// The device's committed, shared and quarantined bytes (released handles may stay pooled).
fn device_held(vm: &VirtualMemory) -> (u64, u64, u64) {
    let d = vm.governor().snapshot().device(D0);
    (d.committed, d.shared, d.quarantined)
}

fn host_used(vm: &VirtualMemory) -> (u64, u64) {
    let h = vm.governor().snapshot().device(DeviceId::HOST);
    (h.committed, h.quarantined)
}

/// Publishes a prompt, evicts it to the host, hits it there (byte-exact), publishes it again
/// and hits it on the device (read-only), then lets everything go.
fn round_trip(backend: Arc<dyn VirtualMemoryBackend>, layout: KvLayout) {
    let vm = tier_manager(backend, None, None);
    let (cache, tier) = cache(&vm, layout);
    let n = 320u64;
    let ids: Vec<u32> = (0..n as u32).collect();
    drop(published(&cache, &ids));
    assert!(cache.evict(u64::MAX) > 0);
    let s = cache.stats();
    assert_eq!(
        (s.cached_entries, s.evicted_to_host, s.host_entries),
        (0, 1, 1)
    );
    assert!(s.host_bytes > 0);
    assert_eq!(host_used(&vm), (s.host_bytes, 0), "billed to the host");
    assert_eq!(vm.governor().snapshot().device(D0).shared, 0);

    let mut longer = ids.clone();
    longer.extend(5000..5040);
    let mut b = cache.admit(&longer, 2048).unwrap();
    assert_eq!((b.hit_tokens, b.host_hit_tokens), (n, n), "{layout:?}");
    assert!(
        read(&b.sequence, 0, n) == pattern(0, n),
        "{layout:?}: bytes differ"
    );
    b.sequence.write_tokens(n, &pattern(n, 40)).unwrap();
    assert!(matches!(
        cache.publish(&mut b.sequence).unwrap(),
        PublishOutcome::Published { .. }
    ));
    let c = cache.admit(&longer, 2048).unwrap();
    assert_eq!(
        (c.hit_tokens, c.host_hit_tokens),
        (352, 0),
        "a device hit now"
    );
    // Token-major, a window holds at most 128 tokens: some are mapped read-only (a fragment
    // of the other layouts may hold 352 tokens in less than a window: copied).
    let shared = c.shared_bytes > 0;
    assert!(shared || layout != KvLayout::TokenMajor);
    let mut c = c.sequence;
    assert!(read(&c, 0, 352) == pattern(0, 352));
    if shared {
        assert!(matches!(
            c.write_tokens(0, &pattern(0, 1)),
            Err(KvCacheError::WriteIntoSharedPrefix { .. })
        ));
    }
    let s = cache.stats();
    assert_eq!((s.host_hits, s.host_tokens_saved, s.host_failed), (1, n, 0));
    drop((b, c));
    cache.clear();
    assert_eq!(cache.stats().host_entries, 0);
    assert_eq!(host_used(&vm), (0, 0));
    tier.trim(0);
    assert_eq!(vm.governor().snapshot().device(DeviceId::HOST).used(), 0);
    assert_eq!(device_held(&vm), (0, 0, 0));
}

#[test]
fn an_evicted_prefix_comes_back_from_the_host_byte_exact_on_the_simulator() {
    for layout in [
        KvLayout::TokenMajor,
        KvLayout::SeqMajor,
        KvLayout::HeadMajor,
    ] {
        round_trip(tier_sim(), layout);
    }
}

#[test]
fn an_evicted_prefix_comes_back_from_the_host_byte_exact_on_the_host_backend() {
    let Some(backend) = tier_host() else { return };
    for layout in [KvLayout::TokenMajor, KvLayout::HeadMajor] {
        round_trip(Arc::clone(&backend), layout);
    }
}

#[test]
fn a_host_hit_past_a_shorter_device_hit_writes_no_read_only_window() {
    let vm = tier_manager(tier_sim(), None, None);
    let (cache, _tier) = cache(&vm, KvLayout::TokenMajor);
    let ids: Vec<u32> = (0..384).collect();
    drop(published(&cache, &ids));
    cache.evict(u64::MAX);
    // The first window's tokens come back from the host and are published on the device.
    let mut short: Vec<u32> = ids[..128].to_vec();
    short.push(9999);
    let mut a = cache.admit(&short, 2048).unwrap();
    assert_eq!(a.host_hit_tokens, 128);
    a.sequence.write_tokens(128, &pattern(128, 1)).unwrap();
    cache.publish(&mut a.sequence).unwrap();
    drop(a);
    let mut longer = ids.clone();
    longer.extend([7, 7, 7]);
    let b = cache.admit(&longer, 2048).unwrap();
    assert_eq!((b.hit_tokens, b.host_hit_tokens), (384, 384));
    assert_eq!(b.shared_bytes, G, "the device's window mapped read-only");
    let mut b = b.sequence;
    assert!(read(&b, 0, 384) == pattern(0, 384));
    assert!(matches!(
        b.write_tokens(0, &pattern(0, 1)),
        Err(KvCacheError::WriteIntoSharedPrefix { .. })
    ));
}

#[test]
fn a_longer_host_entry_subsumes_its_prefixes() {
    let vm = tier_manager(tier_sim(), None, None);
    let (cache, _tier) = cache(&vm, KvLayout::TokenMajor);
    let ids: Vec<u32> = (0..256).collect();
    drop(published(&cache, &ids[..128]));
    cache.evict(u64::MAX);
    drop(published(&cache, &ids));
    cache.evict(u64::MAX);
    let s = cache.stats();
    assert_eq!((s.evicted_to_host, s.host_entries, s.host_hits), (2, 1, 1));
    // The shorter prefix, back on the device from the longer entry, evicted again: the host
    // holds it already (no copy, no second entry).
    drop(published(&cache, &ids[..128]));
    assert_eq!(cache.stats().host_hits, 2);
    cache.evict(u64::MAX);
    let s = cache.stats();
    assert_eq!(
        (s.evicted_to_host, s.host_entries, s.host_bytes),
        (2, 1, 2 * G)
    );
}

#[test]
fn a_caller_refusing_host_hits_prefills() {
    let vm = tier_manager(tier_sim(), None, None);
    let (cache, _tier) = cache(&vm, KvLayout::TokenMajor);
    let ids: Vec<u32> = (0..256).collect();
    drop(published(&cache, &ids));
    cache.evict(u64::MAX);
    let plan = *cache.plan();
    let mut seq = SequenceKv::new(&vm, &plan, 2048).unwrap();
    let info = cache
        .admit_into_with_host(&ids, &mut seq, u64::MAX)
        .unwrap();
    assert_eq!((info.hit_tokens, info.host_hit_tokens), (0, 0));
    seq.release().unwrap();
    // A host hit shorter than asked for is not taken either.
    let info = cache.admit_into_with_host(&ids, &mut seq, 257).unwrap();
    assert_eq!(info.hit_tokens, 0);
    seq.release().unwrap();
    let info = cache.admit_into_with_host(&ids, &mut seq, 256).unwrap();
    assert_eq!(info.host_hit_tokens, 256);
}

#[test]
fn a_full_host_budget_drops_the_least_recently_used_host_entry() {
    // Room for one prefix of 3 windows on the host.
    let vm = tier_manager(tier_sim(), None, Some(3 * G));
    let (cache, _tier) = cache(&vm, KvLayout::TokenMajor);
    let a: Vec<u32> = (0..320).collect();
    let b: Vec<u32> = (1000..1320).collect();
    drop(published(&cache, &a));
    cache.evict(u64::MAX);
    drop(published(&cache, &b));
    cache.evict(u64::MAX);
    let s = cache.stats();
    assert_eq!(
        (s.evicted_to_host, s.host_entries, s.host_evictions),
        (2, 1, 1)
    );
    assert_eq!(host_used(&vm).0, 3 * G);
    let plan = *cache.plan();
    let mut seq = SequenceKv::new(&vm, &plan, 2048).unwrap();
    assert_eq!(cache.admit_into(&a, &mut seq).unwrap().hit_tokens, 0);
    seq.release().unwrap();
    assert_eq!(cache.admit_into(&b, &mut seq).unwrap().host_hit_tokens, 320);
}

#[test]
fn a_swap_needing_the_host_budget_drops_host_prefixes_first() {
    let vm = tier_manager(tier_sim(), None, Some(3 * G));
    let (cache, tier) = cache(&vm, KvLayout::TokenMajor);
    let a: Vec<u32> = (0..320).collect();
    drop(published(&cache, &a));
    cache.evict(u64::MAX);
    assert_eq!(cache.stats().host_entries, 1);
    let plan = *cache.plan();
    let mut seq = SequenceKv::new(&vm, &plan, 2048).unwrap();
    seq.ensure_tokens(300).unwrap();
    let mut swap = seq.swap_out(&tier, 300, None).unwrap();
    seq.finish_swap_out(&mut swap).unwrap();
    assert_eq!(cache.stats().host_entries, 0, "the governor's host reclaim");
    assert_eq!(host_used(&vm).0, 3 * G);
}

/// The host level's chunks and a swap's in one page-locked allocation (the engine prewarms
/// one): a second swap refused on the host takes the chunks the host level gave back.
#[test]
fn a_swap_takes_the_chunks_host_prefixes_give_back_in_a_shared_allocation() {
    let vm = tier_manager(tier_sim(), None, Some(8 * G));
    let plan = LayoutPlan::new(tiny(2048), KvLayout::TokenMajor, vm.granule()).unwrap();
    let tier = HostTier::new(&vm, HostTierConfig::default().slab_windows(8)).unwrap();
    tier.prewarm(8 * G).unwrap();
    let cache = PrefixCache::new(vm.clone(), plan).unwrap();
    cache.attach_host_tier(Arc::clone(&tier)).unwrap();
    let ids: Vec<u32> = (0..320).collect();
    drop(published(&cache, &ids));
    cache.evict(u64::MAX);
    assert_eq!(cache.stats().host_bytes, 3 * G);
    let mut a = SequenceKv::new(&vm, &plan, 2048).unwrap();
    a.ensure_tokens(512).unwrap();
    let mut sa = a.swap_out(&tier, 512, None).unwrap();
    a.finish_swap_out(&mut sa).unwrap();
    let mut b = SequenceKv::new(&vm, &plan, 2048).unwrap();
    b.ensure_tokens(384).unwrap();
    let mut sb = b.swap_out(&tier, 384, None).unwrap();
    b.finish_swap_out(&mut sb).unwrap();
    assert_eq!((sa.bytes(), sb.bytes()), (4 * G, 3 * G));
    assert_eq!(cache.stats().host_entries, 0);
    assert_eq!(tier.stats().slabs, 1);
}

/// A cache with a host level over a simulator whose calls faults can be armed on, with the
/// prompt `0..256` published (its sequence let go): the faults, the manager, the cache, its
/// tier and the prompt.
fn published_under_faults() -> (
    Arc<FaultInjecting>,
    VirtualMemory,
    Arc<PrefixCache>,
    Arc<HostTier>,
    Vec<u32>,
) {
    let faults = Arc::new(FaultInjecting::new(tier_sim()));
    let backend: Arc<dyn VirtualMemoryBackend> = faults.clone();
    let vm = tier_manager(backend, None, None);
    let (cache, tier) = cache(&vm, KvLayout::TokenMajor);
    let ids: Vec<u32> = (0..256).collect();
    drop(published(&cache, &ids));
    (faults, vm, cache, tier, ids)
}

/// A failed copy back (every copy from the host fails): the request is admitted as a miss
/// of the host and prefills; the host entry is dropped; nothing is held after.
#[test]
fn a_failed_copy_back_falls_back_to_a_prefill() {
    let (faults, vm, cache, tier, ids) = published_under_faults();
    cache.evict(u64::MAX);
    faults.arm(&[Operation::CopyFromHost], &[1]);
    let a = cache.admit(&ids, 2048).unwrap();
    assert!(!faults.disarm().is_empty());
    assert_eq!((a.hit_tokens, a.host_hit_tokens), (0, 0));
    let s = cache.stats();
    assert_eq!((s.host_failed, s.host_entries), (1, 0));
    drop(a);
    cache.clear();
    tier.trim(0);
    assert_eq!(vm.governor().snapshot().device(DeviceId::HOST).used(), 0);
    assert_eq!(device_held(&vm), (0, 0, 0));
}

/// A failed copy to the host: the prefix is forgotten, its device memory freed, the host's
/// books empty.
#[test]
fn a_failed_copy_out_forgets_the_prefix() {
    let (faults, vm, cache, tier, _) = published_under_faults();
    faults.arm(&[Operation::CopyToHost], &[1]);
    assert!(cache.evict(u64::MAX) > 0);
    assert!(!faults.disarm().is_empty());
    let s = cache.stats();
    assert_eq!(
        (s.host_failed, s.host_entries, s.evicted_to_host),
        (1, 0, 0)
    );
    assert_eq!(host_used(&vm), (0, 0));
    tier.trim(0);
    assert_eq!(vm.governor().snapshot().device(DeviceId::HOST).used(), 0);
    assert_eq!(device_held(&vm), (0, 0, 0));
}

/// 512 bytes for each token id: what a token's KV would be (depends on the id only).
fn id_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter()
        .flat_map(|&id| (0..512u64).map(move |j| ((u64::from(id) * 31 + j) % 251) as u8))
        .collect()
}

/// Threads admitting four prompts (each hit checked byte for byte, the rest written and
/// published) while another evicts everything to a host level whose budget holds three of
/// their entries (six windows, two an entry): whatever the interleaving, every hit holds its
/// tokens' bytes, the host level stays within its budget, and nothing is held after. (How
/// many entries the host holds at the end depends on the interleaving: a slab of the tier's
/// default four windows, or only the two missing when four would pass the budget.)
#[test]
fn concurrent_admissions_and_evictions_keep_every_hit_byte_exact() {
    let vm = tier_manager(tier_sim(), None, Some(6 * G));
    let (cache, tier) = cache(&vm, KvLayout::TokenMajor);
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|p| (p * 10_000..p * 10_000 + 320).collect())
        .collect();
    let done = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..3usize {
            let (cache, prompts, done) = (&cache, &prompts, &done);
            s.spawn(move || {
                for round in 0..24usize {
                    let mut ids = prompts[(t + round) % 4].clone();
                    ids.push(77);
                    let n = ids.len() as u64;
                    let mut a = cache.admit(&ids, 2048).unwrap();
                    let hit = a.hit_tokens;
                    let h = hit as usize;
                    assert!(
                        read(&a.sequence, 0, hit) == id_bytes(&ids[..h]),
                        "hit {hit}"
                    );
                    a.sequence.write_tokens(hit, &id_bytes(&ids[h..])).unwrap();
                    cache.publish(&mut a.sequence).unwrap();
                    assert_eq!(a.sequence.committed_tokens(), n);
                }
                done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            });
        }
        let (cache, done) = (&cache, &done);
        s.spawn(move || {
            while done.load(std::sync::atomic::Ordering::SeqCst) < 3 {
                cache.evict(u64::MAX);
            }
        });
    });
    // Whatever the evicting thread managed meanwhile, what is cached now goes to the host.
    cache.evict(u64::MAX);
    let s = cache.stats();
    assert!(s.evicted_to_host > 0, "{s:?}");
    assert!(s.host_bytes <= 6 * G && s.host_entries <= 3, "{s:?}");
    assert!(vm.governor().snapshot().device(DeviceId::HOST).used() <= 6 * G);
    assert_eq!(s.host_failed, 0);
    cache.clear();
    tier.trim(0);
    assert_eq!(vm.governor().snapshot().device(DeviceId::HOST).used(), 0);
    assert_eq!(device_held(&vm), (0, 0, 0));
}

/// Admits `ids` (host hits refused: prefilled past the device's hit), writes `salt`'s bytes
/// past the hit, publishes; returns the sequence and the admission's hit origin.
fn prefilled(cache: &PrefixCache, ids: &[u32], salt: u8) -> (SequenceKv, u64) {
    let n = ids.len() as u64;
    let mut seq = SequenceKv::new(cache.vm(), cache.plan(), 2048).unwrap();
    let info = cache.admit_into_with_host(ids, &mut seq, u64::MAX).unwrap();
    let hit = info.hit_tokens;
    let bytes: Vec<u8> = pattern(hit, n - hit).iter().map(|b| b ^ salt).collect();
    seq.write_tokens(hit, &bytes).unwrap();
    cache.publish(&mut seq).unwrap();
    (seq, info.hit_origin)
}

fn with_tail(ids: &[u32], tail: &[u32]) -> Vec<u32> {
    ids.iter().chain(tail).copied().collect()
}

#[test]
fn every_hit_of_one_prefill_has_its_origin_whatever_entry_it_hits() {
    let vm = tier_manager(tier_sim(), None, None);
    let (cache, _tier) = cache(&vm, KvLayout::TokenMajor);
    let system: Vec<u32> = (0..200).collect();
    // The first request prefills the system prompt (and its own blocks): no hit, no origin.
    let (_first, none) = prefilled(&cache, &with_tail(&system, &[9000; 40]), 0);
    assert_eq!(none, 0);
    // The second hits the system prompt's 12 whole blocks and publishes its own blocks past
    // them (a second entry); the third hits that newer entry: the same bytes, one origin.
    let (_second, o2) = prefilled(&cache, &with_tail(&system[..192], &[9001; 40]), 0);
    let third = cache
        .admit(&with_tail(&system[..192], &[9002; 40]), 2048)
        .unwrap();
    assert_eq!((third.hit_tokens, third.hit_origin), (192, o2));
    assert_ne!(o2, 0);
    // 192 tokens of 512 bytes: one window of 128 tokens mapped read-only, the rest copied.
    assert_eq!(third.readonly_tokens, 128);
    assert!(read(&third.sequence, 0, 192) == pattern(0, 192));
    // A hit of fewer tokens of the same prefill: the same origin (a pair with the tokens).
    let short = cache
        .admit(&with_tail(&system[..64], &[9003; 3]), 2048)
        .unwrap();
    assert_eq!(
        (short.hit_tokens, short.hit_origin, short.readonly_tokens),
        (64, o2, 0)
    );
    // Past the first prefill's tokens, the second's blocks: another origin.
    let past = cache
        .admit(&with_tail(&system[..192], &[9001; 40]), 2048)
        .unwrap();
    assert_eq!(past.hit_tokens, 224);
    assert_ne!(past.hit_origin, o2);
}

#[test]
fn the_same_tokens_prefilled_again_have_another_origin() {
    let vm = tier_manager(tier_sim(), None, None);
    let (cache, _tier) = cache(&vm, KvLayout::TokenMajor);
    let ids: Vec<u32> = (0..160).collect();
    drop(prefilled(&cache, &ids, 0));
    let old = cache.admit(&with_tail(&ids, &[1]), 2048).unwrap();
    assert_eq!(old.hit_tokens, 160);
    // Forgotten while the old request still maps it, then prefilled again (other bytes).
    cache.clear();
    let (_again, none) = prefilled(&cache, &ids, 0x33);
    assert_eq!(none, 0, "the prefix is computed again");
    let new = cache.admit(&with_tail(&ids, &[1]), 2048).unwrap();
    assert_eq!(new.hit_tokens, 160);
    assert_ne!(
        new.hit_origin, old.hit_origin,
        "same token ids, another prefill"
    );
    assert!(read(&new.sequence, 0, 160) != read(&old.sequence, 0, 160));
}

#[test]
fn a_host_hit_keeps_its_origin_unless_the_device_maps_another_prefills_bytes() {
    let vm = tier_manager(tier_sim(), None, None);
    let (cache, _tier) = cache(&vm, KvLayout::TokenMajor);
    let ids: Vec<u32> = (0..384).collect();
    drop(prefilled(&cache, &ids, 0));
    let device = cache.admit(&with_tail(&ids, &[5]), 2048).unwrap();
    let origin = device.hit_origin;
    drop(device);
    cache.evict(u64::MAX);
    // Copied back from the host: the evicted prefill's bytes and origin.
    let mut back = cache.admit(&with_tail(&ids, &[6]), 2048).unwrap();
    assert_eq!((back.host_hit_tokens, back.hit_origin), (384, origin));
    back.sequence.write_tokens(384, &pattern(384, 1)).unwrap();
    drop(back);
    cache.clear();
    drop(prefilled(&cache, &ids, 0));
    cache.evict(u64::MAX);
    // The first window prefilled again on the device (other bytes), then a longer hit on the
    // host past it: the device's window maps the new bytes, the rest are the old prefill's.
    let (_window, _) = prefilled(&cache, &with_tail(&ids[..128], &[9999]), 0x77);
    let mixed = cache.admit(&with_tail(&ids, &[7]), 2048).unwrap();
    assert_eq!(
        (
            mixed.hit_tokens,
            mixed.host_hit_tokens,
            mixed.readonly_tokens
        ),
        (384, 384, 128)
    );
    let fresh = cache.admit(&with_tail(&ids[..128], &[8]), 2048).unwrap();
    assert_eq!(fresh.hit_tokens, 128);
    assert_ne!(mixed.hit_origin, fresh.hit_origin);
    assert!(
        read(&mixed.sequence, 0, 128) != pattern(0, 128),
        "the device's window: other bytes"
    );
    assert!(read(&mixed.sequence, 128, 256) == pattern(128, 256));
    assert_ne!(mixed.hit_origin, 0);
    assert_ne!(mixed.hit_origin, origin);
}
