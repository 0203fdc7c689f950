//! The last step of a commit that succeeded: settle the grant for the handles created, move
//! the pooled bytes to their bucket (committed, or shared for a shared set), give back what
//! the grant did not use, and make the blocks and the [`Commit`] to report.

use kvvm_governor::{Bucket, MappedGrowthGrant};

use crate::block::Block;
use crate::mapping::{BlockKind, Commit};
use crate::shared::SharedPiece;

use super::{Applied, Mapped, Origin, Request, Target};

impl Target {
    /// Accounts the mappings made (created bytes from the grant, pooled bytes from the pool,
    /// both to committed or, with `shared`, to shared) and returns them as blocks.
    pub(super) fn settle(
        &self,
        mapped: Vec<Mapped>,
        mut grant: MappedGrowthGrant,
        pooled_bytes: u64,
        shared: Option<&mut Vec<SharedPiece>>,
        request: Request,
    ) -> Applied {
        let ctx = &self.state.ctx;
        let g = ctx.granule;
        let bucket = if shared.is_some() {
            Bucket::Shared
        } else {
            Bucket::Committed
        };
        let created = mapped
            .iter()
            .filter(|m| m.origin == Origin::Created)
            .map(|m| m.windows.saturating_mul(g))
            .fold(0u64, u64::saturating_add);
        ctx.account(grant.settle(created, bucket));
        ctx.account(
            ctx.governor
                .transfer(ctx.device, Bucket::Pooled, bucket, pooled_bytes),
        );
        grant.rollback();
        let kind = match shared {
            Some(set) => {
                set.extend(mapped.iter().map(|m| SharedPiece {
                    offset: m.offset,
                    windows: m.windows,
                    handle: m.handle,
                }));
                BlockKind::Shared { writable: true }
            }
            None => BlockKind::Owned,
        };
        let handles = mapped.len() as u64;
        let blocks = mapped
            .into_iter()
            .map(|m| Block {
                offset: m.offset,
                windows: m.windows,
                handle: m.handle,
                kind,
                shared: None,
            })
            .collect();
        Applied {
            result: Ok(Commit {
                address: request.start,
                bytes: request.bytes,
                granules: request.granules,
                from_pool: pooled_bytes / g,
                mappings: handles,
            }),
            blocks,
        }
    }
}
