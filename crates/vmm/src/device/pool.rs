//! The handle pool: unmapped handles kept for reuse by size, and the count of parked windows,
//! which are pooled memory too. Both count against one cap; the pool's bytes are charged to
//! the governor as *pooled*.
//!
//! How a commit's piece is served ([`HandlePool::take_for`]) is decided here, by the driver's
//! cost per call ([`most_pooled_handles`]): the pooled handle of exactly the piece's size when
//! there is one (it saves the create); else the fewest smaller pooled handles that tile the
//! piece, if mapping that many costs no more than creating and mapping one handle of the
//! piece's size; else none (the commit creates one). The cost of a commit is set by its
//! mappings, so a pool of many small handles must not turn one mapping into many.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use kvvm_governor::Bucket;
use kvvm_hal::{BackendError, LatencyModel, Operation, PhysicalHandle};

use crate::device::{DeviceContext, Source};
use kvvm_hal::sync::lock;

#[derive(Debug, Default)]
struct Free {
    /// Free handles by size in bytes (a handle is reused only for a mapping of its size).
    by_size: BTreeMap<u64, Vec<PhysicalHandle>>,
    /// Bytes of the free handles.
    bytes: u64,
    cap_bytes: u64,
}

impl Free {
    /// Takes the last handle of `size` out.
    fn pop(&mut self, size: u64) -> Option<PhysicalHandle> {
        let list = self.by_size.get_mut(&size)?;
        let h = list.pop()?;
        if list.is_empty() {
            self.by_size.remove(&size);
        }
        self.bytes = self.bytes.saturating_sub(size);
        Some(h)
    }

    /// Puts a free handle of `size` bytes in.
    fn push(&mut self, size: u64, handle: PhysicalHandle) {
        self.by_size.entry(size).or_default().push(handle);
        self.bytes = self.bytes.saturating_add(size);
    }

    /// The sizes (bytes, largest first) of the fewest free handles of power-of-two numbers of
    /// `g`-byte windows, each smaller than `bytes`, that add up to `bytes` exactly, if at most
    /// `most` of them do. Largest first, each one starts at a multiple of its own size from
    /// the piece's start: a buddy-aligned piece stays cut into buddy-aligned handles.
    fn tiling(&self, bytes: u64, g: u64, most: u64) -> Option<Vec<u64>> {
        let mut rest = bytes;
        let mut sizes = Vec::new();
        for (&size, list) in self.by_size.range(..bytes).rev() {
            if rest == 0 {
                break;
            }
            let windows = size.checked_div(g)?;
            if size % g != 0 || !windows.is_power_of_two() || size > rest {
                continue;
            }
            let n = (rest / size).min(list.len() as u64);
            if (sizes.len() as u64).saturating_add(n) > most {
                return None;
            }
            sizes.extend(std::iter::repeat_n(size, usize::try_from(n).ok()?));
            rest -= n * size;
        }
        (rest == 0).then_some(sizes)
    }
}

/// The most pooled handles that may serve one piece of `bytes` in place of a fresh handle of
/// that size, by `model`: the largest `k` (at least 1) such that `k` re-mappings (a `map` and
/// a fresh mapping's share of `set_access`) cost no more than a `create` of `bytes` plus one
/// such mapping. The access call itself and its cost per byte are the same either way (one
/// call over the run, the same bytes), so they do not enter. A model where a mapping is free
/// allows any number.
pub(crate) fn most_pooled_handles(model: &LatencyModel, bytes: u64) -> u64 {
    let remap = model
        .cost(Operation::Map, bytes, 1)
        .saturating_add(model.set_access_per_mapping);
    let fresh = model
        .cost(Operation::Create, bytes, 0)
        .saturating_add(remap);
    match fresh.as_nanos().checked_div(remap.as_nanos()) {
        Some(k) => u64::try_from(k).unwrap_or(u64::MAX).max(1),
        None => u64::MAX,
    }
}

