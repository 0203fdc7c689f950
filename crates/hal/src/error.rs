//! Typed backend errors.

use std::fmt;

/// The driver operation a [`BackendError`] comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    /// Loading the vendor library, resolving symbols, initialising the driver.
    Load,
    /// Enumerating devices or reading their attributes.
    Devices,
    /// Querying free/total memory.
    MemoryInfo,
    /// Querying allocation granularity.
    Granularity,
    /// Reserving virtual address space.
    Reserve,
    /// Freeing virtual address space.
    Free,
    /// Creating a physical allocation.
    Create,
    /// Releasing a physical allocation.
    Release,
    /// Mapping a physical allocation at a virtual address.
    Map,
    /// Setting access flags on a mapped range.
    SetAccess,
    /// Unmapping a range.
    Unmap,
    /// Synchronizing a device.
    Synchronize,
    /// Copying host to device.
    CopyToDevice,
    /// Copying device to host.
    CopyFromDevice,
    /// Queuing a strided device-to-device copy on a stream.
    CopyRows,
    /// Exporting a shareable handle.
    Export,
    /// Importing a shareable handle.
    Import,
    /// Launching a probe kernel.
    Kernel,
    /// Allocating page-locked host memory (a host tier's buffer).
    HostAlloc,
    /// Freeing page-locked host memory.
    HostFree,
    /// Queuing a copy from device memory into page-locked host memory on a stream.
    CopyToHost,
    /// Queuing a copy from page-locked host memory into device memory on a stream.
    CopyFromHost,
    /// Recording, querying, waiting for or destroying an event; making a stream wait for one.
    Event,
    /// Creating the backend's own copy stream.
    Stream,
}

impl Operation {
    /// The position of this operation in [`ALL`](Self::ALL) (what per-operation arrays are
    /// indexed by).
    pub fn index(self) -> usize {
        Operation::ALL.iter().position(|o| *o == self).unwrap_or(0)
    }

    /// Every operation, in declaration order (for per-operation tables and fault plans).
    pub const ALL: [Operation; 24] = [
        Operation::Load,
        Operation::Devices,
        Operation::MemoryInfo,
        Operation::Granularity,
        Operation::Reserve,
        Operation::Free,
        Operation::Create,
        Operation::Release,
        Operation::Map,
        Operation::SetAccess,
        Operation::Unmap,
        Operation::Synchronize,
        Operation::CopyToDevice,
        Operation::CopyFromDevice,
        Operation::CopyRows,
        Operation::Export,
        Operation::Import,
        Operation::Kernel,
        Operation::HostAlloc,
        Operation::HostFree,
        Operation::CopyToHost,
        Operation::CopyFromHost,
        Operation::Event,
        Operation::Stream,
    ];

    /// The calls of a host tier: pinned host memory, copies to and from it on a stream, and
    /// the events that say when they are done (what fault injection fails beside
    /// [`VMM_CALLS`](Self::VMM_CALLS) when a swap is under test).
    pub const TIER_CALLS: [Operation; 5] = [
        Operation::HostAlloc,
        Operation::HostFree,
        Operation::CopyToHost,
        Operation::CopyFromHost,
        Operation::Event,
    ];

    /// The memory-management calls: reserve, free, create, release, map, set access, unmap,
    /// synchronize (what "driver calls" counts in kvvm's reports; copies are counted apart).
    pub const VMM_CALLS: [Operation; 8] = [
        Operation::Reserve,
        Operation::Free,
        Operation::Create,
        Operation::Release,
        Operation::Map,
        Operation::SetAccess,
        Operation::Unmap,
        Operation::Synchronize,
    ];

