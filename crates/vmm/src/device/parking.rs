//! Parked windows (`VmmConfig::park_released`): windows a
//! reservation released but kept mapped, access still set, so that a later commit of the same
//! windows in the same reservation takes them back with no driver call at all.
//!
//! Everything about parking lives here: the per-reservation set ([`ParkedWindows`]), the
//! device-wide registry that the reclaimer walks ([`ParkingLot`]), parking released windows
//! within the pool cap, taking them back on commit, evicting them for a shared mapping, and
//! handing them to teardown. Parked bytes are *pooled* for the governor and count against the
//! pool cap (the count lives in the [`HandlePool`]).

use kvvm_hal::sync::Unpoison;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};

use kvvm_governor::Bucket;
use kvvm_hal::{BackendError, DeviceAddress, PhysicalHandle};

use crate::device::pool::HandlePool;
use crate::device::{DeviceContext, Source};
use crate::mapping::{BlockKind, MappedBlock};
use crate::windows::spans::{covered, Span};
use kvvm_hal::sync::lock;

/// A parked mapping: its offset in the reservation, its windows and the handle mapped there
/// (whole, as it was committed).
pub(crate) type Window = (u64, u64, PhysicalHandle);

/// The parked windows of one reservation: still mapped at `base + offset` with the manager's
/// access, their handles accounted as pooled.
///
/// The lock is held only to edit the lists, never across a driver call: a window being given
/// back to the driver is listed as *evicting* while its unmap and release run, and a commit of
/// it meanwhile is refused as busy.
#[derive(Debug)]
pub(crate) struct ParkedWindows {
    base: DeviceAddress,
    windows: Mutex<Vec<Window>>,
    /// Offsets being unmapped by [`ParkingLot::unpark`] right now.
    evicting: Mutex<Vec<(u64, u64)>>,
    /// Signalled when a window stops evicting.
    evicted: Condvar,
    /// How many windows are parked or evicting, read without a lock: a commit that finds
    /// none takes no lock. One count for both states, because a window moves between them
    /// (the reclaimer starts evicting it; its unmap fails and it is parked again) while a
    /// commit may be reading: two counts read one after the other could both read zero
    /// across such a move, and the commit would map over the window. Raised before a window
    /// becomes either, lowered after it is neither; a move leaves it unchanged.
    present: AtomicUsize,
}

/// Every live reservation's parked set, for the reclaimer.
#[derive(Debug)]
pub(crate) struct ParkingLot {
    enabled: bool,
    sets: Mutex<Vec<Weak<ParkedWindows>>>,
}

impl ParkingLot {
    pub(crate) fn new(enabled: bool) -> Self {
        ParkingLot {
            enabled,
            sets: Mutex::new(Vec::new()),
        }
    }

    /// A parked set for a new reservation at `base`, registered here; `None` when the
    /// manager does not park.
    pub(crate) fn open(&self, base: DeviceAddress) -> Option<Arc<ParkedWindows>> {
        self.enabled.then(|| {
            let set = Arc::new(ParkedWindows {
                base,
                windows: Mutex::new(Vec::new()),
                evicting: Mutex::new(Vec::new()),
                evicted: Condvar::new(),
                present: AtomicUsize::new(0),
            });
            lock(&self.sets).push(Arc::downgrade(&set));
            set
        })
    }

    /// Unmaps and releases parked windows (any reservation's) until `bytes` are released or
    /// none is left; returns the bytes released. A reservation busy on another thread is
    /// skipped (never waited for: the caller may be that thread, asking for memory).
    pub(crate) fn unpark(&self, ctx: &DeviceContext, pool: &HandlePool, bytes: u64) -> u64 {
        if bytes == 0 || pool.parked_bytes() == 0 {
            return 0;
        }
        let sets: Vec<Arc<ParkedWindows>> = {
            let mut sets = lock(&self.sets);
            sets.retain(|w| w.strong_count() > 0);
            sets.iter().filter_map(Weak::upgrade).collect()
        };
        let g = ctx.granule;
        let mut released = 0u64;
        for set in sets {
            while released < bytes {
                // Take one mapping out under the lock, give it back with the lock released.
                let Some(w) = set.start_evicting() else {
                    break;
                };
                let (offset, windows, handle) = w;
                let size = windows.saturating_mul(g);
                let addr = set.base.offset(offset);
                if let Err(error) = ctx.backend.unmap(addr, size) {
                    tracing::warn!(%addr, %error, "unmap of a parked mapping failed; it stays parked");
                    set.stop_evicting(offset, Some(w));
                    break;
                }
                set.stop_evicting(offset, None);
                pool.remove_parked(size);
                released = released.saturating_add(
                    ctx.release_handle(handle, size, Source::Bucket(Bucket::Pooled))
                        .unwrap_or(0),
                );
            }
            if released >= bytes {
                break;
            }
        }
        released
    }
}

