//! [`SharedDevicePrefix`]: one physical copy of a prefix's KV, mapped read-write by its owner
//! and read-only by any number of sharers, billed once.

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use kvvm_vmm::SharedHandles;

use kvvm_num::mul;

use crate::error::KvCacheError;
use crate::sequence::prefix_home::Home;
use kvvm_layout::LayoutPlan;
use kvvm_layout::PrefixShareability;

/// Host bytes written per copy batch when filling a prefix.
pub(crate) const FILL_BATCH_BYTES: u64 = 32 << 20;

/// A shared prefix on the device: the granule windows `[first_window, end_window)` of every
/// fragment of a [`LayoutPlan`], backed by one set of physical handles
/// ([`SharedHandles`]) that every sequence of the prefix maps read-only at the same offsets of
/// its own reservation, and its *tail*: the prefix's bytes past those windows, which sharers
/// copy.
///
/// * **Read-only windows hold prefix bytes only**: a window is mapped read-only by a sharer
///   only when every byte of it belongs to prefix tokens that the sharer will never write,
///   for every geometry (bytes per token need not divide a window). A sharer that takes the
///   first `t` tokens maps the windows lying wholly before token `t`'s first byte
///   (`floor(t x fragment_bytes_per_token / granule)`, cut down to whole handles) and
///   receives the bytes from there to token `t` by a device copy into its own windows; it
///   writes tokens `t..` only, all in its own memory (`prefix_copy.rs`).
/// * **The tail**: when the prefix does not end on a window boundary, its bytes after the
///   last whole window (`[end_window x granule, prefix_len x fragment_bytes_per_token)` of
///   every fragment) are copied, when the owner seals the prefix
///   ([`SequenceKv::seal_prefix`](crate::SequenceKv::seal_prefix)), into handles of the prefix's own (one window per
///   fragment, billed once with the prefix), so that a sharer receives every prefix token:
///   from the read-only windows, then by copy. A prefix shorter than one window has no
///   read-only window at all and is handed on by copy alone.
/// * **Billed once**: the handles are granted and accounted once, as *shared*, however many
///   sequences map them; a sharer pays only for the windows it copies into.
/// * **Lifetime is the union**: each mapping and each `Arc` of this prefix (the owner's and
///   the sharers' sequences, a prefix cache) keeps the handles alive; they are released only
///   when the last is gone. The owner may finish first.
/// * **Home view**: the prefix maps its own handles, read-only, in a reservation of its own
///   (made at the first need, dropped with the prefix; no physical byte of its own): what
///   copies read from, so that a sharer never needs the owner (`prefix_home.rs`).
/// * **Sealed**: the owner writes the prefix through its read-write mapping and seals it;
///   after that nobody writes it (sharers map it with `Read` access, and a write into it is
///   refused with [`KvCacheError::WriteIntoSharedPrefix`] before any driver call). There is
///   no copy-on-write on the device.
pub struct SharedDevicePrefix {
    pub(crate) set: Arc<SharedHandles>,
    pub(crate) plan: LayoutPlan,
    pub(crate) first_window: u64,
    pub(crate) end_window: u64,
    pub(crate) prefix_len: u64,
    pub(crate) shareability: PrefixShareability,
    pub(crate) sealed: AtomicBool,
    pub(crate) home: Mutex<Home>,
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
            home: Mutex::new(Home::default()),
        }
    }

    /// Marks the prefix written: from now on it is read-only for everyone, owner included.
    /// The owner seals through [`SequenceKv::seal_prefix`](crate::SequenceKv::seal_prefix),
    /// which first copies the tail.
    pub(crate) fn seal(&self) {
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

    /// Tokens a sharer receives from token 0 (read-only windows, then copies): the whole
    /// prefix once it is sealed with its tail (or when it needs none), else only the tokens
    /// lying wholly in the read-only windows.
    pub fn tokens(&self) -> u64 {
        if self.tail_bytes() == 0 || self.lock_home().tail.is_some() {
            self.prefix_len
        } else {
            self.shared_tokens().min(self.prefix_len)
        }
    }

    /// Bytes of the tail in each fragment: the prefix's bytes past its read-only windows
    /// (`prefix_len x fragment_bytes_per_token - end_window x granule`, 0 when the prefix ends
    /// on a window boundary).
    pub fn tail_bytes(&self) -> u64 {
        let bytes = self
            .prefix_len
            .saturating_mul(self.plan.fragment_bytes_per_token());
        bytes.saturating_sub(self.end_window.saturating_mul(self.plan.granule()))
    }

    /// One past the last window holding a byte of the prefix, in every fragment: the read-only
    /// windows, then the tail's.
    pub fn tail_end_window(&self) -> u64 {
        self.end_window
            .saturating_add(self.tail_bytes().div_ceil(self.plan.granule().max(1)))
    }

    /// Physical bytes of the prefix (billed once): its read-only windows and its tail.
    pub fn bytes(&self) -> u64 {
        let tail = self.lock_home().tail.as_ref().map_or(0, |t| t.bytes());
        self.set.bytes().saturating_add(tail)
    }

    /// Live window mappings of the prefix's handles (owner's and sharers'), counted per
    /// window: the pool's reference count (`note_shared_map` / `note_unmapped`).
    pub fn mapped_count(&self) -> u64 {
        let own = self.lock_home().set_mappings;
        self.set.mapped_count().saturating_sub(own)
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
