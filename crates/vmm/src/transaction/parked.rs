//! Parked windows in a commit: a private commit first takes back the parked mappings of its
//! reservation lying wholly inside its windows (no driver call, pooled to committed) and
//! commits only the rest; any other parked mapping overlapping the windows (every one, for a
//! shared commit) is unmapped first. If the rest fails, the taken windows go back to parking.

use std::sync::Arc;

use kvvm_governor::{Bucket, MappedGrowthGrant};

use crate::block::Block;
use crate::device::parking::Window;
use crate::error::VmmResult;
use crate::mapping::Commit;
use crate::windows::spans::{self, Span};

use super::{Applied, Request, Target};

impl Target {
    /// Takes the parked mappings of this reservation lying wholly inside `spans` when
    /// `reuse` (a private commit), after unmapping any other parked mapping that overlaps
    /// them (every one when not `reuse`).
    pub(super) fn take_parked(&self, spans: &[Span], reuse: bool) -> VmmResult<Vec<Window>> {
        let Some(parked) = &self.parked else {
            return Ok(Vec::new());
        };
        let st = &self.state;
        parked.evict_overlapping(&st.ctx, &st.pool, spans, reuse)?;
        if reuse {
            Ok(parked.take(&st.pool, st.ctx.granule, spans))
        } else {
            Ok(Vec::new())
        }
    }

    /// A private commit some of whose windows are parked here: the others are committed as
    /// usual, then the parked ones become blocks again (pooled to committed). If the fresh
    /// part fails, the parked windows go back to parking.
    pub(super) fn apply_reusing_parked(
        &self,
        spans: &[Span],
        reused: Vec<Window>,
        grant: Option<MappedGrowthGrant>,
        request: Request,
    ) -> Applied {
        let st = Arc::clone(&self.state);
        let ctx = &st.ctx;
        let g = ctx.granule;
        let holes: Vec<Span> = reused.iter().map(|w| Span::new(w.0, w.1)).collect();
        let fresh = spans::subtract(spans, &holes, g);
        let reused_windows = reused.iter().map(|w| w.1).fold(0u64, u64::saturating_add);
        let reused_bytes = reused_windows.saturating_mul(g);
        let mut applied = if fresh.is_empty() {
            if let Some(grant) = grant {
                grant.rollback();
            }
            Applied {
                result: Ok(Commit::empty(request.start)),
                blocks: Vec::new(),
            }
        } else {
            self.apply(&fresh, grant, None, &[])
        };
        match applied.result {
            Ok(c) => {
                ctx.account(ctx.governor.transfer(
                    ctx.device,
                    Bucket::Pooled,
                    Bucket::Committed,
                    reused_bytes,
                ));
                let n = reused.len() as u64;
                applied
                    .blocks
                    .extend(reused.into_iter().map(|(o, w, h)| Block::owned(o, w, h)));
                applied.blocks.sort_by_key(|b| b.offset);
                Applied {
                    result: Ok(Commit {
                        address: request.start,
                        bytes: request.bytes,
                        granules: request.granules,
                        from_pool: c.from_pool.saturating_add(reused_windows),
                        mappings: c.mappings.saturating_add(n),
                    }),
                    blocks: applied.blocks,
                }
            }
            Err(e) => {
                if let Some(parked) = &self.parked {
                    parked.put_back(&st.pool, g, reused);
                }
                Applied {
                    result: Err(e),
                    blocks: applied.blocks,
                }
            }
        }
    }
}
