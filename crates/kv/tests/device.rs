//! SequenceKv, SharedDevicePrefix and PrefixCache on the simulated driver, with the DESIGN
//! invariants 2 and 4 checked against the simulator's ledger.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kvvm_governor::{Governor, GovernorConfig};
use kvvm_hal::{DeviceAddress, DeviceId, ErrorKind, Operation, VirtualMemoryBackend};
use kvvm_kv::synthetic::token_kv_bytes;
use kvvm_kv::{
    KvCacheError, KvDtype, KvGeometry, KvKind, KvLayout, LayoutPlan, PrefixCache,
    PrefixCacheConfig, PublishOutcome, SequenceKv, SharedDevicePrefix,
};
use kvvm_sim::{FaultRule, LatencyMode, LatencyModel, SimBackend, SimConfig};
use kvvm_vmm::{GranularityChoice, VirtualMemory, VmmConfig};

const D0: DeviceId = DeviceId(0);

struct World {
    sim: Arc<SimBackend>,
    gov: Governor,
    vm: VirtualMemory,
}

fn world(g: u64, budget: Option<u64>) -> World {
    let sim = Arc::new(SimBackend::new(
        SimConfig::single(g, 4096 * g).with_latency(LatencyModel::zero(), LatencyMode::Account),
    ));
    let gov = match budget {
        Some(b) => Governor::new(GovernorConfig::default().device_budget(D0, b)),
        None => Governor::unlimited(),
    };
    let backend: Arc<dyn VirtualMemoryBackend> = sim.clone();
    let vm = VirtualMemory::new(
        backend,
        D0,
        gov.clone(),
        VmmConfig::default()
            .pool_cap_bytes(0)
            .granularity(GranularityChoice::Minimum),
    )
    .unwrap();
    World { sim, gov, vm }
}

/// 2 layers, 2 KV heads, head_dim 32, fp16: 512 B per token; 64 B per token per head.
fn tiny(max_tokens: u64) -> KvGeometry {
    KvGeometry::with_dtype(2, 2, 32, KvDtype::F16, max_tokens).unwrap()
}

fn token_bytes(g: &KvGeometry, seq: u64, pos: u64, prefix: u64) -> Vec<u8> {
    let mut v = vec![0u8; g.bytes_per_token() as usize];
    let id = if pos < prefix {
        pos as u32
    } else {
        (seq * 100_000 + pos) as u32
    };
    token_kv_bytes(g, id, pos, &mut v);
    v
}

fn tokens_bytes(g: &KvGeometry, seq: u64, first: u64, n: u64, prefix: u64) -> Vec<u8> {
    (first..first + n)
        .flat_map(|p| token_bytes(g, seq, p, prefix))
        .collect()
}

/// Invariant 2: governor used = physical bytes owned + shared bytes counted once =
/// the driver's physical bytes; nothing pending; no accounting error.
fn check_books(w: &World, seqs: &[&SequenceKv], shared_sets: &[&SharedDevicePrefix]) {
    let snap = w.gov.snapshot().device(D0);
    let owned: u64 = seqs.iter().map(|s| s.additional_owned_bytes()).sum();
    let mut seen = std::collections::HashSet::new();
    let shared: u64 = shared_sets
        .iter()
        .filter(|p| seen.insert(Arc::as_ptr(p.handles()) as usize))
        .map(|p| p.bytes())
        .sum();
    assert_eq!(snap.committed, owned, "{snap:?}");
    assert_eq!(snap.shared, shared, "{snap:?}");
    assert_eq!(snap.pending, 0);
    assert_eq!(snap.used(), owned + shared);
    assert_eq!(
        snap.used(),
        w.sim.ledger().total_physical_bytes(),
        "governor vs driver"
    );
    assert_eq!(w.vm.accounting_errors(), 0);
}

/// Reads `n` bytes at `offset` of a sequence straight from the driver.
fn raw(w: &World, s: &SequenceKv, offset: u64, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    w.sim
        .copy_from_device(&mut v, DeviceAddress(s.address().0 + offset))
        .unwrap();
    v
}

