//! The steps of opening a `kvvm.Manager`: the arguments checked, the device checked, the
//! governor made (a local budget, or a lease from the node's broker), the manager made.

use std::sync::Arc;

use kvvm::broker::{leased_governor, BrokerClient, BrokerError, ClientOptions};
use kvvm::governor::{Governor, GovernorConfig, LeasePolicy};
use kvvm::hal::{BackendError, DeviceId, VirtualMemoryBackend};
use kvvm::vmm::{GranularityChoice, VirtualMemory, VmmConfig, VmmError};
use pyo3::prelude::*;

use crate::errors;

/// Where a manager's budget comes from.
pub(crate) enum Budget {
    /// This process's own: at most these bytes on the device (None: the device's memory).
    Local(Option<u64>),
    /// A lease from the node's broker (`kvvm broker`), topped up in batches of these bytes.
    Broker(ClientOptions, u64),
}

/// What opening can fail with, before it becomes a Python exception.
pub(crate) enum OpenFailure {
    /// An argument the device cannot honour (an unknown device, a budget past its memory).
    Invalid(String),
    /// The manager could not be made.
    Vmm(VmmError),
    /// The broker could not be reached or refused the client.
    Broker(BrokerError),
}

impl From<VmmError> for OpenFailure {
    fn from(e: VmmError) -> Self {
        OpenFailure::Vmm(e)
    }
}

impl From<BackendError> for OpenFailure {
    fn from(e: BackendError) -> Self {
        OpenFailure::Vmm(VmmError::Backend(e))
    }
}

/// The Python exception of an [`OpenFailure`]: `InvalidArgumentError` for an argument,
/// `UnavailableError` for a broker that cannot be used, the manager's own otherwise.
pub(crate) fn open_error(py: Python<'_>, f: &OpenFailure) -> PyErr {
    match f {
        OpenFailure::Invalid(message) => errors::invalid(py, message.clone()),
        OpenFailure::Vmm(e) => errors::vmm(py, e),
        OpenFailure::Broker(e) => errors::raise(
            py,
            errors::ErrorClass::Unavailable,
            format!("the memory broker cannot be used: {e}"),
            &[],
        ),
    }
}

/// `"recommended"` or `"minimum"`.
pub(crate) fn granularity_choice(py: Python<'_>, name: &str) -> PyResult<GranularityChoice> {
    match name {
        "recommended" => Ok(GranularityChoice::Recommended),
        "minimum" => Ok(GranularityChoice::Minimum),
        other => Err(errors::invalid(
            py,
            format!("granularity must be 'recommended' or 'minimum', not {other:?}"),
        )),
    }
}

/// The host budget a manager asks for (page-locked memory of a host tier), checked.
pub(crate) fn host_budget(py: Python<'_>, bytes: Option<u64>) -> PyResult<Option<u64>> {
    if bytes == Some(0) {
        return Err(errors::invalid(
            py,
            "host_budget_bytes must be positive (or None)",
        ));
    }
    Ok(bytes)
}

/// The budget a manager asks for: a local one, or with `broker` a lease (a local budget is
/// then refused: the broker owns the node's budget).
pub(crate) fn budget(
    py: Python<'_>,
    budget_bytes: Option<u64>,
    broker: Option<String>,
    tenant: String,
    broker_token: Option<String>,
    lease_batch_bytes: u64,
) -> PyResult<Budget> {
    if budget_bytes == Some(0) {
        return Err(errors::invalid(
            py,
            "budget_bytes must be positive (or None)",
        ));
    }
    let Some(socket) = broker else {
        return Ok(Budget::Local(budget_bytes));
    };
    if budget_bytes.is_some() {
        return Err(errors::invalid(
            py,
            "budget_bytes and broker exclude each other: with a broker, the tenant's share of \
             the node's budget is the broker's to decide",
        ));
    }
    if lease_batch_bytes == 0 {
        return Err(errors::invalid(py, "lease_batch_bytes must be positive"));
    }
    let mut options = ClientOptions::new(socket, tenant);
    options.token = broker_token;
    Ok(Budget::Broker(options, lease_batch_bytes))
}

/// The manager of `device` of `backend` with its governor (and the broker's client, which
/// lives as long as the manager: its socket closing gives the lease back); `host`: the
/// budget of page-locked host memory (a host tier's) of a local governor.
pub(crate) fn open_memory(
    backend: &Arc<dyn VirtualMemoryBackend>,
    device: DeviceId,
    budget: Budget,
    vmm: VmmConfig,
    host: Option<u64>,
) -> Result<(VirtualMemory, Governor, Option<BrokerClient>), OpenFailure> {
    check_device(backend.as_ref(), device)?;
    let (governor, client) = match budget {
        Budget::Local(bytes) => (local_governor(backend.as_ref(), device, bytes, host)?, None),
        Budget::Broker(..) if host.is_some() => {
            return Err(OpenFailure::Invalid(
                "host_budget_bytes and broker exclude each other: with a broker, the host's \
                 budget is the broker's to decide"
                    .to_owned(),
            ))
        }
        Budget::Broker(options, batch) => {
            let (g, c) = leased_governor(options, LeasePolicy::batches_of(batch))
                .map_err(OpenFailure::Broker)?;
            (g, Some(c))
        }
    };
    let vm = VirtualMemory::new(Arc::clone(backend), device, governor.clone(), vmm)?;
    Ok((vm, governor, client))
}

fn check_device(backend: &dyn VirtualMemoryBackend, device: DeviceId) -> Result<(), OpenFailure> {
    let count = backend.devices()?.len();
    if usize::try_from(device.0).map_or(true, |d| d >= count) {
        return Err(OpenFailure::Invalid(format!(
            "no device {}: the backend has {count}",
            device.0
        )));
    }
    Ok(())
}

/// A governor with at most `bytes` on `device` (and `host` on the host's page-locked memory):
/// a budget is a share of the device, so one past its memory could never be spent and is
/// refused.
fn local_governor(
    backend: &dyn VirtualMemoryBackend,
    device: DeviceId,
    bytes: Option<u64>,
    host: Option<u64>,
) -> Result<Governor, OpenFailure> {
    let mut config = GovernorConfig::default();
    if let Some(h) = host {
        config = config.device_budget(DeviceId::HOST, h);
    }
    if let Some(bytes) = bytes {
        let total = backend.memory_info(device)?.total;
        if bytes > total {
            return Err(OpenFailure::Invalid(format!(
                "budget_bytes {bytes} exceeds the memory of device {} of the {} backend ({total} \
                 bytes): allowed 1..={total}",
                device.0,
                backend.name()
            )));
        }
        config = config.device_budget(device, bytes);
    }
    Ok(Governor::new(config))
}
