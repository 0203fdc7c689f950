//! `kvvm`: inspect backends, run the conformance suite, plan, simulate and serve.

mod behaviour;
mod bench;
mod bench_host;
mod conformance;
mod info;
mod plan;
mod serve;
mod serve_flags;
mod simulate;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
    /// Benchmarks measured side by side in one run (`kvvm bench vmm`, `kv`, `decode`, `host`).
    Bench(bench::BenchArgs),
    /// Replay a serving trace through every KV memory policy, side by side (table, JSON, SVG).
    Simulate(simulate::SimulateArgs),
    /// HTTP server over the memory manager: sequences, 429 + Retry-After, Prometheus metrics.
    Serve(serve::ServeArgs),
}

fn main() -> ExitCode {
    // A conformance case that must run in a child process re-runs this executable.
    if let Some((backend, case)) = kvvm_conformance::requested_child() {
        let code = match kvvm::open_backend(&backend) {
            Ok(b) => kvvm_conformance::run_child(&*b, &case),
            Err(e) => kvvm_conformance::report_child_error(&e.to_string()),
        };
        return ExitCode::from(u8::try_from(code).unwrap_or(2));
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info(args) => info::run(&args),
        Command::Conformance(args) => conformance::run(&args),
        Command::Behaviour(args) => behaviour::run(&args),
        Command::Plan(args) => plan::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::Simulate(args) => simulate::run(&args),
        Command::Serve(args) => serve::run(&args),
    };
    match result {
        Ok(code) => code,
        Err(message) => {
            eprintln!("kvvm: {message}");
            ExitCode::from(2)
        }
    }
}
