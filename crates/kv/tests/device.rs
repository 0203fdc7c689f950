//! SequenceKv and SharedDevicePrefix on the simulated driver, with the DESIGN invariants 2
//! and 4 checked against the simulator's ledger.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kvvm_hal::{ErrorKind, Operation};
use kvvm_kv::{
    KvCacheError, KvDtype, KvGeometry, KvKind, KvLayout, LayoutPlan, PrefixCache, SequenceKv,
    SharedDevicePrefix,
};
use kvvm_sim::FaultRule;

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
    let mut other = SequenceKv::new(&w.vm, &plan, 1000).unwrap();
    other.ensure_tokens(64).unwrap(); // 4 fragments x 2 windows: 8 of the 10
                                      // Another sequence holds the memory and may release it: backpressure, with a retry time.
    let e = s.ensure_tokens(64).unwrap_err(); // 8 more, 2 free
    assert!(e.is_retryable());
    assert!(e.retry_after().is_some());
    let b = e.backpressure().unwrap();
    assert_eq!(b.needed, 8 * g);
    assert_eq!(b.available, 2 * g);
    assert_eq!(s.committed_tokens(), 0);
    other.release().unwrap();
    s.ensure_tokens(64).unwrap();
    // 4 x 3 windows: only 4 more, but the sequence would hold 12 windows, more than the
    // 10-window budget could ever hold whatever the others free: never fits, no retry time.
    let e = s.ensure_tokens(96).unwrap_err();
    assert!(!e.is_retryable());
    assert!(e.retry_after().is_none());
    let n = e.never_fits().unwrap();
    assert_eq!((n.needed, n.limit_bytes), (12 * g, 10 * g));
    // 4 x 7 windows.
    let e = s.ensure_tokens(200).unwrap_err();
    let n = e.never_fits().unwrap();
    assert_eq!((n.needed, n.limit_bytes), (28 * g, 10 * g));
    assert_eq!(n.limit, kvvm_governor::Limit::DeviceBudget);
    assert_eq!(s.committed_tokens(), 64);
    assert_eq!(s.committed_bytes(), 8 * g);
    check_books(&w, &[&s, &other], &[]);
}

/// A sequence's growth is priced against the budget with everything it would hold, pooled
/// windows included: with the pool holding the whole budget in handles of exactly the sizes
/// the growth cuts, a growth past the budget is never-fits, not backpressure forever.
#[test]
fn a_warm_pool_is_no_discount_to_a_sequence_that_can_never_fit() {
    let g = 4096;
    let plan = LayoutPlan::new(tiny(1000), KvLayout::SeqMajor, g).unwrap();
    let w = world_with(g, 4096, Some(8 * g), 8 * g);
    let mut a = SequenceKv::new(&w.vm, &plan, 1000).unwrap();
    a.ensure_tokens(64).unwrap(); // 4 fragments x 2 windows: the whole budget
    a.release().unwrap();
    assert_eq!(w.vm.pooled_bytes(), 8 * g);
    let mut b = SequenceKv::new(&w.vm, &plan, 1000).unwrap();
    let e = b.ensure_tokens(96).unwrap_err(); // 4 x 3 windows
    assert!(!e.is_retryable(), "{e}");
    let n = e.never_fits().unwrap();
    assert_eq!((n.needed, n.limit_bytes), (12 * g, 8 * g));
    assert_eq!(w.vm.pooled_bytes(), 8 * g, "nothing taken from the pool");
    // Exactly the budget fits, from the pool.
    b.ensure_tokens(64).unwrap();
    assert_eq!(w.vm.pooled_bytes(), 0);
    check_books(&w, &[&a, &b], &[]);
}

