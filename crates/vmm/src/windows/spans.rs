//! Sets of granule windows as sorted runs ([`Span`]): how a commit names the windows it maps,
//! so that checking them, cutting them into handles, taking parked windows back and setting
//! access cost per run and per mapping, never per window.

/// `windows` granule windows from `offset` (bytes from the reservation's base). A list of
/// spans is sorted by offset and its spans are disjoint; adjacent spans are allowed (they
/// form one contiguous run).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) offset: u64,
    pub(crate) windows: u64,
}

impl Span {
    pub(crate) fn new(offset: u64, windows: u64) -> Self {
        Span { offset, windows }
    }

    /// Its size in bytes.
    pub(crate) fn bytes(&self, g: u64) -> u64 {
        self.windows.saturating_mul(g)
    }

    /// The offset just past it.
    pub(crate) fn end(&self, g: u64) -> u64 {
        self.offset.saturating_add(self.bytes(g))
    }
}

/// Windows in `spans`.
pub(crate) fn window_count(spans: &[Span]) -> u64 {
    spans
        .iter()
        .map(|s| s.windows)
        .fold(0u64, u64::saturating_add)
}

/// Appends `s` to the sorted list `out`, merged into the last span when adjacent; an empty
/// span is dropped.
pub(crate) fn push(out: &mut Vec<Span>, s: Span, g: u64) {
    if s.windows == 0 {
        return;
    }
    match out.last_mut() {
        Some(last) if last.end(g) == s.offset => {
            last.windows = last.windows.saturating_add(s.windows);
        }
        _ => out.push(s),
    }
}