impl ParkedWindows {
    fn windows(&self) -> MutexGuard<'_, Vec<Window>> {
        lock(&self.windows)
    }

    /// `n` more windows are about to be parked (before they are listed).
    fn count_in(&self, n: usize) {
        self.present.fetch_add(n, Ordering::AcqRel);
    }

    /// `n` windows are neither parked nor evicting any more (after they left the lists).
    fn count_out(&self, n: usize) {
        let _ = self
            .present
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
                Some(p.saturating_sub(n))
            });
    }

    /// Whether a window is parked or evicting (no lock).
    fn any_present(&self) -> bool {
        self.present.load(Ordering::Acquire) > 0
    }

    /// Moves the highest parked window to the evicting list and returns it (it stays
    /// counted as present).
    fn start_evicting(&self) -> Option<Window> {
        let mut windows = self.windows();
        let w = windows.pop()?;
        lock(&self.evicting).push((w.0, w.1));
        Some(w)
    }

    /// The window at `offset` is no longer evicting; `back` is parked again (its unmap failed)
    /// and stays counted, else it is counted out.
    fn stop_evicting(&self, offset: u64, back: Option<Window>) {
        let parked_again = back.is_some();
        if let Some(w) = back {
            let mut windows = self.windows();
            windows.push(w);
            windows.sort_unstable_by_key(|w| w.0);
        }
        lock(&self.evicting).retain(|&(o, _)| o != offset);
        if !parked_again {
            self.count_out(1);
        }
        self.evicted.notify_all();
    }

    /// Waits until no window of this set is being unmapped by the reclaimer (teardown must
    /// not free the range under a mapping).
    fn wait_evictions(&self) {
        let mut evicting = lock(&self.evicting);
        while !evicting.is_empty() {
            evicting = self.evicted.wait(evicting).unpoisoned();
        }
    }

    /// The parked windows as mappings.
    pub(crate) fn list(&self, g: u64) -> Vec<MappedBlock> {
        self.windows()
            .iter()
            .map(|&(o, n, h)| MappedBlock {
                address: self.base.offset(o),
                size: n.saturating_mul(g),
                handle: h,
                kind: BlockKind::Owned,
            })
            .collect()
    }

    /// Parks the mappings of `blocks` that `window` says are parkable, as many as the pool
    /// cap allows (each whole): they stay mapped, their bytes move from committed to pooled.
    /// Returns the others, in order, for unmapping.
    pub(crate) fn park<B>(
        &self,
        ctx: &DeviceContext,
        pool: &HandlePool,
        blocks: Vec<B>,
        window: impl Fn(&B) -> Option<Window>,
    ) -> Vec<B> {
        let g = ctx.granule;
        let mut keep = Vec::new();
        let mut parked: Vec<Window> = Vec::new();
        for b in blocks {
            match window(&b) {
                Some(w) if pool.try_add_parked(w.1.saturating_mul(g)) => parked.push(w),
                _ => keep.push(b),
            }
        }
        if !parked.is_empty() {
            let bytes = windows_bytes(&parked, g);
            ctx.account(ctx.governor.transfer(
                ctx.device,
                Bucket::Committed,
                Bucket::Pooled,
                bytes,
            ));
            self.count_in(parked.len());
            let mut set = self.windows();
            set.extend(parked);
            set.sort_unstable_by_key(|w| w.0);
        }
        keep
    }

    /// Takes the parked mappings lying wholly inside `spans` (sorted, disjoint window spans)
    /// out of the set; they stay mapped and accounted as pooled until the caller settles them.
    ///
    /// A window of `spans` that the reclaimer is unmapping right now is waited for (one
    /// unmap and release), so that the caller never maps over it.
    pub(crate) fn take(&self, pool: &HandlePool, g: u64, spans: &[Span]) -> Vec<Window> {
        let mut taken = Vec::new();
        let present = self.any_present();
        fast_path_read();
        if !present {
            return taken;
        }
        let mut windows = loop {
            let windows = self.windows();
            let evicting = lock(&self.evicting);
            if !evicting.iter().any(|&(o, n)| covered(spans, g, o, n) > 0) {
                drop(evicting);
                break windows;
            }
            drop(windows);
            // Wait for that eviction (signalled with the evicting list's lock), then look again.
            drop(self.evicted.wait(evicting).unpoisoned());
        };
        windows.retain(|w| {
            if covered(spans, g, w.0, w.1) == w.1 {
                taken.push(*w);
                false
            } else {
                true
            }
        });
        drop(windows);
        self.count_out(taken.len());
        pool.remove_parked(windows_bytes(&taken, g));
        taken
    }

    /// Puts windows taken by [`take`](Self::take) back.
    pub(crate) fn put_back(&self, pool: &HandlePool, g: u64, windows: Vec<Window>) {
        if windows.is_empty() {
            return;
        }
        // They were counted out by `take`: count them back in (the cap was checked when they
        // were first parked) before they are listed. Once listed the reclaimer may evict one
        // and count it out; counted in later, the count would end too high (it saturates at
        // zero).
        pool.add_parked(windows_bytes(&windows, g));
        self.count_in(windows.len());
        let mut set = self.windows();
        set.extend(windows);
        set.sort_unstable_by_key(|w| w.0);
    }

    /// Unmaps the parked mappings overlapping `spans` (sorted, disjoint window spans) and
    /// returns their handles to the pool (or releases them), so that something else can be
    /// mapped there; with `keep_whole`, those lying wholly inside `spans` stay parked (a
    /// private commit takes them back). A mapping whose unmap fails stays parked; the first
    /// error is returned.
    pub(crate) fn evict_overlapping(
        &self,
        ctx: &DeviceContext,
        pool: &HandlePool,
        spans: &[Span],
        keep_whole: bool,
    ) -> Result<(), BackendError> {
        let g = ctx.granule;
        if !self.any_present() {
            return Ok(());
        }
        // The overlapping mappings' own spans, so that `take` returns exactly them.
        let victim_spans: Vec<Span> = {
            let windows = self.windows();
            windows
                .iter()
                .filter(|w| {
                    let c = covered(spans, g, w.0, w.1);
                    c > 0 && !(keep_whole && c == w.1)
                })
                .map(|w| Span::new(w.0, w.1))
                .collect()
        };
        if victim_spans.is_empty() {
            return Ok(());
        }
        let victims = self.take(pool, g, &victim_spans);
        let mut failed = Vec::new();
        let mut first_error = None;
        for w in victims {
            let (o, n, h) = w;
            let size = n.saturating_mul(g);
            match ctx.backend.unmap(self.base.offset(o), size) {
                Ok(()) => {
                    // A failed release is quarantined inside.
                    let _ = pool.dispose(ctx, h, size, Source::Bucket(Bucket::Pooled));
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                    failed.push(w);
                }
            }
        }
        self.put_back(pool, g, failed);
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Takes every parked window out for teardown, which treats them like committed ones:
    /// their bytes move from pooled back to committed.
    ///
    /// The windows are taken first, then the reclaimer's evictions in flight are waited for:
    /// once the set is empty no eviction can start, and one whose unmap failed puts its window
    /// back, which is taken in turn. (Waiting first would let an eviction start in between,
    /// and teardown would free the range under its mapping.)
    pub(crate) fn take_all(&self, ctx: &DeviceContext, pool: &HandlePool) -> Vec<Window> {
        let mut windows = Vec::new();
        loop {
            let n = {
                let mut set = self.windows();
                let n = set.len();
                windows.append(&mut set);
                n
            };
            self.count_out(n);
            self.wait_evictions();
            // An eviction whose unmap failed parked its window again: take it in turn.
            if !self.any_present() {
                break;
            }
        }
        if !windows.is_empty() {
            let bytes = windows_bytes(&windows, ctx.granule);
            pool.remove_parked(bytes);
            ctx.account(ctx.governor.transfer(
                ctx.device,
                Bucket::Pooled,
                Bucket::Committed,
                bytes,
            ));
        }
        windows
    }
}

