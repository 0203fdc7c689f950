//! The vLLM-style policies: a pool preallocated to the budget, handed out in blocks of 16
//! tokens (`paged-16`), and the same with automatic prefix caching (`paged-16+prefix`, vLLM's
//! default), where the whole blocks of the common system prompt are held once and shared by
//! every running request that opens with it. Accounted by formula: the pool is one allocation
//! made at the start and freed at the end.

use std::collections::{BTreeMap, HashMap};

use kvvm_num::{add, mul};

use crate::driver::classic;
use crate::error::WorkloadResult;
use crate::policy::{seq_of, take_seq, Costs, Outcome, Policy, Shape, PAGED_BLOCK_TOKENS};
use crate::trace::Request;

#[derive(Debug, Clone, Copy)]
struct PagedSeq {
    tokens: u64,
    /// Blocks of the sequence's own (not shared).
    blocks: u64,
    /// Leading blocks shared with the prefix cache: the first `shared x 16` tokens.
    shared: u64,
}

/// `paged-16` (`prefix_caching` false) and `paged-16+prefix`.
#[derive(Debug)]
pub(crate) struct PagedPolicy {
    shape: Shape,
    /// Whole blocks of the common system prompt a request can share (0: none, or no prefix
    /// caching).
    prefix_blocks: u64,
    seqs: HashMap<usize, PagedSeq>,
    /// The shared blocks in use: how many running sequences share each number of leading
    /// blocks. They are blocks of one prompt, so the blocks in use are the largest key.
    sharers: BTreeMap<u64, usize>,
    /// Blocks owned by one sequence each.
    private_blocks: u64,
    /// Live tokens outside the shared blocks.
    private_tokens: u64,
}

impl PagedPolicy {
    /// `paged-16` when `prefix_caching` is false; with it, the system prompt of
    /// `system_prompt_tokens` is cached in whole blocks.
    pub fn new(shape: Shape, prefix_caching: bool, system_prompt_tokens: u64) -> Self {
        PagedPolicy {
            shape,
            prefix_blocks: if prefix_caching {
                system_prompt_tokens / PAGED_BLOCK_TOKENS
            } else {
                0
            },
            seqs: HashMap::new(),
            sharers: BTreeMap::new(),
            private_blocks: 0,
            private_tokens: 0,
        }
    }

    fn block_bytes(&self) -> u64 {
        self.shape
            .bytes_per_token
            .saturating_mul(PAGED_BLOCK_TOKENS)
    }

    /// The pool: the budget in whole blocks.
    fn pool_bytes(&self) -> u64 {
        let block = self.block_bytes();
        if block == 0 {
            return 0;
        }
        (self.shape.budget / block).saturating_mul(block)
    }

    /// Shared blocks in use (each held once).
    fn shared_blocks(&self) -> u64 {
        self.sharers.keys().next_back().copied().unwrap_or(0)
    }

    /// Bytes of the shared blocks a sharer maps (the system prompt's whole blocks).
    fn prefix_bytes(&self) -> u64 {
        self.prefix_blocks.saturating_mul(self.block_bytes())
    }

    /// Whether `blocks` blocks in use fit the pool.
    fn fits(&self, blocks: u64) -> WorkloadResult<bool> {
        Ok(mul(blocks, self.block_bytes(), "committed bytes")? <= self.pool_bytes())
    }
}

/// Blocks for `tokens` tokens.
fn blocks_for(tokens: u64) -> u64 {
    tokens.div_ceil(PAGED_BLOCK_TOKENS)
}

