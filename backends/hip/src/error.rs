//! HIP return codes: the raw code type, one table of `(code, name, kind)`, and the
//! [`BackendError`] a failed call becomes.
//!
//! The table is ours (written from ROCm 5.2's `hip_runtime_api.h`, whose values are unchanged
//! in 6.x/7.x), so that a name is available even when the runtime lacks `hipGetErrorName` and
//! so that classification never depends on the runtime. A code missing from the table is
//! classified [`ErrorKind::Other`] and named by `hipGetErrorName` when available, or
//! `"hipError(<n>)"`.

use kvvm_hal::{BackendError, ErrorCodes, ErrorKind, Operation};

/// A raw `hipError_t` value (0 is `hipSuccess`). Never a Rust enum: a newer runtime may return
/// a code this crate does not know, and an out-of-range enum value is undefined behaviour.
pub type HipErrorCode = i32;

/// `hipSuccess`.
pub const HIP_SUCCESS: HipErrorCode = 0;

/// `hipErrorInvalidValue`.
pub const HIP_ERROR_INVALID_VALUE: HipErrorCode = 1;
/// `hipErrorOutOfMemory` (also `hipErrorMemoryAllocation`).
pub const HIP_ERROR_OUT_OF_MEMORY: HipErrorCode = 2;
/// `hipErrorNotInitialized`.
pub const HIP_ERROR_NOT_INITIALIZED: HipErrorCode = 3;
/// `hipErrorInsufficientDriver`.
pub const HIP_ERROR_INSUFFICIENT_DRIVER: HipErrorCode = 35;
/// `hipErrorNoDevice`.
pub const HIP_ERROR_NO_DEVICE: HipErrorCode = 100;
/// `hipErrorInvalidDevice`.
pub const HIP_ERROR_INVALID_DEVICE: HipErrorCode = 101;
/// `hipErrorInvalidContext`.
pub const HIP_ERROR_INVALID_CONTEXT: HipErrorCode = 201;
/// `hipErrorInvalidHandle` (also `hipErrorInvalidResourceHandle`).
pub const HIP_ERROR_INVALID_HANDLE: HipErrorCode = 400;
/// `hipErrorIllegalAddress`.
pub const HIP_ERROR_ILLEGAL_ADDRESS: HipErrorCode = 700;
/// `hipErrorLaunchFailure`.
pub const HIP_ERROR_LAUNCH_FAILURE: HipErrorCode = 719;
/// `hipErrorNotSupported`.
pub const HIP_ERROR_NOT_SUPPORTED: HipErrorCode = 801;
/// `hipErrorUnknown`.
pub const HIP_ERROR_UNKNOWN: HipErrorCode = 999;

