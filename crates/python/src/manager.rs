//! `kvvm.Backend` and `kvvm.Manager`: a driver opened by name, and the memory manager of one
//! of its devices (byte budget, handle pool, optional background pre-committer).

use std::sync::Arc;
use std::time::Duration;

use dlpark::ffi::{DLDevice, DLDeviceType};
use kvvm::broker::{BrokerClient, BrokerError};
use kvvm::governor::{DeviceSnapshot, Governor};
use kvvm::hal::{DeviceId, ShareableHandleType, VirtualMemoryBackend};
use kvvm::kv::precommit::{PrecommitConfig, Precommitter};
use kvvm::vmm::{VirtualMemory, VmmConfig};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::count::{Count, Dim};
use crate::errors;
use crate::manager_open::{
    budget, granularity_choice, host_budget, open_error, open_memory, Budget,
};

/// A driver backend opened by name (`"auto"`, `"cuda"`, `"hip"`, `"host"`, `"sim"`).
#[pyclass(frozen, module = "kvvm._native")]
pub struct Backend {
    pub(crate) backend: Arc<dyn VirtualMemoryBackend>,
    notice: Option<String>,
}

#[pymethods]
impl Backend {
    /// Opens the backend `name`. `"auto"` picks CUDA, then HIP, then the simulator, and says
    /// why in :attr:`notice` when it falls back.
    #[new]
    #[pyo3(signature = (name = "auto"))]
    fn new(py: Python<'_>, name: &str) -> PyResult<Self> {
        let name = name.to_owned();
        let opened = py
            .detach(move || kvvm::open_backend_verbose(&name))
            .map_err(|e| errors::open(py, &e))?;
        Ok(Backend {
            backend: opened.backend,
            notice: opened.notice,
        })
    }

    /// The backend's name (`"cuda"`, `"hip"`, `"host"`, `"sim"`).
    #[getter]
    fn name(&self) -> String {
        self.backend.name().to_owned()
    }

    /// Why `auto` did not choose a better backend, or None.
    #[getter]
    fn notice(&self) -> Option<String> {
        self.notice.clone()
    }

    /// Whether the memory is addressable by tensors (DLPack views): true for CUDA, HIP and
    /// the host backend, false for the simulator.
    #[getter]
    fn addressable(&self) -> bool {
        dl_device(self.backend.name(), 0).is_some()
    }

    /// The devices: a list of dicts with ``ordinal``, ``name``, ``total_memory``,
    /// ``free_memory``, ``granularity`` (minimum) and ``recommended_granularity``.
    fn devices<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let b = Arc::clone(&self.backend);
        let infos = py
            .detach(move || -> Result<_, kvvm::hal::BackendError> {
                let mut out = Vec::new();
                for d in b.devices()? {
                    let mem = b.memory_info(d.id)?;
                    let props = kvvm::hal::AllocationProperties::device(d.id);
                    let gran = b.granularity(&props)?;
                    out.push((d, mem, gran));
                }
                Ok(out)
            })
            .map_err(|e| errors::backend(py, &e))?;
        let mut list = Vec::new();
        for (d, mem, gran) in infos {
            let dict = PyDict::new(py);
            dict.set_item("ordinal", d.id.0)?;
            dict.set_item("name", d.name)?;
            dict.set_item("driver_version", d.driver_version)?;
            dict.set_item("total_memory", mem.total)?;
            dict.set_item("free_memory", mem.free)?;
            dict.set_item("granularity", gran.minimum)?;
            dict.set_item("recommended_granularity", gran.recommended)?;
            list.push(dict);
        }
        Ok(list)
    }

    fn __repr__(&self) -> String {
        format!("Backend({:?})", self.backend.name())
    }
}

