//! Cases that must run in a child process (a kernel fault leaves the context unusable).
//!
//! The parent re-runs a program (by default its own executable) with the environment
//! variables [`CHILD_ENV`] and [`CHILD_BACKEND_ENV`] set. That program must call
//! [`requested_child`] first thing in `main` and, when it returns a request, open the named
//! backend and hand it to `run_child`, then exit with the code it returns. The child prints
//! one verdict line on stdout, which the parent reads.
//!
//! A fault may also end the child before it can print a verdict: on a backend whose "kernels"
//! are CPU code (the host), a store through a `Read` mapping is stopped by the MMU and the
//! process dies of `SIGSEGV`. The child prints an *armed* line just before the operation that
//! may fault; a child that printed it and was then killed by `SIGSEGV` or `SIGBUS` faulted.

use std::path::PathBuf;
use std::process::Command;

use kvvm_hal::DeviceId;

/// Environment variable naming the child case to run.
pub const CHILD_ENV: &str = "KVVM_CONFORMANCE_CHILD";
/// Environment variable naming the backend the child opens.
pub const CHILD_BACKEND_ENV: &str = "KVVM_CONFORMANCE_CHILD_BACKEND";
/// Environment variable holding the ordinal of the device under test (0 when unset).
pub const CHILD_DEVICE_ENV: &str = "KVVM_CONFORMANCE_CHILD_DEVICE";
/// The child case of `kernel_store_through_read_alias_faults`.
pub const CHILD_KERNEL_STORE: &str = "kernel_store";
/// The child case of `peer_store_through_read_access_faults`.
pub const CHILD_PEER_STORE: &str = "peer_store";

const VERDICT_PREFIX: &str = "KVVM_CHILD_VERDICT ";
const ARMED_LINE: &str = "KVVM_CHILD_ARMED";

/// Prints the armed line (see the module docs), flushed, right before a possibly faulting step;
/// only in a child process (a body run in process, where faults are recoverable, prints
/// nothing: stdout is the report's).
pub(crate) fn arm() {
    use std::io::Write as _;
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{ARMED_LINE}");
    let _ = out.flush();
}

/// The memory-fault signal that ended a child, by name, if one did (`SIGSEGV`, `SIGBUS`).
fn memory_fault_signal(status: &std::process::ExitStatus) -> Option<&'static str> {
    use std::os::unix::process::ExitStatusExt as _;
    match status.signal()? {
        11 => Some("SIGSEGV"),
        7 if cfg!(target_os = "linux") => Some("SIGBUS"),
        10 if !cfg!(target_os = "linux") => Some("SIGBUS"),
        _ => None,
    }
}

/// What a child case reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChildVerdict {
    /// The operation faulted, with the error it reported.
    Fault(String),
    /// The operation completed without a fault.
    NoFault,
    /// The child could not run the case.
    Error(String),
}

impl ChildVerdict {
    pub(crate) fn to_line(&self) -> String {
        match self {
            ChildVerdict::Fault(m) => format!("{VERDICT_PREFIX}fault {m}"),
            ChildVerdict::NoFault => format!("{VERDICT_PREFIX}no-fault"),
            ChildVerdict::Error(m) => format!("{VERDICT_PREFIX}error {m}"),
        }
    }

    fn parse(stdout: &str) -> Option<ChildVerdict> {
        let line = stdout
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix(VERDICT_PREFIX))?;
        let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
        match word {
            "fault" => Some(ChildVerdict::Fault(rest.to_owned())),
            "no-fault" => Some(ChildVerdict::NoFault),
            "error" => Some(ChildVerdict::Error(rest.to_owned())),
            _ => None,
        }
    }
}

/// How to start a child process for a case.
#[derive(Debug, Clone)]
pub struct ChildRunner {
    program: PathBuf,
    args: Vec<String>,
}

impl ChildRunner {
    /// Runs `program` with `args` (the program must honour [`requested_child`]).
    pub fn new(program: impl Into<PathBuf>, args: Vec<String>) -> Self {
        ChildRunner {
            program: program.into(),
            args,
        }
    }

