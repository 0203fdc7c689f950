//! What the KV layer's integration tests share: a simulated device with a governor, a tiny
//! geometry, the synthetic token bytes and the books check (DESIGN invariants 2 and 4).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kvvm_governor::{Governor, GovernorConfig};
use kvvm_hal::{DeviceAddress, DeviceId, VirtualMemoryBackend};
use kvvm_host::{HostBackend, HostConfig};
use kvvm_kv::synthetic::token_kv_bytes;
use kvvm_kv::{KvDtype, KvGeometry, SequenceKv, SharedDevicePrefix};
use kvvm_sim::{LatencyMode, LatencyModel, SimBackend, SimConfig};
use kvvm_vmm::{GranularityChoice, VirtualMemory, VmmConfig};

pub const D0: DeviceId = DeviceId(0);

pub struct World {
    pub sim: Arc<SimBackend>,
    pub gov: Governor,
    pub vm: VirtualMemory,
}

/// A simulated device of 4096 granules of `g` bytes, with a governor holding `budget` bytes
/// (unlimited for `None`) and a manager without a handle pool.
pub fn world(g: u64, budget: Option<u64>) -> World {
    world_with(g, 4096, budget, 0)
}

/// [`world`] with `capacity` granules and a handle pool of `pool_bytes`.
pub fn world_with(g: u64, capacity: u64, budget: Option<u64>, pool_bytes: u64) -> World {
    let sim = Arc::new(SimBackend::new(
        SimConfig::single(g, capacity * g).with_latency(LatencyModel::zero(), LatencyMode::Account),
    ));
    let gov = match budget {
        Some(b) => Governor::new(GovernorConfig::default().device_budget(D0, b)),
        None => Governor::unlimited(),
    };
    let backend: Arc<dyn VirtualMemoryBackend> = sim.clone();
    let vm = VirtualMemory::new(
        backend,
        D0,
        gov.clone(),
        VmmConfig::default()
            .pool_cap_bytes(pool_bytes)
            .granularity(GranularityChoice::Minimum),
    )
    .unwrap();
    World { sim, gov, vm }
}

/// 2 layers, 2 KV heads, head_dim 32, fp16: 512 B per token; 64 B per token per head.
pub fn tiny(max_tokens: u64) -> KvGeometry {
    KvGeometry::with_dtype(2, 2, 32, KvDtype::F16, max_tokens).unwrap()
}

pub fn token_bytes(g: &KvGeometry, seq: u64, pos: u64, prefix: u64) -> Vec<u8> {
    let mut v = vec![0u8; g.bytes_per_token() as usize];
    let id = if pos < prefix {
        pos as u32
    } else {
        (seq * 100_000 + pos) as u32
    };
    token_kv_bytes(g, id, pos, &mut v);
    v
}

pub fn tokens_bytes(g: &KvGeometry, seq: u64, first: u64, n: u64, prefix: u64) -> Vec<u8> {
    (first..first + n)
        .flat_map(|p| token_bytes(g, seq, p, prefix))
        .collect()
}

/// Invariant 2: governor used = physical bytes owned + shared bytes counted once =
/// the driver's physical bytes; nothing pending; no accounting error.
pub fn check_books(w: &World, seqs: &[&SequenceKv], shared_sets: &[&SharedDevicePrefix]) {
    let snap = w.gov.snapshot().device(D0);
    let owned: u64 = seqs.iter().map(|s| s.additional_owned_bytes()).sum();
    let mut seen = std::collections::HashSet::new();
    let shared: u64 = shared_sets
        .iter()
        .filter(|p| seen.insert(Arc::as_ptr(p.handles()) as usize))
        .map(|p| p.bytes())
        .sum();
    assert_eq!(snap.committed, owned, "{snap:?}");
    assert_eq!(snap.shared, shared, "{snap:?}");
    assert_eq!(snap.pending, 0);
    assert_eq!(snap.used(), owned + shared);
    assert_eq!(
        snap.used(),
        w.sim.ledger().total_physical_bytes(),
        "governor vs driver"
    );
    assert_eq!(w.vm.accounting_errors(), 0);
}

/// Reads `n` bytes at `offset` of a sequence straight from the driver.
pub fn raw(w: &World, s: &SequenceKv, offset: u64, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    w.sim
        .copy_from_device(&mut v, DeviceAddress(s.address().0 + offset))
        .unwrap();
    v
}

pub fn prompt(n: u64, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(7919) ^ salt).collect()
}

pub fn write_prompt(geo: &KvGeometry, seq: &mut SequenceKv, ids: &[u32], from: u64) {
    let bpt = geo.bytes_per_token() as usize;
    let n = ids.len() as u64 - from;
    let mut buf = vec![0u8; n as usize * bpt];
    for (k, tok) in buf.chunks_mut(bpt).enumerate() {
        let p = from + k as u64;
        token_kv_bytes(geo, ids[p as usize], p, tok);
    }
    seq.write_tokens(from, &buf).unwrap();
}

pub fn check_prompt(geo: &KvGeometry, seq: &SequenceKv, ids: &[u32]) {
    let bpt = geo.bytes_per_token() as usize;
    let mut back = vec![0u8; ids.len() * bpt];
    seq.read_tokens(0, &mut back).unwrap();
    for (p, tok) in back.chunks(bpt).enumerate() {
        let mut e = vec![0u8; bpt];
        token_kv_bytes(geo, ids[p], p as u64, &mut e);
        assert_eq!(tok, &e[..], "token {p}");
    }
}

/// The host tier's tests' granule: 64 KiB.
pub const TIER_G: u64 = 64 << 10;

/// A manager over `backend` with `device` bytes of device budget and `host` of host budget
/// (unlimited for `None`), its granule the backend's least.
pub fn tier_manager(
    backend: Arc<dyn VirtualMemoryBackend>,
    device: Option<u64>,
    host: Option<u64>,
) -> VirtualMemory {
    let mut config = GovernorConfig::default();
    if let Some(b) = device {
        config = config.device_budget(D0, b);
    }
    if let Some(b) = host {
        config = config.device_budget(DeviceId::HOST, b);
    }
    VirtualMemory::new(
        backend,
        D0,
        Governor::new(config),
        VmmConfig::default().granularity(GranularityChoice::Minimum),
    )
    .unwrap()
}

/// A simulated device of 4096 granules of [`TIER_G`].
pub fn tier_sim() -> Arc<dyn VirtualMemoryBackend> {
    Arc::new(SimBackend::new(SimConfig::single(TIER_G, 4096 * TIER_G)))
}

/// The host backend with 1 GiB, or None (printing why) where it cannot run.
pub fn tier_host() -> Option<Arc<dyn VirtualMemoryBackend>> {
    match HostBackend::with_config(HostConfig::default().capacity(1 << 30)) {
        Ok(b) => Some(Arc::new(b)),
        Err(e) => {
            println!("skipped: no host backend here ({e})");
            None
        }
    }
}
