//! [`World`]: one run's stack (`Recording(FaultInjecting(backend))`, a governor, a manager)
//! and [`State`], what a case holds while its operation runs.

use std::sync::Arc;

use kvvm_governor::{Governor, GovernorConfig};
use kvvm_hal::decorate::{FaultInjecting, Recording};
use kvvm_hal::{DeviceId, VirtualMemoryBackend};
use kvvm_kv::{EnsureJob, PrefixCache, SequenceKv};
use kvvm_vmm::{GranularityChoice, Reservation, SharedHandles, VirtualMemory, VmmConfig};

/// How a case's manager is set up, in granules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorldSpec {
    /// The device budget (`None`: unlimited).
    pub budget_granules: Option<u64>,
    /// The handle pool's cap.
    pub pool_granules: u64,
    /// Whether released windows are parked.
    pub park: bool,
    /// Largest handle a commit creates, in granules (`VmmConfig::max_handle_bytes`); 0 or 1:
    /// one handle per window.
    pub max_handle_granules: u64,
}

/// One run's stack. Everything goes through `recording`, which wraps `faults`, which wraps
/// the backend under test.
pub struct World {
    /// The top of the stack, as the manager sees it.
    pub backend: Arc<dyn VirtualMemoryBackend>,
    /// The books of everything made through the stack.
    pub recording: Arc<Recording>,
    /// The fault injector (disarmed unless a run arms it).
    pub faults: Arc<FaultInjecting>,
    /// The governor.
    pub gov: Governor,
    /// The manager.
    pub vm: VirtualMemory,
    /// The manager's granule.
    pub g: u64,
    /// The device.
    pub device: DeviceId,
}

impl World {
    /// A fresh stack over `base` for `device`, with the minimum granularity.
    pub fn new(
        base: &Arc<dyn VirtualMemoryBackend>,
        device: DeviceId,
        spec: WorldSpec,
    ) -> Result<World, String> {
        let faults = Arc::new(FaultInjecting::new(Arc::clone(base)));
        let under: Arc<dyn VirtualMemoryBackend> = faults.clone();
        let recording = Arc::new(Recording::new(under));
        let backend: Arc<dyn VirtualMemoryBackend> = recording.clone();
        let probe = VirtualMemory::new(
            Arc::clone(&backend),
            device,
            Governor::unlimited(),
            VmmConfig::default().granularity(GranularityChoice::Minimum),
        )
        .map_err(|e| format!("cannot open a manager: {e}"))?;
        let g = probe.granule();
        drop(probe);
        let gov = match spec.budget_granules {
            Some(b) => {
                Governor::new(GovernorConfig::default().device_budget(device, b.saturating_mul(g)))
            }
            None => Governor::unlimited(),
        };
        let vm = VirtualMemory::new(
            Arc::clone(&backend),
            device,
            gov.clone(),
            VmmConfig::default()
                .granularity(GranularityChoice::Minimum)
                .pool_cap_bytes(spec.pool_granules.saturating_mul(g))
                .park_released(spec.park)
                .max_handle_bytes(spec.max_handle_granules.saturating_mul(g)),
        )
        .map_err(|e| format!("cannot open a manager: {e}"))?;
        Ok(World {
            backend,
            recording,
            faults,
            gov,
            vm,
            g,
            device,
        })
    }
}

/// What a case holds while its operation runs: everything listed here is checked by the
/// invariants, and dropped (torn down) before the leak check.
#[derive(Default)]
pub struct State {
    /// Reservations.
    pub res: Vec<Reservation>,
    /// Shared sets held outside any reservation.
    pub sets: Vec<Arc<SharedHandles>>,
    /// KV sequences.
    pub seqs: Vec<SequenceKv>,
    /// A prefix cache.
    pub cache: Option<Arc<PrefixCache>>,
    /// A background commit begun and not finished.
    pub job: Option<EnsureJob>,
}

impl State {
    /// Every reservation of the state, the sequences' included.
    pub fn reservations(&self) -> Vec<&Reservation> {
        self.res
            .iter()
            .chain(self.seqs.iter().map(SequenceKv::reservation))
            .collect()
    }
}
