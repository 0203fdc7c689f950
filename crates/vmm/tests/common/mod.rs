//! Test helpers: a world on the simulator and the invariant checks (docs/architecture.md).
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use kvvm_governor::{Governor, GovernorConfig};
use kvvm_hal::{DeviceAddress, DeviceId, Operation, VirtualMemoryBackend};
use kvvm_sim::{LatencyMode, LatencyModel, SimBackend, SimConfig, SimQuirks};
use kvvm_vmm::{GranularityChoice, Reservation, VirtualMemory, VmmConfig, VmmError};

pub const D0: DeviceId = DeviceId(0);

/// A simulator, a governor and a manager over them.
pub struct World {
    pub sim: Arc<SimBackend>,
    pub gov: Governor,
    pub vm: VirtualMemory,
    pub g: u64,
}

pub struct WorldConfig {
    pub granule: u64,
    pub capacity_granules: u64,
    pub budget_granules: Option<u64>,
    pub pool_granules: u64,
    /// Largest handle a commit creates, in granules (1: one handle per window).
    pub max_handle_granules: u64,
    pub quirks: SimQuirks,
    pub park: bool,
    /// The manager's cost model (`VmmConfig::commit_cost`).
    pub commit_cost: LatencyModel,
}

impl WorldConfig {
    pub fn new(granule: u64) -> Self {
        WorldConfig {
            granule,
            capacity_granules: 64,
            budget_granules: None,
            pool_granules: 0,
            max_handle_granules: 1,
            quirks: SimQuirks::default(),
            park: false,
            commit_cost: LatencyModel::h200(),
        }
    }
}

impl World {
    pub fn new(c: WorldConfig) -> World {
        let g = c.granule;
        let sim = Arc::new(SimBackend::new(
            SimConfig::single(g, g * c.capacity_granules)
                .with_quirks(c.quirks)
                .with_latency(LatencyModel::zero(), LatencyMode::Account),
        ));
        let gov = match c.budget_granules {
            Some(b) => Governor::new(GovernorConfig::default().device_budget(D0, b * g)),
            None => Governor::unlimited(),
        };
        let backend: Arc<dyn VirtualMemoryBackend> = sim.clone();
        let vm = VirtualMemory::new(
            backend,
            D0,
            gov.clone(),
            VmmConfig::default()
                .pool_cap_bytes(c.pool_granules * g)
                .granularity(GranularityChoice::Minimum)
                .park_released(c.park)
                .max_handle_bytes(c.max_handle_granules * g)
                .commit_cost(c.commit_cost),
        )
        .unwrap();
        World { sim, gov, vm, g }
    }

    /// 2 MiB granules, handles of up to `max_handle_granules` windows, a pool of
    /// `pool_granules`, parking on or off: the multi-window handle tests' world.
    #[allow(dead_code)]
    pub fn multi(max_handle_granules: u64, pool_granules: u64, park: bool) -> World {
        let mut c = WorldConfig::new(2 * kvvm_sim::MIB);
        c.max_handle_granules = max_handle_granules;
        c.pool_granules = pool_granules;
        c.park = park;
        World::new(c)
    }

    /// `(offset in windows, windows)` of each mapping of `r`.
    #[allow(dead_code)]
    pub fn shape(&self, r: &Reservation) -> Vec<(u64, u64)> {
        self.windows_of(r, &r.mappings())
    }

    /// `(offset in windows, windows)` of each parked mapping of `r`.
    #[allow(dead_code)]
    pub fn parked_shape(&self, r: &Reservation) -> Vec<(u64, u64)> {
        self.windows_of(r, &r.parked())
    }

    fn windows_of(&self, r: &Reservation, maps: &[kvvm_vmm::MappedBlock]) -> Vec<(u64, u64)> {
        maps.iter()
            .map(|m| ((m.address.0 - r.address().0) / self.g, m.size / self.g))
            .collect()
    }

    pub fn simple(g: u64, pool_granules: u64) -> World {
        let mut c = WorldConfig::new(g);
        c.pool_granules = pool_granules;
        World::new(c)
    }

    /// Invariants 1-3 between the manager (the live `reservations`, the pool and the
    /// quarantine) and the simulator's ledger. Requires no commit in flight.
    pub fn check(&self, reservations: &[&Reservation]) {
        check(&self.sim, &self.vm, &self.gov, reservations);
    }
}