/// `(code, name, kind)` for every code this crate knows.
const TABLE: &[(HipErrorCode, &str, ErrorKind)] = &[
    (0, "hipSuccess", ErrorKind::Other),
    (1, "hipErrorInvalidValue", ErrorKind::InvalidValue),
    (2, "hipErrorOutOfMemory", ErrorKind::OutOfMemory),
    (3, "hipErrorNotInitialized", ErrorKind::Unavailable),
    (4, "hipErrorDeinitialized", ErrorKind::Unavailable),
    (5, "hipErrorProfilerDisabled", ErrorKind::Other),
    (6, "hipErrorProfilerNotInitialized", ErrorKind::Other),
    (7, "hipErrorProfilerAlreadyStarted", ErrorKind::Other),
    (8, "hipErrorProfilerAlreadyStopped", ErrorKind::Other),
    (9, "hipErrorInvalidConfiguration", ErrorKind::Other),
    (12, "hipErrorInvalidPitchValue", ErrorKind::InvalidValue),
    (13, "hipErrorInvalidSymbol", ErrorKind::Other),
    (17, "hipErrorInvalidDevicePointer", ErrorKind::InvalidValue),
    (
        21,
        "hipErrorInvalidMemcpyDirection",
        ErrorKind::InvalidValue,
    ),
    (35, "hipErrorInsufficientDriver", ErrorKind::Unavailable),
    (52, "hipErrorMissingConfiguration", ErrorKind::Other),
    (53, "hipErrorPriorLaunchFailure", ErrorKind::DeviceLost),
    (98, "hipErrorInvalidDeviceFunction", ErrorKind::Other),
    (100, "hipErrorNoDevice", ErrorKind::Unavailable),
    (101, "hipErrorInvalidDevice", ErrorKind::InvalidValue),
    (200, "hipErrorInvalidImage", ErrorKind::Other),
    (201, "hipErrorInvalidContext", ErrorKind::InvalidValue),
    (202, "hipErrorContextAlreadyCurrent", ErrorKind::Other),
    (205, "hipErrorMapFailed", ErrorKind::Other),
    (206, "hipErrorUnmapFailed", ErrorKind::Other),
    (207, "hipErrorArrayIsMapped", ErrorKind::Other),
    (208, "hipErrorAlreadyMapped", ErrorKind::Other),
    (209, "hipErrorNoBinaryForGpu", ErrorKind::Other),
    (210, "hipErrorAlreadyAcquired", ErrorKind::Other),
    (211, "hipErrorNotMapped", ErrorKind::Other),
    (212, "hipErrorNotMappedAsArray", ErrorKind::Other),
    (213, "hipErrorNotMappedAsPointer", ErrorKind::Other),
    (214, "hipErrorECCNotCorrectable", ErrorKind::DeviceLost),
    (215, "hipErrorUnsupportedLimit", ErrorKind::Other),
    (216, "hipErrorContextAlreadyInUse", ErrorKind::Other),
    (
        217,
        "hipErrorPeerAccessUnsupported",
        ErrorKind::NotSupported,
    ),
    (218, "hipErrorInvalidKernelFile", ErrorKind::Other),
    (219, "hipErrorInvalidGraphicsContext", ErrorKind::Other),
    (300, "hipErrorInvalidSource", ErrorKind::Other),
    (301, "hipErrorFileNotFound", ErrorKind::Other),
    (302, "hipErrorSharedObjectSymbolNotFound", ErrorKind::Other),
    (303, "hipErrorSharedObjectInitFailed", ErrorKind::Other),
    (304, "hipErrorOperatingSystem", ErrorKind::Other),
    (400, "hipErrorInvalidHandle", ErrorKind::InvalidValue),
    (401, "hipErrorIllegalState", ErrorKind::Other),
    (500, "hipErrorNotFound", ErrorKind::Other),
    (600, "hipErrorNotReady", ErrorKind::Other),
    (700, "hipErrorIllegalAddress", ErrorKind::DeviceLost),
    (701, "hipErrorLaunchOutOfResources", ErrorKind::Other),
    (702, "hipErrorLaunchTimeOut", ErrorKind::DeviceLost),
    (704, "hipErrorPeerAccessAlreadyEnabled", ErrorKind::Other),
    (705, "hipErrorPeerAccessNotEnabled", ErrorKind::Other),
    (708, "hipErrorSetOnActiveProcess", ErrorKind::Other),
    (709, "hipErrorContextIsDestroyed", ErrorKind::DeviceLost),
    (710, "hipErrorAssert", ErrorKind::DeviceLost),
    (712, "hipErrorHostMemoryAlreadyRegistered", ErrorKind::Other),
    (713, "hipErrorHostMemoryNotRegistered", ErrorKind::Other),
    (719, "hipErrorLaunchFailure", ErrorKind::DeviceLost),
    (720, "hipErrorCooperativeLaunchTooLarge", ErrorKind::Other),
    (801, "hipErrorNotSupported", ErrorKind::NotSupported),
    (900, "hipErrorStreamCaptureUnsupported", ErrorKind::Other),
    (901, "hipErrorStreamCaptureInvalidated", ErrorKind::Other),
    (902, "hipErrorStreamCaptureMerge", ErrorKind::Other),
    (903, "hipErrorStreamCaptureUnmatched", ErrorKind::Other),
    (904, "hipErrorStreamCaptureUnjoined", ErrorKind::Other),
    (905, "hipErrorStreamCaptureIsolation", ErrorKind::Other),
    (906, "hipErrorStreamCaptureImplicit", ErrorKind::Other),
    (907, "hipErrorCapturedEvent", ErrorKind::Other),
    (908, "hipErrorStreamCaptureWrongThread", ErrorKind::Other),
    (910, "hipErrorGraphExecUpdateFailure", ErrorKind::Other),
    (999, "hipErrorUnknown", ErrorKind::Other),
    (1052, "hipErrorRuntimeMemory", ErrorKind::Other),
    (1053, "hipErrorRuntimeOther", ErrorKind::Other),
];

/// [`TABLE`] as the [`ErrorCodes`] that names and classifies a code.
const CODES: ErrorCodes<HipErrorCode> = ErrorCodes::new(TABLE);

/// The name of `code` from this crate's table, if it knows the code.
pub fn code_name(code: HipErrorCode) -> Option<&'static str> {
    CODES.name(code)
}

