//! Physical layouts of a KV cache inside one virtual reservation: [`KvLayout`] and the
//! granule-aware [`LayoutPlan`].

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use kvvm_num::{add, mul};

use crate::error::{div_ceil, round_up, KvError};
use crate::geometry::KvGeometry;

/// Which of the two cached tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KvKind {
    /// The key tensor (index 0).
    Key,
    /// The value tensor (index 1).
    Value,
}

impl KvKind {
    /// Both kinds, K first.
    pub const BOTH: [KvKind; 2] = [KvKind::Key, KvKind::Value];

    /// 0 for K, 1 for V: the position of this tensor wherever K and V are interleaved.
    pub const fn index(self) -> u64 {
        match self {
            KvKind::Key => 0,
            KvKind::Value => 1,
        }
    }
}

/// How the elements `(layer, K/V, head, token, dim)` are ordered in memory.
///
/// The layout decides how large each *contiguous fragment* (a run of bytes that holds
/// consecutive tokens in order) is per token, and so how many granule windows a span of tokens
/// touches ([`LayoutPlan::committed_bytes_for_tokens`]) and how long a prefix must be before a
/// whole granule of it can be shared ([`crate::evaluate_prefix_shareability`]).
///
/// | layout | fragments | contiguous bytes per token in a fragment |
/// |---|---|---|
/// | [`HeadMajor`](KvLayout::HeadMajor) (BNSH) | `layers x 2 x kv_heads` | `head_dim x dtype` |
/// | [`SeqMajor`](KvLayout::SeqMajor) (BSNH) | `layers x 2` | `kv_heads x head_dim x dtype` |
/// | [`TokenMajor`](KvLayout::TokenMajor) | 1 | `layers x 2 x kv_heads x head_dim x dtype` |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvLayout {
    /// BNSH: for each layer, for K then V, for each KV head, one slice of
    /// `max_tokens x head_dim` elements.
    HeadMajor,
    /// BSNH: for each layer, for K then V, one slice of `max_tokens x kv_heads x head_dim`
    /// elements.
    SeqMajor,
    /// One token's K and V of every layer are contiguous (`layers x 2 x kv_heads x head_dim`
    /// elements, ordered layer, K/V, head, dim); the whole buffer is indexed by token.
    TokenMajor,
}

impl KvLayout {
    /// Every layout, in declaration order.
    pub const ALL: [KvLayout; 3] = [
        KvLayout::HeadMajor,
        KvLayout::SeqMajor,
        KvLayout::TokenMajor,
    ];

    /// The canonical name (`"head-major"`, `"seq-major"`, `"token-major"`).
    pub const fn as_str(self) -> &'static str {
        match self {
            KvLayout::HeadMajor => "head-major",
            KvLayout::SeqMajor => "seq-major",
            KvLayout::TokenMajor => "token-major",
        }
    }

    /// Number of contiguous fragments (slices) under this layout.
    pub const fn fragment_count(self, geometry: &KvGeometry) -> u64 {
        match self {
            KvLayout::HeadMajor => geometry.kv_head_slices(),
            // layers x 2 <= layers x 2 x kv_heads, which the geometry checked.
            KvLayout::SeqMajor => geometry.kv_head_slices() / geometry.kv_heads() as u64,
            KvLayout::TokenMajor => 1,
        }
    }

    /// Contiguous bytes one token occupies inside one fragment.
    pub const fn fragment_bytes_per_token(self, geometry: &KvGeometry) -> u64 {
        match self {
            KvLayout::HeadMajor => geometry.head_bytes(),
            KvLayout::SeqMajor => geometry.bytes_per_token_per_layer_per_kv(),
            KvLayout::TokenMajor => geometry.bytes_per_token(),
        }
    }
}

impl fmt::Display for KvLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for KvLayout {
    type Err = KvError;

    /// Parses `head-major`/`bnsh`, `seq-major`/`bsnh`, `token-major` (ASCII case-insensitive,
    /// `_` accepted for `-`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "head-major" | "bnsh" => Ok(KvLayout::HeadMajor),
            "seq-major" | "bsnh" => Ok(KvLayout::SeqMajor),
            "token-major" => Ok(KvLayout::TokenMajor),
            _ => Err(KvError::UnknownLayout { name: s.to_owned() }),
        }
    }
}

