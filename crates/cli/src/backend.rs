//! Opening a backend for a command, and saying briefly why one is unavailable.
//!
//! Commands validate their flags first and open the backend last, so that a bad flag is
//! reported before (and instead of) the `auto` notice. The notice and the unavailable lines
//! are one short sentence each: what failed, the driver's code, and the fix; `kvvm info
//! --json` keeps the backend's whole message.

use kvvm::num::format_size;
use kvvm::{DeviceId, OpenError, OpenedBackend, VirtualMemoryBackend, BACKEND_NAMES};

use crate::error::{failed, CliError, CliResult};
use crate::output::note;

/// Why a backend cannot be used here, in short.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unavailable {
    /// The backend's name.
    pub backend: String,
    /// The driver's code (`hipErrorNoDevice, code 100`), or the step that failed when there
    /// is no driver code (`load step, no driver code`).
    pub code: String,
    /// What failed, in a few words (`the CUDA driver library was not found`).
    pub summary: String,
    /// What to do about it.
    pub fix: String,
    /// The backend's whole message.
    pub detail: String,
}

/// The first clause of a backend's message: up to the first parenthesis or semicolon.
fn first_clause(detail: &str) -> String {
    let end = detail.find([';', '(']).unwrap_or(detail.len());
    let clause = detail[..end].trim().trim_end_matches([',', ':', '.']);
    if clause.is_empty() {
        detail.trim().to_owned()
    } else {
        clause.to_owned()
    }
}

fn fix_for(backend: &str, code_name: &str, detail: &str) -> String {
    const NO_GPU: &str = "without a GPU use --backend sim";
    match backend {
        "cuda" if detail.contains("library was not found") => format!(
            "install the NVIDIA driver (it provides libcuda.so.1) or add its folder to LD_LIBRARY_PATH; {NO_GPU}"
        ),
        "cuda" => format!("check the GPU and its driver with nvidia-smi; {NO_GPU}"),
        "hip" if code_name == "hipErrorNoDevice" => format!(
            "the HIP runtime loaded but sees no AMD GPU (needs one with the amdgpu kernel driver); {NO_GPU}"
        ),
        "hip" if detail.contains("not found") || detail.contains("cannot load") => format!(
            "install the HIP runtime (Debian: apt-get install libamdhip64-5) or set KVVM_HIP_LIBRARY to its path; {NO_GPU}"
        ),
        "hip" => format!("check the ROCm installation (rocminfo); {NO_GPU}"),
        "host" => "the host backend needs Linux (memfd_create and mmap)".to_owned(),
        _ => NO_GPU.to_owned(),
    }
}

/// The short account of `error` for backend `name`.
pub fn unavailable(name: &str, error: &OpenError) -> Unavailable {
    match error.backend_error() {
        Some(e) => {
            let detail = e.detail.clone().unwrap_or_else(|| e.to_string());
            let code = if e.code != 0 {
                format!("{}, code {}", e.code_name, e.code)
            } else {
                format!("{} step, no driver code", e.op)
            };
            Unavailable {
                backend: name.to_owned(),
                code,
                summary: first_clause(&detail),
                fix: fix_for(name, &e.code_name, &detail),
                detail: error.to_string(),
            }
        }
        None => Unavailable {
            backend: name.to_owned(),
            code: "unknown name".to_owned(),
            summary: error.to_string(),
            fix: format!("use one of {}", BACKEND_NAMES.join(", ")),
            detail: error.to_string(),
        },
    }
}

/// The error for a name that is not a backend.
pub fn unknown_backend(name: &str) -> CliError {
    CliError::Failed(format!(
        "unknown backend {name:?} (expected one of: {})",
        BACKEND_NAMES.join(", ")
    ))
}

/// Checks a `--backend` value without opening anything.
pub fn check_name(name: &str) -> CliResult<()> {
    if BACKEND_NAMES.contains(&name) {
        Ok(())
    } else {
        Err(unknown_backend(name))
    }
}

/// The one-line notice of an `auto` choice that fell back, for command `command`.
pub fn notice(command: &str, opened: &OpenedBackend) -> Option<String> {
    notice_for(
        command,
        opened.backend.name(),
        opened.notice.is_some(),
        &opened.passed_over,
    )
}