/// What a caller can do about `code` (a non-zero `hipError_t`).
///
/// * `hipErrorOutOfMemory` (2): [`ErrorKind::OutOfMemory`].
/// * `hipErrorInvalidValue` (1), `InvalidDevice` (101), `InvalidContext` (201),
///   `InvalidHandle` (400) and the other argument errors: [`ErrorKind::InvalidValue`].
/// * `hipErrorNotSupported` (801), `PeerAccessUnsupported` (217): [`ErrorKind::NotSupported`].
/// * `hipErrorNoDevice` (100), `InsufficientDriver` (35), `NotInitialized` (3),
///   `Deinitialized` (4): [`ErrorKind::Unavailable`].
/// * `hipErrorIllegalAddress` (700), `LaunchFailure` (719), `LaunchTimeOut` (702),
///   `ContextIsDestroyed` (709), `Assert` (710), `ECCNotCorrectable` (214),
///   `PriorLaunchFailure` (53): [`ErrorKind::DeviceLost`].
/// * anything else, known or not: [`ErrorKind::Other`].
pub fn error_kind(code: HipErrorCode) -> ErrorKind {
    CODES.kind(code)
}

/// The fallback name of a code nobody could name.
pub fn unnamed(code: HipErrorCode) -> String {
    format!("hipError({code})")
}

/// The error of a call that returned `rc`, named `name` (see `result::error_name`).
pub(crate) fn call_error(op: Operation, rc: HipErrorCode, name: String) -> BackendError {
    BackendError::new(op, error_kind(rc), i64::from(rc), name)
}

/// An open-time failure: the backend cannot be used, whatever the code.
pub(crate) fn unavailable(rc: HipErrorCode, name: String) -> BackendError {
    BackendError::new(Operation::Load, ErrorKind::Unavailable, i64::from(rc), name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_codes_the_manager_acts_on_map_as_documented() {
        let cases = [
            (2, ErrorKind::OutOfMemory, "hipErrorOutOfMemory"),
            (1, ErrorKind::InvalidValue, "hipErrorInvalidValue"),
            (101, ErrorKind::InvalidValue, "hipErrorInvalidDevice"),
            (400, ErrorKind::InvalidValue, "hipErrorInvalidHandle"),
            (201, ErrorKind::InvalidValue, "hipErrorInvalidContext"),
            (801, ErrorKind::NotSupported, "hipErrorNotSupported"),
            (100, ErrorKind::Unavailable, "hipErrorNoDevice"),
            (35, ErrorKind::Unavailable, "hipErrorInsufficientDriver"),
            (3, ErrorKind::Unavailable, "hipErrorNotInitialized"),
            (700, ErrorKind::DeviceLost, "hipErrorIllegalAddress"),
            (719, ErrorKind::DeviceLost, "hipErrorLaunchFailure"),
            (709, ErrorKind::DeviceLost, "hipErrorContextIsDestroyed"),
            (999, ErrorKind::Other, "hipErrorUnknown"),
            (208, ErrorKind::Other, "hipErrorAlreadyMapped"),
        ];
        for (code, kind, name) in cases {
            assert_eq!(error_kind(code), kind, "kind of {code}");
            assert_eq!(code_name(code), Some(name), "name of {code}");
        }
    }

    #[test]
    fn unknown_codes_are_other_and_named_by_number() {
        for code in [-1, 42, 1234, i32::MAX, i32::MIN] {
            assert_eq!(error_kind(code), ErrorKind::Other);
            assert_eq!(code_name(code), None);
        }
        assert_eq!(unnamed(4242), "hipError(4242)");
    }

    #[test]
    fn table_has_no_duplicate_codes() {
        let mut codes: Vec<_> = TABLE.iter().map(|(c, _, _)| *c).collect();
        codes.sort_unstable();
        let before = codes.len();
        codes.dedup();
        assert_eq!(codes.len(), before);
    }

    #[test]
    fn named_constants_agree_with_the_table() {
        assert_eq!(
            code_name(HIP_ERROR_OUT_OF_MEMORY),
            Some("hipErrorOutOfMemory")
        );
        assert_eq!(code_name(HIP_ERROR_NO_DEVICE), Some("hipErrorNoDevice"));
        assert_eq!(
            code_name(HIP_ERROR_INSUFFICIENT_DRIVER),
            Some("hipErrorInsufficientDriver")
        );
        assert_eq!(
            code_name(HIP_ERROR_NOT_SUPPORTED),
            Some("hipErrorNotSupported")
        );
        assert_eq!(code_name(HIP_ERROR_UNKNOWN), Some("hipErrorUnknown"));
    }
}
