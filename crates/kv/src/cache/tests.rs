//! Unit tests of the prefix cache (`mod.rs`): the configuration of blocks and the hash chain.

#![allow(clippy::unwrap_used)]
use super::*;

#[test]
fn block_tokens_default_and_floor() {
    assert_eq!(
        PrefixCacheConfig::default().block_tokens,
        crate::DEFAULT_BLOCK_TOKENS
    );
    assert_eq!(PrefixCacheConfig::default().block_tokens(0).block_tokens, 1);
    assert_eq!(PrefixCacheConfig::default().block_tokens(7).block_tokens, 7);
    assert_eq!(
        PrefixCacheConfig::default()
            .handle_windows(0)
            .handle_windows,
        1
    );
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
}