    /// A short lower-case name (`"map"`, `"set_access"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Load => "load",
            Operation::Devices => "devices",
            Operation::MemoryInfo => "memory_info",
            Operation::Granularity => "granularity",
            Operation::Reserve => "reserve",
            Operation::Free => "free",
            Operation::Create => "create",
            Operation::Release => "release",
            Operation::Map => "map",
            Operation::SetAccess => "set_access",
            Operation::Unmap => "unmap",
            Operation::Synchronize => "synchronize",
            Operation::CopyToDevice => "copy_to_device",
            Operation::CopyFromDevice => "copy_from_device",
            Operation::CopyRows => "copy_rows",
            Operation::Export => "export",
            Operation::Import => "import",
            Operation::Kernel => "kernel",
            Operation::HostAlloc => "host_alloc",
            Operation::HostFree => "host_free",
            Operation::CopyToHost => "copy_to_host",
            Operation::CopyFromHost => "copy_from_host",
            Operation::Event => "event",
            Operation::Stream => "stream",
        }
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a caller can do about a [`BackendError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Physical memory or address space is exhausted: retry later or shed load.
    OutOfMemory,
    /// The arguments do not fit the driver's state: a bug in the caller.
    InvalidValue,
    /// The driver cannot do this operation (or not with these arguments).
    NotSupported,
    /// The backend cannot be used here (library, symbol or device missing; runtime too old).
    Unavailable,
    /// The context or device is unusable; its memory cannot be proven idle.
    DeviceLost,
    /// Any other driver failure.
    Other,
}

impl ErrorKind {
    /// A short name (`"out of memory"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::OutOfMemory => "out of memory",
            ErrorKind::InvalidValue => "invalid value",
            ErrorKind::NotSupported => "not supported",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::DeviceLost => "device lost",
            ErrorKind::Other => "other",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed backend call: the operation, the vendor's code and name, and what it means.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{op} failed: {kind}{}{}", fmt_code(*.code, .code_name), fmt_detail(.detail))]
pub struct BackendError {
    /// The driver operation that failed.
    pub op: Operation,
    /// The neutral classification a caller acts on.
    pub kind: ErrorKind,
    /// The vendor's numeric return code (0 when the failure did not come from the driver).
    pub code: i64,
    /// The vendor's name for the code (`"CUDA_ERROR_OUT_OF_MEMORY"`, `"hipErrorNoDevice"`).
    pub code_name: String,
    /// Extra context: the reason a backend is unavailable, the arguments, ...
    pub detail: Option<String>,
}

fn fmt_code(code: i64, name: &str) -> String {
    if code == 0 {
        String::new()
    } else {
        format!(" ({name}, code {code})")
    }
}

fn fmt_detail(detail: &Option<String>) -> String {
    match detail {
        Some(d) => format!(": {d}"),
        None => String::new(),
    }
}

impl BackendError {
    /// A new error from a driver code.
    pub fn new(op: Operation, kind: ErrorKind, code: i64, code_name: impl Into<String>) -> Self {
        BackendError {
            op,
            kind,
            code,
            code_name: code_name.into(),
            detail: None,
        }
    }

    /// An `Unavailable` error that does not come from a driver code (library missing, ...).
    pub fn unavailable(op: Operation, reason: impl Into<String>) -> Self {
        BackendError {
            op,
            kind: ErrorKind::Unavailable,
            code: 0,
            code_name: "unavailable".to_owned(),
            detail: Some(reason.into()),
        }
    }

    /// An error a backend (or a layer above it) raises itself, not from a driver call: an
    /// argument that cannot be passed to the driver (a size that does not fit its type), a
    /// missing device. It carries no vendor code (`code` 0, `code_name` the kind's name), so
    /// it is never mistaken for the driver's answer.
    pub fn raised(op: Operation, kind: ErrorKind, detail: impl Into<String>) -> Self {
        BackendError {
            op,
            kind,
            code: 0,
            code_name: kind.as_str().to_owned(),
            detail: Some(detail.into()),
        }
    }

    /// `value` as the `usize` (`size_t`) a driver call of `op` takes, or the `InvalidValue` a
    /// backend raises itself when it does not fit (on a 32-bit target): the one checked
    /// conversion every vendor backend uses for sizes.
    pub fn usize_arg(op: Operation, what: &str, value: u64) -> Result<usize, BackendError> {
        kvvm_num::to_usize(value, "driver argument").map_err(|_| {
            BackendError::raised(
                op,
                ErrorKind::InvalidValue,
                format!("{what} {value} does not fit in usize"),
            )
        })
    }

    /// Adds context to the error.
    #[must_use]
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Whether the error is an out-of-memory condition (retry later or shed load).
    pub fn is_out_of_memory(&self) -> bool {
        self.kind == ErrorKind::OutOfMemory
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_operation_kind_code_and_detail() {
        let e = BackendError::new(
            Operation::Map,
            ErrorKind::NotSupported,
            801,
            "CUDA_ERROR_NOT_SUPPORTED",
        )
        .with_detail("address 0x200000");
        let s = e.to_string();
        assert_eq!(
            s,
            "map failed: not supported (CUDA_ERROR_NOT_SUPPORTED, code 801): address 0x200000"
        );
        assert!(!e.is_out_of_memory());
    }

    #[test]
    fn unavailable_carries_reason() {
        let e = BackendError::unavailable(Operation::Load, "libcuda.so not found");
        assert_eq!(e.kind, ErrorKind::Unavailable);
        assert!(e.to_string().contains("libcuda.so not found"));
    }

    #[test]
    fn operation_names_are_unique() {
        let mut names: Vec<_> = Operation::ALL.iter().map(|o| o.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Operation::ALL.len());
    }
}
