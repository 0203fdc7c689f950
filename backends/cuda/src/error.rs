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

use kvvm_hal::{BackendError, ErrorKind, Operation};

/// A raw `CUresult` value as the driver returned it.
///
/// It is kept as an integer on purpose: cudarc's `CUresult` is a Rust `enum`, and a driver
/// newer than the bindings can return a code outside it, which would be undefined behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CuCode(pub u32);

impl CuCode {
    /// `CUDA_SUCCESS`.
    pub const SUCCESS: CuCode = CuCode(0);

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
        let name = match self.name() {
            Some(name) => name.to_owned(),
            None => format!("CUresult {}", self.0),
        };
        BackendError::new(op, self.kind(), i64::from(self.0), name)
    }
}

/// The name of a `CUresult` code, or `None` if the code is unknown to this table.
pub fn code_name(code: u32) -> Option<&'static str> {
    let name = match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        5 => "CUDA_ERROR_PROFILER_DISABLED",
        6 => "CUDA_ERROR_PROFILER_NOT_INITIALIZED",
        7 => "CUDA_ERROR_PROFILER_ALREADY_STARTED",
        8 => "CUDA_ERROR_PROFILER_ALREADY_STOPPED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        36 => "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER",
        46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
        47 => "CUDA_ERROR_MULTICAST_RESOURCE_FULL",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        102 => "CUDA_ERROR_DEVICE_NOT_LICENSED",
        200 => "CUDA_ERROR_INVALID_IMAGE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        202 => "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
        205 => "CUDA_ERROR_MAP_FAILED",
        206 => "CUDA_ERROR_UNMAP_FAILED",
        207 => "CUDA_ERROR_ARRAY_IS_MAPPED",
        208 => "CUDA_ERROR_ALREADY_MAPPED",
        209 => "CUDA_ERROR_NO_BINARY_FOR_GPU",
        210 => "CUDA_ERROR_ALREADY_ACQUIRED",
        211 => "CUDA_ERROR_NOT_MAPPED",
        212 => "CUDA_ERROR_NOT_MAPPED_AS_ARRAY",
        213 => "CUDA_ERROR_NOT_MAPPED_AS_POINTER",
        214 => "CUDA_ERROR_ECC_UNCORRECTABLE",
        215 => "CUDA_ERROR_UNSUPPORTED_LIMIT",
        216 => "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
        217 => "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        218 => "CUDA_ERROR_INVALID_PTX",
        219 => "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT",
        220 => "CUDA_ERROR_NVLINK_UNCORRECTABLE",
        221 => "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
        222 => "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
        223 => "CUDA_ERROR_JIT_COMPILATION_DISABLED",
        224 => "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY",
        225 => "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC",
        226 => "CUDA_ERROR_CONTAINED",
        227 => "CUDA_ERROR_INSUFFICIENT_LOADER_VERSION",
        300 => "CUDA_ERROR_INVALID_SOURCE",
        301 => "CUDA_ERROR_FILE_NOT_FOUND",
        302 => "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND",
        303 => "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED",
        304 => "CUDA_ERROR_OPERATING_SYSTEM",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        401 => "CUDA_ERROR_ILLEGAL_STATE",
        402 => "CUDA_ERROR_LOSSY_QUERY",
        500 => "CUDA_ERROR_NOT_FOUND",
        600 => "CUDA_ERROR_NOT_READY",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        701 => "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        702 => "CUDA_ERROR_LAUNCH_TIMEOUT",
        703 => "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING",
        704 => "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
        705 => "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
        708 => "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
        709 => "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        710 => "CUDA_ERROR_ASSERT",
        711 => "CUDA_ERROR_TOO_MANY_PEERS",
        712 => "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        713 => "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        714 => "CUDA_ERROR_HARDWARE_STACK_ERROR",
        715 => "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        716 => "CUDA_ERROR_MISALIGNED_ADDRESS",
        717 => "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        718 => "CUDA_ERROR_INVALID_PC",
        719 => "CUDA_ERROR_LAUNCH_FAILED",
        720 => "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
        721 => "CUDA_ERROR_TENSOR_MEMORY_LEAK",
        800 => "CUDA_ERROR_NOT_PERMITTED",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        802 => "CUDA_ERROR_SYSTEM_NOT_READY",
        803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        804 => "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
        805 => "CUDA_ERROR_MPS_CONNECTION_FAILED",
        806 => "CUDA_ERROR_MPS_RPC_FAILURE",
        807 => "CUDA_ERROR_MPS_SERVER_NOT_READY",
        808 => "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED",
        809 => "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED",
        810 => "CUDA_ERROR_MPS_CLIENT_TERMINATED",
        811 => "CUDA_ERROR_CDP_NOT_SUPPORTED",
        812 => "CUDA_ERROR_CDP_VERSION_MISMATCH",
        900 => "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        901 => "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        902 => "CUDA_ERROR_STREAM_CAPTURE_MERGE",
        903 => "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
        904 => "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
        905 => "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
        906 => "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
        907 => "CUDA_ERROR_CAPTURED_EVENT",
        908 => "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
        909 => "CUDA_ERROR_TIMEOUT",
        910 => "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
        911 => "CUDA_ERROR_EXTERNAL_DEVICE",
        912 => "CUDA_ERROR_INVALID_CLUSTER_SIZE",
        913 => "CUDA_ERROR_FUNCTION_NOT_LOADED",
        914 => "CUDA_ERROR_INVALID_RESOURCE_TYPE",
        915 => "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION",
        916 => "CUDA_ERROR_KEY_ROTATION",
        917 => "CUDA_ERROR_STREAM_DETACHED",
        918 => "CUDA_ERROR_GRAPH_RECAPTURE_FAILURE",
        919 => "CUDA_ERROR_FABRIC_NOT_READY",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return None,
    };
    Some(name)
}

