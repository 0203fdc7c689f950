//! `kvvm serve`: the HTTP server over the memory manager (see `docs/serve.md`).

use std::process::ExitCode;

use clap::Args;
use kvvm::DeviceId;
use kvvm_layout::{KvDtype, KvLayout};
use kvvm_server::ServiceConfig;

use crate::serve_flags::{parse_bytes, ServeFlags};

/// Arguments of `kvvm serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Backend: auto (CUDA, else HIP, else the simulator, with a notice), cuda, hip or sim.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Address to listen on (port 0: any free port, printed at start).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// Device memory budget in bytes (suffixes KiB, MiB, GiB, TiB accepted); default: the
    /// device's free memory at start.
    #[arg(long, value_parser = parse_bytes)]
    budget_bytes: Option<u64>,
    /// Model preset (llama-3-8b, llama-3-70b, mistral-7b, qwen2.5-7b).
    #[arg(long, default_value = "llama-3-8b")]
    model: String,
    /// KV layout: head-major, seq-major or token-major.
    #[arg(long, default_value = "seq-major")]
    layout: String,
    /// Element type: fp16, bf16, fp8 or fp32.
    #[arg(long, default_value = "fp16")]
    dtype: String,
    /// The model's context limit: the largest max_tokens a sequence may ask for.
    #[arg(long, default_value_t = 8192)]
    max_tokens: u64,
    /// Device index.
    #[arg(long, default_value_t = 0)]
    device: u32,
    /// Most bytes of released handles kept for reuse (default: the manager's, 1 GiB).
    #[arg(long, value_parser = parse_bytes)]
    pool_cap_bytes: Option<u64>,
    /// Do not look prompts sent with token_ids up in the prefix cache (no sharing).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Timeouts, caps, API keys, limits and the log.
    #[command(flatten)]
    net: ServeFlags,
}

/// Serves until Ctrl-C or SIGTERM, then releases everything.
pub fn run(args: &ServeArgs) -> Result<ExitCode, String> {
    let dtype: KvDtype = args.dtype.parse().map_err(|e| format!("{e}"))?;
    let layout: KvLayout = args.layout.parse().map_err(|e| format!("{e}"))?;
    let net = args.net.settings()?;
    let opened = kvvm::open_backend_verbose(&args.backend).map_err(|e| e.to_string())?;
    if let Some(notice) = &opened.notice {
        eprintln!("kvvm serve: {notice}");
    }
    let backend_name = opened.backend.name().to_owned();
    let config = ServiceConfig {
        backend: opened.backend,
        device: DeviceId(args.device),
        budget_bytes: args.budget_bytes,
        model: args.model.clone(),
        dtype,
        layout,
        max_tokens: args.max_tokens,
        pool_cap_bytes: args.pool_cap_bytes,
        prefix_cache: !args.no_prefix_cache,
        shared_prefix_cache: net.shared_prefix_cache,
        limits: net.limits,
        idle_timeout: net.idle_timeout,
    };
    let report =
        kvvm_server::serve_until_signal(config, &args.listen, net.http, net.log, |addr, s| {
            let budget = s
                .governor()
                .device_budget(DeviceId(args.device))
                .map_or("unlimited".to_owned(), |b| format!("{b} bytes"));
            println!(
            "kvvm serve: listening on http://{addr} (backend {backend_name}, {} {dtype} {layout}, \
             max {} tokens, granule {} bytes, budget {budget}, prefix cache {}); Ctrl-C to stop",
            s.model(),
            s.max_tokens(),
            s.manager().granule(),
            s.prefix_cache()
                .map_or("off".to_owned(), |c| format!("on, {}-token blocks", c.block_tokens())),
        );
        })
        .map_err(|e| e.to_string())?;
    println!(
        "kvvm serve: stopped; released {} sequences ({} bytes freed, {} bytes still held){}",
        report.sequences,
        report.released_bytes,
        report.held_bytes,
        if report.failures > 0 {
            format!(", {} releases failed (quarantined)", report.failures)
        } else {
            String::new()
        }
    );
    Ok(ExitCode::SUCCESS)
}
