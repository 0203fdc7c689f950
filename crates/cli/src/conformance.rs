//! `kvvm conformance`: the suite against one backend, as a table, JSON or JUnit XML.

use std::process::ExitCode;

use clap::Args;
use kvvm_conformance::{
    all_cases, run_suite_with_progress, unavailable_report, ChildRunner, Report, RunOptions,
};

use crate::backend;
use crate::error::{CliError, CliResult};
use crate::junit;
use crate::output::{self, note, Out};
use crate::progress::Progress;
use crate::suite_args::SuiteArgs;

/// Arguments of `kvvm conformance`.
#[derive(Debug, Args)]
pub struct ConformanceArgs {
    #[command(flatten)]
    suite: SuiteArgs,
    /// Exit 1 unless at least one case passed (nothing ran, or everything was skipped, is a
    /// failure in CI).
    #[arg(long)]
    require_pass: bool,
}

/// Every `--case` text must select at least one case.
fn check_filters(filters: &[String]) -> CliResult<()> {
    let names: Vec<&str> = all_cases().iter().map(|c| c.name).collect();
    for f in filters {
        if !names.iter().any(|n| n.contains(f.as_str())) {
            return Err(CliError::Failed(format!(
                "--case {f:?} matches no case; the cases are: {}",
                names.join(", ")
            )));
        }
    }
    Ok(())
}

fn run_report(args: &ConformanceArgs) -> CliResult<Report> {
    let opened = match kvvm::open_backend_verbose(&args.suite.backend) {
        Ok(opened) => opened,
        Err(kvvm::OpenError::UnknownBackend(name)) => return Err(backend::unknown_backend(&name)),
        Err(e) => {
            let u = backend::unavailable(&args.suite.backend, &e);
            let reason = format!(
                "skipped: backend {} is unavailable: {} ({}); fix: {}",
                args.suite.backend, u.summary, u.code, u.fix
            );
            let all = unavailable_report(&args.suite.backend, &reason);
            let cases = all
                .cases
                .into_iter()
                .filter(|c| {
                    args.suite.cases.is_empty()
                        || args.suite.cases.iter().any(|f| c.name.contains(f))
                })
                .collect();
            return Ok(Report::new(all.backend, all.device, cases));
        }
    };
    if let Some(n) = backend::notice("conformance", &opened) {
        note(n);
    }
    backend::check_device(&opened, args.suite.device)?;
    let options = RunOptions {
        device: kvvm::DeviceId(args.suite.device),
        filter: args.suite.cases.clone(),
        child: ChildRunner::current_exe().ok(),
    };
    let progress = Progress::start("conformance", None);
    let report = run_suite_with_progress(&*opened.backend, &options, &mut |done, total, name| {
        progress.update(done as u64, Some(total as u64), name)
    });
    drop(progress);
    Ok(report)
}

/// Runs the suite; exits 1 when a case fails (or, with `--require-pass`, when none passed),
/// 0 otherwise, 2 on bad flags.
pub fn run(args: &ConformanceArgs, out: Out<'_>) -> CliResult<ExitCode> {
    check_filters(&args.suite.cases)?;
    let report = run_report(args)?;
    if let Some(path) = &args.suite.junit {
        junit::write_report(path, "kvvm conformance", "conformance", &report)?;
    }
    if args.suite.json {
        output::text(out, &report.to_json())?;
        writeln!(out)?;
    } else {
        output::text(out, &report.to_table())?;
    }
    if report.failed > 0 {
        return Ok(ExitCode::from(1));
    }
    if report.passed == 0 {
        let what = if report.cases.is_empty() {
            "no case ran".to_owned()
        } else {
            format!("every case ({}) was skipped", report.skipped)
        };
        if args.require_pass {
            note(format!("kvvm conformance: --require-pass: {what}"));
            return Ok(ExitCode::from(1));
        }
        note(format!(
            "kvvm conformance: nothing was tested: {what} (--require-pass makes this exit 1)"
        ));
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn case_filters_must_select_something() {
        assert!(check_filters(&["granularity".into()]).is_ok());
        let e = check_filters(&["nosuchcase".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("--case \"nosuchcase\" matches no case"),
            "{e}"
        );
        assert!(e.contains("devices_are_listed"), "{e}");
    }
}