/// The [`ErrorKind`] a `CUresult` code maps onto (see the module documentation).
pub fn classify(code: u32) -> ErrorKind {
    match code {
        // OUT_OF_MEMORY
        2 => ErrorKind::OutOfMemory,
        // INVALID_VALUE, INVALID_DEVICE, INVALID_CONTEXT, INVALID_HANDLE, ILLEGAL_STATE
        1 | 101 | 201 | 400 | 401 => ErrorKind::InvalidValue,
        // NOT_SUPPORTED, NOT_PERMITTED; no binary for the GPU, PTX JIT missing, too new or off
        801 | 800 | 209 | 221 | 222 | 223 => ErrorKind::NotSupported,
        // NOT_INITIALIZED, DEINITIALIZED, STUB_LIBRARY, CALL_REQUIRES_NEWER_DRIVER,
        // DEVICE_UNAVAILABLE, NO_DEVICE, DEVICE_NOT_LICENSED, INSUFFICIENT_LOADER_VERSION,
        // SHARED_OBJECT_SYMBOL_NOT_FOUND, SHARED_OBJECT_INIT_FAILED, SYSTEM_NOT_READY,
        // SYSTEM_DRIVER_MISMATCH, COMPAT_NOT_SUPPORTED_ON_DEVICE, MPS connection/server/limits
        3 | 4 | 34 | 36 | 46 | 100 | 102 | 227 | 302 | 303 | 802 | 803 | 804 | 805 | 807 | 808
        | 809 => ErrorKind::Unavailable,
        // ECC_UNCORRECTABLE, NVLINK_UNCORRECTABLE, CONTAINED, ILLEGAL_ADDRESS, LAUNCH_TIMEOUT,
        // CONTEXT_IS_DESTROYED, ASSERT, HARDWARE_STACK_ERROR, ILLEGAL_INSTRUCTION,
        // MISALIGNED_ADDRESS, INVALID_ADDRESS_SPACE, INVALID_PC, LAUNCH_FAILED,
        // TENSOR_MEMORY_LEAK, MPS_CLIENT_TERMINATED: the context is unusable (sticky).
        214 | 220 | 226 | 700 | 702 | 709 | 710 | 714 | 715 | 716 | 717 | 718 | 719 | 721 | 810 => {
            ErrorKind::DeviceLost
        }
        _ => ErrorKind::Other,
    }
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
    fn every_named_code_is_classified_without_panicking() {
        for code in 0..1100 {
            if let Some(name) = code_name(code) {
                assert!(name.starts_with("CUDA_"), "{name}");
                let _ = classify(code);
            }
        }
    }
}
