//! How a command fails, and the exit code each failure gives.
//!
//! | exit | meaning |
//! |---|---|
//! | 0 | success; also a closed output pipe (`kvvm simulate \| head -1`), as Unix tools do |
//! | 1 | the command ran and found a failure (a conformance case failed, a leak, `--require-pass` with nothing passed) |
//! | 2 | bad input (a flag, a file, a name) or an error that stopped the command |

use std::fmt;
use std::io;
use std::process::ExitCode;

/// A command's failure.
#[derive(Debug)]
pub enum CliError {
    /// Bad input or an error that stopped the command; the message names it.
    Failed(String),
    /// Writing the output failed (a closed pipe, a full disk).
    Output(io::Error),
}

/// What every command returns.
pub type CliResult<T> = Result<T, CliError>;

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Failed(m) => f.write_str(m),
            CliError::Output(e) => write!(f, "cannot write the output: {e}"),
        }
    }
}

impl From<io::Error> for CliError {
    fn from(e: io::Error) -> Self {
        CliError::Output(e)
    }
}

impl From<String> for CliError {
    fn from(m: String) -> Self {
        CliError::Failed(m)
    }
}

impl From<&str> for CliError {
    fn from(m: &str) -> Self {
        CliError::Failed(m.to_owned())
    }
}

/// Turns any displayable error into a [`CliError::Failed`] (`.map_err(failed)?`).
pub fn failed(e: impl fmt::Display) -> CliError {
    CliError::Failed(e.to_string())
}

impl CliError {
    /// Whether this is a closed output pipe: the reader has gone, nothing is wrong.
    pub fn is_broken_pipe(&self) -> bool {
        matches!(self, CliError::Output(e) if e.kind() == io::ErrorKind::BrokenPipe)
    }

    /// The process exit code, after printing the message on stderr (nothing for a closed
    /// pipe).
    pub fn report(&self) -> ExitCode {
        if self.is_broken_pipe() {
            return ExitCode::SUCCESS;
        }
        crate::output::note(format_args!("kvvm: {self}"));
        ExitCode::from(2)
    }
}