#[test]
fn writes_land_at_the_layout_offsets_for_every_layout() {
    let g = 4096;
    for layout in KvLayout::ALL {
        let w = world(g, None);
        let geo = tiny(100);
        let plan = LayoutPlan::new(geo, layout, g).unwrap();
        let mut s = SequenceKv::new(&w.vm, &plan, 100).unwrap();
        assert!(matches!(
            s.write_token(0, &token_bytes(&geo, 0, 0, 0)),
            Err(KvCacheError::NotCommitted { .. })
        ));
        let newly = s.ensure_tokens(10).unwrap();
        assert_eq!(newly, plan.committed_bytes_for_tokens(10).unwrap());
        assert_eq!(s.committed_bytes(), newly);
        // Several tokens at once (coalesced) and one alone.
        s.write_tokens(0, &tokens_bytes(&geo, 0, 0, 9, 0)).unwrap();
        s.write_token(9, &token_bytes(&geo, 0, 9, 0)).unwrap();
        for t in 0..10u64 {
            let host = token_bytes(&geo, 0, t, 0);
            let hb = geo.head_bytes() as usize;
            for l in 0..geo.layers() {
                for kv in KvKind::BOTH {
                    for h in 0..geo.kv_heads() {
                        let off = plan.offset(l, kv, h, t).unwrap();
                        let i = ((l as usize * 2 + kv.index() as usize) * geo.kv_heads() as usize
                            + h as usize)
                            * hb;
                        assert_eq!(raw(&w, &s, off, hb), host[i..i + hb], "{layout} t{t}");
                        // Layer pointers and strides give the same address.
                        let p = s.layer_pointers(l).unwrap();
                        let base = if kv == KvKind::Key { p.key } else { p.value };
                        assert_eq!(
                            base.0 + u64::from(h) * p.strides.head + t * p.strides.token,
                            s.address().0 + off
                        );
                    }
                }
            }
        }
        let mut back = vec![0u8; 10 * geo.bytes_per_token() as usize];
        s.read_tokens(0, &mut back).unwrap();
        assert_eq!(back, tokens_bytes(&geo, 0, 0, 10, 0));
        assert!(matches!(
            s.write_tokens(0, &[0u8; 3]),
            Err(KvCacheError::BadLength { .. })
        ));
        assert!(matches!(
            s.ensure_tokens(101),
            Err(KvCacheError::TooManyTokens { .. })
        ));
        check_books(&w, &[&s], &[]);
        drop(s);
        drop(w.vm);
        assert!(w.sim.ledger().is_empty());
    }
}

#[test]
fn ensure_tokens_backpressure_is_typed_with_retry_after() {
    let g = 4096;
    let geo = tiny(1000);
    let plan = LayoutPlan::new(geo, KvLayout::SeqMajor, g).unwrap();
    // seq-major: 4 fragments, 128 B/token; 10 windows of budget.
    let w = world(g, Some(10 * g));
    let mut s = SequenceKv::new(&w.vm, &plan, 1000).unwrap();
    s.ensure_tokens(64).unwrap(); // 4 fragments x 2 windows
    let e = s.ensure_tokens(100).unwrap_err(); // 4 x 4 windows: 8 more, 2 free
    assert!(e.is_retryable());
    assert!(e.retry_after().is_some());
    let b = e.backpressure().unwrap();
    assert_eq!(b.needed, 8 * g);
    assert_eq!(b.available, 2 * g);
    assert_eq!(s.committed_tokens(), 64);
    // 4 x 7 windows: 20 more than the 10-window budget could ever hold: never fits, no
    // retry time offered.
    let e = s.ensure_tokens(200).unwrap_err();
    assert!(!e.is_retryable());
    assert!(e.retry_after().is_none());
    let n = e.never_fits().unwrap();
    assert_eq!((n.needed, n.limit_bytes), (20 * g, 10 * g));
    assert_eq!(n.limit, kvvm_governor::Limit::DeviceBudget);
    assert_eq!(s.committed_tokens(), 64);
    assert_eq!(s.committed_bytes(), 8 * g);
    check_books(&w, &[&s], &[]);
}

