//! # kvvm-layout: KV-cache geometry, layouts and shareability arithmetic
//!
//! Pure arithmetic, no GPU and no manager: given the shape of a model's KV cache
//! ([`KvGeometry`]), a physical layout ([`KvLayout`]) and the device's mapping granule (queried
//! from the driver, never hard-coded), this crate says where every byte lives
//! ([`LayoutPlan::offset`]), how many bytes must be committed for `n` live tokens
//! ([`LayoutPlan::committed_bytes_for_tokens`], [`commit_lower_bound`]) and whether a prefix can
//! be shared by mapping one physical allocation at several addresses
//! ([`evaluate_prefix_shareability`]). `kvvm-kv` builds the device side on it and re-exports
//! it; the host cache, the workload simulator and `kvvm plan` use it directly.
//!
//! ## Geometry
//!
//! A [`KvGeometry`] is `layers x {K, V} x kv_heads x max_tokens x head_dim` elements of
//! `dtype_bytes` bytes ([`KvDtype`]: fp16/bf16 2, fp8 1, fp32 4). `kv_heads` is the number of
//! *KV* heads (grouped-query attention). [`KvGeometry::preset`] knows llama-3-8b (32 layers,
//! 8 KV heads, head_dim 128), llama-3-70b (80, 8, 128), mistral-7b (32, 8, 128) and
//! qwen2.5-7b (28, 4, 128). Construction rejects zero dimensions and checks that the total
//! byte size fits in `u64`; all size arithmetic in this crate is checked and an overflow is a
//! [`KvError::Overflow`], never a wrap.
//!
//! ## Layouts and the two formulas
//!
//! Each layout cuts the cache into *contiguous fragments*, runs of bytes that hold
//! consecutive tokens in order:
//!
//! | layout | fragments | bytes per token in a fragment | llama-3-8b fp16 |
//! |---|---|---|---|
//! | head-major (BNSH) | `layers x 2 x kv_heads` | `head_dim x dtype` | 512 x 256 B |
//! | seq-major (BSNH) | `layers x 2` | `kv_heads x head_dim x dtype` | 64 x 2048 B |
//! | token-major | 1 | `layers x 2 x kv_heads x head_dim x dtype` | 1 x 131072 B |
//!
//! * `committed bytes = granule x (windows holding at least one live byte)`: a window is
//!   mapped whole even for one live byte, so the layout sets the commit lower bound. One live
//!   token of llama-3-8b costs 512 windows head-major, 64 seq-major, 1 token-major.
//! * A prefix is shareable when `fragment_bytes = prefix_len x bytes per token in a fragment`
//!   is at least one granule: only then does a whole window lie inside the prefix. With a
//!   2 MiB granule llama-3-8b needs 8192 tokens head-major, 1024 seq-major, 16 token-major.
//!   "Not shareable" is a value with a reason ([`PrefixShareability::refusal_reason`]).
//!
//! ## The padding rule and its cost
//!
//! A [`LayoutPlan`] pads every fragment up to a granule multiple, so every fragment starts on
//! a granule boundary and no window ever holds bytes of two fragments. That is what makes
//! whole windows shareable and independently committable, and what makes
//! `floor(fragment_bytes / granule)` exact. The cost:
//!
//! * **Address space:** [`LayoutPlan::padding_bytes`] `= fragments x slice_stride -
//!   total_bytes`, up to `fragments x (granule - 1)` bytes. It is reserved, never committed,
//!   and virtual address space is cheap, but it is not nothing when the context is short and
//!   the fragments many: llama-3-8b fp16 at 1000 tokens head-major holds 125 MiB of data in a
//!   1 GiB reservation (512 slices of 250 KB, each padded to 2 MiB). At 128K tokens the
//!   padding is zero for every preset and layout (the slices are whole granules).
//! * **Committed memory:** none beyond the lower bound. A fragment's last live window is
//!   committed whole either way; without padding, neighbouring fragments could share that
//!   window (saving at most one window per fragment boundary) but then no window straddling
//!   two fragments could be shared or released on its own.
//!
//! `docs/kv-layouts.md` has the worked table for every preset; the unit tests assert it.
//!
//! ## Example
//!
//! ```
//! use kvvm_layout::{evaluate_prefix_shareability, KvDtype, KvGeometry, KvLayout, LayoutPlan};
//!
//! # fn main() -> Result<(), kvvm_layout::KvError> {
//! let granule = 2 << 20; // queried from the driver in real use
//! let g = KvGeometry::preset("llama-3-8b", KvDtype::F16, 131_072)?;
//! let plan = LayoutPlan::new(g, KvLayout::SeqMajor, granule)?;
//! assert_eq!(plan.committed_bytes_for_tokens(1)?, 64 * granule); // layers x 2 windows
//!
//! let verdict = evaluate_prefix_shareability(&g, KvLayout::HeadMajor, 4096, granule)?;
//! assert!(!verdict.shareable);
//! assert!(verdict.refusal_reason().is_some_and(|r| r.contains("8192 tokens")));
//! # Ok(())
//! # }
//! ```
//!
//! ## Errors
//!
//! Every function returns [`KvError`]; nothing here panics on bad input.

#![forbid(unsafe_code)]

mod error;
mod geometry;
mod layout;
mod shareability;

pub use error::KvError;
pub use geometry::{KvDtype, KvGeometry, ModelPreset, PRESETS};
pub use layout::{Fragment, KvKind, KvLayout, LayoutPlan, LayoutStrides};
pub use shareability::{
    commit_lower_bound, evaluate_prefix_shareability, min_shareable_prefix, PrefixShareability,
};