/// The DLPack device of a backend's memory, or None when it is not addressable.
pub(crate) fn dl_device(backend: &str, ordinal: u32) -> Option<DLDevice> {
    let id = i32::try_from(ordinal).ok()?;
    let device_type = match backend {
        "cuda" => DLDeviceType::CUDA,
        "hip" => DLDeviceType::ROCM,
        "host" => DLDeviceType::CPU,
        _ => return None,
    };
    Some(DLDevice {
        device_type,
        device_id: if backend == "host" { 0 } else { id },
    })
}

/// What every object made from one manager shares.
pub(crate) struct ManagerState {
    pub(crate) backend: Arc<dyn VirtualMemoryBackend>,
    pub(crate) vm: VirtualMemory,
    pub(crate) governor: Governor,
    pub(crate) device: DeviceId,
    pub(crate) precommit: Option<Precommitter>,
    /// The governor's budget for the device, if any (a local one: with a broker, None).
    pub(crate) budget: Option<u64>,
    /// The connection to the node's broker the budget is leased from, if any (its socket
    /// closing gives the lease back).
    pub(crate) broker: Option<BrokerClient>,
    pub(crate) dl_device: Option<DLDevice>,
}

impl ManagerState {
    /// Synchronizes the device before memory that kernels may have touched is unmapped.
    pub(crate) fn synchronize(&self) -> Result<(), kvvm::hal::BackendError> {
        self.backend.synchronize(self.device)
    }
}

/// A byte-budgeted manager of one device's virtual memory.
#[pyclass(frozen, module = "kvvm._native")]
pub struct Manager {
    pub(crate) state: Arc<ManagerState>,
}

fn backend_arg(
    py: Python<'_>,
    backend: &Bound<'_, PyAny>,
) -> PyResult<Arc<dyn VirtualMemoryBackend>> {
    if let Ok(b) = backend.cast::<Backend>() {
        return Ok(Arc::clone(&b.get().backend));
    }
    if let Ok(name) = backend.extract::<String>() {
        return Ok(Backend::new(py, &name)?.backend);
    }
    Err(errors::invalid(
        py,
        "backend must be a kvvm.Backend or a backend name such as 'auto'",
    ))
}

