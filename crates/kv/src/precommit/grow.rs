//! Growing ahead in buddy-aligned multi-window handles, when the room to grow
//! ([`Precommitter::set_grow_ahead_bytes`](super::Precommitter::set_grow_ahead_bytes)) and
//! the bound allow.

use std::sync::atomic::Ordering;

use super::{Cell, Inner};

impl Inner {
    /// `target` grown, when the room to grow ([`Precommitter::set_grow_ahead_bytes`]) and the
    /// bound allow, so that the windows the commit adds to each fragment are one
    /// buddy-aligned handle: the largest power of two of windows that can start at the
    /// committed end (aligned to its own size, at most the manager's largest handle) and still
    /// covers `target`. The bytes ahead of `live` must stay within one headroom (`2 x
    /// headroom_tokens` and a window per fragment, the most a commit without growth leaves
    /// ahead) plus the room to grow, and the new bytes within what the bound has left
    /// (`total` bytes are ahead now). `target` when no such handle is larger than what
    /// `target` needs.
    pub(super) fn grown_target(
        &self,
        cell: &Cell,
        (have, live, target): (u64, u64, u64),
        total: u64,
    ) -> u64 {
        let grow = self.grow_ahead.load(Ordering::Relaxed);
        if grow == 0 {
            return target;
        }
        let plan = &cell.plan;
        let (Ok(from), Ok(to)) = (
            plan.windows_per_fragment(have),
            plan.windows_per_fragment(target),
        ) else {
            return target;
        };
        let needed = to.saturating_sub(from);
        if needed == 0 {
            return target;
        }
        let most = kvvm_vmm::buddy_windows_at(from, self.vm.max_handle_windows());
        let one_headroom =
            Inner::ahead_bytes(plan, 0, self.config.headroom_tokens.saturating_mul(2))
                .saturating_add(plan.slice_count().saturating_mul(plan.granule()));
        let cap = one_headroom.saturating_add(grow);
        let per_token = plan.fragment_bytes_per_token().max(1);
        let mut windows = 1u64 << (63 - most.leading_zeros());
        while windows > needed {
            let tokens = from.saturating_add(windows).saturating_mul(plan.granule()) / per_token;
            let grown = tokens.min(cell.max_tokens);
            let ahead = Inner::ahead_bytes(plan, live, grown);
            let extra = Inner::ahead_bytes(plan, have.max(live), grown);
            if grown > target
                && ahead <= cap
                && total.saturating_add(extra) <= self.config.max_headroom_bytes
            {
                return grown;
            }
            windows /= 2;
        }
        target
    }
}
