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
            // A prompt of 2.5 windows of every fragment, so the prefix has a tail, and not a
            // whole number of the cache's blocks, so the sharers compute a rest of their own.
            let plan_g = KvGeometry::with_dtype(2, 2, 32, KvDtype::F16, 1 << 20).unwrap();
            let plan = LayoutPlan::new(plan_g, layout, g).unwrap();
            let b = plan.fragment_bytes_per_token();
            let prompt = g / b * 5 / 2 + 3;
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
                    // Whole blocks of the prompt hit; the windows before the hit's end are
                    // mapped read-only, the rest of it copied.
                    assert_eq!(r.hit_tokens, prompt / r.block_tokens * r.block_tokens);
                    let readonly = r.hit_tokens * b / g;
                    let fragments = plan.fragments().unwrap().len();
                    assert!(r.prompt_shareable, "{layout} g={g}");
                    // Both attach figures come from real samples, in their report rows.
                    assert!(r.attach_min > std::time::Duration::ZERO);
                    assert!(r.attach_after_copy_min > std::time::Duration::ZERO);
                    assert!(r.attach_median >= r.attach_min);
                    // The owner's prefix is one handle per fragment run, mapped whole, and
                    // the window each fragment's tail is copied into.
                    let tail = usize::from(!(prompt * b).is_multiple_of(g));
                    assert_eq!(r.attach_mappings, fragments * (1 + tail), "{layout} g={g}");
                    // A hit maps the cache's handles of one window each, then commits the
                    // private rest.
                    assert!(
                        r.admit_hit_mappings as u64 >= readonly * fragments as u64,
                        "{layout} g={g}"
                    );
                    assert!(md_mappings(&r), "{layout} g={g}");
                    let md = r.to_markdown();
                    assert!(md.contains("back to back, median / min"), "{md}");
                    assert!(
                        md.contains("attach right after a copy of the prompt"),
                        "{md}"
                    );
                    assert_eq!(r.cache.hits, 5);
                    assert_eq!(r.cache.misses, 1);
                    // Shared: the prefix's read-only windows once instead of six times; its
                    // tail is held once more (each sequence copies it into its own windows).
                    assert_eq!(
                        r.committed_bytes_with_sharing + 5 * r.shared_prefix_bytes,
                        r.committed_bytes_without_sharing + r.prefix_tail_bytes,
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

/// Head-major with a prompt shorter than a window: nothing is mapped read-only, the report
/// says why, the hit is copied from the cache, every byte is still verified.
#[test]
fn a_prompt_shorter_than_a_window_is_shared_by_copy_with_the_reason() {
    let g = 4096;
    let s = sim(g);
    // head-major: 64 B per token per fragment, a window is 64 tokens.
    let r = run_decode_loop(s.clone(), &config(KvLayout::HeadMajor, 40, true)).unwrap();
    assert!(r.verified);
    assert!(!r.prompt_shareable);
    assert!(r
        .prompt_refusal
        .as_deref()
        .is_some_and(|x| x.contains("prefix not shareable")));
    // Two blocks of 16 tokens hit, copied: the prompt's whole blocks are held once more, in
    // the prefix's tail.
    assert_eq!(r.hit_tokens, 32);
    assert_eq!(r.shared_prefix_bytes, 0);
    assert_eq!(
        r.committed_bytes_with_sharing,
        r.committed_bytes_without_sharing + r.prefix_tail_bytes
    );
    let md = r.to_markdown();
    assert!(
        md.contains("| prompt shared | by copy only: 32 tokens per sharer copied from the prefix cache; prefix not shareable"),
        "{md}"
    );
    assert!(md.contains("simulated timings"), "{md}");
    assert!(!md.contains("| prompt shared | yes"), "{md}");
    drop(r);
    assert!(s.ledger().is_empty());
}
