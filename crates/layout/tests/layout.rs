//! The layout plan: offsets, padding, windows holding live bytes, errors, names (moved out of
//! `src/layout.rs`; they use only the public API).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvvm_layout::*;

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;

fn small() -> KvGeometry {
    // 2 layers, 3 heads, head_dim 4, fp16, 5 tokens: head bytes 8.
    KvGeometry::new(2, 3, 4, 2, 5).unwrap()
}

/// Reference index -> offset by walking the documented nesting order element by element.
fn reference_offset(
    g: &KvGeometry,
    layout: KvLayout,
    stride: u64,
    layer: u32,
    kv: KvKind,
    head: u32,
    token: u64,
) -> u64 {
    let hb = g.head_bytes();
    let heads = u64::from(g.kv_heads());
    let lkv = u64::from(layer) * 2 + kv.index();
    match layout {
        KvLayout::HeadMajor => (lkv * heads + u64::from(head)) * stride + token * hb,
        KvLayout::SeqMajor => lkv * stride + (token * heads + u64::from(head)) * hb,
        KvLayout::TokenMajor => token * g.bytes_per_token() + (lkv * heads + u64::from(head)) * hb,
    }
}

#[test]
fn offsets_match_the_documented_nesting_and_never_collide() {
    let g = small();
    for layout in KvLayout::ALL {
        for granule in [1, 8, 64, 4096] {
            let plan = LayoutPlan::new(g, layout, granule).unwrap();
            let mut seen = std::collections::BTreeSet::new();
            for layer in 0..2 {
                for kv in KvKind::BOTH {
                    for head in 0..3 {
                        for token in 0..5 {
                            let o = plan.offset(layer, kv, head, token).unwrap();
                            assert_eq!(
                                o,
                                reference_offset(
                                    &g,
                                    layout,
                                    plan.slice_stride(),
                                    layer,
                                    kv,
                                    head,
                                    token
                                )
                            );
                            assert!(o + g.head_bytes() <= plan.reservation_bytes());
                            // head vectors are disjoint
                            assert!(seen.insert(o / g.head_bytes()));
                            // the element lies in its fragment
                            let f = plan.fragment_index(layer, kv, head).unwrap();
                            let frag = plan.fragments().unwrap()[f as usize];
                            assert!(o >= frag.offset && o < frag.offset + frag.data_bytes);
                            assert_eq!(frag.offset % granule, 0);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn slices_are_padded_to_the_granule() {
    let g = small();
    // head-major: 12 slices of 5*8 = 40 bytes, padded to 64.
    let plan = LayoutPlan::new(g, KvLayout::HeadMajor, 64).unwrap();
    assert_eq!(plan.slice_count(), 12);
    assert_eq!(plan.slice_data_bytes(), 40);
    assert_eq!(plan.slice_stride(), 64);
    assert_eq!(plan.reservation_bytes(), 768);
    assert_eq!(plan.data_bytes(), 480);
    assert_eq!(plan.padding_bytes(), 288);
    // seq-major: 4 slices of 5*24 = 120 bytes, padded to 128.
    let plan = LayoutPlan::new(g, KvLayout::SeqMajor, 64).unwrap();
    assert_eq!((plan.slice_count(), plan.slice_stride()), (4, 128));
    assert_eq!(plan.padding_bytes(), 32);
    // token-major: 1 slice of 5*96 = 480 bytes, padded to 512.
    let plan = LayoutPlan::new(g, KvLayout::TokenMajor, 64).unwrap();
    assert_eq!((plan.slice_count(), plan.slice_stride()), (1, 512));
    assert_eq!(plan.padding_bytes(), 32);
    // granule 1: no padding at all.
    for layout in KvLayout::ALL {
        assert_eq!(LayoutPlan::new(g, layout, 1).unwrap().padding_bytes(), 0);
    }
}

#[test]
fn windows_count_every_window_with_a_live_byte() {
    let g = small();
    for layout in KvLayout::ALL {
        for granule in [1, 8, 16, 64, 100, 4096] {
            let plan = LayoutPlan::new(g, layout, granule).unwrap();
            for n in 0..=5 {
                // brute force: mark every window holding a live byte.
                let mut live = std::collections::BTreeSet::new();
                for layer in 0..2 {
                    for kv in KvKind::BOTH {
                        for head in 0..3 {
                            for token in 0..n {
                                let o = plan.offset(layer, kv, head, token).unwrap();
                                for b in o..o + g.head_bytes() {
                                    live.insert(b / granule);
                                }
                            }
                        }
                    }
                }
                let ranges = plan.windows_for_tokens(n).unwrap();
                let listed: std::collections::BTreeSet<u64> =
                    ranges.iter().flat_map(|r| r.clone()).collect();
                assert_eq!(listed, live, "{layout} granule {granule} n {n}");
                assert_eq!(plan.window_count_for_tokens(n).unwrap(), live.len() as u64);
                assert_eq!(
                    plan.committed_bytes_for_tokens(n).unwrap(),
                    granule * live.len() as u64
                );
                assert!(listed.iter().all(|w| *w < plan.reservation_windows()));
            }
        }
    }
}

#[test]
fn commit_lower_bound_for_one_token_of_llama_3_8b() {
    let g = KvGeometry::preset("llama-3-8b", KvDtype::F16, 131_072).unwrap();
    let hm = LayoutPlan::new(g, KvLayout::HeadMajor, 2 * MIB).unwrap();
    let sm = LayoutPlan::new(g, KvLayout::SeqMajor, 2 * MIB).unwrap();
    let tm = LayoutPlan::new(g, KvLayout::TokenMajor, 2 * MIB).unwrap();
    // one token touches one window per fragment.
    assert_eq!(hm.committed_bytes_for_tokens(1).unwrap(), 512 * 2 * MIB);
    assert_eq!(sm.committed_bytes_for_tokens(1).unwrap(), 64 * 2 * MIB);
    assert_eq!(tm.committed_bytes_for_tokens(1).unwrap(), 2 * MIB);
    // at capacity all three commit exactly the data (128K tokens fill whole windows).
    for p in [hm, sm, tm] {
        assert_eq!(p.padding_bytes(), 0);
        assert_eq!(
            p.committed_bytes_for_tokens(131_072).unwrap(),
            g.total_bytes()
        );
        assert_eq!(p.reservation_bytes(), 16 * 1024 * MIB);
    }
    // 64 KiB granule, 4096 tokens: head-major 1 MiB per fragment = 16 windows each.
    let hm = LayoutPlan::new(g, KvLayout::HeadMajor, 64 * KIB).unwrap();
    assert_eq!(hm.window_count_for_tokens(4096).unwrap(), 512 * 16);
}

#[test]
fn padding_cost_of_a_short_context() {
    // llama-3-8b fp16 at 1000 tokens, 2 MiB granule: each head-major slice holds 256_000
    // bytes but takes a whole 2 MiB window.
    let g = KvGeometry::preset("llama-3-8b", KvDtype::F16, 1000).unwrap();
    let hm = LayoutPlan::new(g, KvLayout::HeadMajor, 2 * MIB).unwrap();
    assert_eq!(hm.slice_stride(), 2 * MIB);
    assert_eq!(hm.reservation_bytes(), 1024 * MIB);
    assert_eq!(hm.data_bytes(), 131_072_000);
    assert_eq!(hm.padding_bytes(), 1024 * MIB - 131_072_000);
    let tm = LayoutPlan::new(g, KvLayout::TokenMajor, 2 * MIB).unwrap();
    assert_eq!(tm.reservation_bytes(), 126 * MIB);
}

#[test]
fn bad_indices_are_errors() {
    let plan = LayoutPlan::new(small(), KvLayout::SeqMajor, 64).unwrap();
    assert!(matches!(
        plan.offset(2, KvKind::Key, 0, 0),
        Err(KvError::LayerOutOfRange {
            layer: 2,
            layers: 2
        })
    ));
    assert!(matches!(
        plan.offset(0, KvKind::Key, 3, 0),
        Err(KvError::HeadOutOfRange {
            head: 3,
            kv_heads: 3
        })
    ));
    assert!(matches!(
        plan.offset(0, KvKind::Value, 0, 5),
        Err(KvError::TokenOutOfRange {
            token: 5,
            max_tokens: 5
        })
    ));
    assert!(matches!(
        plan.windows_for_tokens(6),
        Err(KvError::TooManyTokens {
            tokens: 6,
            max_tokens: 5
        })
    ));
    assert_eq!(
        LayoutPlan::new(small(), KvLayout::SeqMajor, 0),
        Err(KvError::ZeroGranule)
    );
}

#[test]
fn padded_reservation_overflow_is_an_error() {
    let g = KvGeometry::new(1, 1, 1, 1, u64::MAX / 2).unwrap();
    assert!(matches!(
        LayoutPlan::new(g, KvLayout::TokenMajor, u64::MAX / 2 + 7),
        Err(KvError::Overflow { .. })
    ));
}

#[test]
fn layout_names_parse() {
    for l in KvLayout::ALL {
        assert_eq!(l.as_str().parse::<KvLayout>().unwrap(), l);
    }
    assert_eq!("BNSH".parse::<KvLayout>().unwrap(), KvLayout::HeadMajor);
    assert_eq!("bsnh".parse::<KvLayout>().unwrap(), KvLayout::SeqMajor);
    assert_eq!(
        "token_major".parse::<KvLayout>().unwrap(),
        KvLayout::TokenMajor
    );
    assert!("diagonal".parse::<KvLayout>().is_err());
}

#[test]
fn mapped_tokens_are_the_tokens_wholly_inside_the_windows_of_the_live_ones() {
    let g = KvGeometry::preset("llama-3-8b", KvDtype::F16, 8192).unwrap();
    let tm = LayoutPlan::new(g, KvLayout::TokenMajor, 2 * MIB).unwrap();
    // 128 KiB per token: a 2 MiB window holds 16 tokens.
    assert_eq!(tm.mapped_tokens(0).unwrap(), 0);
    assert_eq!(tm.mapped_tokens(1).unwrap(), 16);
    assert_eq!(tm.mapped_tokens(16).unwrap(), 16);
    assert_eq!(tm.mapped_tokens(17).unwrap(), 32);
    assert_eq!(tm.mapped_tokens(8192).unwrap(), 8192);
    let sm = LayoutPlan::new(g, KvLayout::SeqMajor, 2 * MIB).unwrap();
    // 2 KiB per token in each fragment: 1024 tokens per window.
    assert_eq!(sm.mapped_tokens(1000).unwrap(), 1024);
    // Tokens straddling a window end are not counted: 3 KiB per token, 4 KiB windows.
    let odd = KvGeometry::new(1, 3, 512, 2, 100).unwrap();
    let p = LayoutPlan::new(odd, KvLayout::SeqMajor, 4 * KIB).unwrap();
    assert_eq!(p.mapped_tokens(1).unwrap(), 1);
    assert_eq!(p.mapped_tokens(2).unwrap(), 2);
    assert_eq!(p.mapped_tokens(3).unwrap(), 4);
    // Never past the geometry's tokens, and never fewer than asked.
    for n in 0..=100 {
        let m = p.mapped_tokens(n).unwrap();
        assert!(m >= n && m <= 100, "{n} -> {m}");
        assert_eq!(
            p.committed_bytes_for_tokens(m).unwrap(),
            p.committed_bytes_for_tokens(n).unwrap()
        );
    }
    assert!(p.mapped_tokens(101).is_err());
}