impl Policy for PagedPolicy {
    fn admit(&mut self, id: usize, req: &Request, tokens: u64) -> WorkloadResult<Outcome> {
        // The leading whole blocks of the system prompt this request opens with.
        let shared = self
            .prefix_blocks
            .min(req.shared_prefix_tokens.min(tokens) / PAGED_BLOCK_TOKENS);
        let own_tokens = tokens.saturating_sub(shared.saturating_mul(PAGED_BLOCK_TOKENS));
        let blocks = blocks_for(own_tokens);
        let in_use = add(
            add(self.private_blocks, blocks, "blocks")?,
            self.shared_blocks().max(shared),
            "blocks",
        )?;
        if !self.fits(in_use)? {
            return Ok(Outcome::Refused(None));
        }
        self.private_blocks = add(self.private_blocks, blocks, "blocks")?;
        self.private_tokens = add(self.private_tokens, own_tokens, "live tokens")?;
        if shared > 0 {
            *self.sharers.entry(shared).or_insert(0) += 1;
        }
        self.seqs.insert(
            id,
            PagedSeq {
                tokens,
                blocks,
                shared,
            },
        );
        Ok(Outcome::Done)
    }

    fn grow(&mut self, id: usize, tokens: u64) -> WorkloadResult<Outcome> {
        let seq = seq_of(&self.seqs, "grow", id)?;
        let shared_tokens = seq.shared.saturating_mul(PAGED_BLOCK_TOKENS);
        let blocks = blocks_for(tokens.saturating_sub(shared_tokens)).max(seq.blocks);
        let extra = blocks - seq.blocks;
        if extra > 0 {
            let in_use = add(
                add(self.private_blocks, extra, "blocks")?,
                self.shared_blocks(),
                "blocks",
            )?;
            if !self.fits(in_use)? {
                return Ok(Outcome::Refused(None));
            }
            self.private_blocks = add(self.private_blocks, extra, "blocks")?;
        }
        self.private_tokens = add(
            self.private_tokens,
            tokens.saturating_sub(seq.tokens),
            "live tokens",
        )?;
        self.seqs.insert(
            id,
            PagedSeq {
                tokens,
                blocks,
                ..seq
            },
        );
        Ok(Outcome::Done)
    }

