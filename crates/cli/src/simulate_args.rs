//! The flags of `kvvm simulate` and their checks (run before any backend is opened).

use std::path::{Path, PathBuf};

use clap::Args;
use kvvm::layout::{KvDtype, KvGeometry};
use kvvm_workload::{PolicyKind, SyntheticTrace, Trace};

use crate::error::{failed, CliError, CliResult};
use crate::flags::{self, MAX_CONTEXT_TOKENS};

/// Arguments of `kvvm simulate`.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// Backend for the kvvm policies: auto, sim, cuda, hip or host (auto: the simulator when no GPU).
    #[arg(long, default_value = "auto")]
    pub backend: String,
    /// Model preset (llama-3-8b, llama-3-70b, mistral-7b, qwen2.5-7b).
    #[arg(long, default_value = "llama-3-8b")]
    pub model: String,
    /// KV element type: fp16, bf16, fp8 or fp32.
    #[arg(long, default_value = "fp16")]
    pub dtype: String,
    /// Requests of the synthetic trace (1 to 10000000).
    #[arg(long, default_value_t = 200, conflicts_with = "trace",
          value_parser = flags::int_in::<usize>(1, 10_000_000))]
    pub requests: usize,
    /// Seed of the synthetic trace.
    #[arg(long, default_value_t = 42, conflicts_with = "trace",
          value_parser = flags::int_in::<u64>(0, u64::MAX))]
    pub seed: u64,
    /// Arrival rate of the synthetic trace, requests per second (greater than 0).
    #[arg(long, default_value_t = 4.0, conflicts_with = "trace",
          value_parser = flags::float_in(0.0, 1e6, true))]
    pub rate: f64,
    /// Share of synthetic requests that open with the common system prompt (0 to 1).
    #[arg(long, default_value_t = 0.5, conflicts_with = "trace",
          value_parser = flags::float_in(0.0, 1.0, false))]
    pub shared_prefix_share: f64,
    /// Length of the synthetic system prompt in tokens (at most --max-context - 2).
    #[arg(long, default_value_t = 2048, conflicts_with = "trace",
          value_parser = flags::int_in::<u64>(0, MAX_CONTEXT_TOKENS))]
    pub system_prompt_tokens: u64,
    /// Replay this JSONL trace instead of the synthetic one (format: docs/simulate.md).
    #[arg(long, value_name = "FILE.jsonl")]
    pub trace: Option<PathBuf>,
    /// Memory budget of every policy (8GiB, 512MiB or bytes; at most the device's memory).
    /// The default is tight enough that the policies serve differently.
    #[arg(long, default_value = "8GiB", value_parser = flags::size_in(1, u64::MAX))]
    pub budget_bytes: u64,
    /// Maximum context in tokens (what static-max preallocates and kvvm reserves).
    #[arg(long, default_value_t = 32_768, value_parser = flags::int_in::<u64>(1, MAX_CONTEXT_TOKENS))]
    pub max_context: u64,
    /// Decode step in milliseconds (every running request gains one token per step; 1 to 60000).
    #[arg(long, default_value_t = 20, value_parser = flags::int_in::<u64>(1, 60_000))]
    pub step_ms: u64,
    /// Only these policies (comma-separated names; default: all).
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<String>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// A wider table with every figure (mappings, handles, driver calls and time, live and
    /// stored bytes, waits in full); the default fits 120 columns.
    #[arg(long, conflicts_with = "json")]
    pub wide: bool,
    /// Write an SVG plot of committed memory over time per policy (the name must end in .svg).
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

/// What the flags ask for, checked.
#[derive(Debug)]
pub struct Checked {
    /// The element type.
    pub dtype: KvDtype,
    /// The trace to replay.
    pub trace: Trace,
    /// The policies, in report order.
    pub policies: Vec<PolicyKind>,
}

/// The plot is SVG; any other extension is refused rather than written as SVG.
pub fn check_plot_path(path: &Path) -> CliResult<()> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    if ext.as_deref() == Some("svg") {
        return Ok(());
    }
    Err(CliError::Failed(format!(
        "--plot {}: only SVG plots are written; name the file with .svg (convert it with any SVG tool for another format)",
        path.display()
    )))
}

impl SimulateArgs {
    /// Checks every flag and loads the trace; nothing here opens a backend.
    pub fn check(&self) -> CliResult<Checked> {
        let dtype: KvDtype = self.dtype.parse().map_err(failed)?;
        KvGeometry::preset(&self.model, dtype, self.max_context).map_err(failed)?;
        if let Some(path) = &self.plot {
            check_plot_path(path)?;
        }
        let policies = if self.policies.is_empty() {
            PolicyKind::all()
        } else {
            self.policies
                .iter()
                .map(|s| s.trim().parse::<PolicyKind>().map_err(failed))
                .collect::<CliResult<Vec<_>>>()?
        };
        let trace = match &self.trace {
            Some(path) => Trace::from_jsonl_file(path).map_err(failed)?,
            None => {
                let need = self.system_prompt_tokens.saturating_add(2);
                if self.max_context < need {
                    return Err(CliError::Failed(format!(
                        "--max-context {} leaves no room for --system-prompt-tokens {}: allowed {need}..={MAX_CONTEXT_TOKENS} \
                         (the system prompt, one prompt and one output token), or lower --system-prompt-tokens",
                        self.max_context, self.system_prompt_tokens
                    )));
                }
                Trace::synthetic(&SyntheticTrace {
                    requests: self.requests,
                    seed: self.seed,
                    rate_per_s: self.rate,
                    shared_prefix_share: self.shared_prefix_share,
                    system_prompt_tokens: self.system_prompt_tokens,
                    max_tokens: self.max_context,
                    ..SyntheticTrace::default()
                })
                .map_err(failed)?
            }
        };
        trace.check_fits(self.max_context).map_err(|e| {
            CliError::Failed(format!("{e} (raise --max-context or shorten the trace)"))
        })?;
        Ok(Checked {
            dtype,
            trace,
            policies,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_svg_plots() {
        assert!(check_plot_path(Path::new("a/mem.svg")).is_ok());
        assert!(check_plot_path(Path::new("MEM.SVG")).is_ok());
        for bad in ["x.png", "x", "x.svg.png"] {
            let e = check_plot_path(Path::new(bad)).unwrap_err().to_string();
            assert!(e.contains("only SVG"), "{e}");
        }
    }
}
