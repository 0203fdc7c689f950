//! Whether a prefix of a KV cache can be shared by mapping whole granules at several virtual
//! addresses: the arithmetic, with the refusal as a value.

use kvvm_num::mul;

use crate::error::{div_ceil, KvError};
use crate::geometry::KvGeometry;
use crate::layout::{windows_per_fragment, KvLayout};

/// The verdict of [`evaluate_prefix_shareability`], with the numbers behind it.
///
/// * `fragment_bytes = prefix_len x` (contiguous bytes per token in one fragment under the
///   layout)
/// * `shareable = fragment_bytes >= granule`
/// * `shareable_granules_per_fragment = floor(fragment_bytes / granule)`
/// * `multi_map_ops = fragments x shareable_granules_per_fragment`
///
/// Sharing is possible only when at least one whole granule window lies entirely inside the
/// prefix. Because every fragment starts on a granule boundary (the padding rule of
/// [`LayoutPlan`](crate::LayoutPlan)), exactly `shareable_granules_per_fragment` windows of
/// each fragment do. The layout decides the cost (`multi_map_ops`), not the possibility.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct PrefixShareability {
    /// The layout evaluated.
    pub layout: KvLayout,
    /// The prefix length in tokens.
    pub prefix_len: u64,
    /// The mapping granule in bytes.
    pub granule: u64,
    /// Contiguous bytes one token occupies inside one fragment.
    pub fragment_bytes_per_token: u64,
    /// `fragment_bytes >= granule`.
    pub shareable: bool,
    /// Bytes of the prefix inside one fragment: `prefix_len x fragment_bytes_per_token`.
    pub fragment_bytes: u64,
    /// Number of contiguous fragments.
    pub fragments: u64,
    /// Whole granules of the prefix in one fragment: `floor(fragment_bytes / granule)`.
    pub shareable_granules_per_fragment: u64,
    /// Granule mappings a sharer makes: `fragments x shareable_granules_per_fragment`.
    pub multi_map_ops: u64,
    /// Bytes mapped shared (billed once): `multi_map_ops x granule`.
    pub shared_bytes: u64,
    /// The smallest shareable prefix under this layout and granule:
    /// `ceil(granule / fragment_bytes_per_token)` (it may exceed `max_tokens`).
    pub min_shareable_prefix: u64,
}

impl PrefixShareability {
    /// `None` when shareable; otherwise why not, in words and with the numbers.
    pub fn refusal_reason(&self) -> Option<String> {
        if self.shareable {
            return None;
        }
        Some(format!(
            "prefix not shareable: each contiguous KV fragment is smaller than one mapping \
             granule (fragment_bytes < granule), so no whole granule falls entirely inside the \
             prefix ({layout} layout: prefix_len {prefix} tokens x {per_token} B/token = \
             fragment_bytes {fb} B < granule {granule} B, across {fragments} fragments; a \
             prefix of at least {min} tokens is needed)",
            layout = self.layout,
            prefix = self.prefix_len,
            per_token = self.fragment_bytes_per_token,
            fb = self.fragment_bytes,
            granule = self.granule,
            fragments = self.fragments,
            min = self.min_shareable_prefix,
        ))
    }
}

/// Decides whether the first `prefix_len` tokens of a cache with `geometry` laid out as
/// `layout` can be shared by mapping whole `granule`-sized windows (see
/// [`PrefixShareability`]). "Not shareable" is a value with a reason
/// ([`PrefixShareability::refusal_reason`]), not an error.
///
/// Errors: [`KvError::ZeroGranule`]; [`KvError::TooManyTokens`] when
/// `prefix_len > max_tokens`; [`KvError::Overflow`].
pub fn evaluate_prefix_shareability(
    geometry: &KvGeometry,
    layout: KvLayout,
    prefix_len: u64,
    granule: u64,
) -> Result<PrefixShareability, KvError> {
    check_tokens_and_granule(geometry, prefix_len, granule)?;
    let per_token = layout.fragment_bytes_per_token(geometry);
    let fragments = layout.fragment_count(geometry);
    let fragment_bytes = mul(prefix_len, per_token, "fragment bytes")?;
    let granules = fragment_bytes / granule;
    let multi_map_ops = mul(fragments, granules, "multi-map ops")?;
    Ok(PrefixShareability {
        layout,
        prefix_len,
        granule,
        fragment_bytes_per_token: per_token,
        shareable: fragment_bytes >= granule,
        fragment_bytes,
        fragments,
        shareable_granules_per_fragment: granules,
        multi_map_ops,
        shared_bytes: mul(multi_map_ops, granule, "shared bytes")?,
        min_shareable_prefix: div_ceil(granule, per_token)?,
    })
}

