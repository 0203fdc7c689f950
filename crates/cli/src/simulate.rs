//! `kvvm simulate`: replay a serving trace through every KV memory policy, side by side.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use kvvm::sim::SimBackend;
use kvvm::VirtualMemoryBackend;
use kvvm_workload::{
    render_svg, render_table, render_verdict, simulate, verdict, PolicyKind, SimulationConfig,
    SimulationReport, TableWidth,
};

use crate::backend;
use crate::error::{failed, CliError, CliResult};
use crate::output::{self, Out};
use crate::progress::Progress;
use crate::simulate_args::{Checked, SimulateArgs};

/// The backend of the run, with the simulator or host backend kept for the leak check.
struct RunBackend {
    backend: Arc<dyn VirtualMemoryBackend>,
    sim: Option<Arc<SimBackend>>,
    host: Option<Arc<kvvm::host::HostBackend>>,
}

fn open(name: &str) -> CliResult<RunBackend> {
    // The simulator and the host backend are opened here (not through the facade) so that
    // their ledgers can be checked after the run.
    let sim = |s: Arc<SimBackend>| RunBackend {
        backend: s.clone(),
        sim: Some(s),
        host: None,
    };
    match name {
        "sim" => Ok(sim(Arc::new(SimBackend::h200()))),
        "host" => {
            let h = Arc::new(
                kvvm::host::HostBackend::open()
                    .map_err(|e| CliError::Failed(format!("backend host is unavailable: {e}")))?,
            );
            Ok(RunBackend {
                backend: h.clone(),
                sim: None,
                host: Some(h),
            })
        }
        name => {
            let opened = backend::open("simulate", name)?;
            if opened.backend.name() == "sim" {
                Ok(sim(Arc::new(SimBackend::h200())))
            } else {
                Ok(RunBackend {
                    backend: opened.backend,
                    sim: None,
                    host: None,
                })
            }
        }
    }
}

/// Runs the simulation and prints the table or the JSON.
pub fn run(args: &SimulateArgs, out: Out<'_>) -> CliResult<ExitCode> {
    let checked = args.check()?;
    backend::check_name(&args.backend)?;
    let run = open(&args.backend)?;
    // Every kvvm policy commits on device 0.
    backend::check_budget_fits(args.budget_bytes, &*run.backend, 0)?;
    let config = SimulationConfig {
        model: args.model.clone(),
        dtype: checked.dtype,
        max_context: args.max_context,
        budget_bytes: args.budget_bytes,
        step: Duration::from_millis(args.step_ms),
        policies: checked.policies.clone(),
        ..SimulationConfig::default()
    };
    let report = replay(&checked, &run, &config)?;
    let ledger_empty = run
        .sim
        .as_ref()
        .map(|s| s.ledger().is_empty())
        .or_else(|| run.host.as_ref().map(|h| h.ledger().is_empty()));
    if let Some(path) = &args.plot {
        let svg = render_svg(&report).map_err(failed)?;
        std::fs::write(path, svg)
            .map_err(|e| CliError::Failed(format!("cannot write {}: {e}", path.display())))?;
    }
    if args.json {
        print_json(out, &report, ledger_empty)?;
    } else {
        print_table(out, args, &run, &report, ledger_empty)?;
    }
    if ledger_empty == Some(false) {
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

/// Replays the checked trace through every policy of `config` on `run`'s backend, with a
/// progress bar over the policies and their requests.
fn replay(
    checked: &Checked,
    run: &RunBackend,
    config: &SimulationConfig,
) -> CliResult<SimulationReport> {
    let names: Vec<String> = checked.policies.iter().map(PolicyKind::name).collect();
    let requests = checked.trace.requests.len() as u64;
    let progress = Progress::start("simulate", Some(names.len() as u64 * requests));
    let result = simulate(&checked.trace, run.backend.clone(), config, &mut |p| {
        let done = (p.policies_done as u64 * p.requests as u64 + p.requests_done as u64)
            .min(p.policies as u64 * p.requests as u64);
        let name = names.get(p.policies_done).map_or("done", String::as_str);
        progress.update(
            done,
            None,
            format!(
                "policy {}/{} {name}, {}/{} requests",
                (p.policies_done + 1).min(p.policies),
                p.policies,
                p.requests_done,
                p.requests
            ),
        );
    });
    drop(progress);
    result.map_err(failed)
}

/// The report as pretty JSON, with the leak check and the verdict.
fn print_json(
    out: Out<'_>,
    report: &SimulationReport,
    ledger_empty: Option<bool>,
) -> CliResult<()> {
    let mut v = serde_json::to_value(report).map_err(failed)?;
    if let Some(obj) = v.as_object_mut() {
        obj.insert("ledger_empty_after_run".into(), ledger_empty.into());
        obj.insert(
            "verdict".into(),
            serde_json::to_value(verdict(report)).map_err(failed)?,
        );
    }
    output::json_pretty(out, &v)?;
    Ok(())
}

/// The report as a table, the leak check, where the plot went, and the verdict last; the
/// wall time goes to stderr.
fn print_table(
    out: Out<'_>,
    args: &SimulateArgs,
    run: &RunBackend,
    report: &SimulationReport,
    ledger_empty: Option<bool>,
) -> CliResult<()> {
    let width = if args.wide {
        TableWidth::Wide
    } else {
        TableWidth::Narrow
    };
    output::text(out, &render_table(report, width))?;
    if let Some(empty) = ledger_empty {
        writeln!(
            out,
            "{} ledger after the run: {}",
            if run.host.is_some() {
                "host backend"
            } else {
                "simulated driver"
            },
            if empty { "empty" } else { "NOT EMPTY (leak)" }
        )?;
    }
    if let Some(path) = &args.plot {
        writeln!(out, "plot written to {}", path.display())?;
    }
    // The conclusion comes last; the wall time is a notice (stderr), so that stdout is
    // the same on every run.
    writeln!(out)?;
    output::text(out, &render_verdict(report))?;
    output::note(format_args!(
        "kvvm simulate: replayed in {:.2} s",
        report.elapsed_s
    ));
    Ok(())
}
