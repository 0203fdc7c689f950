//! The tensor-parallel commit: the same token range committed on N ranks (one sequence per
//! device, every device of the backend) as one [`TensorParallelSequence`] transaction, against
//! the same N commits made one after the other, against the raw driver sequence (create, map and
//! one set access per rank, no manager). With a peer device, also the cost of a set access that
//! grants a peer read access beside the owner's, against the owner's alone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvvm::governor::Governor;
use kvvm::hal::{Access, AccessDescriptor, AllocationProperties, DeviceId, VirtualMemoryBackend};
use kvvm::kv::{KvDtype, KvGeometry, KvLayout, LayoutPlan, SequenceKv, TensorParallelSequence};
use kvvm::vmm::{GranularityChoice, VirtualMemory, VmmConfig};

/// The samples of one run (one per iteration for each case).
#[derive(Debug, Clone, Default)]
pub struct TpSamples {
    /// Ranks (devices) in the group.
    pub ranks: u32,
    /// The granule of rank 0.
    pub granule: u64,
    /// Windows committed per rank per sample.
    pub windows: u64,
    /// One transaction over every rank (one thread per rank).
    pub transaction: Vec<Duration>,
    /// The ranks' commits one after the other.
    pub independent: Vec<Duration>,
    /// The raw driver sequence per rank, one after the other.
    pub raw: Vec<Duration>,
    /// Set access over one granule for the owner and one peer (empty without a peer).
    pub peer_set_access: Vec<Duration>,
    /// Set access over one granule for the owner alone (empty without a peer).
    pub own_set_access: Vec<Duration>,
}

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

/// One layer x 8 KV heads x 128 dims fp16 per rank, token-major: 4 KiB a token.
fn plan(granule: u64, windows: u64) -> Result<LayoutPlan, String> {
    let per_token = 4096u64;
    let max = granule.saturating_mul(windows) / per_token;
    let geometry = KvGeometry::with_dtype(1, 8, 128, KvDtype::F16, max.max(1)).map_err(e)?;
    LayoutPlan::new(geometry, KvLayout::TokenMajor, granule).map_err(e)
}

fn timed<T>(f: impl FnOnce() -> Result<T, String>) -> Result<(Duration, T), String> {
    let t = Instant::now();
    let v = f()?;
    Ok((t.elapsed(), v))
}

/// Measures `iterations` samples of each case with `windows` windows per rank (see the
/// module docs). Every sample commits fresh memory (the managers keep no pool).
pub fn measure_tp(
    backend: &Arc<dyn VirtualMemoryBackend>,
    windows: u64,
    iterations: usize,
) -> Result<TpSamples, String> {
    let devices = backend.devices().map_err(e)?;
    let ranks = u32::try_from(devices.len()).map_err(e)?.max(1);
    let gov = Governor::unlimited();
    let config = VmmConfig::default()
        .granularity(GranularityChoice::Minimum)
        .pool_cap_bytes(0);
    let vms: Vec<VirtualMemory> = (0..ranks)
        .map(|d| {
            VirtualMemory::new(
                Arc::clone(backend),
                DeviceId(d),
                gov.clone(),
                config.clone(),
            )
        })
        .collect::<Result<_, _>>()
        .map_err(e)?;
    let granule = vms.first().map_or(0, VirtualMemory::granule);
    let p = plan(granule, windows)?;
    let tokens = p.geometry().max_tokens();
    let group = || -> Result<Vec<SequenceKv>, String> {
        vms.iter()
            .map(|vm| SequenceKv::new(vm, &p, tokens).map_err(e))
            .collect()
    };
    let mut s = TpSamples {
        ranks,
        granule,
        windows,
        ..TpSamples::default()
    };
    for _ in 0..=iterations {
        // One transaction.
        let mut tp = TensorParallelSequence::new(group()?).map_err(e)?;
        let (t_tx, _) = timed(|| tp.ensure_tokens(tokens).map_err(e))?;
        tp.release().map_err(e)?;
        drop(tp);
        // The same commits one after the other.
        let mut seqs = group()?;
        let (t_ind, _) = timed(|| {
            for q in &mut seqs {
                q.ensure_tokens(tokens).map_err(e)?;
            }
            Ok(())
        })?;
        drop(seqs);
        let t_raw = raw_commit(backend, ranks, granule, windows)?;
        s.transaction.push(t_tx);
        s.independent.push(t_ind);
        s.raw.push(t_raw);
    }
    // The first round warms up the driver and is not kept.
    for v in [&mut s.transaction, &mut s.independent, &mut s.raw] {
        if !v.is_empty() {
            v.remove(0);
        }
    }
    if let Some(peer) = (1..ranks).find(|&d| {
        backend
            .can_access_peer(DeviceId(0), DeviceId(d))
            .unwrap_or(false)
    }) {
        for _ in 0..iterations {
            let (own, both) = set_access_costs(backend, granule, DeviceId(peer))?;
            s.own_set_access.push(own);
            s.peer_set_access.push(both);
        }
    }
    Ok(s)
}

/// The raw driver sequence on every rank, one after the other: reserve (not timed), create and
/// map `windows` granules and one set access; then everything given back (not timed).
fn raw_commit(
    backend: &Arc<dyn VirtualMemoryBackend>,
    ranks: u32,
    granule: u64,
    windows: u64,
) -> Result<Duration, String> {
    let bytes = granule.saturating_mul(windows);
    let mut vas = Vec::new();
    for _ in 0..ranks {
        vas.push(backend.reserve(bytes, granule, None).map_err(e)?);
    }
    let mut handles = Vec::new();
    let t = Instant::now();
    for (d, &va) in vas.iter().enumerate() {
        let device = DeviceId(u32::try_from(d).map_err(e)?);
        for w in 0..windows {
            let h = backend
                .create(granule, &AllocationProperties::device(device))
                .map_err(e)?;
            backend.map(va.offset(w * granule), granule, h).map_err(e)?;
            handles.push(h);
        }
        backend
            .set_access(va, bytes, &[AccessDescriptor::read_write(device)])
            .map_err(e)?;
    }
    let elapsed = t.elapsed();
    for &va in &vas {
        backend.unmap(va, bytes).map_err(e)?;
        backend.free(va, bytes).map_err(e)?;
    }
    for h in handles {
        backend.release(h).map_err(e)?;
    }
    Ok(elapsed)
}

/// One granule of device 0 mapped; set access for device 0 alone, then again with `peer`
/// given read access too (a fresh mapping for each, since a first set access costs most).
fn set_access_costs(
    backend: &Arc<dyn VirtualMemoryBackend>,
    granule: u64,
    peer: DeviceId,
) -> Result<(Duration, Duration), String> {
    let own = AccessDescriptor::read_write(DeviceId(0));
    let both = [
        own,
        AccessDescriptor {
            device: peer,
            access: Access::Read,
        },
    ];
    let mut out = [Duration::ZERO; 2];
    for (i, desc) in [&[own][..], &both[..]].into_iter().enumerate() {
        let va = backend.reserve(granule, granule, None).map_err(e)?;
        let h = backend
            .create(granule, &AllocationProperties::device(DeviceId(0)))
            .map_err(e)?;
        backend.map(va, granule, h).map_err(e)?;
        let t = Instant::now();
        backend.set_access(va, granule, desc).map_err(e)?;
        out[i] = t.elapsed();
        backend.unmap(va, granule).map_err(e)?;
        backend.release(h).map_err(e)?;
        backend.free(va, granule).map_err(e)?;
    }
    Ok((out[0], out[1]))
}
