//! [`SuiteArgs`]: the flags `kvvm conformance` and `kvvm behaviour` share (which backend and
//! device, which cases, how to report).

use std::path::PathBuf;

use clap::Args;

use crate::flags;

/// What to run a suite of cases on, which of its cases, and how to report them.
#[derive(Debug, Args)]
pub struct SuiteArgs {
    /// Backend to test: sim, cuda, hip, host or auto.
    #[arg(long, default_value = "sim")]
    pub backend: String,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Run only cases whose name contains this text (repeatable; each must match a case).
    #[arg(long = "case", value_name = "TEXT")]
    pub cases: Vec<String>,
    /// Device ordinal to test (one the backend has).
    #[arg(long, default_value_t = 0, value_parser = flags::int_in::<u32>(0, u64::from(u32::MAX)))]
    pub device: u32,
    /// Also write the report as JUnit XML to FILE (one testcase per case).
    #[arg(long, value_name = "FILE")]
    pub junit: Option<PathBuf>,
}
