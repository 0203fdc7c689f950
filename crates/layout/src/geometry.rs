//! The shape of one sequence's KV cache: [`KvGeometry`], [`KvDtype`] and the model presets.

use std::fmt;
use std::str::FromStr;

use kvvm_num::mul;

use crate::error::KvError;

/// Element type of the cached K and V tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// IEEE half precision, 2 bytes.
    F16,
    /// bfloat16, 2 bytes.
    Bf16,
    /// An 8-bit float in OCP FP8 E4M3 (`float8_e4m3fn`: 3 mantissa bits, largest finite value
    /// 448), 1 byte: what a view of the memory is exported as. Its scales live outside the
    /// cache's memory (they are per layer and KV head, not per token), so a token's bytes are
    /// its elements' only. E5M2 is not a kvvm dtype: one name for two formats would let a
    /// prefix written in one be read in the other.
    Fp8,
    /// IEEE single precision, 4 bytes.
    F32,
}

impl KvDtype {
    /// Every dtype, in declaration order.
    pub const ALL: [KvDtype; 4] = [KvDtype::F16, KvDtype::Bf16, KvDtype::Fp8, KvDtype::F32];

    /// Bytes per element: fp16/bf16 2, fp8 1, fp32 4.
    pub const fn bytes(self) -> u32 {
        match self {
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::Fp8 => 1,
            KvDtype::F32 => 4,
        }
    }

    /// The canonical lower-case name (`"fp16"`, `"bf16"`, `"fp8"`, `"fp32"`).
    pub const fn as_str(self) -> &'static str {
        match self {
            KvDtype::F16 => "fp16",
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8 => "fp8",
            KvDtype::F32 => "fp32",
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for KvDtype {
    type Err = KvError;

    /// Parses `fp16`/`f16`/`half`, `bf16`, `fp8`/`f8`/`fp8e4m3`/`fp8_e4m3`, `fp32`/`f32`/`float`
    /// (ASCII case-insensitive); `fp8e5m2` is refused (see [`KvDtype::Fp8`]).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "fp16" | "f16" | "half" => Ok(KvDtype::F16),
            "bf16" => Ok(KvDtype::Bf16),
            "fp8" | "f8" | "fp8e4m3" | "fp8_e4m3" => Ok(KvDtype::Fp8),
            "fp32" | "f32" | "float" => Ok(KvDtype::F32),
            _ => Err(KvError::UnknownDtype { name: s.to_owned() }),
        }
    }
}

/// The per-model KV shape of a known model (grouped-query attention: `kv_heads` is the number
/// of *KV* heads, not of query heads).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelPreset {
    /// The preset's name, as accepted by [`KvGeometry::preset`].
    pub name: &'static str,
    /// Transformer layers.
    pub layers: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
}

/// The built-in presets with the models' real GQA shapes.
pub const PRESETS: [ModelPreset; 4] = [
    ModelPreset {
        name: "llama-3-8b",
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
    },
    ModelPreset {
        name: "llama-3-70b",
        layers: 80,
        kv_heads: 8,
        head_dim: 128,
    },
    ModelPreset {
        name: "mistral-7b",
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
    },
    ModelPreset {
        name: "qwen2.5-7b",
        layers: 28,
        kv_heads: 4,
        head_dim: 128,
    },
];

/// The shape of one sequence's KV cache, validated, with its byte sizes precomputed.
///
/// A geometry is `layers x {K, V} x kv_heads x max_tokens x head_dim` elements of
/// `dtype_bytes` bytes. Construction ([`KvGeometry::new`]) rejects zero dimensions and checks
/// that the total byte size fits in `u64`; every size accessor below is therefore infallible,
/// since each is a factor of the total.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvGeometry {
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    dtype_bytes: u32,
    max_tokens: u64,
    head_bytes: u64,
    bytes_per_token_per_layer_per_kv: u64,
    bytes_per_token: u64,
    kv_slices: u64,
    total_bytes: u64,
}

