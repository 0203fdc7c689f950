//! Unit tests of the prefix cache (`mod.rs`): the block size rule and the hash chain.

#![allow(clippy::unwrap_used)]
use super::*;
use crate::{KvDtype, KvGeometry, KvLayout};

fn block(preset: &str, layout: KvLayout, granule: u64) -> u64 {
    let g = KvGeometry::preset(preset, KvDtype::F16, 131_072).unwrap();
    PrefixCache::block_tokens_for(&LayoutPlan::new(g, layout, granule).unwrap()).unwrap()
}

/// The block-size rule of docs/prefix-sharing.md, row by row.
#[test]
fn block_size_rule() {
    let m2 = 2 << 20;
    let k64 = 64 << 10;
    assert_eq!(block("llama-3-8b", KvLayout::HeadMajor, m2), 8192);
    assert_eq!(block("llama-3-8b", KvLayout::SeqMajor, m2), 1024);
    assert_eq!(block("llama-3-8b", KvLayout::TokenMajor, m2), 16);
    assert_eq!(block("llama-3-8b", KvLayout::TokenMajor, k64), 1);
    assert_eq!(block("llama-3-70b", KvLayout::TokenMajor, m2), 32); // 10 windows
    assert_eq!(block("llama-3-70b", KvLayout::TokenMajor, k64), 1); // 5 windows
    assert_eq!(block("qwen2.5-7b", KvLayout::SeqMajor, m2), 2048);
    assert_eq!(block("qwen2.5-7b", KvLayout::TokenMajor, m2), 256); // 7 windows
    assert_eq!(block("qwen2.5-7b", KvLayout::TokenMajor, k64), 8); // 7 windows
                                                                   // Whenever the fragment bytes per token divide the granule, it is the smallest
                                                                   // shareable prefix.
    for p in crate::PRESETS {
        for layout in KvLayout::ALL {
            for granule in [k64, m2] {
                let g = KvGeometry::preset(p.name, KvDtype::F16, 131_072).unwrap();
                let b = layout.fragment_bytes_per_token(&g);
                let plan = LayoutPlan::new(g, layout, granule).unwrap();
                let bt = PrefixCache::block_tokens_for(&plan).unwrap();
                assert_eq!((bt * b) % granule, 0);
                if granule % b == 0 {
                    assert_eq!(
                        Some(bt),
                        crate::min_shareable_prefix(&g, layout, granule).unwrap()
                    );
                }
            }
        }
    }
}

#[test]
fn chain_hash_depends_on_every_earlier_block() {
    let a = [1u32, 2, 3, 4];
    let b = [1u32, 2, 3, 5];
    assert_eq!(chain_hash(HASH_SEED, &a), chain_hash(HASH_SEED, &a));
    assert_ne!(chain_hash(HASH_SEED, &a), chain_hash(HASH_SEED, &b));
    let h1 = chain_hash(chain_hash(HASH_SEED, &a), &a);
    let h2 = chain_hash(chain_hash(HASH_SEED, &b), &a);
    assert_ne!(h1, h2);
    assert_eq!(gcd(2 << 20, 327_680), 65_536);
}