/// The notice of an `auto` choice of `chosen` after `passed_over` failed (none when the
/// choice did not fall back).
pub fn notice_for(
    command: &str,
    chosen: &str,
    fell_back: bool,
    passed_over: &[OpenError],
) -> Option<String> {
    if !fell_back {
        return None;
    }
    let why: Vec<String> = passed_over
        .iter()
        .map(|e| {
            let name = match e {
                OpenError::Backend { name, .. } => name.as_str(),
                OpenError::UnknownBackend(n) => n.as_str(),
            };
            let u = unavailable(name, e);
            format!("{name}: {} ({})", u.summary, u.code)
        })
        .collect();
    let what = if chosen == "sim" {
        "the simulated driver (sim)".to_owned()
    } else {
        chosen.to_owned()
    };
    Some(format!(
        "kvvm {command}: auto: using {what}; {}; `kvvm info` says more",
        why.join("; ")
    ))
}

/// The error for a backend that could not be opened: the short reason and the fix.
pub fn open_error(name: &str, error: &OpenError) -> CliError {
    match error {
        OpenError::UnknownBackend(n) => unknown_backend(n),
        e => {
            let u = unavailable(name, e);
            CliError::Failed(format!(
                "backend {name} is unavailable: {} ({}); fix: {}",
                u.summary, u.code, u.fix
            ))
        }
    }
}

/// Opens backend `name` for `command` and prints the `auto` notice on stderr. Unavailable
/// and unknown backends are errors with the short reason and the fix.
pub fn open(command: &str, name: &str) -> CliResult<OpenedBackend> {
    let opened = kvvm::open_backend_verbose(name).map_err(|e| open_error(name, &e))?;
    if let Some(n) = notice(command, &opened) {
        note(n);
    }
    Ok(opened)
}

/// Checks that `device` (the `--device` flag) is one of `opened`'s devices; a backend that
/// cannot list its devices is an error too.
pub fn check_device(opened: &OpenedBackend, device: u32) -> CliResult<()> {
    let name = opened.backend.name();
    let devices = opened
        .backend
        .devices()
        .map_err(|e| CliError::Failed(format!("backend {name} cannot list its devices: {e}")))?;
    crate::flags::check_device("--device", device, name, devices.len())?;
    Ok(())
}

/// Refuses a budget (`--budget-bytes`) larger than the memory of `device` of `backend`: it
/// would promise memory that is not there. A device whose memory is unknown (0) is not checked.
pub fn check_budget_fits(
    budget: u64,
    backend: &dyn VirtualMemoryBackend,
    device: u32,
) -> CliResult<()> {
    let total = backend
        .devices()
        .map_err(failed)?
        .into_iter()
        .find(|d| d.id == DeviceId(device))
        .map_or(0, |d| d.total_memory);
    if total > 0 && budget > total {
        return Err(CliError::Failed(format!(
            "--budget-bytes {} ({budget} bytes) exceeds the memory of device {device} of backend {} ({}): allowed 1 B..={}",
            format_size(budget),
            backend.name(),
            format_size(total),
            format_size(total)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_clauses_are_short() {
        assert_eq!(
            first_clause("the CUDA driver library was not found (searched 17 names; ...)"),
            "the CUDA driver library was not found"
        );
        assert_eq!(
            first_clause(
                "no HIP device (hipErrorNoDevice, HIP runtime 5.2); hipInit(0) returned x"
            ),
            "no HIP device"
        );
        assert_eq!(first_clause("plain"), "plain");
    }

    #[test]
    fn an_unavailable_backend_is_one_line_with_code_and_fix() {
        let e = OpenError::Backend {
            name: "hip".into(),
            source: kvvm::BackendError::new(
                kvvm::Operation::Load,
                kvvm::ErrorKind::Unavailable,
                100,
                "hipErrorNoDevice",
            )
            .with_detail("no HIP device (hipErrorNoDevice, HIP runtime 5.2.21153); hipInit(0) returned hipErrorInvalidDevice"),
        };
        let u = unavailable("hip", &e);
        assert_eq!(u.summary, "no HIP device");
        assert_eq!(u.code, "hipErrorNoDevice, code 100");
        assert!(!u.fix.contains("hipErrorInvalidDevice"), "{}", u.fix);
        assert!(u.detail.contains("hipErrorInvalidDevice"), "{}", u.detail);
        let cuda = OpenError::Backend {
            name: "cuda".into(),
            source: kvvm::BackendError::unavailable(
                kvvm::Operation::Load,
                "the CUDA driver library was not found (searched 17 names such as libcuda.so)",
            ),
        };
        let u = unavailable("cuda", &cuda);
        assert_eq!(u.code, "load step, no driver code");
        assert!(u.fix.contains("LD_LIBRARY_PATH"), "{}", u.fix);
    }
}