impl KvGeometry {
    /// Validates and builds a geometry.
    ///
    /// Errors: [`KvError::ZeroDimension`] for a zero argument, [`KvError::Overflow`] when the
    /// total byte size does not fit in `u64`.
    pub fn new(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype_bytes: u32,
        max_tokens: u64,
    ) -> Result<Self, KvError> {
        for (field, value) in [
            ("layers", u64::from(layers)),
            ("kv_heads", u64::from(kv_heads)),
            ("head_dim", u64::from(head_dim)),
            ("dtype_bytes", u64::from(dtype_bytes)),
            ("max_tokens", max_tokens),
        ] {
            if value == 0 {
                return Err(KvError::ZeroDimension { field });
            }
        }
        let head_bytes = mul(u64::from(head_dim), u64::from(dtype_bytes), "head bytes")?;
        let per_kv = mul(
            u64::from(kv_heads),
            head_bytes,
            "bytes per token per layer per K/V",
        )?;
        let per_layer = mul(per_kv, 2, "bytes per token per layer")?;
        let bytes_per_token = mul(per_layer, u64::from(layers), "bytes per token")?;
        let kv_slices = mul(
            mul(u64::from(layers), 2, "K/V slices")?,
            u64::from(kv_heads),
            "K/V head slices",
        )?;
        let total_bytes = mul(bytes_per_token, max_tokens, "total KV bytes")?;
        Ok(Self {
            layers,
            kv_heads,
            head_dim,
            dtype_bytes,
            max_tokens,
            head_bytes,
            bytes_per_token_per_layer_per_kv: per_kv,
            bytes_per_token,
            kv_slices,
            total_bytes,
        })
    }

    /// Builds a geometry with the element size of `dtype`.
    pub fn with_dtype(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype: KvDtype,
        max_tokens: u64,
    ) -> Result<Self, KvError> {
        Self::new(layers, kv_heads, head_dim, dtype.bytes(), max_tokens)
    }

    /// The geometry of a known model (see [`PRESETS`] / [`KvGeometry::preset_names`]); the
    /// name is matched ASCII case-insensitively.
    ///
    /// Errors: [`KvError::UnknownPreset`], or those of [`KvGeometry::new`] (a zero
    /// `max_tokens`, an overflow).
    pub fn preset(name: &str, dtype: KvDtype, max_tokens: u64) -> Result<Self, KvError> {
        let preset = PRESETS
            .iter()
            .find(|p| p.name.eq_ignore_ascii_case(name))
            .ok_or_else(|| KvError::UnknownPreset {
                name: name.to_owned(),
                known: Self::preset_names().join(", "),
            })?;
        Self::with_dtype(
            preset.layers,
            preset.kv_heads,
            preset.head_dim,
            dtype,
            max_tokens,
        )
    }