pub fn check(sim: &SimBackend, vm: &VirtualMemory, gov: &Governor, reservations: &[&Reservation]) {
    let g = vm.granule();
    let ledger = sim.ledger();
    let quarantine = vm.quarantine();

    // Invariant 1: committed bytes = granule x mapped windows, and the driver agrees.
    for r in reservations {
        let m = r.mappings();
        let windows: u64 = m.iter().map(|b| b.size / g).sum();
        assert!(m.iter().all(|b| b.size % g == 0 && b.size > 0));
        assert_eq!(r.committed_bytes(), g * windows, "invariant 1");
        // Parked windows are still mapped (pooled memory, not committed bytes).
        let parked: u64 = r.parked().iter().map(|b| b.size).sum();
        assert_eq!(
            ledger.mapped_bytes_in(r.address(), r.size()),
            r.committed_bytes() + parked,
            "invariant 1: driver's mapped bytes in {:?}",
            r
        );
        for b in &m {
            assert!(
                b.address.0 >= r.address().0 && b.address.0 + b.size <= r.address().0 + r.size()
            );
        }
    }

    // Invariant 2: governor used = physical owned + quarantined = the driver's physical bytes.
    let snap = gov.snapshot().device(D0);
    let committed: u64 = reservations.iter().map(|r| r.committed_bytes()).sum();
    assert_eq!(snap.committed, committed, "invariant 2: committed {snap:?}");
    assert_eq!(
        snap.pooled,
        vm.pooled_bytes(),
        "invariant 2: pooled {snap:?}"
    );
    assert_eq!(
        snap.quarantined,
        vm.quarantined_bytes(),
        "invariant 2: quarantined"
    );
    assert_eq!(snap.pending, 0, "no grant outstanding");
    assert_eq!(
        snap.used(),
        ledger.physical_bytes.first().copied().unwrap_or(0),
        "invariant 2: governor used vs driver physical bytes {snap:?}"
    );
    assert_eq!(vm.accounting_errors(), 0, "accounting errors");

    // Invariant 3: the manager's records equal the driver's truth.
    let handle_alloc: BTreeMap<u64, u64> = ledger
        .handles
        .iter()
        .map(|h| (h.handle.0, h.allocation))
        .collect();
    let mut ours_mappings = BTreeSet::new();
    let mut ours_handles = BTreeSet::new();
    let mut ours_ranges = BTreeSet::new();
    for r in reservations {
        ours_ranges.insert((r.address().0, r.size()));
        for b in r.mappings().into_iter().chain(r.parked()) {
            assert!(
                ours_mappings.insert((b.address.0, b.size, b.handle.0)),
                "mapping twice"
            );
            assert!(ours_handles.insert(b.handle.0), "handle recorded twice");
        }
    }
    for h in vm.pooled_handles() {
        assert!(ours_handles.insert(h.0), "pooled handle also elsewhere");
    }
    for q in &quarantine {
        if let Some((a, s)) = q.range {
            assert!(ours_ranges.insert((a.0, s)), "quarantined range twice");
        }
        for b in &q.mappings {
            assert!(ours_mappings.insert((b.address.0, b.size, b.handle.0)));
            assert!(ours_handles.insert(b.handle.0));
        }
        for h in &q.handles {
            assert!(ours_handles.insert(h.0));
        }
    }
    let theirs_handles: BTreeSet<u64> = ledger.handles.iter().map(|h| h.handle.0).collect();
    assert_eq!(ours_handles, theirs_handles, "invariant 3: handles");
    let theirs_ranges: BTreeSet<(u64, u64)> = ledger
        .reservations
        .iter()
        .map(|r| (r.address.0, r.size))
        .collect();
    assert_eq!(ours_ranges, theirs_ranges, "invariant 3: reservations");
    let ours_m: BTreeSet<(u64, u64, u64)> = ours_mappings
        .iter()
        .map(|(a, s, h)| (*a, *s, *handle_alloc.get(h).expect("mapped handle is live")))
        .collect();
    let theirs_m: BTreeSet<(u64, u64, u64)> = ledger
        .mappings
        .iter()
        .map(|m| (m.address.0, m.size, m.allocation))
        .collect();
    assert_eq!(ours_m, theirs_m, "invariant 3: mappings");
    // Nothing is alive in the driver without a handle or a mapping we know of.
    assert_eq!(
        ledger.allocations.len(),
        ours_handles.len(),
        "one allocation per handle"
    );
}

/// Makes the reservation a fault scenario starts from.
pub type Setup = fn(&World) -> Reservation;
/// The step of a fault scenario whose driver calls are failed one at a time.
pub type Run = fn(&World, &mut Reservation) -> Result<u64, VmmError>;

/// The calls of each of `ops` that `run` makes after `setup` on a fresh world (`make`), run
/// clean, with the books checked after it.
pub fn calls_of(
    make: fn() -> World,
    setup: Setup,
    run: Run,
    ops: &[Operation],
) -> Vec<(Operation, u64)> {
    let w = make();
    let mut r = setup(&w);
    w.sim.reset_counters();
    run(&w, &mut r).unwrap();
    w.check(&[&r]);
    ops.iter().map(|op| (*op, w.sim.calls(*op))).collect()
}

/// Every address of a reservation's committed range is mapped with read-write access.
pub fn assert_accessible(sim: &SimBackend, r: &Reservation) {
    let ledger = sim.ledger();
    for b in r.mappings() {
        let m = ledger
            .mappings
            .iter()
            .find(|m| m.address == b.address)
            .expect("mapped");
        assert!(
            m.access
                .iter()
                .any(|a| a.device == D0 && a.access.can_write()),
            "{:?} has no read-write access",
            DeviceAddress(b.address.0)
        );
    }
}
