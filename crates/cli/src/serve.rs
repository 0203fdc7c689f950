//! `kvvm serve`: the HTTP server over the memory manager (see `docs/serve.md`).

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::Args;
use kvvm::layout::{KvDtype, KvLayout};
use kvvm::num::format_size;
use kvvm::DeviceId;
use kvvm_server::{KvService, ServedModel, ServiceConfig};

use crate::backend;
use crate::error::{failed, CliError, CliResult};
use crate::flags::{self, MAX_CONTEXT_TOKENS};
use crate::output::Out;
use crate::serve_flags::ServeFlags;

/// Arguments of `kvvm serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Backend: auto (CUDA, else HIP, else the simulator, with a notice), cuda, hip, sim or host.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Address to listen on (port 0: any free port, printed at start).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// Device memory budget (8GiB, 512MiB or bytes; at most the device's memory); default:
    /// the device's free memory at start.
    #[arg(long, value_parser = flags::size_in(1, u64::MAX))]
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
    #[arg(long, default_value_t = 8192, value_parser = flags::int_in::<u64>(1, MAX_CONTEXT_TOKENS))]
    max_tokens: u64,
    /// Device index (one the backend has).
    #[arg(long, default_value_t = 0, value_parser = flags::int_in::<u32>(0, u64::from(u32::MAX)))]
    device: u32,
    /// Most bytes of released handles kept for reuse (a size; default: the manager's, 1GiB).
    #[arg(long, value_parser = flags::size_in(0, u64::MAX))]
    pool_cap_bytes: Option<u64>,
    /// Do not look prompts sent with token_ids up in the prefix cache (no sharing).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Body limit, timeouts, caps, API keys, limits and the log.
    #[command(flatten)]
    net: ServeFlags,
}

/// The first line `kvvm serve` prints: where it listens and what it serves.
fn listening_line(addr: SocketAddr, s: &KvService, backend: &str, device: u32) -> String {
    let budget = s
        .governor()
        .device_budget(DeviceId(device))
        .map_or("unlimited".to_owned(), |b| {
            format!("{} ({b} bytes)", format_size(b))
        });
    let granule = s.manager().granule();
    let prefix_cache = s.prefix_cache().map_or("off".to_owned(), |c| {
        format!("on, {}-token blocks", c.block_tokens())
    });
    format!(
        "kvvm serve: listening on http://{addr} (backend {backend}, {} {} {}, max {} tokens, \
         granule {} ({granule} bytes), budget {budget}, prefix cache {prefix_cache}); Ctrl-C to stop",
        s.model(),
        s.dtype(),
        s.layout(),
        s.max_tokens(),
        format_size(granule),
    )
}

/// Serves until Ctrl-C or SIGTERM, then releases everything.
pub fn run(args: &ServeArgs, out: Out<'_>) -> CliResult<ExitCode> {
    let dtype: KvDtype = args.dtype.parse().map_err(failed)?;
    let layout: KvLayout = args.layout.parse().map_err(failed)?;
    // The model is validated here, once: the service is handed its geometry, not a name.
    let model = ServedModel::preset(&args.model, dtype, args.max_tokens).map_err(failed)?;
    args.listen.parse::<SocketAddr>().map_err(|_| {
        CliError::Failed(format!(
            "--listen {:?} is not an address (write IP:PORT, e.g. 127.0.0.1:8080; port 0 picks a free one)",
            args.listen
        ))
    })?;
    let net = args.net.settings()?;
    backend::check_name(&args.backend)?;
    let opened = backend::open("serve", &args.backend)?;
    backend::check_device(&opened, args.device)?;
    if let Some(budget) = args.budget_bytes {
        backend::check_budget_fits(budget, &*opened.backend, args.device)?;
    }
    let backend_name = opened.backend.name().to_owned();
    let config = ServiceConfig {
        backend: opened.backend,
        device: DeviceId(args.device),
        budget_bytes: args.budget_bytes,
        model,
        layout,
        pool_cap_bytes: args.pool_cap_bytes,
        prefix_cache: !args.no_prefix_cache,
        shared_prefix_cache: net.shared_prefix_cache,
        limits: net.limits,
        idle_timeout: net.idle_timeout,
    };
    let mut first_line: std::io::Result<()> = Ok(());
    let report =
        kvvm_server::serve_until_signal(config, &args.listen, net.http, net.log, |addr, s| {
            let line = listening_line(addr, s, &backend_name, args.device);
            first_line = writeln!(out, "{line}").and_then(|()| out.flush());
        })
        .map_err(failed)?;
    // A reader that went away after the first line (`kvvm serve | head -1`) is not an error.
    if let Err(e) = first_line {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(e.into());
        }
    }
    writeln!(
        out,
        "kvvm serve: stopped; released {} sequences ({}, {} bytes freed; {} bytes still held){}",
        report.sequences,
        format_size(report.released_bytes),
        report.released_bytes,
        report.held_bytes,
        if report.failures > 0 {
            format!(", {} releases failed (quarantined)", report.failures)
        } else {
            String::new()
        }
    )?;
    Ok(ExitCode::SUCCESS)
}
