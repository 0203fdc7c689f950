//! [`ReleaseWindow`]: what was released during the last window of a [`RetryPolicy`], the
//! figure `retry_after` is estimated from. One type for every book that estimates it: the
//! governor's ledger (bytes freed to the driver, bytes consumers released), its tenant books
//! (shares released) and a node broker's books (bytes given back).
//!
//! [`RetryPolicy`]: crate::RetryPolicy

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// What a [`ReleaseWindow`] sums: bytes, or a tenant's share.
pub trait Released: Copy + Default {
    /// `self + other` (saturating: a window never wraps).
    fn plus(self, other: Self) -> Self;
}

impl Released for u64 {
    fn plus(self, other: Self) -> Self {
        self.saturating_add(other)
    }
}

/// The releases of the last window: (when, what) events, oldest first. Events older than the
/// window are dropped as new ones come; at most [`MAX_EVENTS`](Self::MAX_EVENTS) are kept,
/// the oldest merged into the next beyond that, so that however fast releases come the
/// window holds a bounded number of events and its sum stays whole.
#[derive(Debug, Clone, Default)]
pub struct ReleaseWindow<T = u64> {
    events: VecDeque<(Instant, T)>,
}

impl<T: Released> ReleaseWindow<T> {
    /// Most events kept (older ones are merged into their neighbour).
    pub const MAX_EVENTS: usize = 1024;

    /// An empty window.
    pub fn new() -> Self {
        ReleaseWindow {
            events: VecDeque::new(),
        }
    }

    /// Records `what` released at `now`, dropping what is older than `window` first.
    pub fn note(&mut self, now: Instant, window: Duration, what: T) {
        self.prune(now, window);
        if self.events.len() >= Self::MAX_EVENTS {
            // Merge the oldest event into the next one: the sum in the window is kept.
            if let Some((_, oldest)) = self.events.pop_front() {
                if let Some(next) = self.events.front_mut() {
                    next.1 = next.1.plus(oldest);
                }
            }
        }
        self.events.push_back((now, what));
    }

    /// Drops the events older than `window` at `now`.
    pub fn prune(&mut self, now: Instant, window: Duration) {
        while let Some((t, _)) = self.events.front() {
            if now.saturating_duration_since(*t) > window {
                self.events.pop_front();
            } else {
                break;
            }
        }
    }

    /// What was released during the `window` before `now` (older events are not counted,
    /// and are left for [`prune`](Self::prune) or the next [`note`](Self::note)).
    pub fn total(&self, now: Instant, window: Duration) -> T {
        self.events
            .iter()
            .filter(|(t, _)| now.saturating_duration_since(*t) <= window)
            .fold(T::default(), |a, (_, w)| a.plus(*w))
    }

    /// Whether no event is kept.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// The events kept.
    pub fn len(&self) -> usize {
        self.events.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenant::TenantShare;

    const W: Duration = Duration::from_secs(1);

    #[test]
    fn only_the_window_counts_and_older_events_go() {
        let t0 = Instant::now();
        let mut w = ReleaseWindow::<u64>::new();
        assert!(w.is_empty());
        w.note(t0, W, 10);
        assert!(!w.is_empty());
        w.note(t0 + W, W, 5);
        assert_eq!(
            w.total(t0 + W, W),
            15,
            "an event exactly a window old counts"
        );
        assert_eq!(w.total(t0 + W + Duration::from_millis(1), W), 5);
        assert_eq!(w.len(), 2, "total drops nothing");
        w.prune(t0 + W, W);
        assert_eq!(w.len(), 2, "prune keeps an event exactly a window old");
        w.prune(t0 + W + Duration::from_millis(1), W);
        assert_eq!(w.len(), 1);
        w.note(t0 + 3 * W, W, 1);
        assert_eq!(
            (w.len(), w.total(t0 + 3 * W, W)),
            (1, 1),
            "note drops what is old"
        );
    }

    #[test]
    fn past_the_most_events_the_oldest_merge_and_the_sum_is_kept() {
        let t0 = Instant::now();
        let mut w = ReleaseWindow::<u64>::new();
        let n = ReleaseWindow::<u64>::MAX_EVENTS as u64 + 10;
        for i in 0..n {
            w.note(t0, W, i + 1);
        }
        assert_eq!(w.len(), ReleaseWindow::<u64>::MAX_EVENTS);
        assert_eq!(w.total(t0, W), n * (n + 1) / 2);
        w.note(t0, W, u64::MAX);
        assert_eq!(w.total(t0, W), u64::MAX, "saturating");
    }

    #[test]
    fn shares_sum_figure_by_figure() {
        let t0 = Instant::now();
        let mut w = ReleaseWindow::<TenantShare>::new();
        let share = |s, r, c| TenantShare {
            sequences: s,
            reserved_bytes: r,
            committed_bytes: c,
        };
        w.note(t0, W, share(1, 2, 3));
        w.note(t0, W, share(4, 5, 6));
        assert_eq!(w.total(t0, W), share(5, 7, 9));
    }
}
