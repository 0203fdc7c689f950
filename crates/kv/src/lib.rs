//! # kvvm-kv: KV-cache geometry, layouts, shareability, sequences and the prefix cache
//!
//! Two halves. **The arithmetic** (no GPU; it is `kvvm-layout`, re-exported here): given the shape of a model's KV cache ([`KvGeometry`]), a physical
//! layout ([`KvLayout`]) and the device's mapping granule (queried from the driver, never
//! hard-coded), this crate says where every byte lives ([`LayoutPlan::offset`]), how many
//! bytes must be committed for `n` live tokens ([`LayoutPlan::committed_bytes_for_tokens`],
//! [`commit_lower_bound`]) and whether a prefix can be shared by mapping one physical
//! allocation at several addresses ([`evaluate_prefix_shareability`]). **The device side**
//! (over `kvvm-vmm`): one request's cache ([`SequenceKv`]), a prefix mapped read-only by many
//! requests and billed once ([`SharedDevicePrefix`]), an automatic prefix cache
//! ([`PrefixCache`]) and deterministic synthetic KV data ([`synthetic`]); see "On the
//! device" below and `docs/prefix-sharing.md`.
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
//! use kvvm_kv::{evaluate_prefix_shareability, KvDtype, KvGeometry, KvLayout, LayoutPlan};
//!
//! # fn main() -> Result<(), kvvm_kv::KvError> {
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
//! ## On the device: sequences, shared prefixes, the prefix cache
//!
//! Over a [`kvvm_vmm::VirtualMemory`] (one per device, charging a governor):
//!
//! * [`SequenceKv`]: one request's cache, reserved at `max_tokens` under a [`LayoutPlan`].
//!   `ensure_tokens(n) -> Result<u64, KvCacheError>` commits (one transaction through the
//!   governor) the windows holding the first `n` tokens; `write_tokens` / `read_tokens`
//!   (host layout per token `[layer][K, V][kv_head][head_dim]`) scatter and gather with one
//!   copy per contiguous device run; `layer_pointers(layer)` gives K/V device pointers and
//!   strides for kernels; `release()`; `committed_bytes()`, `additional_owned_bytes()`.
//! * [`SharedDevicePrefix`]: `reserve_and_map_shared_prefix(vm, plan, prefix_len, max_tokens,
//!   fill)` (owner: maps the whole windows of the prefix read-write, billed once, writes and
//!   seals them) and `prefix.map_shared_prefix_readonly(vm, max_tokens)` (a sharer maps the
//!   same handles read-only at the same offsets; adds 0 owned bytes). Refused with the
//!   shareability's reason when not shareable; writes into the shared part are refused with
//!   [`KvCacheError::WriteIntoSharedPrefix`] (no copy-on-write on the device).
//! * [`PrefixCache`]: automatic prefix sharing. For a server:
//!
//! ```
//! # use std::sync::Arc;
//! # use kvvm_kv::{KvDtype, KvGeometry, KvLayout, LayoutPlan, PrefixCache, SequenceKv};
//! # use kvvm_sim::{SimBackend, SimConfig};
//! # use kvvm_vmm::{Governor, VirtualMemory, VmmConfig};
//! # fn main() -> Result<(), kvvm_kv::KvCacheError> {
//! # let sim = Arc::new(SimBackend::new(SimConfig::single(2 << 20, 8 << 30)));
//! # let vm = VirtualMemory::new(sim.clone(), kvvm_hal::DeviceId(0), Governor::unlimited(),
//! #                             VmmConfig::default())?;
//! let geometry = KvGeometry::preset("llama-3-8b", KvDtype::F16, 8192)?;
//! let plan = LayoutPlan::new(geometry, KvLayout::TokenMajor, vm.granule())?;
//! let cache: Arc<PrefixCache> = PrefixCache::new(vm, plan)?;   // registers a reclaimer
//! assert_eq!(cache.block_tokens(), 16);                        // 2 MiB / 128 KiB per token
//! let token_ids: Vec<u32> = (0..100).collect();
//!
//! // Request 1: a miss. It owns a new shared prefix of its 6 full blocks (96 tokens).
//! let mut a = cache.admit(&token_ids, 1024)?;                  // 429 on Backpressure
//! assert_eq!((a.hit_tokens, a.owned_prefix_tokens), (0, 96));
//! let bpt = geometry.bytes_per_token() as usize;
//! let kv = vec![7u8; 100 * bpt];                               // prefill's KV, host layout
//! a.sequence.write_tokens(a.info.hit_tokens, &kv)?;            // tokens 0..100
//! cache.publish(&mut a.sequence)?;                             // now others can hit it
//!
//! // Request 2: the same prompt. 96 tokens mapped read-only, 4 to write.
//! let mut b = cache.admit(&token_ids, 1024)?;
//! assert_eq!(b.hit_tokens, 96);
//! assert!(b.sequence.write_token(0, &kv[..bpt]).is_err());     // read-only prefix
//! b.sequence.write_tokens(96, &kv[..4 * bpt])?;
//! b.sequence.ensure_tokens(101)?;                              // decode grows privately
//! b.sequence.write_token(100, &kv[..bpt])?;
//!
//! let s = cache.stats();   // hits, misses, tokens_saved, bytes_saved, cached_bytes, evictions
//! assert_eq!((s.hits, s.misses, s.tokens_saved), (1, 1, 96));
//! drop((a, b));            // the owner may finish first; the cache keeps the prefix
//! assert_eq!(cache.stats().cached_bytes, 6 * (2 << 20));
//! # Ok(())
//! # }
//! ```
//!
//!   [`KvCacheError::Backpressure`] carries the governor's `Backpressure { needed, available,
//!   retry_after, .. }` ([`KvCacheError::retry_after`], [`KvCacheError::needed`],
//!   [`KvCacheError::available`]): answer 429 with `Retry-After`.
//!
//!   With a host level ([`PrefixCache::attach_host_tier`] over a [`HostTier`]) an evicted
//!   prefix is copied to page-locked host memory (billed to the host's budget) and a later
//!   admission whose longest hit lies there copies it back into the request's own windows
//!   instead of leaving it to prefill ([`PrefixCache::admit_into_with_host`] says from how
//!   many tokens; `AdmissionInfo::host_hit_tokens` how many came back).
//! * [`HostTier`]: page-locked host memory under the governor's host budget; a sequence's
//!   swap out and back (`SequenceKv::swap_out`, [`SwappedKv`]).
//! * [`synthetic`]: deterministic token ids and KV bytes for tests and demos (the decode
//!   benchmark that uses them is `kvvm-bench`).
//!
//! ## Errors
//!
//! The arithmetic returns [`KvError`]; the device side returns [`KvCacheError`]. Nothing here
//! panics on bad input.