/// A prefix shorter than a window has no read-only window: it is handed on by copy alone
/// (its bytes held once, in its tail); an empty one is refused with the reason.
#[test]
fn a_prefix_shorter_than_a_window_is_handed_on_by_copy() {
    let g = 4096;
    let w = world(g, None);
    let geo = tiny(1000);
    let plan = LayoutPlan::new(geo, KvLayout::HeadMajor, g).unwrap();
    let e = SharedDevicePrefix::reserve_and_map_shared_prefix(&w.vm, &plan, 0, 1000, |_, _| {})
        .unwrap_err();
    match e {
        KvCacheError::NotShareable { reason } => assert!(reason.contains("empty"), "{reason}"),
        other => panic!("{other:?}"),
    }
    // head-major: 64 B/token per fragment, so 63 tokens fill no window.
    let (prefix, owner) =
        SharedDevicePrefix::reserve_and_map_shared_prefix(&w.vm, &plan, 63, 1000, |t, buf| {
            let n = buf.len() as u64 / geo.bytes_per_token();
            buf.copy_from_slice(&tokens_bytes(&geo, 0, t, n, 63));
        })
        .unwrap();
    assert_eq!((prefix.end_window(), prefix.tokens()), (0, 63));
    assert_eq!(prefix.bytes(), plan.slice_count() * g);
    let sharer = prefix.map_shared_prefix_readonly(&w.vm, 1000).unwrap();
    assert_eq!(sharer.written_tokens(), 63);
    let mut back = vec![0u8; (63 * geo.bytes_per_token()) as usize];
    sharer.read_tokens(0, &mut back).unwrap();
    assert_eq!(back, tokens_bytes(&geo, 0, 0, 63, 63));
    check_books(&w, &[&owner, &sharer], &[&prefix]);
    drop((prefix, owner, sharer));
    drop(w.vm);
    assert!(w.sim.ledger().is_empty());
}

/// Owner writes a prefix that does not end on a window boundary; sharers map its whole windows
/// read-only, receive its tail by copy, grow privately; the owner finishes first (invariant 4).
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
        // The whole windows, then one tail window per fragment (every layout has a tail here).
        assert_eq!(prefix.handles().bytes(), fragments * k * g);
        assert_eq!(prefix.bytes(), fragments * (k + 1) * g);
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
            owner.committed_bytes() - prefix.handles().bytes()
        );
        // Sealed: the owner cannot write into the shared part either.
        assert!(matches!(
            owner.write_token(0, &token_bytes(&geo, 0, 0, prefix_len)),
            Err(KvCacheError::WriteIntoSharedPrefix { .. })
        ));

        let mut sharers = Vec::new();
        for s in 1..=3u64 {
            let mut sh = prefix.map_shared_prefix_readonly(&w.vm, 400).unwrap();
            // Its own: the tail's window of every fragment, copied.
            assert_eq!(sh.additional_owned_bytes(), fragments * g, "{layout}");
            assert_eq!(sh.committed_bytes(), prefix.bytes());
            assert_eq!(sh.committed_tokens(), prefix_len);
            assert_eq!(sh.written_tokens(), prefix_len);
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
            // The sharer's own tokens are private.
            sh.ensure_tokens(prefix_len + 20).unwrap();
            sh.write_tokens(
                prefix_len,
                &tokens_bytes(&geo, s, prefix_len, 20, prefix_len),
            )
            .unwrap();
            assert_eq!(
                sh.additional_owned_bytes(),
                plan.committed_bytes_for_tokens(prefix_len + 20).unwrap()
                    - prefix.handles().bytes()
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

/// A shrink gives back, in each fragment, only the windows past the live tokens, exactly as
/// counted beforehand (`shrinkable_bytes`), for every layout and for a shape whose tokens
/// straddle windows (3 layers, 3 KV heads of 24: 864 bytes a token, token-major): a range
/// that ran past its own fragment would unmap the next fragment's live windows.
#[test]
fn a_shrink_gives_back_each_fragments_windows_past_the_live_tokens_only() {
    let g = 4096;
    let straddling = KvGeometry::with_dtype(3, 3, 24, KvDtype::F16, 256).unwrap();
    for (geo, layout) in [tiny(256), straddling]
        .into_iter()
        .flat_map(|geo| KvLayout::ALL.map(|l| (geo, l)))
    {
        let w = world(g, None);
        let plan = LayoutPlan::new(geo, layout, g).unwrap();
        let mut s = SequenceKv::new(&w.vm, &plan, 256).unwrap();
        s.ensure_tokens(64).unwrap();
        s.ensure_tokens(256).unwrap();
        let live = plan.committed_bytes_for_tokens(64).unwrap();
        let all = s.committed_bytes();
        assert!(all > live, "{layout:?}");
        assert_eq!(s.shrinkable_bytes(64).unwrap(), all - live, "{layout:?}");
        assert_eq!(s.shrink_committed(64).unwrap(), all - live, "{layout:?}");
        assert_eq!(s.committed_bytes(), live, "{layout:?}");
        assert_eq!(s.shrinkable_bytes(64).unwrap(), 0, "{layout:?}");
    }
}
