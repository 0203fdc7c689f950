//! `kvvm bench kv`: the synthetic decode loop of the KV layer, every byte verified.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use kvvm::host::HostBackend;
use kvvm::layout::KvLayout;
use kvvm::VirtualMemoryBackend;
use kvvm_bench::decode::{run_decode_loop_with_progress, DecodeLoopConfig, DecodeLoopReport};
use kvvm_bench::timing::simulated_timing_note;
use serde_json::json;

use crate::backend;
use crate::error::{failed, CliError, CliResult};
use crate::flags::{self, MAX_CONTEXT_TOKENS};
use crate::output::{self, Out};
use crate::progress::Progress;

/// Arguments of `kvvm bench kv`.
#[derive(Debug, Args)]
pub struct KvBenchArgs {
    /// Backend: sim, cuda, hip, host or auto.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// KV layout: head-major, seq-major or token-major.
    #[arg(long, default_value = "seq-major")]
    layout: String,
    /// Sequences sharing the prompt (1 to 4096).
    #[arg(long, default_value_t = 64, value_parser = flags::int_in::<u32>(1, 4096))]
    sequences: u32,
    /// Prompt tokens, the shared prefix (1 to 1048576).
    #[arg(long, default_value_t = 4096, value_parser = flags::int_in::<u64>(1, 1 << 20))]
    prompt_tokens: u64,
    /// Run without prefix sharing (every sequence commits and writes its own prompt).
    #[arg(long)]
    no_sharing: bool,
    /// Most windows per handle of a published prompt in the prefix cache (1 to 1048576): a
    /// hit maps that many times fewer handles, and its read-only part ends on a multiple of it
    /// (the rest is copied; `PrefixCacheConfig::handle_windows`).
    #[arg(long, default_value_t = 1, value_parser = flags::int_in::<u64>(1, 1 << 20))]
    prefix_handle_windows: u64,
    /// Skip the read-back verification.
    #[arg(long)]
    no_verify: bool,
    /// Print JSON instead of Markdown.
    #[arg(long)]
    json: bool,
}

/// Runs `kvvm bench kv`.
pub fn run(args: &KvBenchArgs, out: Out<'_>) -> CliResult<ExitCode> {
    let config = loop_config(args)?;
    backend::check_name(&args.backend)?;
    let OpenedBackend { backend, host } = open_backend(&args.backend)?;
    let progress = Progress::start("bench kv", None);
    let r = run_decode_loop_with_progress(backend, &config, &mut |p| {
        progress.update(p.done, Some(p.total), p.phase)
    });
    drop(progress);
    let r = r.map_err(failed)?;
    let leak_free = host.as_ref().map(|h| h.ledger().is_empty());
    if args.json {
        print_json(out, &r, leak_free)?;
    } else {
        output::text(out, &r.to_markdown())?;
        if let Some(empty) = leak_free {
            writeln!(
                out,
                "host backend ledger after the run: {}",
                if empty { "empty" } else { "NOT EMPTY (leak)" }
            )?;
        }
    }
    if leak_free == Some(false) {
        return Ok(ExitCode::from(1));
    }
    Ok(if r.verified || !config.verify {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The reference run with the layout, sequences, prompt, sharing and verification of
/// `args`; the prompt and the decode tokens must fit the largest context.
fn loop_config(args: &KvBenchArgs) -> CliResult<DecodeLoopConfig> {
    let layout: KvLayout = args.layout.parse().map_err(failed)?;
    let mut config = DecodeLoopConfig::reference().map_err(failed)?;
    if args.prompt_tokens + config.decode_tokens > MAX_CONTEXT_TOKENS {
        return Err(CliError::Failed(format!(
            "--prompt-tokens {} with {} decode tokens exceeds the largest context ({MAX_CONTEXT_TOKENS} tokens)",
            args.prompt_tokens, config.decode_tokens
        )));
    }
    config.layout = layout;
    config.sequences = args.sequences;
    config.prompt_tokens = args.prompt_tokens;
    config.share_prefix = !args.no_sharing;
    config.prefix_handle_windows = args.prefix_handle_windows;
    config.verify = !args.no_verify;
    Ok(config)
}

/// The backend of the run, with the host backend kept for its leak record after the run.
struct OpenedBackend {
    backend: Arc<dyn VirtualMemoryBackend>,
    host: Option<Arc<HostBackend>>,
}

/// The backend named `name`; the host backend is opened directly, for its leak record.
fn open_backend(name: &str) -> CliResult<OpenedBackend> {
    if name == "host" {
        let h = Arc::new(
            HostBackend::open()
                .map_err(|e| CliError::Failed(format!("backend host is unavailable: {e}")))?,
        );
        Ok(OpenedBackend {
            backend: h.clone(),
            host: Some(h),
        })
    } else {
        Ok(OpenedBackend {
            backend: backend::open("bench kv", name)?.backend,
            host: None,
        })
    }
}

/// The report as one JSON line, with whether the host ledger was empty after the run.
fn print_json(out: Out<'_>, r: &DecodeLoopReport, leak_free: Option<bool>) -> CliResult<()> {
    let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
    let v = json!({
        "backend": r.backend,
        "simulated_timings": simulated_timing_note(&r.backend, false).is_some(),
        "model": r.model,
        "layout": r.layout.as_str(),
        "granule": r.granule,
        "sequences": r.sequences,
        "prompt_tokens": r.prompt_tokens,
        "decode_tokens": r.decode_tokens,
        "share_prefix": r.share_prefix,
        "prompt_shareable": r.prompt_shareable,
        "prompt_refusal": r.prompt_refusal,
        "shared_prefix_bytes": r.shared_prefix_bytes,
        "prefix_tail_bytes": r.prefix_tail_bytes,
        "committed_bytes_with_sharing": r.committed_bytes_with_sharing,
        "committed_bytes_without_sharing": r.committed_bytes_without_sharing,
        "attach_median_us": us(r.attach_median),
        "attach_mappings": r.attach_mappings,
        "admit_hit_mappings": r.admit_hit_mappings,
        "attach_min_us": us(r.attach_min),
        "attach_after_copy_median_us": us(r.attach_after_copy_median),
        "copy_median_us": us(r.copy_median),
        "copy_bytes": r.copy_bytes,
        "bytes_written": r.bytes_written,
        "bytes_verified": r.bytes_verified,
        "verified": r.verified,
        "used_bytes_at_end": r.used_bytes_at_end,
        "prefix_hits": r.cache.hits,
        "ledger_empty_after_run": leak_free,
    });
    output::json_line(out, &v)?;
    Ok(())
}