    /// The names [`KvGeometry::preset`] accepts, in [`PRESETS`] order.
    pub fn preset_names() -> Vec<&'static str> {
        PRESETS.iter().map(|p| p.name).collect()
    }

    /// Transformer layers.
    pub const fn layers(&self) -> u32 {
        self.layers
    }

    /// KV heads per layer.
    pub const fn kv_heads(&self) -> u32 {
        self.kv_heads
    }

    /// Elements per head.
    pub const fn head_dim(&self) -> u32 {
        self.head_dim
    }

    /// Bytes per element.
    pub const fn dtype_bytes(&self) -> u32 {
        self.dtype_bytes
    }

    /// Capacity in tokens (the context length the cache is sized for).
    pub const fn max_tokens(&self) -> u64 {
        self.max_tokens
    }

    /// Bytes of one head's vector for one token: `head_dim x dtype_bytes`.
    pub const fn head_bytes(&self) -> u64 {
        self.head_bytes
    }

    /// Bytes of one token's K (or V) in one layer: `kv_heads x head_dim x dtype_bytes`.
    pub const fn bytes_per_token_per_layer_per_kv(&self) -> u64 {
        self.bytes_per_token_per_layer_per_kv
    }

    /// Bytes of one token's K and V in every layer: `layers x 2 x kv_heads x head_dim x dtype_bytes`.
    pub const fn bytes_per_token(&self) -> u64 {
        self.bytes_per_token
    }

    /// Number of (layer, K/V, head) combinations: `layers x 2 x kv_heads`.
    pub const fn kv_head_slices(&self) -> u64 {
        self.kv_slices
    }

    /// Bytes of the whole cache at capacity: `bytes_per_token x max_tokens` (no padding).
    pub const fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Whether `other` has the same per-token shape (layers, KV heads, head size, dtype size);
    /// `max_tokens` is not compared.
    pub const fn same_shape(&self, other: &KvGeometry) -> bool {
        self.layers == other.layers
            && self.kv_heads == other.kv_heads
            && self.head_dim == other.head_dim
            && self.dtype_bytes == other.dtype_bytes
    }

    /// The same shape with another capacity.
    pub fn with_max_tokens(&self, max_tokens: u64) -> Result<Self, KvError> {
        Self::new(
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.dtype_bytes,
            max_tokens,
        )
    }

    /// [`KvError::LayerOutOfRange`] unless `layer < layers`.
    pub fn check_layer(&self, layer: u32) -> Result<(), KvError> {
        Self::below(layer, self.layers, |layer, layers| {
            KvError::LayerOutOfRange { layer, layers }
        })
    }

    /// [`KvError::HeadOutOfRange`] unless `head < kv_heads`.
    pub fn check_head(&self, head: u32) -> Result<(), KvError> {
        Self::below(head, self.kv_heads, |head, kv_heads| {
            KvError::HeadOutOfRange { head, kv_heads }
        })
    }

    /// [`KvError::TokenOutOfRange`] unless `token < max_tokens`.
    pub fn check_token(&self, token: u64) -> Result<(), KvError> {
        Self::below(token, self.max_tokens, |token, max_tokens| {
            KvError::TokenOutOfRange { token, max_tokens }
        })
    }

    /// The bounds check of `check_layer`, `check_head` and `check_token`: `Ok` when
    /// `index < count`, else the error `out_of_range` makes of the two.
    fn below<T: PartialOrd>(
        index: T,
        count: T,
        out_of_range: impl FnOnce(T, T) -> KvError,
    ) -> Result<(), KvError> {
        if index < count {
            Ok(())
        } else {
            Err(out_of_range(index, count))
        }
    }

    /// [`KvError::TooManyTokens`] unless `tokens <= max_tokens`.
    pub fn check_token_count(&self, tokens: u64) -> Result<(), KvError> {
        if tokens <= self.max_tokens {
            Ok(())
        } else {
            Err(KvError::TooManyTokens {
                tokens,
                max_tokens: self.max_tokens,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_real_gqa_shapes() {
        let g = KvGeometry::preset("llama-3-8b", KvDtype::F16, 8192).unwrap();
        assert_eq!((g.layers(), g.kv_heads(), g.head_dim()), (32, 8, 128));
        assert_eq!(g.bytes_per_token_per_layer_per_kv(), 2048);
        assert_eq!(g.bytes_per_token(), 131_072);
        assert_eq!(g.total_bytes(), 131_072 * 8192);

        let g = KvGeometry::preset("llama-3-70b", KvDtype::Bf16, 1).unwrap();
        assert_eq!((g.layers(), g.kv_heads(), g.head_dim()), (80, 8, 128));
        assert_eq!(g.bytes_per_token(), 327_680);

        let g = KvGeometry::preset("Mistral-7B", KvDtype::Fp8, 1).unwrap();
        assert_eq!((g.layers(), g.kv_heads(), g.head_dim()), (32, 8, 128));
        assert_eq!(g.bytes_per_token(), 65_536);

        let g = KvGeometry::preset("qwen2.5-7b", KvDtype::F32, 1).unwrap();
        assert_eq!((g.layers(), g.kv_heads(), g.head_dim()), (28, 4, 128));
        assert_eq!(g.bytes_per_token(), 28 * 2 * 4 * 128 * 4);

        assert_eq!(
            KvGeometry::preset_names(),
            ["llama-3-8b", "llama-3-70b", "mistral-7b", "qwen2.5-7b"]
        );
    }

    #[test]
    fn unknown_preset_lists_the_known_ones() {
        let err = KvGeometry::preset("gpt-5", KvDtype::F16, 1).unwrap_err();
        assert!(matches!(err, KvError::UnknownPreset { .. }));
        assert!(err.to_string().contains("llama-3-8b, llama-3-70b"));
    }

    #[test]
    fn zero_dimensions_are_rejected() {
        assert_eq!(
            KvGeometry::new(0, 1, 1, 1, 1),
            Err(KvError::ZeroDimension { field: "layers" })
        );
        assert_eq!(
            KvGeometry::new(1, 0, 1, 1, 1),
            Err(KvError::ZeroDimension { field: "kv_heads" })
        );
        assert_eq!(
            KvGeometry::new(1, 1, 0, 1, 1),
            Err(KvError::ZeroDimension { field: "head_dim" })
        );
        assert_eq!(
            KvGeometry::new(1, 1, 1, 0, 1),
            Err(KvError::ZeroDimension {
                field: "dtype_bytes"
            })
        );
        assert_eq!(
            KvGeometry::new(1, 1, 1, 1, 0),
            Err(KvError::ZeroDimension {
                field: "max_tokens"
            })
        );
    }

    #[test]
    fn overflow_is_an_error_not_a_wrap() {
        assert!(matches!(
            KvGeometry::new(u32::MAX, u32::MAX, u32::MAX, 4, 1),
            Err(KvError::Overflow { .. })
        ));
        assert!(matches!(
            KvGeometry::preset("llama-3-70b", KvDtype::F32, u64::MAX / 2),
            Err(KvError::Overflow {
                what: "total KV bytes"
            })
        ));
    }

    #[test]
    fn dtype_parsing_and_sizes() {
        assert_eq!("fp16".parse::<KvDtype>().unwrap().bytes(), 2);
        assert_eq!("BF16".parse::<KvDtype>().unwrap().bytes(), 2);
        assert_eq!("fp8".parse::<KvDtype>().unwrap().bytes(), 1);
        assert_eq!("fp32".parse::<KvDtype>().unwrap().bytes(), 4);
        assert!(matches!(
            "int3".parse::<KvDtype>(),
            Err(KvError::UnknownDtype { .. })
        ));
        assert_eq!("FP8_E4M3".parse::<KvDtype>().unwrap(), KvDtype::Fp8);
        // One 8-bit format: e5m2 bytes would be read as e4m3.
        for e5m2 in ["fp8e5m2", "fp8_e5m2"] {
            assert!(matches!(
                e5m2.parse::<KvDtype>(),
                Err(KvError::UnknownDtype { .. })
            ));
        }
        for d in KvDtype::ALL {
            assert_eq!(d.as_str().parse::<KvDtype>().unwrap(), d);
        }
    }

    #[test]
    fn index_checks() {
        let g = KvGeometry::new(2, 3, 4, 2, 10).unwrap();
        assert!(g.check_layer(1).is_ok());
        assert_eq!(
            g.check_layer(2),
            Err(KvError::LayerOutOfRange {
                layer: 2,
                layers: 2
            })
        );
        assert!(g.check_head(2).is_ok());
        assert!(g.check_head(3).is_err());
        assert!(g.check_token(9).is_ok());
        assert!(g.check_token(10).is_err());
        assert!(g.check_token_count(10).is_ok());
        assert!(g.check_token_count(11).is_err());
        assert!(g.same_shape(&g.with_max_tokens(99).unwrap()));
        assert!(!g.same_shape(&KvGeometry::new(2, 3, 4, 1, 10).unwrap()));
    }
}