#[pymethods]
impl Manager {
    /// A manager of `device` of `backend` (a :class:`Backend` or a name).
    ///
    /// Args:
    ///     budget_bytes: the most physical bytes this manager may hold (committed, pooled,
    ///         shared, quarantined); None for no limit beyond the device.
    ///     pool_cap_bytes: the most bytes of released handles kept for reuse.
    ///     park_released: keep released windows mapped for a cheap recommit.
    ///     granularity: ``"recommended"`` (default) or ``"minimum"``.
    ///     precommit: start the background pre-committer (sequences made with
    ///         ``precommit=True`` grow ahead of need, off the decode path).
    ///     headroom_tokens, max_headroom_bytes: the pre-committer's headroom per sequence
    ///         and in all.
    ///     poll_interval_us: how often the pre-committer looks at its sequences.
    ///     broker: the Unix socket of the node's memory broker (``kvvm broker``): the budget
    ///         is then a lease from it, shared with the other processes of the node, topped
    ///         up in batches of ``lease_batch_bytes`` (a grant inside the lease never waits on
    ///         the socket) and given back when the manager is dropped or the process dies;
    ///         ``budget_bytes`` must then be None. Raises ``UnavailableError`` when the broker
    ///         cannot be reached or refuses the tenant.
    ///     tenant, broker_token: who the broker bills (and its token, if it wants one).
    #[new]
    #[pyo3(signature = (backend = None, device = Dim(0), budget_bytes = None, pool_cap_bytes = None,
        park_released = false, granularity = "recommended", precommit = false,
        headroom_tokens = Count(64), max_headroom_bytes = Count(1u64 << 30),
        poll_interval_us = Count(1000), broker = None, tenant = "default".to_owned(),
        broker_token = None, lease_batch_bytes = Count(256u64 << 20), host_budget_bytes = None),
        text_signature = "(backend=None, device=0, budget_bytes=None, pool_cap_bytes=None, \
        park_released=False, granularity='recommended', precommit=False, headroom_tokens=64, \
        max_headroom_bytes=1073741824, poll_interval_us=1000, broker=None, tenant='default', \
        broker_token=None, lease_batch_bytes=268435456, host_budget_bytes=None)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        backend: Option<&Bound<'_, PyAny>>,
        device: Dim,
        budget_bytes: Option<Count>,
        pool_cap_bytes: Option<Count>,
        park_released: bool,
        granularity: &str,
        precommit: bool,
        headroom_tokens: Count,
        max_headroom_bytes: Count,
        poll_interval_us: Count,
        broker: Option<std::path::PathBuf>,
        tenant: String,
        broker_token: Option<String>,
        lease_batch_bytes: Count,
        host_budget_bytes: Option<Count>,
    ) -> PyResult<Self> {
        let choice = granularity_choice(py, granularity)?;
        let budget_bytes = budget_bytes.map(|c| c.0);
        let broker = broker.map(|p| p.to_string_lossy().into_owned());
        let source = budget(
            py,
            budget_bytes,
            broker,
            tenant,
            broker_token,
            lease_batch_bytes.0,
        )?;
        if precommit && headroom_tokens.0 == 0 {
            return Err(errors::invalid(py, "headroom_tokens must be positive"));
        }
        let backend = match backend {
            Some(b) => backend_arg(py, b)?,
            None => Backend::new(py, "auto")?.backend,
        };
        let mut vmm = VmmConfig::default()
            .granularity(choice)
            .park_released(park_released);
        if matches!(source, Budget::Broker(..)) && backend.capabilities().posix_fd_handles {
            // Handles a published prefix can pass to other processes.
            vmm.handle_type = ShareableHandleType::PosixFd;
        }
        if let Some(cap) = pool_cap_bytes {
            vmm = vmm.pool_cap_bytes(cap.0);
        }
        let id = DeviceId(device.0);
        let b = Arc::clone(&backend);
        let host = host_budget(py, host_budget_bytes.map(|c| c.0))?;
        let (vm, governor, broker) = py
            .detach(move || open_memory(&b, id, source, vmm, host))
            .map_err(|f| open_error(py, &f))?;
        let precommitter = precommit
            .then(|| {
                let config = PrecommitConfig {
                    headroom_tokens: headroom_tokens.0,
                    max_headroom_bytes: max_headroom_bytes.0,
                    poll_interval: Duration::from_micros(poll_interval_us.0.max(1)),
                };
                Precommitter::start(&vm, config).map_err(|e| errors::kv(py, &e))
            })
            .transpose()?;
        let dl = dl_device(backend.name(), device.0);
        Ok(Manager {
            state: Arc::new(ManagerState {
                backend,
                vm,
                governor,
                device: id,
                precommit: precommitter,
                budget: budget_bytes,
                broker,
                dl_device: dl,
            }),
        })
    }

    /// The bytes leased from the node's broker now (None without a broker): what this
    /// manager may hold without asking it again.
    #[getter]
    fn leased_bytes(&self) -> Option<u64> {
        let s = &self.state;
        s.broker.as_ref().map(|c| c.held(s.device.0))
    }

    /// Lets go of the tenant's prefix ``key`` once (published or opened by this process);
    /// returns the users it has left (0: the broker freed it). Mappings of it stay valid
    /// until they are unmapped.
    fn close_prefix(&self, py: Python<'_>, key: &str) -> PyResult<u64> {
        let client = broker_of(py, self)?;
        py.detach(|| client.close_prefix(key))
            .map_err(|e| broker_error(py, &e))
    }

    /// How the broker's lease served this manager's grants (None without a broker): ``grants``,
    /// ``local_grants`` (the lease had room: no round trip), ``hit_rate``, ``top_ups`` (round
    /// trips to the broker), ``top_up_refusals``, ``top_up_mean_us`` and ``top_up_max_us``.
    #[getter]
    fn lease_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(s) = self.state.governor.lease_stats() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("grants", s.grants)?;
        d.set_item("local_grants", s.local_grants)?;
        d.set_item("hit_rate", s.hit_rate())?;
        d.set_item("top_ups", s.top_ups)?;
        d.set_item("top_up_refusals", s.top_up_refusals)?;
        d.set_item(
            "top_up_mean_us",
            s.mean_top_up().map(|t| t.as_secs_f64() * 1e6),
        )?;
        d.set_item("top_up_max_us", s.top_up_max.as_secs_f64() * 1e6)?;
        Ok(Some(d))
    }

    /// The backend's name.
    #[getter]
    fn backend(&self) -> String {
        self.state.backend.name().to_owned()
    }

    /// The device ordinal.
    #[getter]
    fn device(&self) -> u32 {
        self.state.device.0
    }

    /// The mapping granule in bytes (queried from the driver).
    #[getter]
    fn granule(&self) -> u64 {
        self.state.vm.granule()
    }

    /// The byte budget, or None.
    #[getter]
    fn budget_bytes(&self) -> Option<u64> {
        self.state.budget
    }

    /// Whether the background pre-committer runs.
    #[getter]
    fn precommit(&self) -> bool {
        self.state.precommit.is_some()
    }

    /// Whether tensors can view this manager's memory (DLPack).
    #[getter]
    fn addressable(&self) -> bool {
        self.state.dl_device.is_some()
    }

    /// The governor's books right now: a :class:`MemorySnapshot`.
    fn snapshot(&self) -> MemorySnapshot {
        let s = self.state.governor.snapshot().device(self.state.device);
        MemorySnapshot::of(&s, self.state.budget)
    }

    /// Bytes a new request could be granted now: the budget's free bytes plus what a grant
    /// would reclaim first (the handle pool, idle cached prefixes, the pre-committer's
    /// windows ahead that it can give back); None without a local budget. The figure a
    /// :class:`BackpressureError` reports as ``available_bytes``.
    fn available_bytes(&self, py: Python<'_>) -> Option<u64> {
        let governor = self.state.governor.clone();
        let device = self.state.device;
        let available = py.detach(move || governor.available_bytes(device));
        (available != u64::MAX).then_some(available)
    }

    /// The governor's books of page-locked host memory (a :class:`HostTier`'s) right now:
    /// a :class:`MemorySnapshot` whose ``budget`` is ``host_budget_bytes``.
    fn host_snapshot(&self) -> MemorySnapshot {
        let s = self.state.governor.snapshot().device(DeviceId::HOST);
        MemorySnapshot::of(&s, s.budget)
    }

    /// Releases pooled handles until at most `keep_bytes` stay; returns the bytes released.
    #[pyo3(signature = (keep_bytes = 0))]
    fn trim_pool(&self, py: Python<'_>, keep_bytes: u64) -> u64 {
        let vm = self.state.vm.clone();
        py.detach(move || vm.trim_pool(keep_bytes))
    }

    /// The pre-committer's counters (a dict), or None when it does not run.
    fn precommit_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(p) = &self.state.precommit else {
            return Ok(None);
        };
        let s = p.stats();
        crate::dict::counters(
            py,
            &[
                ("ready", s.ready),
                ("inline_commits", s.inline_commits),
                ("background_commits", s.background_commits),
                ("background_refused", s.background_refused),
                ("background_failures", s.background_failures),
                ("headroom_bytes", s.headroom_bytes),
                ("peak_headroom_bytes", s.peak_headroom_bytes),
                ("reclaimed_bytes", s.reclaimed_bytes),
            ],
        )
        .map(Some)
    }

    /// Blocks until the pre-committer has nothing left to commit (for tests and orderly
    /// measurements); returns at once without one.
    fn wait_precommit_idle(&self, py: Python<'_>) {
        let state = Arc::clone(&self.state);
        py.detach(move || {
            if let Some(p) = &state.precommit {
                p.wait_idle();
            }
        });
    }

    /// Stops the pre-committer's worker for good (sequences keep working: what they have not
    /// committed is then committed inline when asked for). No-op without one.
    fn stop_precommit(&self, py: Python<'_>) {
        let state = Arc::clone(&self.state);
        py.detach(move || {
            if let Some(p) = &state.precommit {
                p.shutdown();
            }
        });
    }

    /// Synchronizes the device (waits for every kernel that may touch its memory).
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let state = Arc::clone(&self.state);
        py.detach(move || state.synchronize())
            .map_err(|e| errors::backend(py, &e))
    }

    fn __repr__(&self) -> String {
        format!(
            "Manager(backend={:?}, device={}, granule={}, budget_bytes={})",
            self.state.backend.name(),
            self.state.device.0,
            self.state.vm.granule(),
            py_opt(self.state.budget)
        )
    }
}

