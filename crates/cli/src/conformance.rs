//! `kvvm conformance`.

use std::process::ExitCode;

use clap::Args;
use kvvm_conformance::{run_suite, unavailable_report, ChildRunner, RunOptions};

/// Arguments of `kvvm conformance`.
#[derive(Debug, Args)]
pub struct ConformanceArgs {
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
}

/// Runs the suite; exits 1 when a case fails, 0 otherwise (also when every case is skipped
/// because the backend is unavailable here).
pub fn run(args: &ConformanceArgs) -> Result<ExitCode, String> {
    let report = match kvvm::open_backend_verbose(&args.backend) {
        Ok(opened) => {
            if let Some(notice) = &opened.notice {
                eprintln!("{notice}");
            }
            let options = RunOptions {
                device: kvvm::DeviceId(args.device),
                filter: args.cases.clone(),
                child: ChildRunner::current_exe().ok(),
            };
            run_suite(&*opened.backend, &options)
        }
        Err(kvvm::OpenError::UnknownBackend(name)) => {
            return Err(format!(
                "unknown backend {name:?} (expected one of: {})",
                kvvm::BACKEND_NAMES.join(", ")
            ))
        }
        Err(e) => {
            let reason = format!("skipped: {e}");
            unavailable_report(&args.backend, &reason)
        }
    };
    if args.json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.to_table());
    }
    Ok(if report.failed > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
