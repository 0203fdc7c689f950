//! `kvvm simulate`: replay a serving trace through every KV memory policy, side by side.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use kvvm::sim::SimBackend;
use kvvm::VirtualMemoryBackend;
use kvvm_workload::{
    render_svg, render_table, simulate, PolicyKind, Progress, SimulationConfig, SyntheticTrace,
    Trace, DEFAULT_BUDGET_BYTES,
};

/// Arguments of `kvvm simulate`.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// Backend for the kvvm policies: auto, sim, cuda, hip or host (auto: the simulator when no GPU).
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Model preset (llama-3-8b, llama-3-70b, mistral-7b, qwen2.5-7b).
    #[arg(long, default_value = "llama-3-8b")]
    model: String,
    /// KV element type: fp16, bf16, fp8 or fp32.
    #[arg(long, default_value = "fp16")]
    dtype: String,
    /// Requests of the synthetic trace.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Seed of the synthetic trace.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Arrival rate of the synthetic trace, requests per second.
    #[arg(long, default_value_t = 4.0)]
    rate: f64,
    /// Share of synthetic requests that open with the common system prompt (0..1).
    #[arg(long, default_value_t = 0.5)]
    shared_prefix_share: f64,
    /// Length of the synthetic system prompt in tokens.
    #[arg(long, default_value_t = 2048)]
    system_prompt_tokens: u64,
    /// Replay this JSONL trace instead of the synthetic one (format: docs/simulate.md).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Memory budget of every policy, in bytes (default 40 GiB).
    #[arg(long, default_value_t = DEFAULT_BUDGET_BYTES)]
    budget_bytes: u64,
    /// Maximum context in tokens (what static-max preallocates and kvvm reserves).
    #[arg(long, default_value_t = 32_768)]
    max_context: u64,
    /// Decode step in milliseconds (every running request gains one token per step).
    #[arg(long, default_value_t = 20)]
    step_ms: u64,
    /// Only these policies (comma-separated names; default: all).
    #[arg(long, value_delimiter = ',')]
    policies: Vec<String>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Write an SVG plot of committed memory over time per policy.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

/// A progress bar on stderr, drawn only when stderr is a terminal and the run has lasted more
/// than a second.
struct Bar {
    start: Instant,
    tty: bool,
    drawn: bool,
    last: Instant,
    names: Vec<String>,
}

impl Bar {
    fn new(names: Vec<String>) -> Self {
        let now = Instant::now();
        Bar {
            start: now,
            tty: std::io::stderr().is_terminal(),
            drawn: false,
            last: now,
            names,
        }
    }

    fn update(&mut self, p: Progress) {
        if !self.tty || self.start.elapsed() < Duration::from_secs(1) {
            return;
        }
        if self.drawn && self.last.elapsed() < Duration::from_millis(80) {
            return;
        }
        self.last = Instant::now();
        let total = (p.policies * p.requests).max(1);
        let done = (p.policies_done * p.requests + p.requests_done).min(total);
        let width = 30;
        let fill = done * width / total;
        let name = self
            .names
            .get(p.policies_done)
            .map_or("done", String::as_str);
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r[{}{}] {:>3}% {}/{} {:<24} {:>5}/{} requests",
            "#".repeat(fill),
            ".".repeat(width - fill),
            done * 100 / total,
            (p.policies_done + 1).min(p.policies),
            p.policies,
            name,
            p.requests_done,
            p.requests
        );
        let _ = err.flush();
        self.drawn = true;
    }

    fn finish(&mut self) {
        if self.drawn {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r{}\r", " ".repeat(100));
            let _ = err.flush();
        }
    }
}

/// Runs the simulation and prints the table or the JSON.
pub fn run(args: &SimulateArgs) -> Result<ExitCode, String> {
    let dtype = args.dtype.parse().map_err(|e| format!("{e}"))?;
    let trace = match &args.trace {
        Some(path) => Trace::from_jsonl_file(path).map_err(|e| e.to_string())?,
        None => Trace::synthetic(&SyntheticTrace {
            requests: args.requests,
            seed: args.seed,
            rate_per_s: args.rate,
            shared_prefix_share: args.shared_prefix_share,
            system_prompt_tokens: args.system_prompt_tokens,
            max_tokens: args.max_context,
            ..SyntheticTrace::default()
        })
        .map_err(|e| e.to_string())?,
    };
    let policies = if args.policies.is_empty() {
        PolicyKind::all()
    } else {
        args.policies
            .iter()
            .map(|s| s.trim().parse::<PolicyKind>().map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()?
    };
    // The simulator is opened here (not through the facade) so that its ledger can be
    // checked after the run.
    let mut sim: Option<Arc<SimBackend>> = None;
    let mut host: Option<Arc<kvvm::host::HostBackend>> = None;
    let backend: Arc<dyn VirtualMemoryBackend> = match args.backend.as_str() {
        "sim" => {
            let s = Arc::new(SimBackend::h200());
            sim = Some(s.clone());
            s
        }
        // Opened here too, for its leak record after the run.
        "host" => {
            let h = Arc::new(kvvm::host::HostBackend::open().map_err(|e| e.to_string())?);
            host = Some(h.clone());
            h
        }
        name => {
            let opened = kvvm::open_backend_verbose(name).map_err(|e| e.to_string())?;
            if let Some(notice) = &opened.notice {
                eprintln!("kvvm: {notice}");
            }
            if opened.backend.name() == "sim" {
                let s = Arc::new(SimBackend::h200());
                sim = Some(s.clone());
                s
            } else {
                opened.backend
            }
        }
    };
    let config = SimulationConfig {
        model: args.model.clone(),
        dtype,
        max_context: args.max_context,
        budget_bytes: args.budget_bytes,
        step: Duration::from_millis(args.step_ms),
        policies: policies.clone(),
        ..SimulationConfig::default()
    };
    let mut bar = Bar::new(policies.iter().map(PolicyKind::name).collect());
    let result = simulate(&trace, backend, &config, &mut |p| bar.update(p));
    bar.finish();
    let report = result.map_err(|e| e.to_string())?;
    let ledger_empty = sim
        .as_ref()
        .map(|s| s.ledger().is_empty())
        .or_else(|| host.as_ref().map(|h| h.ledger().is_empty()));
    if let Some(path) = &args.plot {
        std::fs::write(path, render_svg(&report))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if args.json {
        let mut v = serde_json::to_value(&report).map_err(|e| e.to_string())?;
        if let Some(obj) = v.as_object_mut() {
            obj.insert("ledger_empty_after_run".into(), ledger_empty.into());
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
        );
    } else {
        print!("{}", render_table(&report));
        if let Some(empty) = ledger_empty {
            println!(
                "{} ledger after the run: {}",
                if host.is_some() {
                    "host backend"
                } else {
                    "simulated driver"
                },
                if empty { "empty" } else { "NOT EMPTY (leak)" }
            );
        }
        if let Some(path) = &args.plot {
            println!("plot written to {}", path.display());
        }
        println!("replayed in {:.2} s", report.elapsed_s);
    }
    if ledger_empty == Some(false) {
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}
