//! [`SharedDevicePrefix`]: one physical copy of a prefix's KV, mapped read-write by its owner
//! and read-only by any number of sharers, billed once.

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvvm_vmm::SharedHandles;

use kvvm_num::mul;

use crate::error::KvCacheError;
use kvvm_layout::LayoutPlan;
use kvvm_layout::PrefixShareability;

/// Host bytes written per copy batch when filling a prefix.
pub(crate) const FILL_BATCH_BYTES: u64 = 32 << 20;

/// A shared prefix on the device: the granule windows `[first_window, end_window)` of every
/// fragment of a [`LayoutPlan`], backed by one set of physical handles
/// ([`SharedHandles`]) that every sequence of the prefix maps at the same offsets of its own
/// reservation.
///
/// * **Billed once**: the handles are granted and accounted once, as *shared*, however many
///   sequences map them; a sharer's `SequenceKv::additional_owned_bytes` is 0 right after
///   [`map_shared_prefix_readonly`](Self::map_shared_prefix_readonly) (`prefix_setup.rs`).
/// * **Lifetime is the union**: each mapping and each `Arc` of this prefix (the owner's and
///   the sharers' sequences, a prefix cache) keeps the handles alive; they are released only
///   when the last is gone. The owner may finish first.
/// * **Reference count per handle**: [`mapped_count`](Self::mapped_count) is the number of
///   live window mappings (`note_shared_map` / `note_unmapped`).
/// * **Read-only**: the owner writes the prefix through its read-write mapping and seals it;
///   after that nobody writes it (sharers map it with `Read` access, and a write into it is
///   refused with [`KvCacheError::WriteIntoSharedPrefix`] before any driver call). There is
///   no copy-on-write on the device.
/// * **Only whole windows are shared**: per fragment, the first
///   `floor(prefix_len x fragment_bytes_per_token / granule)` windows
///   ([`PrefixShareability::shareable_granules_per_fragment`]). The partial window at the end
///   of each fragment's prefix is private to each sequence: a sharer commits it and writes
///   those prefix tokens itself.
pub struct SharedDevicePrefix {
    pub(crate) set: Arc<SharedHandles>,
    pub(crate) plan: LayoutPlan,
    pub(crate) first_window: u64,
    pub(crate) end_window: u64,
    pub(crate) prefix_len: u64,
    pub(crate) shareability: PrefixShareability,
    pub(crate) sealed: AtomicBool,
}

impl fmt::Debug for SharedDevicePrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedDevicePrefix")
            .field("layout", &self.plan.layout())
            .field("windows", &(self.first_window..self.end_window))
            .field("prefix_len", &self.prefix_len)
            .field("bytes", &self.bytes())
            .field("mapped_count", &self.mapped_count())
            .field("sealed", &self.is_sealed())
            .finish()
    }
}

impl SharedDevicePrefix {
    pub(crate) fn new(
        set: Arc<SharedHandles>,
        plan: LayoutPlan,
        first_window: u64,
        end_window: u64,
        prefix_len: u64,
        shareability: PrefixShareability,
    ) -> Self {
        SharedDevicePrefix {
            set,
            plan,
            first_window,
            end_window,
            prefix_len,
            shareability,
            sealed: AtomicBool::new(false),
        }
    }

    /// Marks the prefix written: from now on it is read-only for everyone, owner included.
    pub fn seal(&self) {
        self.sealed.store(true, Ordering::Release);
    }

    /// Whether the prefix was sealed (written and read-only).
    pub fn is_sealed(&self) -> bool {
        self.sealed.load(Ordering::Acquire)
    }

    /// The plan the prefix is laid out under.
    pub fn plan(&self) -> &LayoutPlan {
        &self.plan
    }

    /// The shareability verdict the prefix was made under.
    pub fn shareability(&self) -> &PrefixShareability {
        &self.shareability
    }

    /// Prefix length in tokens (its content is identical for every sequence of the prefix).
    pub fn prefix_len(&self) -> u64 {
        self.prefix_len
    }

    /// First shared window of every fragment (0 for a prefix that starts at token 0).
    pub fn first_window(&self) -> u64 {
        self.first_window
    }

    /// One past the last shared window of every fragment.
    pub fn end_window(&self) -> u64 {
        self.end_window
    }

    /// Shared windows per fragment.
    pub fn windows_per_fragment(&self) -> u64 {
        self.end_window.saturating_sub(self.first_window)
    }

    /// Tokens whose bytes lie entirely in the shared windows (from token 0 to the end window).
    pub fn shared_tokens(&self) -> u64 {
        self.end_window.saturating_mul(self.plan.granule())
            / self.plan.fragment_bytes_per_token().max(1)
    }

    /// Physical bytes of the prefix (billed once).
    pub fn bytes(&self) -> u64 {
        self.set.bytes()
    }

    /// Live window mappings of the prefix's handles (owner's and sharers'), counted per
    /// window: the pool's reference count (`note_shared_map` / `note_unmapped`).
    pub fn mapped_count(&self) -> u64 {
        self.set.mapped_count()
    }

    /// The physical handles.
    pub fn handles(&self) -> &Arc<SharedHandles> {
        &self.set
    }

    /// Whether a sharer may map this prefix up to `end_window` (per fragment): every
    /// fragment's end falls on a handle boundary of the set. Handles are mapped whole, so a
    /// partial attach (a prefix-cache hit shorter than the cached prefix) must end where no
    /// handle is cut; a full attach always may.
    pub fn can_end_at(&self, end_window: u64) -> bool {
        let k = self.windows_per_fragment();
        let take = end_window
            .min(self.end_window)
            .saturating_sub(self.first_window);
        if take == k {
            return true;
        }
        (0..self.plan.slice_count()).all(|f| {
            let i = f.saturating_mul(k).saturating_add(take);
            usize::try_from(i).is_ok_and(|i| self.set.starts_handle(i))
        })
    }

    /// Set indices of windows `[first_window, end_window)` of every fragment, as one index
    /// range per fragment.
    pub(crate) fn window_ranges(&self, end_window: u64) -> Result<Vec<Range<usize>>, KvCacheError> {
        let overflow = || crate::KvError::Overflow {
            what: "window index",
        };
        let k = self.windows_per_fragment();
        let take = end_window
            .min(self.end_window)
            .saturating_sub(self.first_window);
        let fragments = self.plan.slice_count();
        let mut out = Vec::new();
        if take == 0 {
            return Ok(out);
        }
        for f in 0..fragments {
            let first = mul(f, k, "window index")?;
            let last = first.checked_add(take - 1).ok_or_else(overflow)?;
            let first = usize::try_from(first).map_err(|_| overflow())?;
            let end = usize::try_from(last)
                .ok()
                .and_then(|l| l.checked_add(1))
                .ok_or_else(overflow)?;
            out.push(first..end);
        }
        Ok(out)
    }
}
