//! The checks every change of a reservation starts with: bounds (the driver checks none),
//! free windows (not mapped, not in flight), never-fits, and which windows of some ranges are
//! missing. Their cost is per span and per mapping, never per window.

use crate::block::Block;
use crate::error::{VmmError, VmmResult};
use crate::windows::spans::{self, Span};

use super::Reservation;

impl Reservation {
    /// The end of `[offset, offset + len)`, refused when it overflows or runs past the
    /// reservation (the driver does not check reservation bounds; the manager always does).
    pub(crate) fn checked_end(&self, offset: u64, len: u64, what: &'static str) -> VmmResult<u64> {
        let end = offset
            .checked_add(len)
            .ok_or(VmmError::SizeOverflow { what })?;
        if end > self.size {
            return Err(VmmError::OutOfBounds {
                offset,
                requested: len,
                reserved: self.size,
            });
        }
        Ok(end)
    }

    /// The first mapped window of `[start, end)` (granule-aligned bounds), if any.
    fn first_mapped(&self, start: u64, end: u64) -> Option<u64> {
        let span = |b: &Block| Span::new(b.offset, b.windows);
        spans::first_of(&self.records(), self.granule(), start, end, span)
    }

    /// Every window of `spans` is free: in bounds, granule-aligned, not mapped, not in
    /// flight. The first window (in order) that is not is refused, with the checks made in
    /// that order for it; the cost is per span, not per window.
    pub(crate) fn check_free(&self, spans: &[Span]) -> VmmResult<()> {
        let g = self.granule();
        for s in spans {
            if s.windows == 0 {
                continue;
            }
            // Windows of the span that end inside the reservation.
            let in_bounds = s.windows.min(self.size.saturating_sub(s.offset) / g);
            if in_bounds == 0 {
                self.checked_end(s.offset, g, "window end")?;
            }
            if !s.offset.is_multiple_of(g) {
                return Err(VmmError::OutOfBounds {
                    offset: s.offset,
                    requested: g,
                    reserved: self.size,
                });
            }
            let end = s.offset.saturating_add(in_bounds.saturating_mul(g));
            let mapped = self.first_mapped(s.offset, end);
            let busy = self
                .in_flight
                .as_ref()
                .and_then(|f| f.first_held(g, s.offset, end));
            match (mapped, busy) {
                (Some(m), Some(b)) if b < m => return Err(VmmError::Busy { offset: b }),
                (Some(m), _) => return Err(VmmError::AlreadyMapped { offset: m }),
                (None, Some(b)) => return Err(VmmError::Busy { offset: b }),
                (None, None) => {}
            }
            if in_bounds < s.windows {
                self.checked_end(end, g, "window end")?;
            }
        }
        Ok(())
    }

    /// The never-fits decision of every commit into this reservation (a private commit, a
    /// shared commit, a background job; the KV layer's growth and admission and the server's
    /// appends all come here): refuses `new_windows` more granule windows when this
    /// reservation would then hold more physical memory than could ever be granted to it.
    /// Its cost is per mapping of the reservation, never per window.
    ///
    /// What it would hold is every window it maps now (its own, its shared set's, and shared
    /// windows it maps read-only: none of them can be freed while it maps them) plus the new
    /// windows, *wherever their memory comes from*: a handle from the pool or a parked window
    /// is already inside the budget, so it is no discount. What could ever be granted is the
    /// budget less the quarantine, or the device's memory ([`DeviceContext::check_fits`],
    /// which asks [`Governor::check_fits`](kvvm_governor::Governor::check_fits)). Anything
    /// else the budget holds (other reservations, the pool, shared prefixes nobody here maps)
    /// can be freed, so a request under that ceiling is backpressure, never refused for good.
    ///
    /// [`DeviceContext::check_fits`]: crate::device::DeviceContext::check_fits
    pub(crate) fn check_fits(&self, new_windows: u64) -> VmmResult<()> {
        let g = self.granule();
        let holding = self
            .committed_windows()
            .saturating_add(new_windows)
            .saturating_mul(g);
        self.state.ctx.check_fits(holding)?;
        Ok(())
    }

    /// The unmapped windows overlapping `ranges`, bounds-checked, as sorted spans, refused
    /// when they can never fit ([`check_fits`](Self::check_fits)). The work is per range and
    /// per mapping, not per window: a range of any size costs one span.
    pub(crate) fn missing_spans(&self, ranges: &[(u64, u64)]) -> VmmResult<Vec<Span>> {
        let g = self.granule();
        let mut wanted = Vec::with_capacity(ranges.len());
        for &(offset, len) in ranges {
            if len == 0 {
                continue;
            }
            let end = self.checked_end(offset, len, "range end")?;
            wanted.push((offset / g, end.div_ceil(g)));
        }
        // The union of the ranges' windows, less what is mapped.
        let mut out = Vec::new();
        for (first, last) in spans::union(wanted) {
            let (start, end) = (first.saturating_mul(g), last.saturating_mul(g));
            let mut at = start;
            let i = self.blocks.partition_point(|b| b.end(g) <= start);
            for b in self.blocks.iter().skip(i) {
                if b.offset >= end {
                    break;
                }
                if b.offset > at {
                    spans::push(&mut out, Span::new(at, (b.offset - at) / g), g);
                }
                at = at.max(b.end(g));
            }
            if at < end {
                spans::push(&mut out, Span::new(at, (end - at) / g), g);
            }
        }
        self.check_fits(spans::window_count(&out))?;
        Ok(out)
    }
}
