//! `kvvm plan`: the shareability verdict and commit lower bound for a model and layout.

use std::process::ExitCode;

use clap::Args;
use kvvm_layout::{
    commit_lower_bound, evaluate_prefix_shareability, KvDtype, KvGeometry, KvLayout, LayoutPlan,
};
use serde_json::json;

/// Arguments of `kvvm plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Model preset (llama-3-8b, llama-3-70b, mistral-7b, qwen2.5-7b).
    #[arg(long)]
    model: String,
    /// KV layout: head-major, seq-major or token-major.
    #[arg(long, default_value = "seq-major")]
    layout: String,
    /// Prefix length in tokens to evaluate for sharing.
    #[arg(long, default_value_t = 0)]
    prefix: u64,
    /// Mapping granule in bytes (default: the H200's 2 MiB; query yours with `kvvm info`).
    #[arg(long, default_value_t = 2 << 20)]
    granule: u64,
    /// Element type: fp16, bf16, fp8 or fp32.
    #[arg(long, default_value = "fp16")]
    dtype: String,
    /// Maximum context in tokens (the reservation size).
    #[arg(long, default_value_t = 32_768)]
    max_tokens: u64,
    /// Live tokens for the commit lower bound (default: the prefix, or 1).
    #[arg(long)]
    tokens: Option<u64>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn mib(b: u64) -> String {
    format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
}

/// Prints the plan.
pub fn run(args: &PlanArgs) -> Result<ExitCode, String> {
    let dtype: KvDtype = args.dtype.parse().map_err(|e| format!("{e}"))?;
    let layout: KvLayout = args.layout.parse().map_err(|e| format!("{e}"))?;
    let max_tokens = args
        .max_tokens
        .max(args.prefix)
        .max(args.tokens.unwrap_or(0));
    let geometry =
        KvGeometry::preset(&args.model, dtype, max_tokens).map_err(|e| format!("{e}"))?;
    let verdict = evaluate_prefix_shareability(&geometry, layout, args.prefix, args.granule)
        .map_err(|e| format!("{e}"))?;
    let tokens = args.tokens.unwrap_or(args.prefix.max(1));
    let lower_bound =
        commit_lower_bound(&geometry, layout, tokens, args.granule).map_err(|e| format!("{e}"))?;
    let plan = LayoutPlan::new(geometry, layout, args.granule).map_err(|e| format!("{e}"))?;
    let reservation = plan.reservation_bytes();
    let live = geometry
        .bytes_per_token()
        .checked_mul(tokens)
        .ok_or("live bytes overflow")?;
    if args.json {
        let v = json!({
            "model": args.model,
            "dtype": args.dtype,
            "layout": layout.as_str(),
            "granule": args.granule,
            "prefix_len": args.prefix,
            "shareable": verdict.shareable,
            "refusal_reason": verdict.refusal_reason(),
            "fragment_bytes": verdict.fragment_bytes,
            "fragment_bytes_per_token": verdict.fragment_bytes_per_token,
            "fragments": verdict.fragments,
            "shareable_granules_per_fragment": verdict.shareable_granules_per_fragment,
            "multi_map_ops": verdict.multi_map_ops,
            "shared_bytes": verdict.shared_bytes,
            "min_shareable_prefix": verdict.min_shareable_prefix,
            "tokens": tokens,
            "live_bytes": live,
            "commit_lower_bound_bytes": lower_bound,
            "reservation_bytes": reservation,
        });
        println!("{v}");
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{} ({}), {} layout, granule {}, max {} tokens",
        args.model,
        args.dtype,
        layout,
        mib(args.granule),
        max_tokens
    );
    println!(
        "  fragments: {} of {} B per token",
        verdict.fragments, verdict.fragment_bytes_per_token
    );
    match verdict.refusal_reason() {
        None => println!(
            "  prefix of {} tokens: SHAREABLE: {} whole granules per fragment, {} multi-map operations, {} shared (billed once)",
            args.prefix,
            verdict.shareable_granules_per_fragment,
            verdict.multi_map_ops,
            mib(verdict.shared_bytes)
        ),
        Some(reason) => println!("  prefix of {} tokens: {reason}", args.prefix),
    }
    println!(
        "  smallest shareable prefix: {} tokens",
        verdict.min_shareable_prefix
    );
    println!(
        "  {} live tokens ({}): commit lower bound {} (granule x windows holding live bytes)",
        tokens,
        mib(live),
        mib(lower_bound)
    );
    println!("  reservation (virtual, padded): {}", mib(reservation));
    Ok(ExitCode::SUCCESS)
}
