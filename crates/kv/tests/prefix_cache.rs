//! PrefixCache on the simulated driver: hits, chains, eviction, the cache cap, concurrent
//! admissions, faults inside an admission, and the handles a published segment is made of;
//! the DESIGN invariants 2 and 4 checked against the simulator's ledger.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kvvm_hal::{ErrorKind, Operation};
use kvvm_kv::synthetic::token_kv_bytes;
use kvvm_kv::{
    KvCacheError, KvDtype, KvGeometry, KvLayout, LayoutPlan, PrefixCache, PrefixCacheConfig,
    PublishOutcome, SequenceKv, SharedDevicePrefix,
};
use kvvm_sim::FaultRule;

/// A cache whose blocks are one window of every fragment (`plan`'s fragment bytes per token
/// divide the granule): its hits end on window boundaries and copy nothing.
fn window_blocks(w: &World, plan: LayoutPlan) -> std::sync::Arc<PrefixCache> {
    let tokens = plan.granule() / plan.fragment_bytes_per_token();
    assert_eq!(tokens * plan.fragment_bytes_per_token(), plan.granule());
    PrefixCache::with_config(
        w.vm.clone(),
        plan,
        PrefixCacheConfig::default().block_tokens(tokens),
    )
    .unwrap()
}

#[test]
fn prefix_cache_hits_chains_and_counts() {
    let g = 4096;
    let w = world(g, None);
    let geo = tiny(1000);
    let plan = LayoutPlan::new(geo, KvLayout::SeqMajor, g).unwrap();
    // Blocks of one window (4096 / 128 B per token per fragment): every hit is mapped whole.
    let cache = window_blocks(&w, plan);
    assert_eq!(cache.block_tokens(), 32);
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
    let cache = window_blocks(&w, plan);
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

/// 4 threads admit, write, publish, decode and release requests over a few prompts under a
/// budget that forces backpressure and eviction; at the end the books and the ledger agree
/// and everything is freed. What the threads meet (hits, evictions, refusals) depends on how
/// they overlap, so only what holds for every schedule is asserted of them; a hit and an
/// eviction are then made on one thread.
#[test]
fn concurrent_admissions_under_a_budget() {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    let g = 4096;
    let geo = tiny(256);
    let plan = LayoutPlan::new(geo, KvLayout::TokenMajor, g).unwrap();
    let w = world(g, Some(60 * g));
    let cache = PrefixCache::new(w.vm.clone(), plan).unwrap();
    let (admitted, backpressured) = (AtomicU64::new(0), AtomicU64::new(0));
    let start = std::sync::Barrier::new(4);
    std::thread::scope(|scope| {
        for t in 0..4u32 {
            let (cache, admitted, backpressured, start) =
                (&cache, &admitted, &backpressured, &start);
            scope.spawn(move || {
                start.wait();
                for i in 0..40u32 {
                    let salt = (i * 7 + t) % 11;
                    let len = 40 + u64::from((i * 13 + t) % 60);
                    let ids = prompt(len, salt);
                    let mut adm = match cache.admit(&ids, 200) {
                        Ok(a) => a,
                        Err(e) => {
                            assert!(e.retry_after().is_some(), "{e:?}");
                            backpressured.fetch_add(1, Relaxed);
                            continue;
                        }
                    };
                    admitted.fetch_add(1, Relaxed);
                    write_prompt(&geo, &mut adm.sequence, &ids, adm.info.hit_tokens);
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
    // Every lookup ended as a hit, a miss, or a refusal (nothing else fails).
    let (admitted, backpressured) = (admitted.load(Relaxed), backpressured.load(Relaxed));
    assert_eq!(admitted + backpressured, 160);
    assert_eq!(st.hits + st.misses, admitted, "{st:?}");
    // On one thread: a published prompt hits, and a sequence that needs the whole budget
    // evicts every idle prefix before its grant is decided.
    let ids = prompt(64, 3);
    let mut a = cache.admit(&ids, 64).unwrap();
    write_prompt(&geo, &mut a.sequence, &ids, a.info.hit_tokens);
    cache.publish(&mut a.sequence).unwrap();
    drop(a);
    assert_eq!(cache.admit(&ids, 64).unwrap().hit_tokens, 64);
    let before = cache.stats();
    assert!(
        before.hits > st.hits && before.cached_bytes > 0,
        "{before:?}"
    );
    let mut big: Vec<SequenceKv> = (0..2)
        .map(|_| SequenceKv::new(&w.vm, &plan, 256).unwrap())
        .collect();
    for s in &mut big {
        s.ensure_tokens(240).unwrap(); // 30 windows each: the whole budget
    }
    let after = cache.stats();
    assert!(after.evictions > before.evictions, "{after:?}");
    assert_eq!(after.cached_bytes, 0, "{after:?}");
    drop(big);
    drop(cache);
    drop(w.vm);
    assert!(w.sim.ledger().is_empty());
}

/// A prefix whose end is not on a window boundary and whose tokens straddle windows (96-byte
/// heads): the sharer maps the windows before the straddling token read-only, receives every
/// prefix token (the straddling one and the tail by copy), refuses writes into the read-only
/// windows, writes its own tokens and reads back every byte.
#[test]
fn straddling_prefix_token_is_copied_never_written() {
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
        assert_eq!(sh.written_tokens(), prefix_len);
        // Read-only: the windows before the first byte of the token it will write next.
        assert!(sh.shared_tokens() * bpt_f <= prefix_len * bpt_f, "{layout}");
        sh.ensure_tokens(prefix_len + 5).unwrap();
        if sh.shared_tokens() > 0 {
            let t = sh.shared_tokens() - 1;
            assert!(matches!(
                sh.write_tokens(t, &tokens_bytes(&geo, 1, t, 1, prefix_len)),
                Err(KvCacheError::WriteIntoSharedPrefix { .. })
            ));
        }
        sh.write_tokens(
            prefix_len,
            &tokens_bytes(&geo, 1, prefix_len, 5, prefix_len),
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

/// With `handle_windows`, a published segment is made of handles of that many windows: a
/// full hit maps that many times fewer handles (one mapping each), and a partial match maps
/// read-only only up to a handle boundary and copies the rest of the hit.
#[test]
fn handle_windows_trade_mappings_per_hit_for_copied_bytes() {
    let g = 4096;
    for (k, readonly) in [(1u64, 6u64), (4, 4)] {
        let w = world(g, None);
        let geo = tiny(1000);
        let plan = LayoutPlan::new(geo, KvLayout::SeqMajor, g).unwrap();
        // One block is one window of every fragment (32 tokens x 128 B).
        let cache = PrefixCache::with_config(
            w.vm.clone(),
            plan,
            PrefixCacheConfig::default()
                .block_tokens(32)
                .handle_windows(k),
        )
        .unwrap();
        let block = cache.block_tokens();
        let a = prompt(8 * block, 0);
        let mut owner = cache.admit(&a, 600).unwrap();
        write_prompt(&geo, &mut owner.sequence, &a, 0);
        cache.publish(&mut owner.sequence).unwrap();
        let fragments = plan.fragments().unwrap().len() as u64;
        // Full hit: 8 windows in 8 / k handles per fragment.
        let maps = w.sim.calls(Operation::Map);
        let full = cache.admit(&a, 600).unwrap();
        assert_eq!(full.hit_tokens, 8 * block, "k={k}");
        let shared_maps = w.sim.calls(Operation::Map) - maps;
        // The sharer also commits its private rest (none here: the prompt is whole blocks).
        assert_eq!(shared_maps, fragments * 8 / k, "k={k}");
        assert_eq!(full.copied_bytes, 0, "k={k}");
        check_prompt(&geo, &full.sequence, &a);
        // A prompt matching 6 blocks: all 6 hit; read-only up to a handle boundary (6 windows
        // with k = 1, 4 with k = 4), the rest copied.
        let mut b_ids = a[..(6 * block) as usize].to_vec();
        b_ids.extend(prompt(3 * block, 0xbeef));
        let mut b = cache.admit(&b_ids, 600).unwrap();
        assert_eq!(b.hit_tokens, 6 * block, "k={k}");
        assert_eq!(b.shared_bytes, readonly * fragments * g, "k={k}");
        assert_eq!(b.copied_bytes, (6 - readonly) * fragments * g, "k={k}");
        write_prompt(&geo, &mut b.sequence, &b_ids, b.info.hit_tokens);
        check_prompt(&geo, &b.sequence, &b_ids);
        let seqs = [&owner.sequence, &full.sequence, &b.sequence];
        let sets: Vec<_> = seqs
            .iter()
            .flat_map(|s| {
                s.attached_prefixes()
                    .into_iter()
                    .chain(s.owned_prefix().cloned())
            })
            .collect();
        let set_refs: Vec<&SharedDevicePrefix> = sets.iter().map(|p| p.as_ref()).collect();
        check_books(&w, &seqs, &set_refs);
        drop(set_refs);
        drop((sets, owner, full, b, cache));
        drop(w.vm);
        assert!(w.sim.ledger().is_empty(), "k={k}");
    }
}

#[test]
fn a_sequence_of_another_manager_or_in_use_is_refused_at_the_first_call() {
    let g = 4096;
    let (w, other) = (world(g, None), world(g, None));
    let geo = tiny(1000);
    let plan = LayoutPlan::new(geo, KvLayout::SeqMajor, g).unwrap();
    let cache = PrefixCache::new(w.vm.clone(), plan).unwrap();
    let ids = prompt(100, 0);
    // Another manager's sequence: refused at admission, untouched, nothing cached.
    let mut foreign = SequenceKv::new(&other.vm, &plan, 200).unwrap();
    let e = cache.admit_into(&ids, &mut foreign).unwrap_err();
    assert!(matches!(e, KvCacheError::OtherManager { .. }), "{e:?}");
    assert!(e.to_string().contains("another manager"), "{e}");
    assert!(foreign.is_empty());
    assert!(other.sim.ledger().mappings.is_empty());
    // And at publication (admitted by the other manager's own cache).
    let theirs = PrefixCache::new(other.vm.clone(), plan).unwrap();
    theirs.admit_into(&ids, &mut foreign).unwrap();
    write_prompt(&geo, &mut foreign, &ids, 0);
    assert!(matches!(
        cache.publish(&mut foreign),
        Err(KvCacheError::OtherManager { .. })
    ));
    assert_eq!(cache.stats().cached_entries, 0);
    // A sequence in use is refused as such, not as a plan mismatch.
    let e = theirs.admit_into(&ids, &mut foreign).unwrap_err();
    assert!(matches!(e, KvCacheError::InUse { .. }), "{e:?}");
    assert!(e.to_string().starts_with("the sequence is in use"), "{e}");
}

#[test]
fn releasable_bytes_count_a_shared_prefix_only_when_nothing_else_holds_it() {
    let g = 4096;
    let w = world(g, None);
    let geo = tiny(1000);
    let plan = LayoutPlan::new(geo, KvLayout::SeqMajor, g).unwrap();
    let cache = PrefixCache::new(w.vm.clone(), plan).unwrap();
    let ids = prompt(100, 0);
    let mut owner = cache.admit(&ids, 200).unwrap().sequence;
    write_prompt(&geo, &mut owner, &ids, 0);
    cache.publish(&mut owner).unwrap();
    let mut sharer = cache.admit(&ids, 200).unwrap().sequence;
    write_prompt(&geo, &mut sharer, &ids, 96);
    let prefix_bytes = cache.stats().cached_bytes;
    assert!(prefix_bytes > 0);
    // The cache and the other sequence hold the prefix: each gives back its own windows.
    for s in [&owner, &sharer] {
        assert_eq!(s.releasable_bytes(), s.additional_owned_bytes());
    }
    let used = |w: &World| w.gov.snapshot().device(w.vm.device());
    let before = used(&w);
    let expected = owner.releasable_bytes();
    owner.release().unwrap();
    let after = used(&w);
    assert_eq!(
        (before.committed + before.shared) - (after.committed + after.shared),
        expected
    );
    // The cache lets go: the last sharer now holds the prefix alone and gives it back too.
    cache.clear();
    let expected = sharer.additional_owned_bytes() + prefix_bytes;
    assert_eq!(sharer.releasable_bytes(), expected);
    let before = used(&w);
    sharer.release().unwrap();
    let after = used(&w);
    assert_eq!(
        (before.committed + before.shared) - (after.committed + after.shared),
        expected
    );
}

#[test]
fn a_refused_admission_names_the_whole_prompt_against_what_is_available() {
    let g = 4096;
    let geo = tiny(1000);
    let plan = LayoutPlan::new(geo, KvLayout::SeqMajor, g).unwrap();
    let whole = plan.committed_bytes_for_tokens(100).unwrap();
    let w = world(g, Some(whole + 2 * g));
    let mut other = SequenceKv::new(&w.vm, &plan, 200).unwrap();
    other.ensure_tokens(1).unwrap();
    let held = other.committed_bytes();
    assert!(held > 2 * g);
    let cache = PrefixCache::new(w.vm.clone(), plan).unwrap();
    // 3 full blocks go to a new shared segment and the rest is private: two commits. The
    // second is refused; the refusal is restated for the admission as a whole.
    let e = cache.admit(&prompt(100, 0), 200).unwrap_err();
    let bp = e.backpressure().expect("backpressure");
    assert_eq!((bp.needed, bp.available), (whole, whole + 2 * g - held));
    assert_eq!(bp.available, w.gov.available_bytes(D0));
    assert_eq!(w.gov.snapshot().device(D0).used(), held, "undone");
}

#[test]
fn tokens_written_on_the_device_are_published_once_marked_written() {
    let g = 4096;
    let w = world(g, None);
    let geo = tiny(1000);
    let plan = LayoutPlan::new(geo, KvLayout::SeqMajor, g).unwrap();
    let cache = PrefixCache::new(w.vm.clone(), plan).unwrap();
    let a = prompt(100, 0);
    let mut adm = cache.admit(&a, 200).unwrap();
    // A model wrote the prompt through a tensor view: the sequence cannot know it.
    assert!(matches!(
        cache.publish(&mut adm.sequence),
        Err(KvCacheError::PrefixNotWritten { written: 0, .. })
    ));
    let committed = adm.sequence.committed_tokens();
    assert!(matches!(
        adm.sequence.mark_written(committed + 1),
        Err(KvCacheError::NotCommitted { end, .. }) if end == committed + 1
    ));
    adm.sequence.mark_written(100).unwrap();
    assert_eq!(adm.sequence.written_tokens(), 100);
    assert!(matches!(
        cache.publish(&mut adm.sequence).unwrap(),
        PublishOutcome::Published { tokens: 96, .. }
    ));
    // Marking fewer tokens never lowers what was written.
    adm.sequence.mark_written(10).unwrap();
    assert_eq!(adm.sequence.written_tokens(), 100);
    assert_eq!(cache.admit(&a, 200).unwrap().hit_tokens, 96);
}

/// A prefix cache's tail is memory the cache gives back under pressure: a request that
/// published its prompt (which ends inside a window, so the entry has a tail of its own)
/// grows past what the budget holds beside the tail; the cache gives the tail back and the
/// request grows; a later hit then takes only the entry's whole windows, copying nothing.
#[test]
fn a_cache_tail_is_given_back_under_pressure() {
    let g = 4096;
    // Token-major, 512 B a token: 8 tokens a window; blocks of 4 tokens.
    let geo = tiny(1000);
    let plan = LayoutPlan::new(geo, KvLayout::TokenMajor, g).unwrap();
    let w = world(g, Some(6 * g));
    let cache = PrefixCache::with_config(
        w.vm.clone(),
        plan,
        PrefixCacheConfig::default().block_tokens(4),
    )
    .unwrap();
    // 20 tokens: two whole windows and a tail of 4 tokens.
    let ids = prompt(20, 1);
    let mut a = cache.admit(&ids, 64).unwrap();
    write_prompt(&geo, &mut a.sequence, &ids, 0);
    assert!(matches!(
        cache.publish(&mut a.sequence).unwrap(),
        PublishOutcome::Published { tokens: 20, .. }
    ));
    let owned = a.sequence.owned_prefix().cloned().unwrap();
    assert_eq!(owned.tokens(), 20);
    assert_eq!(cache.stats().tail_bytes, g);
    assert_eq!(w.gov.snapshot().device(D0).used(), 4 * g);
    // 48 tokens hold 6 windows: with the tail, 7 would be over the budget.
    a.sequence.ensure_tokens(48).unwrap();
    assert_eq!(cache.stats().tail_bytes, 0);
    assert_eq!(
        owned.tokens(),
        16,
        "only the whole windows' tokens are handed on now"
    );
    check_books(&w, &[&a.sequence], &[&owned]);
    drop(a);
    let b = cache.admit(&ids, 64).unwrap();
    assert_eq!(
        (b.hit_tokens, b.shared_bytes, b.copied_bytes),
        (16, 2 * g, 0)
    );
    check_prompt(&geo, &b.sequence, &ids[..16]);
    drop((b, owned));
    cache.clear();
    drop(cache);
    drop(w.vm);
    assert!(w.sim.ledger().is_empty());
}