/// Free handles (kept by size) and the parked-bytes count, under one cap.
#[derive(Debug, Default)]
pub(crate) struct HandlePool {
    free: Mutex<Free>,
    /// Bytes parked in all reservations (part of the pooled bytes).
    parked_bytes: AtomicU64,
}

impl HandlePool {
    pub(crate) fn new(cap_bytes: u64) -> Self {
        HandlePool {
            free: Mutex::new(Free {
                by_size: BTreeMap::new(),
                bytes: 0,
                cap_bytes,
            }),
            parked_bytes: AtomicU64::new(0),
        }
    }

    /// Pooled handles for one piece of `windows` windows of `g` bytes, as `(windows, handle)`
    /// in the order they map from the piece's start: the handle of exactly the piece's size
    /// when the pool holds one; else, when `tile`, the fewest smaller ones that tile it (see
    /// the module docs) if [`most_pooled_handles`] by `model` allows that many; else none
    /// (the caller creates one handle). They stay accounted as pooled until the caller
    /// settles them.
    pub(crate) fn take_for(
        &self,
        windows: u64,
        g: u64,
        model: &LatencyModel,
        tile: bool,
    ) -> Vec<(u64, PhysicalHandle)> {
        let bytes = windows.saturating_mul(g);
        let mut free = lock(&self.free);
        if let Some(h) = free.pop(bytes) {
            return vec![(windows, h)];
        }
        let most = most_pooled_handles(model, bytes);
        if !tile || most < 2 {
            return Vec::new();
        }
        let Some(sizes) = free.tiling(bytes, g, most) else {
            return Vec::new();
        };
        let taken: Vec<(u64, PhysicalHandle)> = sizes
            .into_iter()
            .filter_map(|size| free.pop(size).map(|h| (size / g, h)))
            .collect();
        let covered = taken.iter().map(|t| t.0).fold(0u64, u64::saturating_add);
        if covered != windows {
            // Cannot happen (the tiling was counted under this lock), but a piece is served
            // whole or not at all: put them back.
            for (n, h) in taken {
                free.push(n.saturating_mul(g), h);
            }
            return Vec::new();
        }
        taken
    }

    /// Puts handles taken by [`take_for`](Self::take_for) back (accounted as pooled all along);
    /// releases those that no longer fit.
    pub(crate) fn untake(&self, ctx: &DeviceContext, handles: Vec<(PhysicalHandle, u64)>) {
        for (h, size) in handles {
            // A failed release is quarantined and logged inside.
            let _ = self.dispose(ctx, h, size, Source::Bucket(Bucket::Pooled));
        }
    }

    /// Returns an unmapped handle of `size` bytes to the pool if it fits, otherwise releases
    /// it; a failed release quarantines it (and is returned after that). Returns the bytes
    /// released to the driver.
    pub(crate) fn dispose(
        &self,
        ctx: &DeviceContext,
        handle: PhysicalHandle,
        size: u64,
        source: Source<'_>,
    ) -> Result<u64, BackendError> {
        {
            let mut free = lock(&self.free);
            if self.held(&free).saturating_add(size) <= free.cap_bytes {
                // Account before the handle becomes visible to other threads.
                ctx.account(source.settle(ctx, Bucket::Pooled, size));
                free.push(size, handle);
                return Ok(0);
            }
        }
        ctx.release_handle(handle, size, source)
    }

    fn held(&self, free: &Free) -> u64 {
        free.bytes.saturating_add(self.parked_bytes())
    }

    /// Bytes held: free handles and parked windows.
    pub(crate) fn held_bytes(&self) -> u64 {
        self.held(&lock(&self.free))
    }

