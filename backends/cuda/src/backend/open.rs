//! Opening the CUDA backend (load the driver, initialise it, retain every device's primary
//! context) and closing it (unload the modules loaded on demand, release the contexts).

use kvvm_hal::sync::Unpoison;
use std::sync::Mutex;

use cudarc::driver::sys::CUdevice_attribute;
use kvvm_hal::{BackendError, DeviceId, DeviceInfo, ErrorKind, Operation};

use super::{error_with_name, Context, CudaBackend, Device};
use crate::conv::{format_driver_version, to_u64};
use crate::driver;
use crate::error::CuCode;

impl CudaBackend {
    /// Loads the CUDA driver library, initialises it, and retains the primary context of every
    /// device.
    ///
    /// Fails with [`ErrorKind::Unavailable`] (operation [`Operation::Load`]) when the library
    /// or one of the symbols the backend uses is missing, when `cuInit` fails (no device, stub
    /// library, driver mismatch, ...), or when there is no device; the error's detail says
    /// which. Every failure while opening is reported as `Unavailable` (with the driver's code
    /// and name when one exists) so that a caller choosing a backend can move on. Never panics:
    /// a panic inside the loader is caught and reported as `Unavailable` as well.
    pub fn open() -> Result<CudaBackend, BackendError> {
        let _span = tracing::debug_span!("kvvm_cuda", op = "open").entered();
        let result = match std::panic::catch_unwind(Self::open_inner) {
            Ok(result) => result,
            Err(payload) => {
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".to_owned());
                Err(BackendError::unavailable(
                    Operation::Load,
                    format!("loading the CUDA driver panicked: {message}"),
                ))
            }
        };
        match &result {
            Ok(b) => tracing::debug!(devices = b.devices.len(), "opened"),
            Err(e) => tracing::debug!(error = %e, "unavailable"),
        }
        result
    }

    fn open_inner() -> Result<CudaBackend, BackendError> {
        let driver = driver::load()?;
        let unavailable = |call: &str, code: CuCode| unavailable(&driver, call, code);
        driver.init().map_err(|c| unavailable("cuInit", c))?;
        let version = driver
            .driver_version()
            .map_err(|c| unavailable("cuDriverGetVersion", c))?;
        let version = format_driver_version(version);
        let count = driver
            .device_count()
            .map_err(|c| unavailable("cuDeviceGetCount", c))?;
        if count <= 0 {
            return Err(CuCode::NO_DEVICE
                .to_error(Operation::Load)
                .with_detail(format!(
                    "no CUDA device ({version} reports {count} devices)"
                )));
        }

        // Built incrementally so that `Drop` releases the contexts retained so far on error.
        let mut backend = CudaBackend {
            driver,
            devices: Vec::new(),
            posix_fd: false,
            tier: super::tier::new_books(),
        };
        for ordinal in 0..count {
            let device = open_device(&driver, ordinal, &version)?;
            backend.devices.push(device);
        }
        backend.posix_fd = backend.devices.iter().all(|d| d.info.posix_fd_supported);
        Ok(backend)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let driver = self.driver;
        if let Some(first) = self.devices.first() {
            // SAFETY: the context is still retained (released below).
            if unsafe { driver.ctx_set_current(first.ctx.0) }.is_ok() {
                self.drop_tier();
            }
        }
        for device in &self.devices {
            // SAFETY: as above.
            if unsafe { driver.ctx_set_current(device.ctx.0) }.is_ok() {
                self.drop_copy_stream(device);
            }
        }
        for device in self.devices.iter_mut().rev() {
            let probe = device.probe.get_mut().unpoisoned().take();
            let rows = device.rows.get_mut().unpoisoned().take();
            if probe.is_some() || rows.is_some() {
                // SAFETY: the context is still retained (released just below).
                let current = unsafe { driver.ctx_set_current(device.ctx.0) };
                if current.is_ok() {
                    // Failures (a context lost to a fault) leave nothing we could do.
                    if let Some(probe) = probe {
                        // SAFETY: the module was loaded in this context, which is now
                        // current, and it is not used again.
                        let _ = unsafe { probe.unload(&driver) };
                    }
                    if let Some(rows) = rows {
                        // SAFETY: as for the probe module just above.
                        let _ = unsafe { rows.unload(&driver) };
                    }
                }
            }
            // SAFETY: balances the one retain of `open`; nothing of this backend uses the
            // context afterwards.
            if let Err(code) = unsafe { driver.primary_ctx_release(device.cu) } {
                tracing::debug!(code = code.0, "cuDevicePrimaryCtxRelease failed");
            }
        }
    }
}

/// Every failure while opening means "this backend cannot be used here": `call`'s failure
/// with `code`, as an `Unavailable` error.
fn unavailable(driver: &driver::Driver, call: &str, code: CuCode) -> BackendError {
    let e = error_with_name(driver, Operation::Load, code);
    let kind = e.kind;
    BackendError {
        kind: ErrorKind::Unavailable,
        detail: Some(format!("{call} failed ({kind})")),
        ..e
    }
}

/// Device `ordinal`: its name, memory and capabilities queried, its primary context retained.
fn open_device(
    driver: &driver::Driver,
    ordinal: std::ffi::c_int,
    version: &str,
) -> Result<Device, BackendError> {
    let unavailable = |call: &str, code: CuCode| unavailable(driver, call, code);
    let cu = driver
        .device(ordinal)
        .map_err(|c| unavailable("cuDeviceGet", c))?;
    let name = driver
        .device_name(cu)
        .map_err(|c| unavailable("cuDeviceGetName", c))?;
    let total = driver
        .device_total_mem(cu)
        .map_err(|c| unavailable("cuDeviceTotalMem", c))?;
    let vmm = driver
        .device_attribute(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
            cu,
        )
        .map_err(|c| unavailable("cuDeviceGetAttribute(VMM supported)", c))?;
    let posix_fd = driver
        .device_attribute(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            cu,
        )
        .map_err(|c| unavailable("cuDeviceGetAttribute(POSIX FD supported)", c))?;
    let ctx = driver
        .primary_ctx_retain(cu)
        .map_err(|c| unavailable("cuDevicePrimaryCtxRetain", c))?;
    let id = DeviceId(u32::try_from(ordinal).unwrap_or_default());
    tracing::debug!(%id, %name, total, vmm, posix_fd, "device");
    Ok(Device {
        cu,
        ordinal,
        ctx: Context(ctx),
        info: DeviceInfo {
            id,
            name,
            total_memory: to_u64(total),
            vmm_supported: vmm != 0,
            posix_fd_supported: posix_fd != 0,
            driver_version: version.to_owned(),
        },
        probe: Mutex::new(None),
        rows: Mutex::new(None),
        copy_stream: Mutex::new(None),
    })
}
