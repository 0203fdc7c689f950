//! Deterministic synthetic token ids and KV bytes: what the tests, the decode benchmark and
//! the demos write into a cache and verify afterwards. A pure function of the geometry, the
//! token id and the position, so identical prefixes give identical bytes.

use kvvm_layout::KvGeometry;

/// The first SplitMix64 draw for seed `x`: a deterministic per-position value.
fn splitmix(x: u64) -> u64 {
    kvvm_num::SplitMix64::new(x).next_u64()
}

/// Token id of prompt position `i` (the same for every sequence).
pub fn prompt_token_id(i: u64) -> u32 {
    (splitmix(i ^ 0x7072_6f6d_7074) % 128_000) as u32
}

/// Token id sequence `seq` generates at position `pos`.
pub fn decode_token_id(seq: u64, pos: u64) -> u32 {
    (splitmix(pos ^ seq.wrapping_mul(0x1000_0000_01b3) ^ 0x6465_636f_6465) % 128_000) as u32
}

/// Fills `out` (`bytes_per_token` bytes, host layout `[layer][K, V][kv_head][head_dim]`) with
/// the synthetic KV of token `token_id` at `position`: a deterministic function of token id,
/// position, layer, K/V, head and byte, so identical prefixes give identical bytes.
pub fn token_kv_bytes(geometry: &KvGeometry, token_id: u32, position: u64, out: &mut [u8]) {
    let head = usize::try_from(geometry.head_bytes())
        .unwrap_or(usize::MAX)
        .max(1);
    let base = splitmix(u64::from(token_id) ^ position.rotate_left(32));
    for (i, chunk) in out.chunks_mut(head).enumerate() {
        // i = (layer x 2 + kv) x kv_heads + head.
        let seed = splitmix(base ^ (i as u64).wrapping_mul(0xa076_1d64_78bd_642f));
        for (j, w) in chunk.chunks_mut(8).enumerate() {
            let v = splitmix(seed.wrapping_add(j as u64)).to_le_bytes();
            w.copy_from_slice(&v[..w.len()]);
        }
    }
}

/// Fills `out` with tokens `first..first + n` of a sequence whose ids are `id(pos)`.
pub fn fill_tokens(geometry: &KvGeometry, first: u64, out: &mut [u8], id: &dyn Fn(u64) -> u32) {
    let bpt = usize::try_from(geometry.bytes_per_token())
        .unwrap_or(usize::MAX)
        .max(1);
    for (k, tok) in out.chunks_mut(bpt).enumerate() {
        let pos = first + k as u64;
        token_kv_bytes(geometry, id(pos), pos, tok);
    }
}
