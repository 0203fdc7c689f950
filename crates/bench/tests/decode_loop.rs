//! The synthetic decode loop on the simulator: every byte verified at two granularities and
//! all three layouts, with and without sharing; the sim ledger empty at the end.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kvvm::kv::{KvDtype, KvGeometry, KvLayout, LayoutPlan};
use kvvm::sim::{LatencyMode, LatencyModel, SimBackend, SimConfig};
use kvvm::vmm::GranularityChoice;
use kvvm_bench::decode::{run_decode_loop, DecodeLoopConfig};

fn sim(g: u64) -> Arc<SimBackend> {
    Arc::new(SimBackend::new(
        SimConfig::single(g, 1 << 34).with_latency(LatencyModel::zero(), LatencyMode::Account),
    ))
}

fn config(layout: KvLayout, prompt: u64, share: bool) -> DecodeLoopConfig {
    let mut c = DecodeLoopConfig::reference().unwrap();
    // 2 layers, 2 KV heads, head_dim 32, fp16: 512 B per token.
    c.geometry = KvGeometry::with_dtype(2, 2, 32, KvDtype::F16, 1).unwrap();
    c.model = "tiny".to_owned();
    c.layout = layout;
    c.granularity = GranularityChoice::Minimum;
    c.sequences = 6;
    c.prompt_tokens = prompt;
    c.decode_tokens = 37;
    c.step_tokens = 5;
    c.share_prefix = share;
    c.attach_copy_samples = 2;
    c.attach_samples = 3;
    c
}

/// Whether the Markdown report names the attach's mappings.
fn md_mappings(r: &kvvm_bench::decode::DecodeLoopReport) -> bool {
    r.to_markdown()
        .contains(&format!("({} mappings)", r.attach_mappings))
}

#[test]
fn every_byte_verified_at_two_granularities_and_three_layouts() {
    for g in [4096u64, 64 << 10] {
        for layout in KvLayout::ALL {
            // A prompt of 2.5 prefix-cache blocks, so the tail is private to each sharer.
            let plan_g = KvGeometry::with_dtype(2, 2, 32, KvDtype::F16, 1 << 20).unwrap();
            let plan = LayoutPlan::new(plan_g, layout, g).unwrap();
            let block = kvvm::kv::PrefixCache::block_tokens_for(&plan).unwrap();
            let prompt = block * 5 / 2;
            for share in [true, false] {
                let s = sim(g);
                let r = run_decode_loop(s.clone(), &config(layout, prompt, share)).unwrap();
                assert!(r.verified);
                let total = prompt + 37;
                assert_eq!(r.bytes_verified, 6 * total * 512, "{layout} g={g}");
                assert_eq!(r.used_bytes_at_end, 0);
                assert_eq!(
                    r.committed_bytes_without_sharing,
                    6 * plan.with_max_tokens_committed(total)
                );
                if share {
                    assert_eq!(r.hit_tokens, 2 * block, "{layout} g={g}");
                    if r.prompt_shareable {
                        // Both attach figures come from real samples, in their report rows.
                        assert!(r.attach_min > std::time::Duration::ZERO);
                        assert!(r.attach_after_copy_min > std::time::Duration::ZERO);
                        assert!(r.attach_median >= r.attach_min);
                        // The owner's prefix is one handle per fragment run, mapped whole.
                        let fragments = plan.fragments().unwrap().len();
                        assert_eq!(r.attach_mappings, fragments, "{layout} g={g}");
                        // A hit maps the cache's handles of one block each (2 blocks per
                        // fragment), then commits the private rest.
                        assert!(r.admit_hit_mappings >= 2 * fragments, "{layout} g={g}");
                        assert!(md_mappings(&r), "{layout} g={g}");
                        let md = r.to_markdown();
                        assert!(md.contains("back to back, median / min"), "{md}");
                        assert!(
                            md.contains("attach right after a copy of the prompt"),
                            "{md}"
                        );
                    }
                    assert_eq!(r.cache.hits, 5);
                    assert_eq!(r.cache.misses, 1);
                    // Shared: the prefix's 2 blocks once, every sequence's private rest.
                    assert_eq!(
                        r.committed_bytes_with_sharing + 5 * r.shared_prefix_bytes,
                        r.committed_bytes_without_sharing,
                        "{layout} g={g}"
                    );
                } else {
                    assert_eq!(
                        r.committed_bytes_with_sharing,
                        r.committed_bytes_without_sharing
                    );
                }
                drop(r);
                assert!(s.ledger().is_empty(), "{layout} g={g} share={share}");
            }
        }
    }
}

/// Helper trait: the commit lower bound of a plan re-instantiated at `total` tokens, which is
/// what the loop lays out.
trait Committed {
    fn with_max_tokens_committed(&self, total: u64) -> u64;
}

impl Committed for LayoutPlan {
    fn with_max_tokens_committed(&self, total: u64) -> u64 {
        let g = self.geometry().with_max_tokens(total).unwrap();
        LayoutPlan::new(g, self.layout(), self.granule())
            .unwrap()
            .committed_bytes_for_tokens(total)
            .unwrap()
    }
}

/// Head-major with a prompt shorter than a block: nothing is shared, the report says why,
/// every byte is still verified.
#[test]
fn unshareable_prompt_is_reported_with_the_reason() {
    let g = 4096;
    let s = sim(g);
    // head-major: 64 B per token per fragment, a block is 64 tokens.
    let r = run_decode_loop(s.clone(), &config(KvLayout::HeadMajor, 40, true)).unwrap();
    assert!(r.verified);
    assert!(!r.prompt_shareable);
    assert!(r
        .prompt_refusal
        .as_deref()
        .is_some_and(|x| x.contains("prefix not shareable")));
    assert_eq!(r.hit_tokens, 0);
    assert_eq!(
        r.committed_bytes_with_sharing,
        r.committed_bytes_without_sharing
    );
    let md = r.to_markdown();
    assert!(
        md.contains("| prompt shared | no: the prompt is not shareable here: prefix not shareable"),
        "{md}"
    );
    assert!(md.contains("simulated timings"), "{md}");
    assert!(!md.contains("| prompt shared | yes"), "{md}");
    drop(r);
    assert!(s.ledger().is_empty());
}