/// The commit lower bound for `n_tokens` live tokens: `granule x` (windows holding at least
/// one live byte), with slices padded to the granule as in [`LayoutPlan`](crate::LayoutPlan)
/// (equal to [`LayoutPlan::committed_bytes_for_tokens`](crate::LayoutPlan::committed_bytes_for_tokens)).
///
/// Errors: [`KvError::ZeroGranule`]; [`KvError::TooManyTokens`]; [`KvError::Overflow`].
pub fn commit_lower_bound(
    geometry: &KvGeometry,
    layout: KvLayout,
    n_tokens: u64,
    granule: u64,
) -> Result<u64, KvError> {
    check_tokens_and_granule(geometry, n_tokens, granule)?;
    let per_fragment =
        windows_per_fragment(layout.fragment_bytes_per_token(geometry), n_tokens, granule)?;
    let windows = mul(
        layout.fragment_count(geometry),
        per_fragment,
        "window count",
    )?;
    Ok(mul(granule, windows, "committed bytes")?)
}

/// The arguments' checks shared by [`evaluate_prefix_shareability`] and [`commit_lower_bound`]:
/// [`KvError::ZeroGranule`] for a zero `granule`, then [`KvError::TooManyTokens`] unless
/// `tokens <= max_tokens`.
fn check_tokens_and_granule(
    geometry: &KvGeometry,
    tokens: u64,
    granule: u64,
) -> Result<(), KvError> {
    if granule == 0 {
        return Err(KvError::ZeroGranule);
    }
    geometry.check_token_count(tokens)
}