/// Byte strides of a [`LayoutPlan`]: the offset of element `(layer, kv, head, token)` is
/// `layer*layer + kv.index()*kv + head*head + token*token` (all in bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayoutStrides {
    /// Bytes between consecutive layers.
    pub layer: u64,
    /// Bytes between K and V of one layer.
    pub kv: u64,
    /// Bytes between consecutive KV heads.
    pub head: u64,
    /// Bytes between consecutive tokens.
    pub token: u64,
}

/// One contiguous slice of a [`LayoutPlan`]: it holds its tokens in order, `bytes_per_token`
/// bytes each, starting at `offset` (a granule multiple).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fragment {
    /// Position of this fragment in the plan (0-based, in address order).
    pub index: u64,
    /// The layer it holds, or `None` for token-major (every layer).
    pub layer: Option<u32>,
    /// K or V, or `None` for token-major (both).
    pub kind: Option<KvKind>,
    /// The KV head it holds (head-major), or `None` when it holds every head.
    pub head: Option<u32>,
    /// Byte offset of its first token in the reservation; always a multiple of the granule.
    pub offset: u64,
    /// Contiguous bytes of one token in this fragment.
    pub bytes_per_token: u64,
    /// Bytes of data at capacity: `max_tokens x bytes_per_token`.
    pub data_bytes: u64,
    /// Bytes reserved for it: `data_bytes` rounded up to the granule (the plan's slice stride).
    pub reserved_bytes: u64,
}

impl Fragment {
    /// Byte range holding the first `n_tokens` tokens of this fragment (not checked against
    /// capacity; use [`LayoutPlan::windows_for_tokens`] for checked queries).
    pub fn live_bytes(&self, n_tokens: u64) -> Result<Range<u64>, KvError> {
        let len = mul(n_tokens, self.bytes_per_token, "fragment live bytes")?;
        Ok(self.offset..add(self.offset, len, "fragment live end")?)
    }
}

/// A [`KvLayout`] instantiated for one geometry and one mapping granule.
///
/// **Padding rule:** every contiguous slice (fragment) starts on a granule boundary: each
/// slice is padded up to a granule multiple ([`slice_stride`](Self::slice_stride)). Whole
/// granule windows therefore never hold bytes of two fragments, so a window that lies inside a
/// fragment's prefix can be shared, committed or released on its own, and
/// `floor(fragment_bytes / granule)` whole windows of a prefix are exactly shareable. The cost
/// is [`padding_bytes`](Self::padding_bytes) of *reserved address space* (free: no physical
/// memory) and, in committed memory, at most one partly-filled window per fragment, which the
/// commit lower bound `granule x windows` already counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayoutPlan {
    geometry: KvGeometry,
    layout: KvLayout,
    granule: u64,
    slices: u64,
    slice_data_bytes: u64,
    slice_stride: u64,
    reservation_bytes: u64,
    strides: LayoutStrides,
}

impl LayoutPlan {
    /// Lays out `geometry` under `layout` with slices padded to `granule` bytes.
    ///
    /// Errors: [`KvError::ZeroGranule`]; [`KvError::Overflow`] when the padded reservation
    /// does not fit in `u64`.
    pub fn new(geometry: KvGeometry, layout: KvLayout, granule: u64) -> Result<Self, KvError> {
        if granule == 0 {
            return Err(KvError::ZeroGranule);
        }
        let slices = layout.fragment_count(&geometry);
        let per_token = layout.fragment_bytes_per_token(&geometry);
        let slice_data_bytes = mul(per_token, geometry.max_tokens(), "slice bytes")?;
        let slice_stride = round_up(slice_data_bytes, granule, "padded slice stride")?;
        let reservation_bytes = mul(slices, slice_stride, "reservation bytes")?;
        let heads = u64::from(geometry.kv_heads());
        let head_bytes = geometry.head_bytes();
        let strides = match layout {
            KvLayout::HeadMajor => LayoutStrides {
                head: slice_stride,
                kv: mul(heads, slice_stride, "K/V stride")?,
                layer: mul(mul(heads, slice_stride, "K/V stride")?, 2, "layer stride")?,
                token: head_bytes,
            },
            KvLayout::SeqMajor => LayoutStrides {
                head: head_bytes,
                token: geometry.bytes_per_token_per_layer_per_kv(),
                kv: slice_stride,
                layer: mul(slice_stride, 2, "layer stride")?,
            },
            KvLayout::TokenMajor => LayoutStrides {
                head: head_bytes,
                kv: geometry.bytes_per_token_per_layer_per_kv(),
                layer: mul(
                    geometry.bytes_per_token_per_layer_per_kv(),
                    2,
                    "layer stride",
                )?,
                token: geometry.bytes_per_token(),
            },
        };
        Ok(Self {
            geometry,
            layout,
            granule,
            slices,
            slice_data_bytes,
            slice_stride,
            reservation_bytes,
            strides,
        })
    }

