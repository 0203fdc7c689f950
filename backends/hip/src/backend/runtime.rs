//! [`HipRuntime`]: loading the HIP runtime library, resolving its symbols and reading its
//! version, then initialising it into a [`HipBackend`] ([`HipRuntime::open`]).

use std::mem::ManuallyDrop;

use kvvm_hal::{BackendError, BackendResult, Operation};
use libloading::Library;

use super::HipBackend;
use crate::driver::result::error_name;
use crate::driver::HipApi;
use crate::error::{unavailable, HIP_ERROR_NO_DEVICE, HIP_SUCCESS};
use crate::version::{self, PropLayout, RuntimeVersion};
use crate::{LIBRARY_ENV, LIBRARY_NAMES};

/// A loaded HIP runtime whose symbols are resolved and whose version is read, before
/// `hipInit`. `HipRuntime::open` turns it into a `HipBackend`.
///
/// Reading the version needs no device, which is what lets CI check a real runtime on a
/// machine without an AMD GPU.
#[derive(Debug)]
pub struct HipRuntime {
    /// Never dropped: unloading the HIP runtime under its own threads crashes.
    _library: ManuallyDrop<Library>,
    pub(crate) api: HipApi,
    pub(crate) path: String,
    pub(crate) version: RuntimeVersion,
}

impl HipRuntime {
    /// Loads the runtime named by `KVVM_HIP_LIBRARY`, or else the first of [`LIBRARY_NAMES`]
    /// that loads.
    pub fn load() -> BackendResult<HipRuntime> {
        match std::env::var_os(LIBRARY_ENV) {
            Some(path) if !path.is_empty() => Self::load_from(&path.to_string_lossy()),
            _ => Self::load_system(),
        }
    }

    /// Loads the first of [`LIBRARY_NAMES`] that loads, ignoring `KVVM_HIP_LIBRARY`.
    ///
    /// When none loads, the error's message starts with `no HIP runtime (libamdhip64 not
    /// found` and lists each name with the loader's reason.
    pub fn load_system() -> BackendResult<HipRuntime> {
        let mut tried = Vec::new();
        for name in LIBRARY_NAMES {
            // SAFETY: loading runs the library's initialisers; these names are the HIP
            // runtime's own sonames, whose initialisers are safe to run in any process.
            match unsafe { Library::new(name) } {
                Ok(lib) => return Self::from_library(lib, name.to_owned()),
                Err(e) => tried.push(format!("{name}: {}", describe(&e))),
            }
        }
        Err(BackendError::unavailable(
            Operation::Load,
            format!(
                "no HIP runtime (libamdhip64 not found; tried {})",
                tried.join("; ")
            ),
        ))
    }

    /// Loads the HIP runtime (or a library with the HIP ABI, such as the HIP-on-CUDA shim)
    /// at `path`. Nothing else is tried.
    pub fn load_from(path: &str) -> BackendResult<HipRuntime> {
        // SAFETY: loading runs the library's initialisers; the caller (or KVVM_HIP_LIBRARY)
        // chose this library explicitly as a HIP runtime.
        match unsafe { Library::new(path) } {
            Ok(lib) => Self::from_library(lib, path.to_owned()),
            Err(e) => Err(BackendError::unavailable(
                Operation::Load,
                format!("cannot load the HIP runtime {path}: {}", describe(&e)),
            )),
        }
    }

    fn from_library(lib: Library, path: String) -> BackendResult<HipRuntime> {
        let library = ManuallyDrop::new(lib);
        let api = HipApi::load(&library, &path)?;
        let raw = api.call_runtime_get_version().map_err(|rc| {
            unavailable(rc, error_name(&api, rc)).with_detail(format!(
                "hipRuntimeGetVersion failed ({}, code {rc}) in {path}",
                error_name(&api, rc)
            ))
        })?;
        Ok(HipRuntime {
            _library: library,
            api,
            path,
            version: RuntimeVersion(raw),
        })
    }

    /// The runtime's version (`hipRuntimeGetVersion`).
    pub fn version(&self) -> RuntimeVersion {
        self.version
    }

    /// The library that was loaded (a soname or the path given).
    pub fn library(&self) -> &str {
        &self.path
    }

    /// The resolved entry points.
    pub fn api(&self) -> &HipApi {
        &self.api
    }

    /// The `hipMemAllocationProp` layout of this runtime, or `Unavailable` naming the version
    /// when it is outside the verified range.
    pub fn layout(&self) -> BackendResult<PropLayout> {
        version::layout_for(self.version).map_err(|reason| {
            BackendError::unavailable(Operation::Load, format!("{reason} ({})", self.path))
        })
    }
}

impl HipRuntime {
    /// Initialises the runtime (`hipInit(0)`, `hipGetDeviceCount`) and returns the backend.
    ///
    /// Fails with `Unavailable` when the version is outside the verified range, when the
    /// runtime cannot initialise, or when there is no device (`no HIP device
    /// (hipErrorNoDevice, HIP runtime X.Y.Z)`).
    pub fn open(self) -> BackendResult<HipBackend> {
        let layout = self.layout()?;
        let api = self.api;
        let version = self.version;
        // 0 is the only documented flag value.
        let init_rc = api.call_init(0).err().unwrap_or(HIP_SUCCESS);
        let (count_rc, count) = api.call_get_device_count();
        tracing::debug!(
            library = %self.path, %version, init_rc, count_rc, count, "HIP runtime initialised"
        );
        let init_note = if init_rc == HIP_SUCCESS {
            String::new()
        } else {
            format!("; hipInit(0) returned {}", error_name(&api, init_rc))
        };
        let refuse = |rc, what: String| {
            Err(unavailable(rc, error_name(&api, rc))
                .with_detail(format!("{what}; library {}", self.path)))
        };
        if count_rc == HIP_ERROR_NO_DEVICE || (count_rc == HIP_SUCCESS && count <= 0) {
            let what =
                format!("no HIP device (hipErrorNoDevice, HIP runtime {version}){init_note}");
            return refuse(HIP_ERROR_NO_DEVICE, what);
        }
        if count_rc != HIP_SUCCESS {
            let name = error_name(&api, count_rc);
            let what =
                format!("hipGetDeviceCount failed ({name}, HIP runtime {version}){init_note}");
            return refuse(count_rc, what);
        }
        if init_rc != HIP_SUCCESS {
            let name = error_name(&api, init_rc);
            return refuse(
                init_rc,
                format!("hipInit(0) failed ({name}, HIP runtime {version})"),
            );
        }
        let device_count = u32::try_from(count).unwrap_or(0);
        HipBackend::new(self, layout, device_count)
    }
}

/// A loader error with its cause (`dlopen failed: libfoo.so: cannot open shared object ...`).
fn describe(e: &libloading::Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvvm_hal::ErrorKind;

    #[test]
    fn a_missing_library_is_unavailable_and_names_the_path() {
        let e = HipRuntime::load_from("/nonexistent/libamdhip64.so.42").expect_err("no library");
        assert_eq!(e.kind, ErrorKind::Unavailable);
        assert_eq!(e.op, Operation::Load);
        assert!(
            e.to_string().contains("/nonexistent/libamdhip64.so.42"),
            "{e}"
        );
    }

    #[test]
    fn a_library_without_hip_symbols_is_unavailable_and_names_the_symbol() {
        // libc loads everywhere and has no HIP symbol.
        let e = HipRuntime::load_from("libc.so.6").expect_err("not HIP");
        assert_eq!(e.kind, ErrorKind::Unavailable);
        let s = e.to_string();
        assert!(s.contains("hipInit") && s.contains("libc.so.6"), "{s}");
    }
}