/// Where a commit's lock-free read of the parked count has been made and not yet acted on:
/// a unit test runs the other thread's step there, so that the race is forced, not timed.
#[cfg(test)]
fn fast_path_read() {
    FAST_PATH_READ.with(|h| {
        if let Some(f) = h.borrow_mut().take() {
            f();
        }
    });
}

#[cfg(not(test))]
#[inline(always)]
fn fast_path_read() {}

#[cfg(test)]
thread_local! {
    static FAST_PATH_READ: std::cell::RefCell<Option<Box<dyn FnOnce()>>> =
        const { std::cell::RefCell::new(None) };
}

/// Bytes of the parked mappings `windows`.
fn windows_bytes(windows: &[Window], g: u64) -> u64 {
    windows
        .iter()
        .map(|w| w.1.saturating_mul(g))
        .fold(0u64, u64::saturating_add)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A window whose eviction fails while a commit of it reads the count without a lock: it
    /// goes from evicting back to parked right after the read. The commit must still take it
    /// (else it would map over the window). With one count per state read one after the
    /// other, the commit read "none parked", then "none evicting", and took nothing.
    #[test]
    fn a_window_parked_again_while_a_commit_looks_is_taken() {
        let g = 4096;
        let lot = ParkingLot::new(true);
        let set = lot.open(DeviceAddress(1 << 40)).unwrap();
        let pool = HandlePool::new(16 * g);
        let w: Window = (0, 2, PhysicalHandle(0x10));
        assert!(pool.try_add_parked(2 * g));
        set.count_in(1);
        set.windows().push(w);
        // The reclaimer starts evicting it; its unmap will fail.
        assert_eq!(set.start_evicting(), Some(w));
        let back = Arc::clone(&set);
        FAST_PATH_READ.with(|h| {
            *h.borrow_mut() = Some(Box::new(move || back.stop_evicting(0, Some(w))));
        });
        let taken = set.take(&pool, g, &[Span::new(0, 2)]);
        assert_eq!(taken, vec![w], "the window parked again is taken back");
        assert!(!set.any_present());
        assert_eq!(pool.parked_bytes(), 0);
    }

    /// A commit waits only for evictions of its own windows: one of another window that the
    /// reclaimer is unmapping does not hold it up (nothing would wake it here).
    #[test]
    fn a_commit_takes_its_windows_while_another_window_is_evicting() {
        let g = 4096;
        let lot = ParkingLot::new(true);
        let set = lot.open(DeviceAddress(1 << 40)).unwrap();
        let pool = HandlePool::new(16 * g);
        let a: Window = (0, 1, PhysicalHandle(0x10));
        let b: Window = (4 * g, 1, PhysicalHandle(0x11));
        assert!(pool.try_add_parked(2 * g));
        set.count_in(2);
        set.windows().extend([a, b]);
        // The reclaimer takes the highest window, b, and is unmapping it.
        assert_eq!(set.start_evicting(), Some(b));
        assert_eq!(set.take(&pool, g, &[Span::new(0, 1)]), vec![a]);
        assert_eq!(pool.parked_bytes(), g);
        assert!(set.any_present(), "b is still evicting");
        set.stop_evicting(4 * g, None);
        assert!(!set.any_present());
    }

    /// The registry forgets the parked set of a reservation that is gone.
    #[test]
    fn a_dropped_set_is_forgotten_by_the_next_unpark() {
        let g = 4096;
        let backend: Arc<dyn kvvm_hal::VirtualMemoryBackend> = Arc::new(kvvm_sim::SimBackend::new(
            kvvm_sim::SimConfig::single(g, 64 * g),
        ));
        let ctx = DeviceContext::new(
            backend,
            kvvm_hal::AllocationProperties::device(kvvm_hal::DeviceId(0)),
            g,
            g,
            Vec::new(),
            kvvm_governor::Governor::unlimited(),
            kvvm_hal::LatencyModel::h200(),
        );
        let lot = ParkingLot::new(true);
        let live = lot.open(DeviceAddress(1 << 40)).unwrap();
        for i in 1..4u64 {
            drop(lot.open(DeviceAddress((1 << 40) + (i << 30))));
        }
        assert_eq!(lock(&lot.sets).len(), 4);
        let pool = HandlePool::new(16 * g);
        assert!(pool.try_add_parked(g));
        // Nothing is parked in the live set: nothing is released, and the dead sets go.
        assert_eq!(lot.unpark(&ctx, &pool, g), 0);
        assert_eq!(lock(&lot.sets).len(), 1);
        drop(live);
    }
}