/// The governor's books for one device, in bytes.
#[pyclass(frozen, get_all, module = "kvvm._native")]
#[derive(Debug, Clone, Copy)]
pub struct MemorySnapshot {
    /// Bytes committed privately by sequences.
    pub committed: u64,
    /// Bytes held by the handle pool and parked windows (reusable, still physical).
    pub pooled: u64,
    /// Bytes of shared prefixes (each counted once).
    pub shared: u64,
    /// Bytes that could not be proven idle (never reused, never reported free).
    pub quarantined: u64,
    /// Bytes granted but not yet settled (a commit in flight).
    pub pending: u64,
    /// Everything the budget counts: committed + pooled + shared + quarantined + pending.
    pub used: u64,
    /// The budget, or None.
    pub budget: Option<u64>,
    /// Budget minus used, or None without a budget.
    pub free: Option<u64>,
}

impl MemorySnapshot {
    /// One device's books against `budget` (`free` is the budget minus `used`).
    fn of(s: &DeviceSnapshot, budget: Option<u64>) -> Self {
        MemorySnapshot {
            committed: s.committed,
            pooled: s.pooled,
            shared: s.shared,
            quarantined: s.quarantined,
            pending: s.pending,
            used: s.used(),
            budget,
            free: budget.map(|b| b.saturating_sub(s.used())),
        }
    }
}

