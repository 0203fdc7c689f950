//! [`World`]: one run's stack (`Recording(FaultInjecting(backend))`, a governor, a manager)
//! and [`State`], what a case holds while its operation runs.

use std::sync::Arc;

use kvvm_governor::{Governor, GovernorConfig};
use kvvm_hal::decorate::{FaultInjecting, Recording};
use kvvm_hal::{DeviceId, Operation, VirtualMemoryBackend};
use kvvm_kv::{EnsureJob, HostTier, HostTierConfig, PrefixCache, SequenceKv, SwappedKv};
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
    /// A host tier over the manager, its page-locked allocations of this many windows at
    /// least (`None`: no tier). Its calls are then failed too.
    pub tier_slab_windows: Option<u64>,
    /// The host's budget, in granules (`None`: unlimited).
    pub host_budget_granules: Option<u64>,
}

impl WorldSpec {
    /// The driver calls a fault run counts and fails: the manager's steps, and the tier's
    /// (pinned memory, copies to and from it, events) when there is one.
    pub fn counted_ops(&self) -> Vec<Operation> {
        let mut ops = FaultInjecting::STEPS.to_vec();
        if self.tier_slab_windows.is_some() {
            ops.extend(Operation::TIER_CALLS);
        }
        ops
    }
}

/// A tier whose page-locked allocations hold `slab` windows at least.
pub(crate) fn with_tier(slab: u64) -> WorldSpec {
    WorldSpec {
        tier_slab_windows: Some(slab),
        ..WorldSpec::default()
    }
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
    /// The host tier, when the spec asks for one.
    pub tier: Option<Arc<HostTier>>,
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
        let mut config = GovernorConfig::default();
        if let Some(b) = spec.budget_granules {
            config = config.device_budget(device, b.saturating_mul(g));
        }
        if let Some(b) = spec.host_budget_granules {
            config = config.device_budget(DeviceId::HOST, b.saturating_mul(g));
        }
        let gov = Governor::new(config);
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
        let tier = match spec.tier_slab_windows {
            Some(n) => Some(
                HostTier::new(&vm, HostTierConfig::default().slab_windows(n))
                    .map_err(|e| format!("cannot open a host tier: {e}"))?,
            ),
            None => None,
        };
        Ok(World {
            backend,
            recording,
            faults,
            gov,
            vm,
            g,
            device,
            tier,
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
    /// Swaps to the host tier (dropped after the sequences).
    pub swaps: Vec<SwappedKv>,
    /// Broken promises an operation found in its own outcome (bytes lost, a swap in a phase
    /// its result does not allow): each fails the run, faults or not.
    pub violations: Vec<String>,
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