    /// The geometry laid out.
    pub const fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// The layout.
    pub const fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The mapping granule every slice is padded to.
    pub const fn granule(&self) -> u64 {
        self.granule
    }

    /// Number of contiguous slices (= fragments).
    pub const fn slice_count(&self) -> u64 {
        self.slices
    }

    /// Data bytes of one slice at capacity, before padding.
    pub const fn slice_data_bytes(&self) -> u64 {
        self.slice_data_bytes
    }

    /// Bytes from the start of one slice to the next: the slice's data padded up to a granule
    /// multiple.
    pub const fn slice_stride(&self) -> u64 {
        self.slice_stride
    }

    /// Bytes of virtual address space to reserve: `slice_count x slice_stride`, a granule
    /// multiple.
    pub const fn reservation_bytes(&self) -> u64 {
        self.reservation_bytes
    }

    /// Granule windows in the reservation.
    pub const fn reservation_windows(&self) -> u64 {
        self.reservation_bytes / self.granule
    }

    /// Data bytes at capacity (the geometry's total bytes).
    pub const fn data_bytes(&self) -> u64 {
        self.geometry.total_bytes()
    }

    /// Reserved bytes that never hold data: `reservation_bytes - data_bytes`, i.e. the padding
    /// at the end of each slice. It costs address space only (never committed unless it
    /// shares a window with a slice's last live byte).
    pub const fn padding_bytes(&self) -> u64 {
        self.reservation_bytes - self.geometry.total_bytes()
    }

    /// The byte strides of this plan.
    pub const fn strides(&self) -> LayoutStrides {
        self.strides
    }

    /// Contiguous bytes one token occupies inside one fragment.
    pub const fn fragment_bytes_per_token(&self) -> u64 {
        self.layout.fragment_bytes_per_token(&self.geometry)
    }

    /// Byte offset in the reservation of the first element of head `head` of the K or V of
    /// `layer` for token `token`; the head's `head_dim` elements follow contiguously.
    ///
    /// Errors: [`KvError::LayerOutOfRange`], [`KvError::HeadOutOfRange`],
    /// [`KvError::TokenOutOfRange`].
    pub fn offset(&self, layer: u32, kv: KvKind, head: u32, token: u64) -> Result<u64, KvError> {
        self.geometry.check_layer(layer)?;
        self.geometry.check_head(head)?;
        self.geometry.check_token(token)?;
        let s = &self.strides;
        let mut offset = mul(u64::from(layer), s.layer, "offset")?;
        offset = add(offset, mul(kv.index(), s.kv, "offset")?, "offset")?;
        offset = add(offset, mul(u64::from(head), s.head, "offset")?, "offset")?;
        Ok(add(offset, mul(token, s.token, "offset")?, "offset")?)
    }

    /// The fragment holding `(layer, kv, head)`; its index in [`fragments`](Self::fragments).
    pub fn fragment_index(&self, layer: u32, kv: KvKind, head: u32) -> Result<u64, KvError> {
        self.geometry.check_layer(layer)?;
        self.geometry.check_head(head)?;
        let lkv = add(
            mul(u64::from(layer), 2, "fragment index")?,
            kv.index(),
            "fragment index",
        )?;
        match self.layout {
            KvLayout::HeadMajor => Ok(add(
                mul(lkv, u64::from(self.geometry.kv_heads()), "fragment index")?,
                u64::from(head),
                "fragment index",
            )?),
            KvLayout::SeqMajor => Ok(lkv),
            KvLayout::TokenMajor => Ok(0),
        }
    }

