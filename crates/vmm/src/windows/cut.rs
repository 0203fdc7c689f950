//! How a commit cuts windows into handles: each contiguous run of windows is cut largest first
//! into power-of-two numbers of windows, each aligned to its own size from the reservation's
//! base and at most `VmmConfig::max_handle_bytes` (buddy style, so that a later release at an
//! aligned boundary frees whole handles). Pure arithmetic: [`commit_pieces`] tells a planner
//! (`kvvm plan`) how many handles and mappings a commit makes.

use std::ops::Range;

use crate::windows::spans::{merged, Span};

/// The most windows one handle of a commit holds: the largest power of two not above
/// `max_handle_bytes / granule`, at least one.
pub fn max_handle_windows(max_handle_bytes: u64, granule: u64) -> u64 {
    let most = (max_handle_bytes / granule.max(1)).max(1);
    1u64 << (63 - most.leading_zeros())
}

/// The most windows a handle whose first window is `first` may hold: a buddy piece is
/// aligned to its own size from the base (window 0 takes any power of two), and holds at most
/// `max_windows` (a power of two).
pub fn buddy_windows_at(first: u64, max_windows: u64) -> u64 {
    let align = if first == 0 {
        max_windows
    } else {
        1u64 << first.trailing_zeros().min(63)
    };
    align.min(max_windows).max(1)
}

/// The handles (one mapping each) a commit of the windows `ranges` makes, as `(first window,
/// windows)` per handle: `ranges` are window indices from the reservation's base, sorted and
/// disjoint (adjacent ones form one run), and no handle holds more than `max_handle_windows`
/// windows (see [`max_handle_windows`]). This is the cut `Reservation::commit_ranges` makes
/// of windows none of which is mapped or parked yet.
pub fn commit_pieces(ranges: &[Range<u64>], max_handle_windows: u64) -> Vec<(u64, u64)> {
    pieces(&window_spans(ranges), 1, max_handle_windows.max(1), &[])
}

/// Window index ranges as spans of a granule of 1 (offsets are window indices).
fn window_spans(ranges: &[Range<u64>]) -> Vec<Span> {
    ranges
        .iter()
        .map(|r| Span::new(r.start, r.end.saturating_sub(r.start)))
        .collect()
}

/// The handles (one mapping each) a shared commit of the windows `ranges` makes, as `(first
/// window, windows)` per handle: one per range, cut again only every `max_handle_windows`
/// windows (the cut `Reservation::commit_shared` makes, see `run_pieces`). `ranges` are
/// window indices from the reservation's base, sorted and disjoint.
pub fn shared_commit_pieces(ranges: &[Range<u64>], max_handle_windows: u64) -> Vec<(u64, u64)> {
    let spans = window_spans(ranges);
    let cuts: Vec<u64> = ranges
        .iter()
        .filter(|r| r.end > r.start)
        .map(|r| r.start)
        .collect();
    run_pieces(&spans, 1, max_handle_windows.max(1), &cuts)
}

/// How a commit maps sorted, disjoint window spans: `(offset, windows)` per handle. Each
/// contiguous run (adjacent spans merged) is cut largest first into power-of-two numbers of
/// windows, each aligned to its own size from the base (offset 0) and at most `max_windows`
/// (a power of two); no piece crosses one of the sorted offsets `cuts` (a piece may start
/// there). The work is per piece, not per window.
pub(crate) fn pieces(spans: &[Span], g: u64, max_windows: u64, cuts: &[u64]) -> Vec<(u64, u64)> {
    cut_runs(spans, g, cuts, |p, to_cut| {
        let fit = 1u64 << (63 - to_cut.leading_zeros());
        fit.min(buddy_windows_at(p, max_windows))
    })
}

/// How a shared commit maps sorted, disjoint window spans: `(offset, windows)` per handle.
/// Each contiguous run is cut only where it must be: at the sorted offsets `cuts` (a piece
/// may start there) and every `max_windows` windows, with no alignment and any number of
/// windows per piece. A shared set is released whole, never at a window boundary inside it,
/// so buddy pieces buy nothing there, and a fragment's run of a shared prefix is one handle
/// (one mapping for every sharer) wherever it starts.
pub(crate) fn run_pieces(
    spans: &[Span],
    g: u64,
    max_windows: u64,
    cuts: &[u64],
) -> Vec<(u64, u64)> {
    let most = max_windows.max(1);
    cut_runs(spans, g, cuts, |_, to_cut| to_cut.min(most))
}

