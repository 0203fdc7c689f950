//! `CUresult` codes: their names and the [`ErrorKind`] each one maps onto.
//!
//! The table is our own (CUDA 13.4's `cuda.h` codes, a superset of the 12.8 bindings), so an
//! error can be named even when the library is missing or too old for `cuGetErrorName` to
//! know the code. The classification follows the crate contract:
//!
//! | codes | kind |
//! |---|---|
//! | `OUT_OF_MEMORY` | `OutOfMemory` |
//! | `INVALID_VALUE`, `INVALID_HANDLE`, `INVALID_DEVICE`, `INVALID_CONTEXT`, `ILLEGAL_STATE` | `InvalidValue` |
//! | `NOT_SUPPORTED`, `NOT_PERMITTED`, PTX/JIT not available | `NotSupported` |
//! | no device, not initialised, stub or too-old library, system not ready, MPS unavailable | `Unavailable` |
//! | sticky launch errors (`ILLEGAL_ADDRESS`, `LAUNCH_FAILED`, ...), ECC/NVLink faults, destroyed context | `DeviceLost` |
//! | everything else, including codes this table does not know | `Other` |

use kvvm_hal::{BackendError, ErrorCodes, ErrorKind, Operation};

/// A raw `CUresult` value as the driver returned it.
///
/// It is kept as an integer on purpose: cudarc's `CUresult` is a Rust `enum`, and a driver
/// newer than the bindings can return a code outside it, which would be undefined behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CuCode(pub u32);

impl CuCode {
    /// `CUDA_SUCCESS`.
    pub const SUCCESS: CuCode = CuCode(0);
    /// `CUDA_ERROR_NO_DEVICE`.
    pub const NO_DEVICE: CuCode = CuCode(100);
    /// `CUDA_ERROR_INVALID_DEVICE`.
    pub const INVALID_DEVICE: CuCode = CuCode(101);
    /// `CUDA_ERROR_NOT_READY`: queued work (an event's) is not done yet; not a failure.
    pub const NOT_READY: CuCode = CuCode(600);
    /// `CUDA_ERROR_NOT_SUPPORTED`.
    pub const NOT_SUPPORTED: CuCode = CuCode(801);

    /// Whether the code is `CUDA_SUCCESS`.
    pub fn is_success(self) -> bool {
        self.0 == 0
    }

    /// The code's name (`"CUDA_ERROR_OUT_OF_MEMORY"`), if this table knows it.
    pub fn name(self) -> Option<&'static str> {
        code_name(self.0)
    }

    /// The neutral classification of the code.
    pub fn kind(self) -> ErrorKind {
        classify(self.0)
    }

    /// A [`BackendError`] for `op` carrying the code, its name and its kind.
    pub fn to_error(self, op: Operation) -> BackendError {
        CODES.error(op, self.0, "CUresult")
    }
}

