//! `kvvm plan`: the shareability verdict and commit lower bound for a model and layout, in
//! bytes and in the handles (one mapping each) the manager commits them as.

use std::ops::Range;
use std::process::ExitCode;

use clap::Args;
use kvvm::layout::{
    commit_lower_bound, evaluate_prefix_shareability, KvDtype, KvGeometry, KvLayout, LayoutPlan,
    PrefixShareability,
};
use kvvm::num::format_size;
use kvvm::vmm::{
    commit_pieces, max_handle_windows, shared_commit_pieces, DEFAULT_MAX_HANDLE_BYTES,
};
use serde_json::json;

use crate::error::{failed, CliError, CliResult};
use crate::flags::{self, MAX_CONTEXT_TOKENS};
use crate::output::{self, Out};

/// Arguments of `kvvm plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Model preset (llama-3-8b, llama-3-70b, mistral-7b, qwen2.5-7b).
    #[arg(long)]
    model: String,
    /// KV layout: head-major, seq-major or token-major.
    #[arg(long, default_value = "seq-major")]
    layout: String,
    /// Prefix length in tokens to evaluate for sharing (at most --max-tokens).
    #[arg(long, default_value_t = 0, value_parser = flags::int_in::<u64>(0, MAX_CONTEXT_TOKENS))]
    prefix: u64,
    /// Mapping granule: a power of two from 4KiB to 1GiB (default: the H200's 2MiB; query
    /// yours with `kvvm info`).
    #[arg(long, default_value = "2MiB", value_parser = flags::granule)]
    granule: u64,
    /// Largest handle the manager creates (`VmmConfig::max_handle_bytes`; default 512MiB; the
    /// granule gives one handle per granule).
    #[arg(long, value_parser = flags::size_in(1, u64::MAX))]
    max_handle: Option<u64>,
    /// Element type: fp16, bf16, fp8 or fp32.
    #[arg(long, default_value = "fp16")]
    dtype: String,
    /// Maximum context in tokens (the reservation size).
    #[arg(long, default_value_t = 32_768, value_parser = flags::int_in::<u64>(1, MAX_CONTEXT_TOKENS))]
    max_tokens: u64,
    /// Live tokens for the commit lower bound, at most --max-tokens (default: the prefix, or 1).
    #[arg(long, value_parser = flags::int_in::<u64>(1, MAX_CONTEXT_TOKENS))]
    tokens: Option<u64>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// `--prefix` and `--tokens` must fit in `--max-tokens`: nothing is raised behind the
/// user's back.
fn check_lengths(args: &PlanArgs) -> CliResult<()> {
    if args.prefix > args.max_tokens {
        return Err(CliError::Failed(format!(
            "--prefix {} exceeds --max-tokens {}: allowed 0..={} (raise --max-tokens to plan a longer prefix)",
            args.prefix, args.max_tokens, args.max_tokens
        )));
    }
    if let Some(t) = args.tokens.filter(|t| *t > args.max_tokens) {
        return Err(CliError::Failed(format!(
            "--tokens {t} exceeds --max-tokens {}: allowed 1..={}",
            args.max_tokens, args.max_tokens
        )));
    }
    Ok(())
}

/// How a commit cuts window ranges into handles (`commit_pieces`, `shared_commit_pieces`).
type Cut = fn(&[Range<u64>], u64) -> Vec<(u64, u64)>;

/// Handles (one mapping each) of one commit of the windows `ranges` cut by `cut`, and the
/// windows.
fn handles(ranges: &[Range<u64>], max_windows: u64, cut: Cut) -> (u64, u64) {
    let windows = ranges.iter().map(|r| r.end - r.start).sum();
    (cut(ranges, max_windows).len() as u64, windows)
}

/// `n` followed by `word`, plural when `n != 1`.
fn count(n: u64, word: &str) -> String {
    format!("{n} {word}{}", if n == 1 { "" } else { "s" })
}

