//! Plan the pieces of a commit and pay for them: cut the windows into handles, take pooled
//! handles of exactly those sizes, and ask the governor for the rest (no grant, no commit).
//! Each step's undo is beside it: what the pool gave goes back ([`Plan::untake`]).

use kvvm_governor::{MappedGrowthGrant, Refusal};
use kvvm_hal::PhysicalHandle;

use crate::error::{VmmError, VmmResult};
use crate::windows::cut::{pieces, run_pieces};
use crate::windows::spans::Span;

use super::Target;

/// One handle a commit maps: `windows` windows from `offset`, and the pooled handle of
/// exactly that size when the pool had one.
pub(super) struct Piece {
    pub(super) offset: u64,
    pub(super) windows: u64,
    pub(super) pooled: Option<PhysicalHandle>,
}

/// The pieces of a commit, in order, and the bytes the pool supplies.
pub(super) struct Plan {
    pub(super) pieces: Vec<Piece>,
    pub(super) pooled_bytes: u64,
}

impl Plan {
    /// Gives the pooled handles of `pieces` back to the pool.
    pub(super) fn untake(target: &Target, pieces: &[Piece]) {
        let st = &target.state;
        let g = st.ctx.granule;
        st.pool.untake(
            &st.ctx,
            pieces
                .iter()
                .filter_map(|p| p.pooled.map(|h| (h, p.windows.saturating_mul(g))))
                .collect(),
        );
    }
}

impl Target {
    /// Cuts `spans` into handles (one per range up to the largest handle for a shared
    /// commit, buddy-aligned pieces otherwise; none crossing `cuts`) and takes from the pool
    /// a handle of exactly each piece's size where it holds one.
    pub(super) fn plan(&self, spans: &[Span], shared: bool, cuts: &[u64]) -> Plan {
        let st = &self.state;
        let g = st.ctx.granule;
        let cut = if shared { run_pieces } else { pieces };
        let pieces: Vec<Piece> = cut(spans, g, self.max_windows, cuts)
            .into_iter()
            .map(|(offset, windows)| Piece {
                offset,
                windows,
                pooled: st.pool.take(windows.saturating_mul(g)),
            })
            .collect();
        let pooled_bytes = pieces
            .iter()
            .filter(|p| p.pooled.is_some())
            .map(|p| p.windows.saturating_mul(g))
            .fold(0u64, u64::saturating_add);
        Plan {
            pieces,
            pooled_bytes,
        }
    }

    /// The grant for what the pool cannot supply: `grant` when one was handed in, otherwise
    /// one from the governor. On a refusal the pooled handles go back to the pool.
    pub(super) fn grant_for(
        &self,
        plan: &Plan,
        grant: Option<MappedGrowthGrant>,
        bytes: u64,
    ) -> VmmResult<MappedGrowthGrant> {
        if let Some(grant) = grant {
            return Ok(grant);
        }
        let ctx = &self.state.ctx;
        let new_bytes = bytes.saturating_sub(plan.pooled_bytes);
        ctx.governor
            .try_grant(ctx.device, new_bytes)
            .map_err(|refusal| {
                Plan::untake(self, &plan.pieces);
                whole_request(refusal, bytes, plan.pooled_bytes)
            })
    }
}

/// A refusal of the grant for what the pool could not supply, restated for the whole commit:
/// `needed` is every byte the commit asked for and `available` includes the pooled handles it
/// had set aside (back in the pool now), so that both count the same bytes.
fn whole_request(refusal: Refusal, bytes: u64, pooled_bytes: u64) -> VmmError {
    match refusal {
        Refusal::Backpressure(mut b) => {
            b.needed = bytes;
            b.available = b.available.saturating_add(pooled_bytes);
            VmmError::Backpressure(b)
        }
        other => other.into(),
    }
}