    fn finish(&mut self, id: usize) -> WorkloadResult<()> {
        let seq = take_seq(&mut self.seqs, "finish", id)?;
        self.private_blocks = self.private_blocks.saturating_sub(seq.blocks);
        let own = seq
            .tokens
            .saturating_sub(seq.shared.saturating_mul(PAGED_BLOCK_TOKENS));
        self.private_tokens = self.private_tokens.saturating_sub(own);
        if seq.shared > 0 {
            if let Some(n) = self.sharers.get_mut(&seq.shared) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.sharers.remove(&seq.shared);
                }
            }
        }
        Ok(())
    }

    fn committed_bytes(&self) -> u64 {
        self.private_blocks
            .saturating_add(self.shared_blocks())
            .saturating_mul(self.block_bytes())
    }

    fn held_bytes(&self) -> u64 {
        self.pool_bytes()
    }

    fn live_bytes(&self) -> u64 {
        let shared_tokens = self.shared_blocks().saturating_mul(PAGED_BLOCK_TOKENS);
        self.private_tokens
            .saturating_add(shared_tokens)
            .saturating_mul(self.shape.bytes_per_token)
    }

    fn close(&mut self) -> WorkloadResult<Costs> {
        // One allocation of the whole pool at the start, one free at the end.
        let pool = self.pool_bytes();
        Ok(Costs {
            driver_calls: 2,
            mappings: 1,
            handles: 1,
            peak_mappings: 1,
            driver_time: classic::alloc(pool).saturating_add(classic::free(pool)),
            measured: false,
            block_prefix_bytes: (self.prefix_blocks > 0).then(|| self.prefix_bytes()),
            ..Costs::default()
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kvvm_layout::KvGeometry;

    const BPT: u64 = 1 << 10;
    const BLOCK: u64 = BPT * PAGED_BLOCK_TOKENS;

    fn shape(budget: u64) -> Shape {
        let geometry = KvGeometry::new(1, 1, 256, 2, 4096).unwrap();
        Shape {
            geometry,
            bytes_per_token: geometry.bytes_per_token(),
            max_context: 4096,
            budget,
        }
    }

    fn req(prompt: u64, shared: u64) -> Request {
        Request {
            arrival_us: 0,
            prompt_tokens: prompt,
            output_tokens: 8,
            shared_prefix_tokens: shared,
            line: None,
        }
    }

    fn admit(p: &mut PagedPolicy, id: usize, r: &Request) -> Outcome {
        p.admit(id, r, r.prompt_tokens).unwrap()
    }

    #[test]
    fn the_prompt_s_whole_blocks_are_held_once() {
        assert_eq!(shape(1).bytes_per_token, BPT);
        let (mut plain, mut cached) = (
            PagedPolicy::new(shape(1 << 30), false, 100),
            PagedPolicy::new(shape(1 << 30), true, 100),
        );
        // A 100-token system prompt: 6 whole blocks (96 tokens) shareable.
        for (id, r) in [(0, req(130, 100)), (1, req(120, 100)), (2, req(50, 0))] {
            assert_eq!(admit(&mut plain, id, &r), Outcome::Done);
            assert_eq!(admit(&mut cached, id, &r), Outcome::Done);
        }
        // Plain: 9 + 8 + 4 blocks. Cached: 6 shared + 3 + 2 + 4.
        assert_eq!(plain.committed_bytes(), 21 * BLOCK);
        assert_eq!(cached.committed_bytes(), 15 * BLOCK);
        // Live bytes count the shared tokens once: 130 + 120 + 50 - 96.
        assert_eq!(cached.live_bytes(), (300 - 96) * BPT);
        assert_eq!(plain.live_bytes(), 300 * BPT);
        // Growth past a sharer's last block takes one private block.
        assert_eq!(cached.grow(1, 129).unwrap(), Outcome::Done);
        assert_eq!(cached.committed_bytes(), 16 * BLOCK);
        // The shared blocks stay while one sharer runs, and go with the last one.
        cached.finish(0).unwrap();
        assert_eq!(cached.committed_bytes(), 13 * BLOCK);
        cached.finish(1).unwrap();
        assert_eq!(cached.committed_bytes(), 4 * BLOCK);
        cached.finish(2).unwrap();
        assert_eq!((cached.committed_bytes(), cached.live_bytes()), (0, 0));
        assert_eq!(cached.held_bytes(), plain.held_bytes());
        let costs = cached.close().unwrap();
        assert_eq!(costs.block_prefix_bytes, Some(6 * BLOCK));
        assert_eq!(
            (costs.driver_calls, costs.mappings, costs.handles),
            (2, 1, 1)
        );
        assert_eq!(plain.close().unwrap().block_prefix_bytes, None);
    }

    #[test]
    fn without_a_shared_prefix_it_is_paged_16() {
        let (mut plain, mut cached) = (
            PagedPolicy::new(shape(1 << 30), false, 0),
            PagedPolicy::new(shape(1 << 30), true, 15),
        );
        for (id, r) in [(0, req(130, 15)), (1, req(17, 0))] {
            admit(&mut plain, id, &r);
            admit(&mut cached, id, &r);
            assert_eq!(plain.committed_bytes(), cached.committed_bytes());
        }
        // A prompt shorter than one block shares nothing.
        assert_eq!(cached.close().unwrap().block_prefix_bytes, None);
    }

    #[test]
    fn the_pool_counts_shared_blocks_once() {
        // A pool of 10 blocks: two sharers of 6 blocks with 2 blocks each fit (10), a third
        // needs 2 more.
        let mut p = PagedPolicy::new(shape(10 * BLOCK), true, 96);
        assert_eq!(admit(&mut p, 0, &req(128, 96)), Outcome::Done);
        assert_eq!(admit(&mut p, 1, &req(128, 96)), Outcome::Done);
        assert_eq!(p.committed_bytes(), 10 * BLOCK);
        assert_eq!(admit(&mut p, 2, &req(128, 96)), Outcome::Refused(None));
        assert_eq!(p.grow(0, 129).unwrap(), Outcome::Refused(None));
        p.finish(1).unwrap();
        assert_eq!(p.grow(0, 129).unwrap(), Outcome::Done);
        assert_eq!(p.committed_bytes(), 9 * BLOCK);
    }
}