#![forbid(unsafe_code)]

mod cache;
mod device_copy;
mod error;
mod host_tier;
pub mod precommit;
mod sequence;
pub mod synthetic;
mod tensor_parallel;

pub use cache::records::{
    Admission, AdmissionInfo, PrefixCacheConfig, PrefixCacheStats, PublishOutcome,
    DEFAULT_BLOCK_TOKENS,
};
pub use cache::PrefixCache;
pub use error::KvCacheError;
pub use host_tier::{HostTier, HostTierConfig, HostTierStats, DEFAULT_MAX_COPY_BYTES};
pub use sequence::prefix::SharedDevicePrefix;
pub use sequence::prefix_export::PrefixDescriptor;
pub use sequence::swap::{SwapPhase, SwappedKv};
pub use sequence::{EnsureJob, LayerPointers, SequenceKv};
pub use tensor_parallel::precommit::{GroupPrecommitStats, PrecommittedGroup};
pub use tensor_parallel::{TensorParallelJob, TensorParallelSequence};

/// The layout arithmetic (`kvvm-layout`), re-exported: every path `kvvm_kv::KvGeometry`, ...
/// keeps working.
pub use kvvm_layout::{
    commit_lower_bound, evaluate_prefix_shareability, min_shareable_prefix, Fragment, KvDtype,
    KvError, KvGeometry, KvKind, KvLayout, LayoutPlan, LayoutStrides, ModelPreset,
    PrefixShareability, PRESETS,
};