#[test]
fn not_shareable_is_refused_with_the_reason() {
    let g = 4096;
    let w = world(g, None);
    let plan = LayoutPlan::new(tiny(1000), KvLayout::HeadMajor, g).unwrap();
    // head-major: 64 B/token per fragment, a 4096-byte granule needs 64 tokens.
    let e = SharedDevicePrefix::reserve_and_map_shared_prefix(&w.vm, &plan, 63, 1000, |_, _| {})
        .unwrap_err();
    match e {
        KvCacheError::NotShareable { reason } => {
            assert!(reason.contains("prefix not shareable"), "{reason}");
            assert!(reason.contains("64 tokens"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(w.sim.ledger().total_physical_bytes(), 0);
}

/// Owner writes a prefix that does not end on a window boundary; sharers map it read-only,
/// write the tail themselves, grow privately; the owner finishes first (invariant 4).
#[test]
fn owner_finishes_first_and_sharers_keep_reading() {
    let g = 4096;
    for layout in KvLayout::ALL {
        let w = world(g, None);
        let geo = tiny(400);
        let plan = LayoutPlan::new(geo, layout, g).unwrap();
        // token-major: 512 B/token, 8 per window; prefix 100 tokens = 12 whole windows
        // (96 tokens) + a tail of 4 tokens. seq-major: 128 B, 32 per window: 3 windows + 4.
        // head-major: 64 B, 64 per window: 1 window + 36.
        let prefix_len = 100;
        let (prefix, mut owner) = SharedDevicePrefix::reserve_and_map_shared_prefix(
            &w.vm,
            &plan,
            prefix_len,
            400,
            |t, buf| {
                let n = buf.len() as u64 / geo.bytes_per_token();
                buf.copy_from_slice(&tokens_bytes(&geo, 0, t, n, prefix_len));
            },
        )
        .unwrap();
        let k = prefix.shareability().shareable_granules_per_fragment;
        let fragments = plan.slice_count();
        assert_eq!(prefix.windows_per_fragment(), k);
        assert_eq!(prefix.bytes(), fragments * k * g);
        // The owner maps each handle once; each fragment's run is as few handles as it allows.
        let handles = prefix.handles().handle_count() as u64;
        assert_eq!(prefix.mapped_count(), handles);
        assert!(handles >= fragments && handles <= fragments * k);
        assert!(prefix.is_sealed());
        // The owner's private part: the tail windows.
        assert_eq!(
            owner.committed_bytes(),
            plan.committed_bytes_for_tokens(prefix_len).unwrap()
        );
        assert_eq!(
            owner.additional_owned_bytes(),
            owner.committed_bytes() - prefix.bytes()
        );
        // Sealed: the owner cannot write into the shared part either.
        assert!(matches!(
            owner.write_token(0, &token_bytes(&geo, 0, 0, prefix_len)),
            Err(KvCacheError::WriteIntoSharedPrefix { .. })
        ));

        let mut sharers = Vec::new();
        for s in 1..=3u64 {
            let mut sh = prefix.map_shared_prefix_readonly(&w.vm, 400).unwrap();
            assert_eq!(sh.additional_owned_bytes(), 0, "{layout}");
            assert_eq!(sh.committed_bytes(), prefix.bytes());
            let whole = prefix.shared_tokens();
            assert_eq!(sh.committed_tokens(), whole);
            // Write into the shared part: refused before any driver call.
            let calls = w.sim.driver_calls();
            let e = sh
                .write_token(0, &token_bytes(&geo, s, 0, prefix_len))
                .unwrap_err();
            assert!(
                matches!(e, KvCacheError::WriteIntoSharedPrefix { token: 0, .. }),
                "{e:?}"
            );
            assert_eq!(w.sim.driver_calls(), calls);
            // The tail of the prefix and the sharer's own tokens are private.
            sh.ensure_tokens(prefix_len + 20).unwrap();
            sh.write_tokens(
                whole,
                &tokens_bytes(&geo, s, whole, prefix_len + 20 - whole, prefix_len),
            )
            .unwrap();
            assert_eq!(
                sh.additional_owned_bytes(),
                plan.committed_bytes_for_tokens(prefix_len + 20).unwrap() - prefix.bytes()
            );
            sharers.push(sh);
        }
        assert_eq!(prefix.mapped_count(), 4 * handles);
        let all: Vec<&SequenceKv> = std::iter::once(&owner).chain(sharers.iter()).collect();
        check_books(&w, &all, &[&prefix]);

        // The owner finishes first.
        drop(owner);
        assert_eq!(prefix.mapped_count(), 3 * handles);
        let refs: Vec<&SequenceKv> = sharers.iter().collect();
        check_books(&w, &refs, &[&prefix]);
        for (i, sh) in sharers.iter().enumerate() {
            let s = i as u64 + 1;
            let n = prefix_len + 20;
            let mut back = vec![0u8; (n * geo.bytes_per_token()) as usize];
            sh.read_tokens(0, &mut back).unwrap();
            assert_eq!(
                back,
                tokens_bytes(&geo, s, 0, n, prefix_len),
                "{layout} sharer {s}"
            );
        }
        // Invariant 4: the shared handles live until the last sharer unmapped them.
        let handles: Vec<u64> = prefix
            .handles()
            .windows()
            .iter()
            .map(|(_, h)| h.0)
            .collect();
        drop(prefix);
        let live = |w: &World| {
            let l = w.sim.ledger();
            handles
                .iter()
                .filter(|h| l.handles.iter().any(|x| x.handle.0 == **h))
                .count()
        };
        assert_eq!(live(&w), handles.len());
        let last = sharers.pop().unwrap();
        for mut sh in sharers {
            sh.release().unwrap();
            assert_eq!(live(&w), handles.len(), "released before the last sharer");
        }
        drop(last);
        assert_eq!(live(&w), 0);
        drop(w.vm);
        assert!(w.sim.ledger().is_empty(), "{layout}");
    }
}

/// A sharer's map succeeds and its set access fails: the mappings are withdrawn and counted
/// down, the handles stay with the prefix, the other users are unaffected.
#[test]
fn sharer_set_access_fails_midway() {
    let g = 4096;
    let w = world(g, None);
    let geo = tiny(200);
    let plan = LayoutPlan::new(geo, KvLayout::SeqMajor, g).unwrap();
    let (prefix, owner) =
        SharedDevicePrefix::reserve_and_map_shared_prefix(&w.vm, &plan, 64, 200, |t, buf| {
            let n = buf.len() as u64 / geo.bytes_per_token();
            buf.copy_from_slice(&tokens_bytes(&geo, 0, t, n, 64));
        })
        .unwrap();
    let sharer = prefix.map_shared_prefix_readonly(&w.vm, 200).unwrap();
    let before = prefix.mapped_count();
    let maps_before = w.sim.calls(Operation::Map);
    w.sim.inject(FaultRule::nth(
        Operation::SetAccess,
        1,
        ErrorKind::InvalidValue,
    ));
    let e = prefix.map_shared_prefix_readonly(&w.vm, 200).unwrap_err();
    w.sim.clear_faults();
    assert!(matches!(e, KvCacheError::Vmm(_)), "{e:?}");
    // Every handle was mapped (one mapping each), then withdrawn.
    assert_eq!(
        w.sim.calls(Operation::Map) - maps_before,
        prefix.handles().handle_count() as u64
    );
    assert_eq!(prefix.mapped_count(), before);
    check_books(&w, &[&owner, &sharer], &[&prefix]);
    // The handles stay with the prefix: a later sharer attaches and reads the bytes.
    let again = prefix.map_shared_prefix_readonly(&w.vm, 200).unwrap();
    let mut back = vec![0u8; (64 * geo.bytes_per_token()) as usize];
    again.read_tokens(0, &mut back).unwrap();
    assert_eq!(back, tokens_bytes(&geo, 0, 0, 64, 64));
    drop((owner, sharer, again, prefix));
    drop(w.vm);
    assert!(w.sim.ledger().is_empty());
}

fn prompt(n: u64, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(7919) ^ salt).collect()
}

fn write_prompt(geo: &KvGeometry, seq: &mut SequenceKv, ids: &[u32], from: u64) {
    let bpt = geo.bytes_per_token() as usize;
    let n = ids.len() as u64 - from;
    let mut buf = vec![0u8; n as usize * bpt];
    for (k, tok) in buf.chunks_mut(bpt).enumerate() {
        let p = from + k as u64;
        token_kv_bytes(geo, ids[p as usize], p, tok);
    }
    seq.write_tokens(from, &buf).unwrap();
}

fn check_prompt(geo: &KvGeometry, seq: &SequenceKv, ids: &[u32]) {
    let bpt = geo.bytes_per_token() as usize;
    let mut back = vec![0u8; ids.len() * bpt];
    seq.read_tokens(0, &mut back).unwrap();
    for (p, tok) in back.chunks(bpt).enumerate() {
        let mut e = vec![0u8; bpt];
        token_kv_bytes(geo, ids[p], p as u64, &mut e);
        assert_eq!(tok, &e[..], "token {p}");
    }
}

#[test]
fn prefix_cache_hits_chains_and_counts() {
    let g = 4096;
    let w = world(g, None);
    let geo = tiny(1000);
    let plan = LayoutPlan::new(geo, KvLayout::SeqMajor, g).unwrap();
    let cache = PrefixCache::new(w.vm.clone(), plan).unwrap();
    assert_eq!(cache.block_tokens(), 32); // 4096 / 128 B per token per fragment
    let a = prompt(100, 0); // 3 full blocks
    let mut adm = cache.admit(&a, 200).unwrap();
    assert_eq!((adm.hit_tokens, adm.owned_prefix_tokens), (0, 96));
    // Not written yet: publishing is refused.
    assert!(matches!(
        cache.publish(&mut adm.sequence),
        Err(KvCacheError::PrefixNotWritten {
            written: 0,
            needed: 96
        })
    ));
    // A second identical request before publication: a miss (never maps unwritten bytes).
    let early = cache.admit(&a, 200).unwrap();
    assert_eq!(early.hit_tokens, 0);
    write_prompt(&geo, &mut adm.sequence, &a, 0);
    assert!(matches!(
        cache.publish(&mut adm.sequence).unwrap(),
        PublishOutcome::Published { tokens: 96, .. }
    ));
    let mut early = early;
    write_prompt(&geo, &mut early.sequence, &a, 0);
    assert_eq!(
        cache.publish(&mut early.sequence).unwrap(),
        PublishOutcome::AlreadyCached
    );
    drop(early);

    // Full hit: 96 tokens attached, 4 written privately.
    let mut b = cache.admit(&a, 200).unwrap();
    assert_eq!(b.hit_tokens, 96);
    assert_eq!(b.shared_bytes, 4 * 3 * g);
    assert!(matches!(
        b.sequence.write_token(95, &vec![0u8; 512]),
        Err(KvCacheError::WriteIntoSharedPrefix { .. })
    ));
    write_prompt(&geo, &mut b.sequence, &a, 96);
    check_prompt(&geo, &b.sequence, &a);
    assert_eq!(
        b.sequence.additional_owned_bytes(),
        plan.committed_bytes_for_tokens(100).unwrap() - 4 * 3 * g
    );

    // A longer prompt sharing 2 blocks: hits 64 tokens, owns blocks 3..5.
    let mut c_ids = a[..64].to_vec();
    c_ids.extend(prompt(100, 0xdead));
    let mut c = cache.admit(&c_ids, 300).unwrap();
    assert_eq!((c.hit_tokens, c.owned_prefix_tokens), (64, 96));
    write_prompt(&geo, &mut c.sequence, &c_ids, 64);
    cache.publish(&mut c.sequence).unwrap();
    check_prompt(&geo, &c.sequence, &c_ids);
    // A third request follows the chain: 160 tokens from two segments.
    let mut d = cache.admit(&c_ids, 300).unwrap();
    assert_eq!(d.hit_tokens, 160);
    write_prompt(&geo, &mut d.sequence, &c_ids, 160);
    check_prompt(&geo, &d.sequence, &c_ids);
    assert_eq!(d.sequence.attached_prefixes().len(), 2);

    let st = cache.stats();
    assert_eq!((st.lookups, st.hits, st.misses), (5, 3, 2));
    assert_eq!(st.tokens_saved, 96 + 64 + 160);
    assert_eq!(st.bytes_saved, 4 * g * (3 + 2 + 5));
    assert_eq!(st.cached_entries, 2);
    assert_eq!(st.cached_bytes, 4 * g * 6);
    assert_eq!(st.published, 2);
    assert_eq!(st.already_cached, 1);

    // Invariant 2 with the cache: owned + shared (once) = the driver.
    let owned_prefixes: Vec<_> = [&adm.sequence, &c.sequence]
        .iter()
        .filter_map(|s| s.owned_prefix().cloned())
        .collect();
    let p: Vec<&SharedDevicePrefix> = owned_prefixes.iter().map(|x| &**x).collect();
    check_books(
        &w,
        &[&adm.sequence, &b.sequence, &c.sequence, &d.sequence],
        &p,
    );

    // Owners finish first; the cache keeps the prefixes (billed once) after everyone left.
    drop(p);
    drop(owned_prefixes);
    drop(adm);
    drop(c);
    drop((b, d));
    assert_eq!(w.gov.snapshot().device(D0).shared, 4 * g * 6);
    assert_eq!(cache.stats().idle_bytes, 4 * g * 6);
    assert_eq!(w.sim.ledger().total_physical_bytes(), 4 * g * 6);
    assert_eq!(cache.clear(), 4 * g * 6);
    assert_eq!(cache.stats().evictions, 2);
    drop(cache);
    drop(w.vm);
    assert!(w.sim.ledger().is_empty());
}

/// The governor refuses, the cache evicts an idle prefix, the grant then succeeds; a prefix
/// still mapped by a live sequence is kept (evicting it would free nothing).
#[test]
fn eviction_under_pressure() {
    let g = 4096;
    let geo = tiny(1000);
    let plan = LayoutPlan::new(geo, KvLayout::TokenMajor, g).unwrap();
    // token-major: 8 tokens per window; budget 40 windows.
    let w = world(g, Some(40 * g));
    let cache = PrefixCache::new(w.vm.clone(), plan).unwrap();
    assert_eq!(cache.block_tokens(), 8);
    let old = prompt(64, 1); // 8 windows
    let hot = prompt(64, 2); // 8 windows
    for ids in [&old, &hot] {
        let mut a = cache.admit(ids, 64).unwrap();
        write_prompt(&geo, &mut a.sequence, ids, 0);
        cache.publish(&mut a.sequence).unwrap();
    }
    // `hot` is in use by a live sequence.
    let user = cache.admit(&hot, 64).unwrap();
    assert_eq!(user.hit_tokens, 64);
    assert_eq!(w.gov.snapshot().device(D0).used(), 16 * g);
    // 30 windows needed, 24 available: the governor asks the cache, which evicts `old`.
    let mut big = SequenceKv::new(&w.vm, &plan, 1000).unwrap();
    big.ensure_tokens(240).unwrap();
    let st = cache.stats();
    assert_eq!(st.evictions, 1);
    assert_eq!(st.evicted_bytes, 8 * g);
    assert_eq!(st.cached_bytes, 8 * g);
    // `old` is gone: a miss (whose commit is refused while `big` holds the memory).
    assert!(cache.admit(&old, 64).unwrap_err().backpressure().is_some());
    // `hot` survived: still a hit (and still mapped by `user`).
    drop(big);
    let again = cache.admit(&hot, 64).unwrap();
    assert_eq!(again.hit_tokens, 64);
    // Now nothing idle: a grant that does not fit is refused, the in-use prefix stays.
    let mut huge = SequenceKv::new(&w.vm, &plan, 1000).unwrap();
    let e = huge.ensure_tokens(1000).unwrap_err();
    assert!(
        e.never_fits().is_some(),
        "125 windows under a 40-window budget: {e}"
    );
    assert!(e.retry_after().is_none());
    assert_eq!(cache.stats().cached_entries, 1);
    let attached = user.sequence.attached_prefixes();
    let shared: Vec<&SharedDevicePrefix> = attached.iter().map(|p| &**p).collect();
    check_books(&w, &[&user.sequence, &again.sequence, &huge], &shared);
    drop(shared);
    drop(attached);
    drop((user, again, huge));
    drop(cache);
    drop(w.vm);
    assert!(w.sim.ledger().is_empty());
}

#[test]
fn cache_cap_evicts_least_recently_used_idle_prefixes() {
    let g = 4096;
    let w = world(g, None);
    let geo = tiny(1000);
    let plan = LayoutPlan::new(geo, KvLayout::TokenMajor, g).unwrap();
    let cache = PrefixCache::with_config(
        w.vm.clone(),
        plan,
        PrefixCacheConfig::default().max_cached_bytes(Some(16 * g)),
    )
    .unwrap();
    for salt in 0..4 {
        let ids = prompt(64, salt);
        let mut a = cache.admit(&ids, 64).unwrap();
        write_prompt(&geo, &mut a.sequence, &ids, 0);
        cache.publish(&mut a.sequence).unwrap();
    }
    let st = cache.stats();
    assert_eq!(st.cached_entries, 2);
    assert_eq!(st.cached_bytes, 16 * g);
    assert_eq!(st.evictions, 2);
    assert_eq!(cache.admit(&prompt(64, 3), 64).unwrap().hit_tokens, 64);
    assert_eq!(cache.admit(&prompt(64, 0), 64).unwrap().hit_tokens, 0);
    drop(cache);
    drop(w.vm);
    assert!(w.sim.ledger().is_empty());
}

#[test]
fn api_types_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<PrefixCache>();
    send_sync::<SharedDevicePrefix>();
    send::<SequenceKv>();
    send::<kvvm_kv::Admission>();
    send_sync::<KvCacheError>();
}

/// 4 threads admit, write, publish, decode and release requests over a few prompts under a
/// budget that forces backpressure and eviction; at the end the books and the ledger agree
/// and everything is freed.
#[test]
fn concurrent_admissions_under_a_budget() {
    let g = 4096;
    let geo = tiny(256);
    let plan = LayoutPlan::new(geo, KvLayout::TokenMajor, g).unwrap();
    let w = world(g, Some(60 * g));
    let cache = PrefixCache::new(w.vm.clone(), plan).unwrap();
    let backpressured = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|scope| {
        for t in 0..4u32 {
            let cache = &cache;
            let backpressured = &backpressured;
            scope.spawn(move || {
                for i in 0..40u32 {
                    let salt = (i * 7 + t) % 11;
                    let len = 40 + u64::from((i * 13 + t) % 60);
                    let ids = prompt(len, salt);
                    let mut adm = match cache.admit(&ids, 200) {
                        Ok(a) => a,
                        Err(e) => {
                            assert!(e.retry_after().is_some(), "{e:?}");
                            backpressured.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            continue;
                        }
                    };
                    write_prompt(&geo, &mut adm.sequence, &ids, adm.hit_tokens);
                    cache.publish(&mut adm.sequence).unwrap();
                    check_prompt(&geo, &adm.sequence, &ids);
                    if adm.sequence.ensure_tokens(len + 30).is_ok() {
                        let mut buf = vec![0u8; 30 * 512];
                        token_kv_bytes(&geo, 9, len, &mut buf[..512]);
                        adm.sequence.write_tokens(len, &buf).unwrap();
                    }
                    if i % 3 == 0 {
                        adm.sequence.release().unwrap();
                    }
                }
            });
        }
    });
    let snap = w.gov.snapshot().device(D0);
    assert_eq!(snap.committed, 0);
    assert_eq!(snap.shared, cache.stats().cached_bytes);
    assert_eq!(snap.used(), w.sim.ledger().total_physical_bytes());
    assert_eq!(w.vm.accounting_errors(), 0);
    let st = cache.stats();
    assert_eq!(st.lookups, 160);
    assert!(st.hits > 0);
    // The budget is tight enough that admissions evict idle prefixes.
    assert!(st.evictions > 0, "{st:?}");
    let _ = backpressured.load(std::sync::atomic::Ordering::Relaxed);
    drop(cache);
    drop(w.vm);
    assert!(w.sim.ledger().is_empty());
}

/// A prefix whose end is not on a window boundary and whose tokens straddle windows (96-byte
/// heads): the sharer writes the straddling prefix token's private bytes only, refuses the
/// tokens wholly inside the shared windows, and reads back every byte.
#[test]
fn straddling_prefix_token_is_written_privately() {
    let g = 4096;
    for layout in KvLayout::ALL {
        let w = world(g, None);
        // 2 layers, 2 KV heads, head_dim 48, fp16: 96 B per head, 768 B per token.
        let geo = KvGeometry::with_dtype(2, 2, 48, KvDtype::F16, 300).unwrap();
        let plan = LayoutPlan::new(geo, layout, g).unwrap();
        let prefix_len = 55;
        let (prefix, owner) = SharedDevicePrefix::reserve_and_map_shared_prefix(
            &w.vm,
            &plan,
            prefix_len,
            300,
            |t, buf| {
                let n = buf.len() as u64 / geo.bytes_per_token();
                buf.copy_from_slice(&tokens_bytes(&geo, 0, t, n, prefix_len));
            },
        )
        .unwrap();
        let whole = prefix.shared_tokens();
        let bpt_f = plan.fragment_bytes_per_token();
        // The first token past the whole ones straddles the end of the shared windows.
        assert_ne!((whole * bpt_f) % g, 0, "{layout}");
        assert!(whole < prefix_len);
        let mut sh = prefix.map_shared_prefix_readonly(&w.vm, 300).unwrap();
        assert_eq!(sh.committed_tokens(), whole);
        sh.ensure_tokens(prefix_len + 5).unwrap();
        assert!(matches!(
            sh.write_tokens(whole - 1, &tokens_bytes(&geo, 1, whole - 1, 2, prefix_len)),
            Err(KvCacheError::WriteIntoSharedPrefix { .. })
        ));
        sh.write_tokens(
            whole,
            &tokens_bytes(&geo, 1, whole, prefix_len + 5 - whole, prefix_len),
        )
        .unwrap();
        let n = prefix_len + 5;
        let mut back = vec![0u8; (n * geo.bytes_per_token()) as usize];
        sh.read_tokens(0, &mut back).unwrap();
        assert_eq!(back, tokens_bytes(&geo, 1, 0, n, prefix_len), "{layout}");
        check_books(&w, &[&owner, &sh], &[&prefix]);
        drop((owner, sh, prefix));
        drop(w.vm);
        assert!(w.sim.ledger().is_empty());
    }
}

/// Driver faults inside admit (creating the owned segment, mapping a sharer's windows):
/// nothing of the request is left, the books match the driver, the cache still works.
#[test]
fn faults_inside_admit_leave_nothing_behind() {
    let g = 4096;
    let geo = tiny(1000);
    let plan = LayoutPlan::new(geo, KvLayout::SeqMajor, g).unwrap();
    let w = world(g, None);
    let cache = PrefixCache::new(w.vm.clone(), plan).unwrap();
    let ids = prompt(70, 3); // 2 blocks + 6 tokens
    for n in 1..=3 {
        w.sim
            .inject(FaultRule::nth(Operation::Create, n, ErrorKind::OutOfMemory));
        let e = cache.admit(&ids, 100).unwrap_err();
        w.sim.clear_faults();
        assert!(e.is_retryable(), "{e:?}");
        check_books(&w, &[], &[]);
        assert_eq!(w.sim.ledger().total_physical_bytes(), 0);
    }
    let mut a = cache.admit(&ids, 100).unwrap();
    write_prompt(&geo, &mut a.sequence, &ids, 0);
    cache.publish(&mut a.sequence).unwrap();
    let owned = a.sequence.owned_prefix().cloned().unwrap();
    let before = owned.mapped_count();
    for n in [1, 3, 8] {
        w.sim
            .inject(FaultRule::nth(Operation::Map, n, ErrorKind::InvalidValue));
        assert!(cache.admit(&ids, 100).is_err());
        w.sim.clear_faults();
        assert_eq!(owned.mapped_count(), before);
        check_books(&w, &[&a.sequence], &[&owned]);
    }
    let b = cache.admit(&ids, 100).unwrap();
    assert_eq!(b.hit_tokens, 64);
    check_prompt(&geo, &b.sequence, &ids[..64]);
    drop((a, b, owned));
    drop(cache);
    drop(w.vm);
    assert!(w.sim.ledger().is_empty());
}

/// The owner's prefix is one handle per fragment run (token-major: one for the whole prefix),
/// and a sharer attaches it with one mapping per handle, whatever the run's length in windows.
#[test]
fn a_prefix_is_one_handle_per_fragment_run_and_attaches_with_one_mapping_each() {
    let g = 4096;
    for layout in KvLayout::ALL {
        let w = world(g, None);
        let geo = tiny(400);
        let plan = LayoutPlan::new(geo, layout, g).unwrap();
        // 256 tokens: every fragment's run is several windows long.
        let (prefix, owner) =
            SharedDevicePrefix::reserve_and_map_shared_prefix(&w.vm, &plan, 256, 400, |t, buf| {
                let n = buf.len() as u64 / geo.bytes_per_token();
                buf.copy_from_slice(&tokens_bytes(&geo, 0, t, n, 256));
            })
            .unwrap();
        let fragments = plan.fragments().unwrap().len();
        assert!(
            prefix.windows_per_fragment() > 1,
            "{layout}: runs of several windows"
        );
        assert_eq!(prefix.handles().handle_count(), fragments, "{layout}");
        let maps_before = w.sim.calls(Operation::Map);
        let sharer = prefix.map_shared_prefix_readonly(&w.vm, 400).unwrap();
        assert_eq!(
            w.sim.calls(Operation::Map) - maps_before,
            fragments as u64,
            "{layout}: one mapping per handle"
        );
        let mut back = vec![0u8; (256 * geo.bytes_per_token()) as usize];
        sharer.read_tokens(0, &mut back).unwrap();
        assert_eq!(back, tokens_bytes(&geo, 0, 0, 256, 256), "{layout}");
        check_books(&w, &[&owner, &sharer], &[&prefix]);
        drop((owner, sharer, prefix));
        drop(w.vm);
        assert!(w.sim.ledger().is_empty(), "{layout}");
    }
}