/// The smallest `prefix_len` that is shareable under `layout` and `granule`:
/// `ceil(granule / fragment_bytes_per_token)`, or `None` when that exceeds the geometry's
/// `max_tokens` (no prefix of this cache can be shared).
///
/// Errors: [`KvError::ZeroGranule`].
pub fn min_shareable_prefix(
    geometry: &KvGeometry,
    layout: KvLayout,
    granule: u64,
) -> Result<Option<u64>, KvError> {
    if granule == 0 {
        return Err(KvError::ZeroGranule);
    }
    let min = div_ceil(granule, layout.fragment_bytes_per_token(geometry))?;
    Ok((min <= geometry.max_tokens()).then_some(min))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::KvDtype;
    use crate::LayoutPlan;

    const MIB: u64 = 1 << 20;
    const KIB: u64 = 1 << 10;
    const CTX: u64 = 131_072;

    /// A row of the worked table of `docs/kv-layouts.md`: (preset, dtype, granule, layout,
    /// fragment bytes per token, fragments, minimum shareable prefix, multi-map ops at that
    /// prefix, commit lower bound of one live token in KiB).
    type Row = (
        &'static str,
        KvDtype,
        u64,
        KvLayout,
        u64,
        u64,
        u64,
        u64,
        u64,
    );

    #[rustfmt::skip]
    const TABLE: &[Row] = &[
        ("llama-3-8b",  KvDtype::F16, 2 * MIB,  KvLayout::HeadMajor,  256,     512,   8192,   512,   1048576),
        ("llama-3-8b",  KvDtype::F16, 2 * MIB,  KvLayout::SeqMajor,   2048,    64,    1024,   64,    131072),
        ("llama-3-8b",  KvDtype::F16, 2 * MIB,  KvLayout::TokenMajor, 131072,  1,     16,     1,     2048),
        ("llama-3-8b",  KvDtype::F16, 64 * KIB, KvLayout::HeadMajor,  256,     512,   256,    512,   32768),
        ("llama-3-8b",  KvDtype::F16, 64 * KIB, KvLayout::SeqMajor,   2048,    64,    32,     64,    4096),
        ("llama-3-8b",  KvDtype::F16, 64 * KIB, KvLayout::TokenMajor, 131072,  1,     1,      2,     128),
        ("llama-3-8b",  KvDtype::Fp8, 2 * MIB,  KvLayout::HeadMajor,  128,     512,   16384,  512,   1048576),
        ("llama-3-8b",  KvDtype::Fp8, 2 * MIB,  KvLayout::SeqMajor,   1024,    64,    2048,   64,    131072),
        ("llama-3-8b",  KvDtype::Fp8, 2 * MIB,  KvLayout::TokenMajor, 65536,   1,     32,     1,     2048),
        ("llama-3-70b", KvDtype::F16, 2 * MIB,  KvLayout::HeadMajor,  256,     1280,  8192,   1280,  2621440),
        ("llama-3-70b", KvDtype::F16, 2 * MIB,  KvLayout::SeqMajor,   2048,    160,   1024,   160,   327680),
        ("llama-3-70b", KvDtype::F16, 2 * MIB,  KvLayout::TokenMajor, 327680,  1,     7,      1,     2048),
        ("llama-3-70b", KvDtype::F16, 64 * KIB, KvLayout::HeadMajor,  256,     1280,  256,    1280,  81920),
        ("llama-3-70b", KvDtype::F16, 64 * KIB, KvLayout::SeqMajor,   2048,    160,   32,     160,   10240),
        ("llama-3-70b", KvDtype::F16, 64 * KIB, KvLayout::TokenMajor, 327680,  1,     1,      5,     320),
        ("mistral-7b",  KvDtype::F16, 2 * MIB,  KvLayout::HeadMajor,  256,     512,   8192,   512,   1048576),
        ("mistral-7b",  KvDtype::F16, 2 * MIB,  KvLayout::SeqMajor,   2048,    64,    1024,   64,    131072),
        ("mistral-7b",  KvDtype::F16, 2 * MIB,  KvLayout::TokenMajor, 131072,  1,     16,     1,     2048),
        ("mistral-7b",  KvDtype::F16, 64 * KIB, KvLayout::HeadMajor,  256,     512,   256,    512,   32768),
        ("mistral-7b",  KvDtype::F16, 64 * KIB, KvLayout::SeqMajor,   2048,    64,    32,     64,    4096),
        ("mistral-7b",  KvDtype::F16, 64 * KIB, KvLayout::TokenMajor, 131072,  1,     1,      2,     128),
        ("qwen2.5-7b",  KvDtype::F16, 2 * MIB,  KvLayout::HeadMajor,  256,     224,   8192,   224,   458752),
        ("qwen2.5-7b",  KvDtype::F16, 2 * MIB,  KvLayout::SeqMajor,   1024,    56,    2048,   56,    114688),
        ("qwen2.5-7b",  KvDtype::F16, 2 * MIB,  KvLayout::TokenMajor, 57344,   1,     37,     1,     2048),
        ("qwen2.5-7b",  KvDtype::F16, 64 * KIB, KvLayout::HeadMajor,  256,     224,   256,    224,   14336),
        ("qwen2.5-7b",  KvDtype::F16, 64 * KIB, KvLayout::SeqMajor,   1024,    56,    64,     56,    3584),
        ("qwen2.5-7b",  KvDtype::F16, 64 * KIB, KvLayout::TokenMajor, 57344,   1,     2,      1,     64),
    ];

    #[test]
    fn worked_table_of_docs_kv_layouts_md() {
        for &(name, dtype, granule, layout, per_token, fragments, min, ops, commit_kib) in TABLE {
            let g = KvGeometry::preset(name, dtype, CTX).unwrap();
            let ctx = format!("{name} {dtype} {granule} {layout}");
            assert_eq!(layout.fragment_bytes_per_token(&g), per_token, "{ctx}");
            assert_eq!(layout.fragment_count(&g), fragments, "{ctx}");
            assert_eq!(
                min_shareable_prefix(&g, layout, granule).unwrap(),
                Some(min),
                "{ctx}"
            );
            // min is shareable, min - 1 is not.
            let at = evaluate_prefix_shareability(&g, layout, min, granule).unwrap();
            assert!(at.shareable, "{ctx}");
            let granules = min * per_token / granule;
            assert!(granules >= 1, "{ctx}");
            assert_eq!(at.shareable_granules_per_fragment, granules, "{ctx}");
            assert_eq!(at.multi_map_ops, fragments * granules, "{ctx}");
            assert_eq!(at.multi_map_ops, ops, "{ctx}");
            assert_eq!(
                commit_lower_bound(&g, layout, 1, granule).unwrap(),
                commit_kib * KIB,
                "{ctx}"
            );
            assert!(at.refusal_reason().is_none());
            let below = evaluate_prefix_shareability(&g, layout, min - 1, granule).unwrap();
            assert!(!below.shareable, "{ctx}");
            assert_eq!(below.multi_map_ops, 0);
            assert!(below.refusal_reason().is_some());
        }
    }

    #[test]
    fn the_three_headline_numbers() {
        let g = KvGeometry::preset("llama-3-8b", KvDtype::F16, CTX).unwrap();
        let min = |l| min_shareable_prefix(&g, l, 2 * MIB).unwrap();
        assert_eq!(min(KvLayout::HeadMajor), Some(8192));
        assert_eq!(min(KvLayout::SeqMajor), Some(1024));
        assert_eq!(min(KvLayout::TokenMajor), Some(16));
    }

    #[test]
    fn a_4096_token_prefix_of_llama_3_8b() {
        let g = KvGeometry::preset("llama-3-8b", KvDtype::F16, CTX).unwrap();
        let hm = evaluate_prefix_shareability(&g, KvLayout::HeadMajor, 4096, 2 * MIB).unwrap();
        assert!(!hm.shareable);
        assert_eq!(hm.fragment_bytes, MIB);
        assert_eq!(hm.fragments, 512);
        assert_eq!(hm.shareable_granules_per_fragment, 0);
        let reason = hm.refusal_reason().unwrap();
        assert!(reason.starts_with(
            "prefix not shareable: each contiguous KV fragment is smaller than one mapping \
             granule (fragment_bytes < granule), so no whole granule falls entirely inside the \
             prefix"
        ));
        assert!(
            reason.contains("fragment_bytes 1048576 B < granule 2097152 B"),
            "{reason}"
        );
        assert!(reason.contains("at least 8192 tokens"), "{reason}");

        let sm = evaluate_prefix_shareability(&g, KvLayout::SeqMajor, 4096, 2 * MIB).unwrap();
        assert!(sm.shareable);
        assert_eq!(sm.fragment_bytes, 8 * MIB);
        assert_eq!(
            (sm.shareable_granules_per_fragment, sm.multi_map_ops),
            (4, 256)
        );
        assert_eq!(sm.shared_bytes, 512 * MIB);

        let tm = evaluate_prefix_shareability(&g, KvLayout::TokenMajor, 4096, 2 * MIB).unwrap();
        assert_eq!(tm.fragment_bytes, 512 * MIB);
        assert_eq!(
            (tm.shareable_granules_per_fragment, tm.multi_map_ops),
            (256, 256)
        );

        // a prefix that does not end on a window boundary: floor.
        let tm = evaluate_prefix_shareability(&g, KvLayout::TokenMajor, 17, 2 * MIB).unwrap();
        assert_eq!(
            (tm.shareable_granules_per_fragment, tm.multi_map_ops),
            (1, 1)
        );
    }

    #[test]
    fn shared_windows_lie_inside_the_prefix_of_the_plan() {
        // Every shareable window, located with the plan, holds prefix bytes only.
        let g = KvGeometry::new(2, 3, 4, 2, 40).unwrap();
        for layout in KvLayout::ALL {
            for granule in [8, 16, 48, 64, 128] {
                let plan = LayoutPlan::new(g, layout, granule).unwrap();
                for prefix in 0..=40 {
                    let s = evaluate_prefix_shareability(&g, layout, prefix, granule).unwrap();
                    let frags = plan.fragments().unwrap();
                    assert_eq!(s.fragments, frags.len() as u64);
                    for f in &frags {
                        let live = f.live_bytes(prefix).unwrap();
                        let whole = (live.end - live.start) / granule;
                        assert_eq!(whole, s.shareable_granules_per_fragment);
                        // the window after the shared ones is not entirely prefix.
                        let next_end = f.offset + (whole + 1) * granule;
                        assert!(next_end > live.end);
                    }
                    assert_eq!(
                        commit_lower_bound(&g, layout, prefix, granule).unwrap(),
                        plan.committed_bytes_for_tokens(prefix).unwrap()
                    );
                }
            }
        }
    }

    #[test]
    fn errors_and_unreachable_minimums() {
        let g = KvGeometry::preset("llama-3-8b", KvDtype::F16, 4096).unwrap();
        assert_eq!(
            min_shareable_prefix(&g, KvLayout::HeadMajor, 2 * MIB).unwrap(),
            None
        );
        assert_eq!(
            evaluate_prefix_shareability(&g, KvLayout::HeadMajor, 1, 0),
            Err(KvError::ZeroGranule)
        );
        assert_eq!(
            evaluate_prefix_shareability(&g, KvLayout::HeadMajor, 4097, 2 * MIB),
            Err(KvError::TooManyTokens {
                tokens: 4097,
                max_tokens: 4096
            })
        );
        assert_eq!(
            commit_lower_bound(&g, KvLayout::SeqMajor, 1, 0),
            Err(KvError::ZeroGranule)
        );
        assert_eq!(
            min_shareable_prefix(&g, KvLayout::SeqMajor, 0),
            Err(KvError::ZeroGranule)
        );
        let empty = evaluate_prefix_shareability(&g, KvLayout::TokenMajor, 0, 2 * MIB).unwrap();
        assert!(!empty.shareable);
        assert!(empty.refusal_reason().is_some());
    }
}
