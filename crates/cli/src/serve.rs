//! `kvvm serve`: the HTTP server over the memory manager (see `docs/serve.md`).

use std::process::ExitCode;

use clap::Args;
use kvvm::DeviceId;
use kvvm_layout::{KvDtype, KvLayout};
use kvvm_server::{ServiceConfig, DEFAULT_BODY_LIMIT};

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
    /// Largest request body accepted, in bytes (larger: 413).
    #[arg(long, value_parser = parse_bytes, default_value_t = DEFAULT_BODY_LIMIT as u64)]
    body_limit_bytes: u64,
}

/// `N`, or `N` followed by KiB, MiB, GiB or TiB (or K, M, G, T).
fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count (e.g. 8589934592 or 8GiB)"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        other => return Err(format!("unknown unit {other:?} (use KiB, MiB, GiB or TiB)")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{s:?} does not fit in 64 bits"))
}

/// Serves until Ctrl-C or SIGTERM, then releases everything.
pub fn run(args: &ServeArgs) -> Result<ExitCode, String> {
    let dtype: KvDtype = args.dtype.parse().map_err(|e| format!("{e}"))?;
    let layout: KvLayout = args.layout.parse().map_err(|e| format!("{e}"))?;
    let body_limit = usize::try_from(args.body_limit_bytes)
        .map_err(|_| "--body-limit-bytes is too large".to_owned())?;
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
    };
    let report =
        kvvm_server::serve_until_signal(config, &args.listen, body_limit, |addr, s| {
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
        "kvvm serve: stopped; released {} sequences ({} bytes){}",
        report.sequences,
        report.released_bytes,
        if report.failures > 0 {
            format!(", {} releases failed (quarantined)", report.failures)
        } else {
            String::new()
        }
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts_with_units() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("8GiB"), Ok(8 << 30));
        assert_eq!(parse_bytes("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("2k"), Ok(2048));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("1XB").is_err());
        assert!(parse_bytes("99999999TiB").is_err());
    }
}
