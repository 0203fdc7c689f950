//! The undo of a commit that failed after its grant: unmap what it mapped, last first, and
//! dispose of the handles (to the pool or the driver); roll the grant back. A mapping whose
//! unmap fails stays as an owned block of the reservation (it is still mapped), accounted as
//! committed.

use kvvm_governor::{Bucket, MappedGrowthGrant};
use kvvm_hal::BackendError;

use crate::block::Block;
use crate::device::Source;

use super::{Applied, Mapped, Origin, Target};

impl Target {
    /// Rolls a failed commit back: undoes `mapped`, rolls `grant` back, reports `error` and
    /// the blocks left mapped.
    pub(super) fn roll_back(
        &self,
        error: BackendError,
        mapped: Vec<Mapped>,
        mut grant: MappedGrowthGrant,
    ) -> Applied {
        tracing::debug!(%error, mapped = mapped.len(), "commit failed; rolling back");
        let kept = self.undo_maps(mapped, &mut grant);
        grant.rollback();
        Applied {
            result: Err(error.into()),
            blocks: kept,
        }
    }

    /// Undoes the maps of a failed commit in reverse order, mapping by mapping. A mapping
    /// whose unmap fails stays recorded (it is still mapped) and its bytes are accounted as
    /// committed.
    fn undo_maps(&self, mapped: Vec<Mapped>, grant: &mut MappedGrowthGrant) -> Vec<Block> {
        let st = &*self.state;
        let ctx = &st.ctx;
        let g = ctx.granule;
        let mut kept = Vec::new();
        for m in mapped.into_iter().rev() {
            let addr = self.at(m.offset);
            let size = m.windows.saturating_mul(g);
            match ctx.backend.unmap(addr, size) {
                Ok(()) => {
                    // A failed release is quarantined inside; the commit's error is reported.
                    let _ = match m.origin {
                        Origin::Pool => st.dispose(m.handle, size, Source::Bucket(Bucket::Pooled)),
                        Origin::Created => st.dispose(m.handle, size, Source::Grant(grant)),
                    };
                }
                Err(error) => {
                    tracing::warn!(%addr, %error, "rollback unmap failed; mapping stays recorded");
                    // Still mapped: it stays as an owned block of this reservation, even when
                    // the commit was for a shared set (the set never saw it).
                    let r = match m.origin {
                        Origin::Pool => ctx.governor.transfer(
                            ctx.device,
                            Bucket::Pooled,
                            Bucket::Committed,
                            size,
                        ),
                        Origin::Created => grant.settle(size, Bucket::Committed),
                    };
                    ctx.account(r);
                    kept.push(Block::owned(m.offset, m.windows, m.handle));
                }
            }
        }
        kept
    }
}