    /// Releases free handles until at most `keep_bytes` of pooled memory (parked windows
    /// included) stay, or no free handle is left; returns the bytes released. Each step
    /// releases the smallest handle that covers what is still over, else the largest.
    pub(crate) fn trim_free(&self, ctx: &DeviceContext, keep_bytes: u64) -> u64 {
        let victims = {
            let mut free = lock(&self.free);
            let mut victims = Vec::new();
            loop {
                let over = self.held(&free).saturating_sub(keep_bytes);
                if over == 0 {
                    break;
                }
                let size = free
                    .by_size
                    .range(over..)
                    .next()
                    .or_else(|| free.by_size.iter().next_back())
                    .map(|(s, _)| *s);
                let Some(size) = size else { break };
                let Some(h) = free.pop(size) else { break };
                victims.push((h, size));
            }
            victims
        };
        victims
            .into_iter()
            .map(|(h, size)| {
                ctx.release_handle(h, size, Source::Bucket(Bucket::Pooled))
                    .unwrap_or(0)
            })
            .fold(0u64, u64::saturating_add)
    }

    /// The free handles.
    pub(crate) fn handles(&self) -> Vec<PhysicalHandle> {
        lock(&self.free)
            .by_size
            .values()
            .flat_map(|v| v.iter().copied())
            .collect()
    }

    /// The cap in bytes.
    pub(crate) fn cap_bytes(&self) -> u64 {
        lock(&self.free).cap_bytes
    }

    /// Changes the cap (the caller trims).
    pub(crate) fn set_cap_bytes(&self, bytes: u64) {
        lock(&self.free).cap_bytes = bytes;
    }

    /// Bytes of parked windows.
    pub(crate) fn parked_bytes(&self) -> u64 {
        self.parked_bytes.load(Ordering::Acquire)
    }

    /// Counts `g` more parked bytes if the cap allows it; returns whether it did.
    pub(crate) fn try_add_parked(&self, g: u64) -> bool {
        let free = lock(&self.free);
        if self.held(&free).saturating_add(g) <= free.cap_bytes {
            self.parked_bytes.fetch_add(g, Ordering::AcqRel);
            true
        } else {
            false
        }
    }

    /// Counts `bytes` back into the parked bytes (windows taken out and put back; the cap was
    /// checked when they were first parked).
    pub(crate) fn add_parked(&self, bytes: u64) {
        self.parked_bytes.fetch_add(bytes, Ordering::AcqRel);
    }

    /// `bytes` of parked windows left the parked state.
    pub(crate) fn remove_parked(&self, bytes: u64) {
        let _ = self
            .parked_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
                Some(p.saturating_sub(bytes))
            });
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const MIB: u64 = 1 << 20;

    /// The H200's figures: a create of 7 us + 37 ns a MiB against 21.7 us a mapping. Two
    /// pooled handles beat one create only from about 400 MiB on.
    #[test]
    fn the_h200_allows_more_than_one_pooled_handle_only_for_large_pieces() {
        let m = LatencyModel::h200();
        assert_eq!(most_pooled_handles(&m, 2 * MIB), 1);
        assert_eq!(most_pooled_handles(&m, 256 * MIB), 1);
        assert_eq!(most_pooled_handles(&m, 512 * MIB), 2);
        assert_eq!(
            most_pooled_handles(&LatencyModel::zero(), 2 * MIB),
            u64::MAX
        );
    }

    /// The tiling takes the largest handles first and only power-of-two window counts, so
    /// that each tile starts at a multiple of its size; it takes nothing over `most`.
    #[test]
    fn a_tiling_is_the_fewest_power_of_two_handles_largest_first() {
        let g = 4096;
        let mut free = Free::default();
        for (windows, n) in [(1u64, 4u64), (2, 1), (3, 2), (4, 1)] {
            for i in 0..n {
                free.by_size
                    .entry(windows * g)
                    .or_default()
                    .push(PhysicalHandle(windows * 100 + i));
            }
        }
        assert_eq!(free.tiling(8 * g, g, 8), Some(vec![4 * g, 2 * g, g, g]));
        assert_eq!(free.tiling(8 * g, g, 3), None, "four are needed");
        assert_eq!(
            free.tiling(16 * g, g, 16),
            None,
            "not enough bytes in powers of two"
        );
        assert_eq!(
            free.tiling(2 * g, g, 2),
            Some(vec![g, g]),
            "smaller than the piece"
        );
    }
}
