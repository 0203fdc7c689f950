//! The host backend against plain memory (`kvvm bench host`): a commit through the manager on
//! `host` (create, map and set access of each granule; a fresh commit, no pool) and the first
//! touch of its pages, against a plain anonymous `mmap` of the same bytes and its first touch;
//! attaching a shared prefix read-only (what a sharer of a prompt does) against a `memcpy` of
//! it into an already touched buffer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvvm::host::{mmap_first_touch, HostBackend};
use kvvm::vmm::{Governor, SharedHandles, VirtualMemory, VmmConfig};
use kvvm::{Access, DeviceId, VirtualMemoryBackend};

/// The samples of each case, one per iteration (after one unmeasured warm-up).
#[derive(Debug, Clone, Default)]
pub struct HostSamples {
    /// Commit through the manager (create + map + set access).
    pub commit: Vec<Duration>,
    /// First touch of the committed pages.
    pub touch: Vec<Duration>,
    /// Commit plus first touch.
    pub commit_touch: Vec<Duration>,
    /// Plain mmap plus first touch of the same bytes.
    pub mmap_touch: Vec<Duration>,
    /// Attach the shared prefix read-only (reserve + map).
    pub attach: Vec<Duration>,
    /// memcpy of the prefix into a touched buffer.
    pub memcpy: Vec<Duration>,
}

/// Measures `iterations` samples of each case with `bytes` bytes on `host` (one warm-up
/// first); everything made is released before returning.
pub fn measure_host(
    host: &Arc<HostBackend>,
    bytes: u64,
    iterations: usize,
) -> Result<HostSamples, String> {
    let backend: Arc<dyn VirtualMemoryBackend> = host.clone();
    let vm = VirtualMemory::new(
        backend,
        DeviceId(0),
        Governor::unlimited(),
        VmmConfig::default().pool_cap_bytes(0),
    )
    .map_err(|e| err(&e))?;
    let len = usize::try_from(bytes).map_err(|e| err(&e))?;
    let mut s = HostSamples::default();

    // The owner of a shared prefix of `bytes`, written once.
    let prefix: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let mut owner = vm.reserve(bytes).map_err(|e| err(&e))?;
    let set = owner.commit_shared(&[(0, bytes)]).map_err(|e| err(&e))?;
    host.copy_to_device(owner.address(), &prefix)
        .map_err(|e| err(&e))?;
    let windows: Vec<usize> = (0..set.len()).collect();
    let mut copy_dst = vec![1u8; len];

    for i in 0..=iterations {
        let keep = i > 0; // sample 0 is the warm-up
        let (commit, touch) = time_commit_and_touch(host, &vm, bytes)?;
        // Plain mmap and first touch of the same bytes.
        let plain = mmap_first_touch(bytes).map_err(|e| err(&e))?;
        let attach = time_attach(host, &vm, (&set, &windows), &prefix)?;
        let t = Instant::now();
        copy_dst.copy_from_slice(&prefix);
        let memcpy = t.elapsed();
        std::hint::black_box(&copy_dst);
        if keep {
            s.commit.push(commit);
            s.touch.push(touch);
            s.commit_touch.push(commit + touch);
            s.mmap_touch.push(plain);
            s.attach.push(attach);
            s.memcpy.push(memcpy);
        }
    }
    owner.release().map_err(|e| err(&e))?;
    drop(owner);
    drop(set);
    drop(vm);
    Ok(s)
}

fn err(e: &dyn std::fmt::Display) -> String {
    e.to_string()
}

/// A commit of `bytes` through the manager, then the first touch of its pages: the time of
/// each. The reservation is released after.
fn time_commit_and_touch(
    host: &HostBackend,
    vm: &VirtualMemory,
    bytes: u64,
) -> Result<(Duration, Duration), String> {
    let mut r = vm.reserve(bytes).map_err(|e| err(&e))?;
    let t = Instant::now();
    r.commit(bytes).map_err(|e| err(&e))?;
    let commit = t.elapsed();
    let t = Instant::now();
    host.touch_pages(r.address(), bytes).map_err(|e| err(&e))?;
    let touch = t.elapsed();
    r.release().map_err(|e| err(&e))?;
    drop(r);
    Ok((commit, touch))
}

/// The time to attach the shared prefix (`set`, all its `windows`) read-only into a new
/// reservation, which must then show the owner's bytes (`prefix`) at its end.
fn time_attach(
    host: &HostBackend,
    vm: &VirtualMemory,
    (set, windows): (&Arc<SharedHandles>, &[usize]),
    prefix: &[u8],
) -> Result<Duration, String> {
    let bytes = prefix.len() as u64;
    let t = Instant::now();
    let mut sharer = vm.reserve(bytes).map_err(|e| err(&e))?;
    sharer
        .map_shared(set, windows, Access::Read)
        .map_err(|e| err(&e))?;
    let attach = t.elapsed();
    let mut probe = [0u8; 64];
    let last = sharer
        .address()
        .checked_add(bytes - 64)
        .ok_or("address overflow")?;
    host.copy_from_device(&mut probe, last)
        .map_err(|e| err(&e))?;
    if probe[..] != prefix[prefix.len() - 64..] {
        return Err("the attached prefix does not show the owner's bytes".into());
    }
    sharer.release().map_err(|e| err(&e))?;
    drop(sharer);
    Ok(attach)
}