/// The union of half-open intervals `(start, end)`: sorted, disjoint and non-empty, with
/// intervals that overlap or touch merged. What a caller's ranges of windows, bytes or set
/// indices come to before they are compared with what is mapped.
pub(crate) fn union<T: Ord + Copy>(mut intervals: Vec<(T, T)>) -> Vec<(T, T)> {
    intervals.retain(|&(start, end)| start < end);
    intervals.sort_unstable();
    let mut out: Vec<(T, T)> = Vec::with_capacity(intervals.len());
    for (start, end) in intervals {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

/// The contiguous runs of `spans`: adjacent spans merged.
pub(crate) fn merged(spans: &[Span], g: u64) -> Vec<Span> {
    let mut out = Vec::with_capacity(spans.len());
    for &s in spans {
        push(&mut out, s, g);
    }
    out
}

/// The contiguous runs of `spans` as `(offset, bytes)`: what one set access covers.
pub(crate) fn runs(spans: &[Span], g: u64) -> Vec<(u64, u64)> {
    merged(spans, g)
        .into_iter()
        .map(|s| (s.offset, s.bytes(g)))
        .collect()
}

/// The first window of `[start, end)` that lies in `spans`, if any.
pub(crate) fn first_in(spans: &[Span], g: u64, start: u64, end: u64) -> Option<u64> {
    first_of(spans, g, start, end, |s| *s)
}

/// The first window of `[start, end)` that lies in one of `items` (sorted, disjoint; `span`
/// gives the windows of each), if any: a binary search, then the items overlapping the range.
pub(crate) fn first_of<T>(
    items: &[T],
    g: u64,
    start: u64,
    end: u64,
    span: impl Fn(&T) -> Span,
) -> Option<u64> {
    let i = items.partition_point(|x| span(x).end(g) <= start);
    items
        .get(i..)?
        .iter()
        .map(span)
        .take_while(|s| s.offset < end)
        .find(|s| s.windows > 0)
        .map(|s| s.offset.max(start))
}

/// How many of the `windows` windows from `start` lie in `spans`.
pub(crate) fn covered(spans: &[Span], g: u64, start: u64, windows: u64) -> u64 {
    let end = start.saturating_add(windows.saturating_mul(g));
    let g = g.max(1);
    let mut n = 0u64;
    let mut i = spans.partition_point(|s| s.end(g) <= start);
    while let Some(s) = spans.get(i) {
        if s.offset >= end {
            break;
        }
        let lo = s.offset.max(start);
        let hi = s.end(g).min(end);
        n = n.saturating_add(hi.saturating_sub(lo) / g);
        i = i.saturating_add(1);
    }
    n
}

/// The windows of `spans` that lie in none of `holes` (sorted, disjoint), as sorted spans.
pub(crate) fn subtract(spans: &[Span], holes: &[Span], g: u64) -> Vec<Span> {
    let mut out = Vec::new();
    for s in spans {
        let end = s.end(g);
        let mut at = s.offset;
        let mut i = holes.partition_point(|h| h.end(g) <= at);
        while let Some(h) = holes.get(i) {
            if h.offset >= end {
                break;
            }
            if h.offset > at {
                push(&mut out, Span::new(at, (h.offset - at) / g.max(1)), g);
            }
            at = at.max(h.end(g));
            i = i.saturating_add(1);
        }
        if at < end {
            push(&mut out, Span::new(at, (end - at) / g.max(1)), g);
        }
    }
    out
}

/// Every window offset of `spans`, in order (for tests and small lists).
#[cfg(test)]
pub(crate) fn offsets(spans: &[Span], g: u64) -> Vec<u64> {
    spans
        .iter()
        .flat_map(|s| (0..s.windows).map(move |i| s.offset + i * g))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 4;

    fn sp(list: &[(u64, u64)]) -> Vec<Span> {
        list.iter().map(|&(o, n)| Span::new(o * G, n)).collect()
    }

    #[test]
    fn union_merges_overlapping_and_touching_intervals_and_drops_empty_ones() {
        let u = union(vec![(9u64, 12), (0, 3), (2, 5), (5, 6), (7, 7), (10, 11)]);
        assert_eq!(u, vec![(0, 6), (9, 12)]);
        assert!(union::<u64>(Vec::new()).is_empty());
        assert_eq!(union(vec![(4usize, 4)]), Vec::new());
    }

    #[test]
    fn adjacent_spans_merge_into_runs() {
        let s = sp(&[(0, 2), (2, 1), (5, 1), (6, 2)]);
        assert_eq!(merged(&s, G), sp(&[(0, 3), (5, 3)]));
        assert_eq!(runs(&s, G), vec![(0, 3 * G), (5 * G, 3 * G)]);
        assert_eq!(window_count(&s), 6);
        let mut out = Vec::new();
        push(&mut out, Span::new(0, 0), G);
        assert!(out.is_empty());
    }

    #[test]
    fn covered_and_first_in_count_windows_not_spans() {
        let s = sp(&[(1, 2), (3, 1), (8, 4)]);
        // Windows 0..10: 1, 2, 3, 8, 9.
        assert_eq!(covered(&s, G, 0, 10), 5);
        assert_eq!(covered(&s, G, 2 * G, 7), 3);
        assert_eq!(covered(&s, G, 4 * G, 4), 0);
        assert_eq!(covered(&s, G, 11 * G, 5), 1);
        assert_eq!(first_in(&s, G, 0, 10 * G), Some(G));
        assert_eq!(first_in(&s, G, 4 * G, 8 * G), None);
        assert_eq!(first_in(&s, G, 4 * G, 9 * G), Some(8 * G));
        assert_eq!(first_in(&s, G, 9 * G, 10 * G), Some(9 * G));
    }

    #[test]
    fn subtract_matches_a_window_by_window_filter() {
        let s = sp(&[(0, 6), (8, 3), (12, 4)]);
        let holes = sp(&[(1, 2), (5, 4), (13, 1), (15, 3)]);
        let got = offsets(&subtract(&s, &holes, G), G);
        let hole_offsets = offsets(&holes, G);
        let want: Vec<u64> = offsets(&s, G)
            .into_iter()
            .filter(|o| !hole_offsets.contains(o))
            .collect();
        assert_eq!(got, want);
        assert_eq!(subtract(&s, &[], G), merged(&s, G));
    }
}
