//! `kvvm behaviour`: the manager's behaviour suite, with fault injection, against a backend.

use std::process::ExitCode;

use clap::Args;
use kvvm_behaviour::{run_behaviour, BehaviourOptions, FaultDepth};

/// Arguments of `kvvm behaviour`.
#[derive(Debug, Args)]
pub struct BehaviourArgs {
    /// Backend to test: sim, cuda, hip, host or auto.
    #[arg(long, default_value = "sim")]
    backend: String,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Run only cases whose name contains this text (repeatable).
    #[arg(long = "case")]
    cases: Vec<String>,
    /// Device ordinal to test.
    #[arg(long, default_value_t = 0)]
    device: u32,
    /// Faults per run of each fault scenario: none, single (every driver step failing alone)
    /// or pairs (also every ordered pair of steps).
    #[arg(long, default_value = "pairs", value_parser = parse_depth)]
    faults: FaultDepth,
}

fn parse_depth(s: &str) -> Result<FaultDepth, String> {
    FaultDepth::parse(s).ok_or_else(|| format!("{s:?}: expected none, single or pairs"))
}

/// Runs the suite; exits 1 when a case fails. A backend that cannot be opened is an error
/// (exit 2) with the reason: the suite needs a working backend.
pub fn run(args: &BehaviourArgs) -> Result<ExitCode, String> {
    let opened = match kvvm::open_backend_verbose(&args.backend) {
        Ok(opened) => opened,
        Err(kvvm::OpenError::UnknownBackend(name)) => {
            return Err(format!(
                "unknown backend {name:?} (expected one of: {})",
                kvvm::BACKEND_NAMES.join(", ")
            ))
        }
        Err(e) => return Err(format!("skipped: {e}")),
    };
    if let Some(notice) = &opened.notice {
        eprintln!("{notice}");
    }
    let options = BehaviourOptions {
        device: kvvm::DeviceId(args.device),
        filter: args.cases.clone(),
        depth: args.faults,
    };
    let report = run_behaviour(&opened.backend, &options);
    if args.json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.to_table());
    }
    Ok(if report.report.failed > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
