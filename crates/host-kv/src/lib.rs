//! # kvvm-host-kv: a host paged KV cache with true copy-on-write
//!
//! The host side of kvvm (no GPU): a sequence's KV cache lives in host RAM on fixed-size pages
//! ([`HostPageStore`]), mapped by a [`PageTable`] of reference-counted physical pages.
//! [`PagedKvCache::fork`] shares every page of a sequence with a new one by bumping reference
//! counts (no byte is copied); a page is copied only when a fork writes into it while another
//! fork still maps it ([`PagedKvCache::ensure_page_for_write`]). This is copy-on-write on the
//! host; the GPU-side shared prefix (kvvm-vmm) is read-only by contract and has no CoW.
//! A "page" here is a logical reference-counting unit, not a kernel-visible block table.
//!
//! ## Pages
//!
//! The store's [`KvGeometry`](kvvm_layout::KvGeometry) gives the per-token shape; a page holds
//! `tokens_per_page` tokens, laid out `[layer][K, V][slot][kv_head][head_dim]`, so the keys
//! (or values) of one layer for all tokens of a page are one contiguous slice
//! ([`PageView::keys`]). Tokens enter and leave the API as `[layer][K, V][kv_head][head_dim]`
//! (`bytes_per_token` bytes). Dropped pages go to the store's free list and are reused; a
//! reused page may hold stale bytes in slots the sequence has not written, and the API never
//! exposes those.
//!
//! ## Copy-on-write rules
//!
//! * [`PagedKvCache::fork`]: one reference-count increment per page (a walk of the page
//!   table), no copy, whatever the number of tokens.
//! * [`PagedKvCache::ensure_page_for_write`]: when the page's count is above one, copy it into
//!   a fresh page and map the copy; the siblings keep the original. Otherwise nothing.
//! * [`PagedKvCache::append_token`] calls it for the tail page itself (right after a fork the
//!   partly filled tail page is shared).
//! * [`PagedKvCache::write_token`] / [`PagedKvCache::write_token_kv`] never copy implicitly:
//!   writing into a page that is still shared is [`HostKvError::PageShared`].
//! * Dropping (or [truncating](PagedKvCache::truncate)) a sequence releases its references; a
//!   page returns to the store when the last fork that maps it lets go.
//!
//! ## Thread safety
//!
//! * [`HostPageStore`] is a cheap `Clone` handle (`Arc`) and is `Send + Sync`. Its counters
//!   and free list sit behind one `Mutex`, taken only to allocate or return a page (never
//!   while copying page bytes). A poisoned lock is recovered: no critical section can leave
//!   the state inconsistent.
//! * [`PagedKvCache`] and [`PageTable`] are `Send + Sync`. Forks are independent values:
//!   each may live on its own thread; reads take `&self`, writes `&mut self`. Pages shared by
//!   forks are immutable while shared (a write needs a reference count of one, checked
//!   atomically by `Arc::get_mut`), so forks never race on bytes. Reference counts are atomic;
//!   [`PageTable::ref_count`] is therefore a snapshot when other threads hold forks. Two
//!   forks making the same shared page writable at the same time may both copy it; each ends
//!   with a private page and the original returns to the store.
//!
//! The tests drop and write forks on several threads and check that the store ends with
//! every page free.
//!
//! ## Example
//!
//! ```
//! use kvvm_host_kv::{HostKvError, HostPageStore, PageWrite, PagedKvCache};
//! use kvvm_layout::KvGeometry;
//!
//! # fn main() -> Result<(), HostKvError> {
//! // 2 layers x 2 KV heads x head_dim 4, fp16: 64 bytes per token; 16 tokens per page.
//! let geometry = KvGeometry::new(2, 2, 4, 2, 1024)?;
//! let store = HostPageStore::new(geometry, 16)?;
//! let mut a = PagedKvCache::new(&store, geometry)?;
//! a.append_tokens(&[7u8; 64 * 20])?; // 20 tokens, 2 pages
//!
//! let mut b = a.fork(); // no copy
//! assert_eq!(store.live_pages(), 2);
//! assert!(matches!(b.write_token(3, &[1; 64]), Err(HostKvError::PageShared { .. })));
//! assert!(matches!(b.ensure_token_for_write(3)?, PageWrite::Copied { .. }));
//! b.write_token(3, &[1; 64])?;
//! assert_eq!(a.token_to_vec(3)?, vec![7; 64]); // the sibling is unchanged
//!
//! for page in b.pages() {
//!     let keys = page.keys(0)?; // layer 0's keys of this page's tokens
//!     assert_eq!(keys.len(), page.token_count() * 16);
//! }
//! drop(a);
//! drop(b);
//! assert_eq!(store.live_pages(), 0);
//! # Ok(())
//! # }
//! ```
//!
//! ## Errors
//!
//! Every fallible call returns [`HostKvError`]: out-of-range tokens or pages, wrong byte
//! lengths, a geometry that does not match the store's, a write into a shared page, a full
//! sequence, an exhausted store or a refused allocation. Nothing here panics on bad input.

#![forbid(unsafe_code)]

mod cache;
mod error;
mod store;
mod table;

pub use cache::{PageIter, PageView, PagedKvCache};
pub use error::HostKvError;
pub use store::{HostPageStore, PhysicalPageId, StoreStats};
pub use table::{PageTable, PageWrite};