/// Prints the plan.
pub fn run(args: &PlanArgs, out: Out<'_>) -> CliResult<ExitCode> {
    let f = figures(args)?;
    if args.json {
        print_json(out, args, &f)?;
    } else {
        print_text(out, args, &f)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// What the plan says for a model and layout.
struct Figures {
    layout: KvLayout,
    geometry: KvGeometry,
    verdict: PrefixShareability,
    /// The live tokens of the commit lower bound.
    tokens: u64,
    /// Their bytes.
    live: u64,
    lower_bound: u64,
    reservation: u64,
    max_handle: u64,
    max_windows: u64,
    /// Handles and windows of one commit of the live tokens.
    live_handles: u64,
    live_windows: u64,
    /// Handles and windows of the shared prefix (none when it is not shareable).
    shared_handles: u64,
    shared_windows: u64,
}

/// Works out the plan of `args`: the verdict on the prefix, the commit lower bound of the
/// live tokens, and the handles both are committed as.
fn figures(args: &PlanArgs) -> CliResult<Figures> {
    let dtype: KvDtype = args.dtype.parse().map_err(failed)?;
    let layout: KvLayout = args.layout.parse().map_err(failed)?;
    check_lengths(args)?;
    let geometry = KvGeometry::preset(&args.model, dtype, args.max_tokens).map_err(failed)?;
    let verdict = evaluate_prefix_shareability(&geometry, layout, args.prefix, args.granule)
        .map_err(failed)?;
    let tokens = args.tokens.unwrap_or(args.prefix.max(1));
    let lower_bound =
        commit_lower_bound(&geometry, layout, tokens, args.granule).map_err(failed)?;
    let plan = LayoutPlan::new(geometry, layout, args.granule).map_err(failed)?;
    let max_handle = args.max_handle.unwrap_or(DEFAULT_MAX_HANDLE_BYTES);
    let max_windows = max_handle_windows(max_handle, args.granule);
    let live_ranges = plan.windows_for_tokens(tokens).map_err(failed)?;
    let (live_handles, live_windows) = handles(&live_ranges, max_windows, commit_pieces);
    // The shared windows: the first whole windows of every fragment.
    let k = verdict.shareable_granules_per_fragment;
    let shared_ranges: Vec<Range<u64>> = if verdict.shareable {
        plan.windows_for_tokens(args.prefix)
            .map_err(failed)?
            .into_iter()
            .map(|r| r.start..r.start.saturating_add(k))
            .collect()
    } else {
        Vec::new()
    };
    // A shared prefix is one handle per fragment run.
    let (shared_handles, shared_windows) =
        handles(&shared_ranges, max_windows, shared_commit_pieces);
    let live = geometry
        .bytes_per_token()
        .checked_mul(tokens)
        .ok_or_else(|| CliError::Failed("live bytes overflow".into()))?;
    Ok(Figures {
        layout,
        geometry,
        verdict,
        tokens,
        live,
        lower_bound,
        reservation: plan.reservation_bytes(),
        max_handle,
        max_windows,
        live_handles,
        live_windows,
        shared_handles,
        shared_windows,
    })
}

/// The plan as one JSON line.
fn print_json(out: Out<'_>, args: &PlanArgs, f: &Figures) -> CliResult<()> {
    let verdict = &f.verdict;
    let v = json!({
        "model": args.model,
        "dtype": args.dtype,
        "layout": f.layout.as_str(),
        "granule": args.granule,
        "max_tokens": args.max_tokens,
        "bytes_per_token": f.geometry.bytes_per_token(),
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
        "tokens": f.tokens,
        "live_bytes": f.live,
        "commit_lower_bound_bytes": f.lower_bound,
        "commit_lower_bound_windows": f.live_windows,
        "max_handle_bytes": f.max_handle,
        "commit_handles": f.live_handles,
        "commit_mappings": f.live_handles,
        "shared_prefix_windows": f.shared_windows,
        "shared_prefix_handles": f.shared_handles,
        "reservation_bytes": f.reservation,
    });
    output::json_line(out, &v)?;
    Ok(())
}

/// The plan as text: the model, the prefix's verdict, the commit lower bound and the
/// handles, the reservation.
fn print_text(out: Out<'_>, args: &PlanArgs, f: &Figures) -> CliResult<()> {
    let verdict = &f.verdict;
    writeln!(
        out,
        "{} ({}, {} per token), {} layout, granule {}, max {} tokens",
        args.model,
        args.dtype,
        format_size(f.geometry.bytes_per_token()),
        f.layout,
        format_size(args.granule),
        args.max_tokens
    )?;
    writeln!(
        out,
        "  fragments: {} of {} B per token",
        verdict.fragments, verdict.fragment_bytes_per_token
    )?;
    match verdict.refusal_reason() {
        None => writeln!(
            out,
            "  prefix of {} tokens: SHAREABLE: {} whole granules per fragment, {} multi-map operations, {} shared (billed once), as few as {}: a sharer's attach is {} ({} with one handle per granule)",
            args.prefix,
            verdict.shareable_granules_per_fragment,
            verdict.multi_map_ops,
            format_size(verdict.shared_bytes),
            count(f.shared_handles, "handle"),
            count(f.shared_handles, "mapping"),
            f.shared_windows
        )?,
        Some(reason) => writeln!(out, "  prefix of {} tokens: {reason}", args.prefix)?,
    }
    writeln!(
        out,
        "  smallest shareable prefix: {} tokens",
        verdict.min_shareable_prefix
    )?;
    writeln!(
        out,
        "  {} live tokens ({}): commit lower bound {} (granule x windows holding live bytes) = {} windows",
        f.tokens,
        format_size(f.live),
        format_size(f.lower_bound),
        f.live_windows
    )?;
    writeln!(
        out,
        "  committed at once: {} of at most {} = {} ({} with one handle per granule)",
        count(f.live_handles, "handle"),
        format_size(f.max_windows.saturating_mul(args.granule)),
        count(f.live_handles, "mapping"),
        f.live_windows
    )?;
    writeln!(
        out,
        "  reservation (virtual address space, padded; not memory): {}",
        format_size(f.reservation)
    )?;
    Ok(())
}