    /// Re-runs the current executable.
    pub fn current_exe() -> std::io::Result<Self> {
        Ok(ChildRunner::new(std::env::current_exe()?, Vec::new()))
    }

    /// Runs child case `case` against device `device` of backend `backend` and returns its
    /// verdict.
    pub fn run(&self, backend: &str, case: &str, device: DeviceId) -> Result<ChildVerdict, String> {
        let out = Command::new(&self.program)
            .args(&self.args)
            .env(CHILD_ENV, case)
            .env(CHILD_BACKEND_ENV, backend)
            .env(CHILD_DEVICE_ENV, device.0.to_string())
            .output()
            .map_err(|e| format!("cannot start {}: {e}", self.program.display()))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if let Some(verdict) = ChildVerdict::parse(&stdout) {
            return Ok(verdict);
        }
        let armed = stdout.lines().any(|l| l == ARMED_LINE);
        if let (true, Some(signal)) = (armed, memory_fault_signal(&out.status)) {
            return Ok(ChildVerdict::Fault(format!(
                "the child was killed by {signal} at the faulting access"
            )));
        }
        Err(format!(
            "child exited with {} and no verdict; stderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A child case this process was started to run (see [`requested_child`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildRequest {
    /// The backend to open, by name (`auto` when unset).
    pub backend: String,
    /// The child case, for `run_child`.
    pub case: String,
    /// The device under test; `None` when the ordinal given is not a number (`run_child`
    /// reports that as an error verdict).
    pub device: Option<DeviceId>,
}

/// The child request in this process's environment, if there is one.
pub fn requested_child() -> Option<ChildRequest> {
    let case = std::env::var(CHILD_ENV).ok()?;
    let backend = std::env::var(CHILD_BACKEND_ENV).unwrap_or_else(|_| "auto".to_owned());
    let device = match std::env::var(CHILD_DEVICE_ENV) {
        Ok(d) => d.trim().parse().ok().map(DeviceId),
        Err(_) => Some(DeviceId(0)),
    };
    Some(ChildRequest {
        backend,
        case,
        device,
    })
}

/// Prints an error verdict (for a child that could not open its backend); returns the code.
pub fn report_child_error(message: &str) -> i32 {
    use std::io::Write as _;
    let _ = writeln!(
        std::io::stdout(),
        "{}",
        ChildVerdict::Error(message.to_owned()).to_line()
    );
    2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdict_lines_roundtrip() {
        for v in [
            ChildVerdict::Fault("kernel failed: device lost".into()),
            ChildVerdict::NoFault,
            ChildVerdict::Error("no device".into()),
        ] {
            let text = format!("noise\n{}\n", v.to_line());
            assert_eq!(ChildVerdict::parse(&text), Some(v));
        }
        assert_eq!(ChildVerdict::parse("nothing here"), None);
    }

    fn sh(script: &str) -> ChildRunner {
        ChildRunner::new("sh", vec!["-c".into(), script.into()])
    }

    #[test]
    fn a_child_killed_by_sigsegv_after_arming_faulted() {
        let armed = sh(&format!("echo {ARMED_LINE}; kill -SEGV $$"));
        match armed.run("host", CHILD_KERNEL_STORE, DeviceId(0)) {
            Ok(ChildVerdict::Fault(m)) => assert!(m.contains("SIGSEGV"), "{m}"),
            other => panic!("expected a fault, got {other:?}"),
        }
        // Killed before arming (in its set-up): no verdict, an error.
        assert!(sh("kill -SEGV $$")
            .run("host", CHILD_KERNEL_STORE, DeviceId(0))
            .is_err());
        // Armed but killed by another signal: not a memory fault.
        let killed = sh(&format!("echo {ARMED_LINE}; kill -TERM $$"));
        assert!(killed.run("host", CHILD_KERNEL_STORE, DeviceId(0)).is_err());
        // A verdict line wins.
        let verdict = sh(&format!("echo {ARMED_LINE}; echo {VERDICT_PREFIX}no-fault"));
        assert_eq!(
            verdict.run("host", CHILD_KERNEL_STORE, DeviceId(0)),
            Ok(ChildVerdict::NoFault)
        );
    }
}
