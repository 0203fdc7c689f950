//! The driver steps of a commit: create each handle the pool did not supply and map it
//! whole, then set access once over each contiguous run. A step that fails stops here; the
//! maps made so far are undone by `rollback.rs`.

use kvvm_governor::{Bucket, MappedGrowthGrant};
use kvvm_hal::BackendError;

use crate::device::Source;
use crate::windows::spans::{self, Span};

use super::plan::{Piece, Plan};
use super::{Mapped, Origin, Target};

impl Target {
    /// Creates (or takes from the plan) and maps each piece's handle whole, in order, until
    /// one fails. Returns the mappings made and the failure. A handle that was created or
    /// taken but could not be mapped is disposed of here; pooled handles of pieces not
    /// reached go back to the pool.
    pub(super) fn create_and_map(
        &self,
        pieces: Vec<Piece>,
        grant: &mut MappedGrowthGrant,
    ) -> (Vec<Mapped>, Option<BackendError>) {
        let st = &*self.state;
        let ctx = &st.ctx;
        let g = ctx.granule;
        let mut mapped: Vec<Mapped> = Vec::new();
        let mut failure: Option<BackendError> = None;
        let mut rest = pieces.into_iter();
        for p in rest.by_ref() {
            let size = p.windows.saturating_mul(g);
            let (handle, origin) = match p.pooled {
                Some(h) => (h, Origin::Pool),
                None => match ctx.backend.create(size, &ctx.props) {
                    Ok(h) => (h, Origin::Created),
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                },
            };
            if let Err(e) = ctx.backend.map(self.at(p.offset), size, handle) {
                // A failed release is quarantined inside; the map error is the one reported.
                let _ = match origin {
                    Origin::Pool => st.dispose(handle, size, Source::Bucket(Bucket::Pooled)),
                    Origin::Created => st.dispose(handle, size, Source::Grant(grant)),
                };
                failure = Some(e);
                break;
            }
            mapped.push(Mapped {
                offset: p.offset,
                windows: p.windows,
                handle,
                origin,
            });
        }
        // Handles taken from the pool but not reached go back.
        let left: Vec<Piece> = rest.collect();
        Plan::untake(self, &left);
        (mapped, failure)
    }

    /// Sets access once over each contiguous run of `spans`, retried as the backend asks.
    pub(super) fn set_access(&self, spans: &[Span]) -> Result<(), BackendError> {
        let ctx = &self.state.ctx;
        for (run_offset, run_bytes) in spans::runs(spans, ctx.granule) {
            ctx.set_access_retrying(self.at(run_offset), run_bytes, &ctx.access)?;
        }
        Ok(())
    }
}
