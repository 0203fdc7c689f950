//! `kvvm`: inspect backends, run the conformance suite, plan, benchmark, simulate and serve.
//!
//! Each subcommand is one module with its clap `Args` and a `run(&args, out)` that writes its
//! report to `out` and returns the exit code; adding one is a module, a variant of
//! [`Command`] and a line of [`Command::run`]. The helpers every subcommand shares:
//! [`flags`] (ranges and the one size syntax), [`output`] (writing without panicking on a
//! closed pipe), [`error`] (exit codes), [`backend`] (opening a backend, short reasons),
//! [`progress`] (bars on a terminal, periodic lines elsewhere) and [`junit`] (JUnit XML).

#![forbid(unsafe_code)]
// Output goes to a `Write` whose errors are handled (stdout: the command's `out`; stderr:
// `output::note`): a print macro panics when stdout or stderr cannot be written.
#![warn(clippy::print_stdout, clippy::print_stderr)]

mod backend;
mod behaviour;
mod bench;
mod bench_decode;
mod bench_host;
mod bench_kv;
mod bench_tp;
mod bench_vmm;
mod broker;
mod conformance;
mod error;
mod flags;
mod info;
mod junit;
mod output;
mod plan;
mod progress;
mod serve;
mod serve_flags;
mod simulate;
mod simulate_args;
mod suite_args;

use std::io::Write;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::error::CliResult;

/// GPU memory for LLM KV caches through the drivers' virtual-memory API.
#[derive(Debug, Parser)]
#[command(name = "kvvm", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show the backends found, their devices, memory, granularity and capabilities.
    Info(info::InfoArgs),
    /// Run the conformance suite against a backend.
    Conformance(conformance::ConformanceArgs),
    /// Run the manager's behaviour suite, with single and double fault injection, against a
    /// backend.
    Behaviour(behaviour::BehaviourArgs),
    /// Shareability verdict, fragments and commit lower bound for a model and layout.
    Plan(plan::PlanArgs),
    /// Benchmarks measured side by side in one run: `vmm`, `kv`, `decode`, `host`, `tp`.
    Bench(bench::BenchArgs),
    /// Replay a serving trace through every KV memory policy, side by side (table, JSON, SVG).
    Simulate(simulate_args::SimulateArgs),
    /// HTTP server over the memory manager: sequences, 429 + Retry-After, Prometheus metrics.
    // Boxed: its flags make it several times larger than every other command's.
    Serve(Box<serve::ServeArgs>),
    /// The node's memory broker: one KV budget shared by many engine processes.
    Broker(broker::BrokerArgs),
}

impl Command {
    fn run(&self, out: &mut dyn Write) -> CliResult<ExitCode> {
        match self {
            Command::Info(args) => info::run(args, out),
            Command::Conformance(args) => conformance::run(args, out),
            Command::Behaviour(args) => behaviour::run(args, out),
            Command::Plan(args) => plan::run(args, out),
            Command::Bench(args) => bench::run(args, out),
            Command::Simulate(args) => simulate::run(args, out),
            Command::Serve(args) => serve::run(args, out),
            Command::Broker(args) => broker::run(args, out),
        }
    }
}

/// Every command and subcommand accepts `-5` as a value, so that a negative number reaches
/// the flag's parser and gets its range in the error, instead of clap's "unexpected
/// argument '-5'".
fn accept_negative_numbers(cmd: clap::Command) -> clap::Command {
    cmd.allow_negative_numbers(true)
        .mut_subcommands(accept_negative_numbers)
}

fn parse() -> Result<Cli, clap::Error> {
    let matches = accept_negative_numbers(Cli::command()).try_get_matches()?;
    Cli::from_arg_matches(&matches)
}

fn main() -> ExitCode {
    // A conformance case that must run in a child process re-runs this executable.
    if let Some(req) = kvvm_conformance::requested_child() {
        let code = match kvvm::open_backend(&req.backend) {
            Ok(b) => kvvm_conformance::run_child(&*b, &req.case, req.device),
            Err(e) => kvvm_conformance::report_child_error(&e.to_string()),
        };
        return ExitCode::from(u8::try_from(code).unwrap_or(2));
    }
    let cli = match parse() {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version go to stdout, usage errors to stderr; a closed pipe is quiet.
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    let mut stdout = std::io::stdout();
    let result = cli.command.run(&mut stdout).and_then(|code| {
        stdout.flush()?;
        Ok(code)
    });
    match result {
        Ok(code) => code,
        Err(e) => e.report(),
    }
}
