//! `kvvm behaviour`: the manager's behaviour suite, with fault injection, against a backend.

use std::process::ExitCode;

use clap::Args;
use kvvm_behaviour::{run_behaviour, BehaviourOptions, FaultDepth};

use crate::backend;
use crate::error::{CliError, CliResult};
use crate::junit;
use crate::output::{self, note, Out};
use crate::progress::Progress;
use crate::suite_args::SuiteArgs;

/// Arguments of `kvvm behaviour`.
#[derive(Debug, Args)]
pub struct BehaviourArgs {
    #[command(flatten)]
    suite: SuiteArgs,
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
pub fn run(args: &BehaviourArgs, out: Out<'_>) -> CliResult<ExitCode> {
    backend::check_name(&args.suite.backend)?;
    let opened = backend::open("behaviour", &args.suite.backend)?;
    backend::check_device(&opened, args.suite.device)?;
    let options = BehaviourOptions {
        device: kvvm::DeviceId(args.suite.device),
        filter: args.suite.cases.clone(),
        depth: args.faults,
    };
    let progress = Progress::start("behaviour", None);
    progress.message("cases, then every fault scenario");
    let report = run_behaviour(&opened.backend, &options);
    drop(progress);
    if let Some(f) = args.suite.cases.iter().find(|f| {
        !report
            .report
            .cases
            .iter()
            .any(|c| c.name.contains(f.as_str()))
    }) {
        return Err(CliError::Failed(format!("--case {f:?} matches no case")));
    }
    if let Some(path) = &args.suite.junit {
        junit::write_report(path, "kvvm behaviour", "behaviour", &report.report)?;
    }
    if args.suite.json {
        output::text(out, &report.to_json())?;
        writeln!(out)?;
    } else {
        output::text(out, &report.to_table())?;
    }
    if report.report.failed > 0 {
        return Ok(ExitCode::from(1));
    }
    if report.report.passed == 0 {
        note("kvvm behaviour: no case passed");
    }
    Ok(ExitCode::SUCCESS)
}