/// Walks each contiguous run of `spans` (adjacent ones merged) from its first window: at
/// window `p`, with `to_cut` windows (at least one) left before the next of the sorted `cuts`
/// or the run's end, `size(p, to_cut)` windows (clamped to `1..=to_cut`) make the next piece.
/// The work is per piece, not per window.
fn cut_runs(
    spans: &[Span],
    g: u64,
    cuts: &[u64],
    size: impl Fn(u64, u64) -> u64,
) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let g = g.max(1);
    for run in merged(spans, g) {
        let mut p = run.offset / g;
        let end = p.saturating_add(run.windows);
        while p < end {
            let left = end - p;
            let at = p.saturating_mul(g);
            let to_cut = cuts
                .get(cuts.partition_point(|&c| c <= at))
                .map_or(left, |&c| (c.saturating_sub(at) / g).clamp(1, left));
            let k = size(p, to_cut).clamp(1, to_cut);
            out.push((at, k));
            p = p.saturating_add(k);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::single_range_in_vec_init)]
    use super::*;

    #[test]
    fn a_run_is_cut_largest_first_and_aligned() {
        // 0..13 with handles of at most 8: 8 + 4 + 1.
        assert_eq!(commit_pieces(&[0..13], 8), vec![(0, 8), (8, 4), (12, 1)]);
        // 3..9: 3 (1, aligned to 1), 4..8 (4), 8 (1).
        assert_eq!(commit_pieces(&[3..9], 8), vec![(3, 1), (4, 4), (8, 1)]);
        // Adjacent ranges form one run; separate ones are cut apart.
        assert_eq!(commit_pieces(&[0..2, 2..4, 8..10], 8), vec![(0, 4), (8, 2)]);
        // One window per handle.
        assert_eq!(commit_pieces(&[0..3], 1).len(), 3);
        assert!(commit_pieces(&[], 8).is_empty());
    }

    #[test]
    fn a_shared_run_is_cut_only_at_its_cuts_and_the_largest_handle() {
        let spans =
            |r: &[(u64, u64)]| -> Vec<Span> { r.iter().map(|&(o, n)| Span::new(o, n)).collect() };
        // An unaligned run of 5 windows is one piece (buddy: 3, then 4..8).
        assert_eq!(run_pieces(&spans(&[(3, 5)]), 1, 8, &[]), vec![(3, 5)]);
        assert_eq!(pieces(&spans(&[(3, 5)]), 1, 8, &[]).len(), 2);
        // Cut at the cuts (one per fragment run) and at the largest handle.
        assert_eq!(
            run_pieces(&spans(&[(3, 10)]), 1, 4, &[3, 6]),
            vec![(3, 3), (6, 4), (10, 3)]
        );
        // Byte offsets with a granule: adjacent spans form one run.
        assert_eq!(
            run_pieces(&spans(&[(0, 2), (8, 1)]), 4, 8, &[]),
            vec![(0, 3)]
        );
        assert!(run_pieces(&[], 4, 8, &[]).is_empty());
        // The planner's view: one handle per range, adjacent ranges kept apart.
        assert_eq!(
            shared_commit_pieces(&[3..8, 8..12, 20..21], 8),
            vec![(3, 5), (8, 4), (20, 1)]
        );
        // An empty range names no window and cuts nothing, wherever it lies.
        assert_eq!(shared_commit_pieces(&[0..6, 3..3], 8), vec![(0, 6)]);
    }

    #[test]
    fn max_handle_windows_is_a_power_of_two() {
        let g = 2 << 20;
        assert_eq!(max_handle_windows(512 << 20, g), 256);
        assert_eq!(max_handle_windows(3 * g, g), 2);
        assert_eq!(max_handle_windows(0, g), 1);
        // A granule of 0 is taken as 1 byte.
        assert_eq!(max_handle_windows(g, 0), g);
    }
}