/// `(code, name, kind)` of every `CUresult` this crate knows: one table, read by
/// [`code_name`] and [`classify`] (see the module documentation for the classification).
const TABLE: &[(u32, &str, ErrorKind)] = &[
    (0, "CUDA_SUCCESS", ErrorKind::Other),
    (1, "CUDA_ERROR_INVALID_VALUE", ErrorKind::InvalidValue),
    (2, "CUDA_ERROR_OUT_OF_MEMORY", ErrorKind::OutOfMemory),
    (3, "CUDA_ERROR_NOT_INITIALIZED", ErrorKind::Unavailable),
    (4, "CUDA_ERROR_DEINITIALIZED", ErrorKind::Unavailable),
    (5, "CUDA_ERROR_PROFILER_DISABLED", ErrorKind::Other),
    (6, "CUDA_ERROR_PROFILER_NOT_INITIALIZED", ErrorKind::Other),
    (7, "CUDA_ERROR_PROFILER_ALREADY_STARTED", ErrorKind::Other),
    (8, "CUDA_ERROR_PROFILER_ALREADY_STOPPED", ErrorKind::Other),
    (34, "CUDA_ERROR_STUB_LIBRARY", ErrorKind::Unavailable),
    (
        36,
        "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER",
        ErrorKind::Unavailable,
    ),
    (46, "CUDA_ERROR_DEVICE_UNAVAILABLE", ErrorKind::Unavailable),
    (47, "CUDA_ERROR_MULTICAST_RESOURCE_FULL", ErrorKind::Other),
    (100, "CUDA_ERROR_NO_DEVICE", ErrorKind::Unavailable),
    (101, "CUDA_ERROR_INVALID_DEVICE", ErrorKind::InvalidValue),
    (
        102,
        "CUDA_ERROR_DEVICE_NOT_LICENSED",
        ErrorKind::Unavailable,
    ),
    (200, "CUDA_ERROR_INVALID_IMAGE", ErrorKind::Other),
    (201, "CUDA_ERROR_INVALID_CONTEXT", ErrorKind::InvalidValue),
    (202, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT", ErrorKind::Other),
    (205, "CUDA_ERROR_MAP_FAILED", ErrorKind::Other),
    (206, "CUDA_ERROR_UNMAP_FAILED", ErrorKind::Other),
    (207, "CUDA_ERROR_ARRAY_IS_MAPPED", ErrorKind::Other),
    (208, "CUDA_ERROR_ALREADY_MAPPED", ErrorKind::Other),
    (209, "CUDA_ERROR_NO_BINARY_FOR_GPU", ErrorKind::NotSupported),
    (210, "CUDA_ERROR_ALREADY_ACQUIRED", ErrorKind::Other),
    (211, "CUDA_ERROR_NOT_MAPPED", ErrorKind::Other),
    (212, "CUDA_ERROR_NOT_MAPPED_AS_ARRAY", ErrorKind::Other),
    (213, "CUDA_ERROR_NOT_MAPPED_AS_POINTER", ErrorKind::Other),
    (214, "CUDA_ERROR_ECC_UNCORRECTABLE", ErrorKind::DeviceLost),
    (215, "CUDA_ERROR_UNSUPPORTED_LIMIT", ErrorKind::Other),
    (216, "CUDA_ERROR_CONTEXT_ALREADY_IN_USE", ErrorKind::Other),
    (217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", ErrorKind::Other),
    (218, "CUDA_ERROR_INVALID_PTX", ErrorKind::Other),
    (219, "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT", ErrorKind::Other),
    (
        220,
        "CUDA_ERROR_NVLINK_UNCORRECTABLE",
        ErrorKind::DeviceLost,
    ),
    (
        221,
        "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
        ErrorKind::NotSupported,
    ),
    (
        222,
        "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
        ErrorKind::NotSupported,
    ),
    (
        223,
        "CUDA_ERROR_JIT_COMPILATION_DISABLED",
        ErrorKind::NotSupported,
    ),
    (
        224,
        "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY",
        ErrorKind::Other,
    ),
    (225, "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC", ErrorKind::Other),
    (226, "CUDA_ERROR_CONTAINED", ErrorKind::DeviceLost),
    (
        227,
        "CUDA_ERROR_INSUFFICIENT_LOADER_VERSION",
        ErrorKind::Unavailable,
    ),
    (300, "CUDA_ERROR_INVALID_SOURCE", ErrorKind::Other),
    (301, "CUDA_ERROR_FILE_NOT_FOUND", ErrorKind::Other),
    (
        302,
        "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND",
        ErrorKind::Unavailable,
    ),
    (
        303,
        "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED",
        ErrorKind::Unavailable,
    ),
    (304, "CUDA_ERROR_OPERATING_SYSTEM", ErrorKind::Other),
    (400, "CUDA_ERROR_INVALID_HANDLE", ErrorKind::InvalidValue),
    (401, "CUDA_ERROR_ILLEGAL_STATE", ErrorKind::InvalidValue),
    (402, "CUDA_ERROR_LOSSY_QUERY", ErrorKind::Other),
    (500, "CUDA_ERROR_NOT_FOUND", ErrorKind::Other),
    (600, "CUDA_ERROR_NOT_READY", ErrorKind::Other),
    (700, "CUDA_ERROR_ILLEGAL_ADDRESS", ErrorKind::DeviceLost),
    (701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", ErrorKind::Other),
    (702, "CUDA_ERROR_LAUNCH_TIMEOUT", ErrorKind::DeviceLost),
    (
        703,
        "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING",
        ErrorKind::Other,
    ),
    (
        704,
        "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
        ErrorKind::Other,
    ),
    (705, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", ErrorKind::Other),
    (708, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", ErrorKind::Other),
    (
        709,
        "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        ErrorKind::DeviceLost,
    ),
    (710, "CUDA_ERROR_ASSERT", ErrorKind::DeviceLost),
    (711, "CUDA_ERROR_TOO_MANY_PEERS", ErrorKind::Other),
    (
        712,
        "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        ErrorKind::Other,
    ),
    (
        713,
        "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        ErrorKind::Other,
    ),
    (
        714,
        "CUDA_ERROR_HARDWARE_STACK_ERROR",
        ErrorKind::DeviceLost,
    ),
    (715, "CUDA_ERROR_ILLEGAL_INSTRUCTION", ErrorKind::DeviceLost),
    (716, "CUDA_ERROR_MISALIGNED_ADDRESS", ErrorKind::DeviceLost),
    (
        717,
        "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        ErrorKind::DeviceLost,
    ),
    (718, "CUDA_ERROR_INVALID_PC", ErrorKind::DeviceLost),
    (719, "CUDA_ERROR_LAUNCH_FAILED", ErrorKind::DeviceLost),
    (
        720,
        "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
        ErrorKind::Other,
    ),
    (721, "CUDA_ERROR_TENSOR_MEMORY_LEAK", ErrorKind::DeviceLost),
    (800, "CUDA_ERROR_NOT_PERMITTED", ErrorKind::NotSupported),
    (801, "CUDA_ERROR_NOT_SUPPORTED", ErrorKind::NotSupported),
    (802, "CUDA_ERROR_SYSTEM_NOT_READY", ErrorKind::Unavailable),
    (
        803,
        "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        ErrorKind::Unavailable,
    ),
    (
        804,
        "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
        ErrorKind::Unavailable,
    ),
    (
        805,
        "CUDA_ERROR_MPS_CONNECTION_FAILED",
        ErrorKind::Unavailable,
    ),
    (806, "CUDA_ERROR_MPS_RPC_FAILURE", ErrorKind::Other),
    (
        807,
        "CUDA_ERROR_MPS_SERVER_NOT_READY",
        ErrorKind::Unavailable,
    ),
    (
        808,
        "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED",
        ErrorKind::Unavailable,
    ),
    (
        809,
        "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED",
        ErrorKind::Unavailable,
    ),
    (
        810,
        "CUDA_ERROR_MPS_CLIENT_TERMINATED",
        ErrorKind::DeviceLost,
    ),
    (811, "CUDA_ERROR_CDP_NOT_SUPPORTED", ErrorKind::Other),
    (812, "CUDA_ERROR_CDP_VERSION_MISMATCH", ErrorKind::Other),
    (
        900,
        "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        ErrorKind::Other,
    ),
    (
        901,
        "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        ErrorKind::Other,
    ),
    (902, "CUDA_ERROR_STREAM_CAPTURE_MERGE", ErrorKind::Other),
    (903, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", ErrorKind::Other),
    (904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", ErrorKind::Other),
    (905, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION", ErrorKind::Other),
    (906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", ErrorKind::Other),
    (907, "CUDA_ERROR_CAPTURED_EVENT", ErrorKind::Other),
    (
        908,
        "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
        ErrorKind::Other,
    ),
    (909, "CUDA_ERROR_TIMEOUT", ErrorKind::Other),
    (
        910,
        "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
        ErrorKind::Other,
    ),
    (911, "CUDA_ERROR_EXTERNAL_DEVICE", ErrorKind::Other),
    (912, "CUDA_ERROR_INVALID_CLUSTER_SIZE", ErrorKind::Other),
    (913, "CUDA_ERROR_FUNCTION_NOT_LOADED", ErrorKind::Other),
    (914, "CUDA_ERROR_INVALID_RESOURCE_TYPE", ErrorKind::Other),
    (
        915,
        "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION",
        ErrorKind::Other,
    ),
    (916, "CUDA_ERROR_KEY_ROTATION", ErrorKind::Other),
    (917, "CUDA_ERROR_STREAM_DETACHED", ErrorKind::Other),
    (918, "CUDA_ERROR_GRAPH_RECAPTURE_FAILURE", ErrorKind::Other),
    (919, "CUDA_ERROR_FABRIC_NOT_READY", ErrorKind::Other),
    (999, "CUDA_ERROR_UNKNOWN", ErrorKind::Other),
];

/// [`TABLE`] as the [`ErrorCodes`] that names and classifies a code.
const CODES: ErrorCodes<u32> = ErrorCodes::new(TABLE);

/// The name of a `CUresult` code, or `None` if the code is unknown to this table.
pub fn code_name(code: u32) -> Option<&'static str> {
    CODES.name(code)
}

/// The [`ErrorKind`] a `CUresult` code maps onto (see the module documentation); `Other` for
/// a code this table does not know.
pub fn classify(code: u32) -> ErrorKind {
    CODES.kind(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn success_is_success() {
        assert!(CuCode::SUCCESS.is_success());
        assert!(!CuCode(1).is_success());
        assert_eq!(CuCode(0).name(), Some("CUDA_SUCCESS"));
    }

    #[test]
    fn codes_map_onto_kinds() {
        let cases: &[(u32, &str, ErrorKind)] = &[
            (2, "CUDA_ERROR_OUT_OF_MEMORY", ErrorKind::OutOfMemory),
            (1, "CUDA_ERROR_INVALID_VALUE", ErrorKind::InvalidValue),
            (400, "CUDA_ERROR_INVALID_HANDLE", ErrorKind::InvalidValue),
            (101, "CUDA_ERROR_INVALID_DEVICE", ErrorKind::InvalidValue),
            (201, "CUDA_ERROR_INVALID_CONTEXT", ErrorKind::InvalidValue),
            (801, "CUDA_ERROR_NOT_SUPPORTED", ErrorKind::NotSupported),
            (800, "CUDA_ERROR_NOT_PERMITTED", ErrorKind::NotSupported),
            (
                222,
                "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
                ErrorKind::NotSupported,
            ),
            (100, "CUDA_ERROR_NO_DEVICE", ErrorKind::Unavailable),
            (3, "CUDA_ERROR_NOT_INITIALIZED", ErrorKind::Unavailable),
            (4, "CUDA_ERROR_DEINITIALIZED", ErrorKind::Unavailable),
            (34, "CUDA_ERROR_STUB_LIBRARY", ErrorKind::Unavailable),
            (
                36,
                "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER",
                ErrorKind::Unavailable,
            ),
            (
                302,
                "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND",
                ErrorKind::Unavailable,
            ),
            (
                303,
                "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED",
                ErrorKind::Unavailable,
            ),
            (
                803,
                "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
                ErrorKind::Unavailable,
            ),
            (700, "CUDA_ERROR_ILLEGAL_ADDRESS", ErrorKind::DeviceLost),
            (719, "CUDA_ERROR_LAUNCH_FAILED", ErrorKind::DeviceLost),
            (214, "CUDA_ERROR_ECC_UNCORRECTABLE", ErrorKind::DeviceLost),
            (
                709,
                "CUDA_ERROR_CONTEXT_IS_DESTROYED",
                ErrorKind::DeviceLost,
            ),
            (715, "CUDA_ERROR_ILLEGAL_INSTRUCTION", ErrorKind::DeviceLost),
            (716, "CUDA_ERROR_MISALIGNED_ADDRESS", ErrorKind::DeviceLost),
            (710, "CUDA_ERROR_ASSERT", ErrorKind::DeviceLost),
            (600, "CUDA_ERROR_NOT_READY", ErrorKind::Other),
            (218, "CUDA_ERROR_INVALID_PTX", ErrorKind::Other),
            (999, "CUDA_ERROR_UNKNOWN", ErrorKind::Other),
        ];
        for &(code, name, kind) in cases {
            assert_eq!(code_name(code), Some(name), "name of {code}");
            assert_eq!(classify(code), kind, "kind of {name}");
        }
    }

    #[test]
    fn unknown_codes_are_other_and_still_named() {
        assert_eq!(code_name(12345), None);
        assert_eq!(classify(12345), ErrorKind::Other);
        let e = CuCode(12345).to_error(Operation::Map);
        assert_eq!(e.kind, ErrorKind::Other);
        assert_eq!(e.code, 12345);
        assert_eq!(e.code_name, "CUresult 12345");
    }

    #[test]
    fn errors_carry_operation_code_and_name() {
        let e = CuCode(801).to_error(Operation::Map);
        assert_eq!(e.op, Operation::Map);
        assert_eq!(e.kind, ErrorKind::NotSupported);
        assert_eq!(e.code, 801);
        assert_eq!(e.code_name, "CUDA_ERROR_NOT_SUPPORTED");
        assert_eq!(
            e.to_string(),
            "map failed: not supported (CUDA_ERROR_NOT_SUPPORTED, code 801)"
        );
        assert!(CuCode(2).to_error(Operation::Create).is_out_of_memory());
    }

    #[test]
    fn table_agrees_with_cudarc_bindings() {
        use cudarc::driver::sys::CUresult as R;
        let variants = [
            R::CUDA_SUCCESS,
            R::CUDA_ERROR_INVALID_VALUE,
            R::CUDA_ERROR_OUT_OF_MEMORY,
            R::CUDA_ERROR_NOT_INITIALIZED,
            R::CUDA_ERROR_DEINITIALIZED,
            R::CUDA_ERROR_STUB_LIBRARY,
            R::CUDA_ERROR_NO_DEVICE,
            R::CUDA_ERROR_INVALID_DEVICE,
            R::CUDA_ERROR_INVALID_CONTEXT,
            R::CUDA_ERROR_ECC_UNCORRECTABLE,
            R::CUDA_ERROR_INVALID_PTX,
            R::CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
            R::CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND,
            R::CUDA_ERROR_SHARED_OBJECT_INIT_FAILED,
            R::CUDA_ERROR_INVALID_HANDLE,
            R::CUDA_ERROR_ILLEGAL_STATE,
            R::CUDA_ERROR_NOT_FOUND,
            R::CUDA_ERROR_NOT_READY,
            R::CUDA_ERROR_ILLEGAL_ADDRESS,
            R::CUDA_ERROR_LAUNCH_TIMEOUT,
            R::CUDA_ERROR_CONTEXT_IS_DESTROYED,
            R::CUDA_ERROR_ILLEGAL_INSTRUCTION,
            R::CUDA_ERROR_LAUNCH_FAILED,
            R::CUDA_ERROR_NOT_PERMITTED,
            R::CUDA_ERROR_NOT_SUPPORTED,
            R::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,
            R::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE,
            R::CUDA_ERROR_TIMEOUT,
            R::CUDA_ERROR_EXTERNAL_DEVICE,
            R::CUDA_ERROR_UNKNOWN,
        ];
        for r in variants {
            let debug = format!("{r:?}");
            assert_eq!(code_name(r as u32), Some(debug.as_str()));
        }
    }

    #[test]
    fn table_has_no_duplicate_codes_and_the_constants_agree() {
        let mut codes: Vec<u32> = TABLE.iter().map(|(c, _, _)| *c).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), TABLE.len());
        assert_eq!(CuCode::NO_DEVICE.name(), Some("CUDA_ERROR_NO_DEVICE"));
        assert_eq!(
            CuCode::INVALID_DEVICE.name(),
            Some("CUDA_ERROR_INVALID_DEVICE")
        );
        assert_eq!(
            CuCode::NOT_SUPPORTED.name(),
            Some("CUDA_ERROR_NOT_SUPPORTED")
        );
    }

    #[test]
    fn every_named_code_is_classified_without_panicking() {
        for code in 0..1100 {
            if let Some(name) = code_name(code) {
                assert!(name.starts_with("CUDA_"), "{name}");
                let _ = classify(code);
            }
        }
    }
}