#[pymethods]
impl MemorySnapshot {
    fn __repr__(&self) -> String {
        format!(
            "MemorySnapshot(used={}, committed={}, pooled={}, shared={}, quarantined={}, pending={}, budget={}, free={})",
            self.used,
            self.committed,
            self.pooled,
            self.shared,
            self.quarantined,
            self.pending,
            py_opt(self.budget),
            py_opt(self.free)
        )
    }
}

/// `None` or the number, as Python prints it.
fn py_opt(v: Option<u64>) -> String {
    v.map_or_else(|| "None".to_owned(), |b| b.to_string())
}

/// The broker `manager` leases from; `InvalidArgumentError` without one.
pub(crate) fn broker_of<'a>(py: Python<'_>, manager: &'a Manager) -> PyResult<&'a BrokerClient> {
    manager.state.broker.as_ref().ok_or_else(|| {
        errors::invalid(
            py,
            "this manager has no broker: prefixes are shared between processes through one \
             (Manager(broker=...))",
        )
    })
}

/// A broker's answer as a Python exception: a refusal (no such prefix, a key taken, bytes
/// not held, bad arguments) is `InvalidArgumentError`, a broker that cannot be reached
/// `UnavailableError`.
pub(crate) fn broker_error(py: Python<'_>, e: &BrokerError) -> PyErr {
    match e {
        BrokerError::Refused(why) => errors::invalid(py, format!("the broker refused: {why}")),
        other => errors::raise(
            py,
            errors::ErrorClass::Unavailable,
            format!("the memory broker cannot be used: {other}"),
            &[],
        ),
    }
}