    /// Every contiguous fragment, in address order.
    pub fn fragments(&self) -> Result<Vec<Fragment>, KvError> {
        let per_token = self.fragment_bytes_per_token();
        let mut out = Vec::new();
        let mut push = |index: u64, layer, kind, head| -> Result<(), KvError> {
            out.push(Fragment {
                index,
                layer,
                kind,
                head,
                offset: mul(index, self.slice_stride, "fragment offset")?,
                bytes_per_token: per_token,
                data_bytes: self.slice_data_bytes,
                reserved_bytes: self.slice_stride,
            });
            Ok(())
        };
        match self.layout {
            KvLayout::TokenMajor => push(0, None, None, None)?,
            KvLayout::SeqMajor | KvLayout::HeadMajor => {
                let mut index = 0;
                for layer in 0..self.geometry.layers() {
                    for kind in KvKind::BOTH {
                        if self.layout == KvLayout::SeqMajor {
                            push(index, Some(layer), Some(kind), None)?;
                            index += 1;
                        } else {
                            for head in 0..self.geometry.kv_heads() {
                                push(index, Some(layer), Some(kind), Some(head))?;
                                index += 1;
                            }
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// Windows each fragment needs for its first `n_tokens` tokens:
    /// `ceil(n_tokens x fragment_bytes_per_token / granule)`.
    ///
    /// Errors: [`KvError::TooManyTokens`] when `n_tokens > max_tokens`.
    pub fn windows_per_fragment(&self, n_tokens: u64) -> Result<u64, KvError> {
        self.geometry.check_token_count(n_tokens)?;
        windows_per_fragment(self.fragment_bytes_per_token(), n_tokens, self.granule)
    }

    /// The granule windows (indices `offset / granule` into the reservation) that hold at
    /// least one live byte when the first `n_tokens` tokens are live: one non-empty range per
    /// fragment, in address order (empty when `n_tokens == 0`). Ranges never overlap, by the
    /// padding rule.
    ///
    /// Errors: [`KvError::TooManyTokens`] when `n_tokens > max_tokens`.
    pub fn windows_for_tokens(&self, n_tokens: u64) -> Result<Vec<Range<u64>>, KvError> {
        let per_fragment = self.windows_per_fragment(n_tokens)?;
        if per_fragment == 0 {
            return Ok(Vec::new());
        }
        let stride_windows = self.slice_stride / self.granule;
        (0..self.slices)
            .map(|i| {
                let start = mul(i, stride_windows, "window index")?;
                Ok(start..add(start, per_fragment, "window index")?)
            })
            .collect()
    }

    /// Number of windows holding at least one live byte for `n_tokens` live tokens:
    /// `fragments x windows_per_fragment(n_tokens)`.
    pub fn window_count_for_tokens(&self, n_tokens: u64) -> Result<u64, KvError> {
        Ok(mul(
            self.slices,
            self.windows_per_fragment(n_tokens)?,
            "window count",
        )?)
    }

    /// The most tokens whose bytes all lie in the windows that hold the first `n_tokens`
    /// tokens (never more than `max_tokens`): what may be written past `n_tokens` without
    /// committing a window more. `n_tokens` itself when the windows end on a token boundary.
    ///
    /// Errors: [`KvError::TooManyTokens`] when `n_tokens > max_tokens`.
    pub fn mapped_tokens(&self, n_tokens: u64) -> Result<u64, KvError> {
        let per_token = self.fragment_bytes_per_token();
        if per_token == 0 {
            return Ok(n_tokens);
        }
        let windows = self.windows_per_fragment(n_tokens)?;
        let bytes = mul(windows, self.granule, "mapped bytes")?;
        Ok((bytes / per_token).clamp(n_tokens, self.geometry.max_tokens()))
    }

    /// The commit lower bound for `n_tokens` live tokens: `granule x windows holding at least
    /// one live byte`.
    pub fn committed_bytes_for_tokens(&self, n_tokens: u64) -> Result<u64, KvError> {
        Ok(mul(
            self.granule,
            self.window_count_for_tokens(n_tokens)?,
            "committed bytes",
        )?)
    }
}

/// `ceil(n_tokens x per_token / granule)`, checked.
pub(crate) fn windows_per_fragment(
    per_token: u64,
    n_tokens: u64,
    granule: u64,
) -> Result<u64, KvError> {
    div_ceil(mul(n_tokens, per_token, "fragment live bytes")?, granule)
}
