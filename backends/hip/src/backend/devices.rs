//! What the HIP backend reports about its devices: names, memory, driver version, and which
//! devices may access each other's memory (`hipDeviceCanAccessPeer`).

use kvvm_hal::{
    BackendError, BackendResult, DeviceId, DeviceInfo, ErrorKind, Operation, ShareableHandleType,
};

use super::HipBackend;
use crate::conv::{ordinal, to_u64};

impl HipBackend {
    pub(crate) fn driver_version(&self) -> String {
        let mut s = format!("HIP runtime {}", self.runtime.version);
        if let Some(Ok(v)) = self.api().call_driver_get_version() {
            if v > 0 {
                s.push_str(&format!(", driver {v}"));
            }
        }
        s
    }

    pub(crate) fn device_info(
        &self,
        index: u32,
        driver_version: &str,
    ) -> BackendResult<DeviceInfo> {
        let id = DeviceId(index);
        let ordinal = ordinal(Operation::Devices, id)?;
        let name = self.check(
            Operation::Devices,
            self.api().call_device_get_name(ordinal),
            || format!("hipDeviceGetName(device {ordinal})"),
        )?;
        let total = self.check(
            Operation::Devices,
            self.api().call_device_total_mem(ordinal),
            || format!("hipDeviceTotalMem(device {ordinal})"),
        )?;
        let vmm_supported = self.probe_granularity(id, ShareableHandleType::None)?;
        let posix_fd_supported =
            self.posix_fd && self.probe_granularity(id, ShareableHandleType::PosixFd)?;
        Ok(DeviceInfo {
            id,
            name,
            total_memory: to_u64(total),
            vmm_supported,
            posix_fd_supported,
            driver_version: driver_version.to_owned(),
        })
    }

    /// Whether memory on `device` can be given access from `peer`: true for the device itself;
    /// otherwise `hipDeviceCanAccessPeer(peer, device)` (whether `peer` can access the memory
    /// of `device`), and false when the runtime does not export it. A device the backend does
    /// not have is `InvalidValue`.
    pub(crate) fn peer_access(&self, device: DeviceId, peer: DeviceId) -> BackendResult<bool> {
        let op = Operation::Devices;
        for id in [device, peer] {
            if id.0 >= self.device_count {
                return Err(BackendError::raised(
                    op,
                    ErrorKind::InvalidValue,
                    format!("no {id} ({} devices)", self.device_count),
                ));
            }
        }
        if device == peer {
            return Ok(true);
        }
        let (d, p) = (ordinal(op, device)?, ordinal(op, peer)?);
        let Some(result) = self.api().call_device_can_access_peer(p, d) else {
            return Ok(false);
        };
        self.check(op, result, || format!("hipDeviceCanAccessPeer({p}, {d})"))
    }
}
