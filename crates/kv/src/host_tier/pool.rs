//! The tier's page-locked memory: slabs (one [`host_alloc`] each) cut into chunks of one
//! window, the free chunks kept for reuse, every byte billed to the governor on
//! [`DeviceId::HOST`]: a slab's bytes are granted when it is allocated, its chunks are
//! *pooled* while free and *committed* while they hold a window, and a slab whose chunks are
//! all free goes back to the backend (and its bytes to the budget) when the pool is trimmed.
//! Chunks whose copies cannot be proven done are *quarantined*: never reused, freed only with
//! the tier.
//!
//! [`host_alloc`]: kvvm_hal::VirtualMemoryBackend::host_alloc

use std::collections::{BTreeMap, BTreeSet};

use kvvm_governor::{Bucket, Governor};
use kvvm_hal::{DeviceId, HostBuffer, VirtualMemoryBackend};

/// One chunk of a slab: `bytes` bytes at `offset` of `buffer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Chunk {
    /// The slab's id.
    pub(crate) slab: u64,
    /// Its index in the slab.
    pub(crate) index: u64,
    /// The slab's buffer.
    pub(crate) buffer: HostBuffer,
    /// Its first byte in the buffer.
    pub(crate) offset: u64,
}

/// One page-locked allocation.
#[derive(Debug)]
pub(crate) struct Slab {
    pub(crate) buffer: HostBuffer,
    pub(crate) chunks: u64,
    /// Chunks taken (held or quarantined).
    pub(crate) taken: u64,
    /// Chunks quarantined (never given back while the tier lives).
    pub(crate) quarantined: u64,
}

/// The slabs and their free chunks.
#[derive(Debug, Default)]
pub(crate) struct Pool {
    pub(crate) slabs: BTreeMap<u64, Slab>,
    /// Free chunks as `(slab, index)`: taken lowest first, so that the oldest slabs fill up
    /// and the newest empty out (and can be freed).
    pub(crate) free: BTreeSet<(u64, u64)>,
    pub(crate) next_slab: u64,
    /// Buffers whose free failed, their bytes quarantined: tried again by every trim and at
    /// the tier's drop.
    pub(crate) stuck: Vec<(HostBuffer, u64)>,
}

impl Pool {
    /// Takes up to `n` free chunks of `chunk_bytes` each.
    pub(crate) fn take(&mut self, n: u64, chunk_bytes: u64) -> Vec<Chunk> {
        let mut out = Vec::new();
        while (out.len() as u64) < n {
            let Some((slab, index)) = self.free.pop_first() else {
                break;
            };
            let Some(s) = self.slabs.get_mut(&slab) else {
                continue;
            };
            s.taken += 1;
            out.push(Chunk {
                slab,
                index,
                buffer: s.buffer,
                offset: index.saturating_mul(chunk_bytes),
            });
        }
        out
    }

    /// Adds a slab of `chunks` chunks over `buffer`, all free.
    pub(crate) fn add_slab(&mut self, buffer: HostBuffer, chunks: u64) {
        self.next_slab += 1;
        let id = self.next_slab;
        self.slabs.insert(
            id,
            Slab {
                buffer,
                chunks,
                taken: 0,
                quarantined: 0,
            },
        );
        for i in 0..chunks {
            self.free.insert((id, i));
        }
    }

    /// Gives chunks back (free again).
    pub(crate) fn give_back(&mut self, chunks: &[Chunk]) {
        for c in chunks {
            if let Some(s) = self.slabs.get_mut(&c.slab) {
                s.taken = s.taken.saturating_sub(1);
                self.free.insert((c.slab, c.index));
            }
        }
    }

    /// Marks taken chunks quarantined: they stay taken for good.
    pub(crate) fn quarantine(&mut self, chunks: &[Chunk]) {
        for c in chunks {
            if let Some(s) = self.slabs.get_mut(&c.slab) {
                s.quarantined += 1;
            }
        }
    }

    /// Removes whole free slabs, newest first, until at least `bytes` are removed (or none
    /// is left to remove); returns their buffers and sizes in bytes.
    pub(crate) fn remove_idle(&mut self, bytes: u64, chunk_bytes: u64) -> Vec<(HostBuffer, u64)> {
        let idle: Vec<u64> = self
            .slabs
            .iter()
            .rev()
            .filter(|(_, s)| s.taken == 0)
            .map(|(id, _)| *id)
            .collect();
        let mut out = Vec::new();
        let mut removed = 0u64;
        for id in idle {
            if removed >= bytes {
                break;
            }
            if let Some(s) = self.slabs.remove(&id) {
                for i in 0..s.chunks {
                    self.free.remove(&(id, i));
                }
                let n = s.chunks.saturating_mul(chunk_bytes);
                removed = removed.saturating_add(n);
                out.push((s.buffer, n));
            }
        }
        out
    }

    /// Free chunks.
    pub(crate) fn free_chunks(&self) -> u64 {
        self.free.len() as u64
    }

    /// Chunks in all slabs.
    pub(crate) fn total_chunks(&self) -> u64 {
        self.slabs.values().map(|s| s.chunks).sum()
    }

    /// Chunks quarantined.
    pub(crate) fn quarantined_chunks(&self) -> u64 {
        self.slabs.values().map(|s| s.quarantined).sum()
    }

    /// Free chunks lying in slabs that are wholly free: what trimming gives back.
    pub(crate) fn idle_chunks(&self) -> u64 {
        self.slabs
            .values()
            .filter(|s| s.taken == 0)
            .map(|s| s.chunks)
            .sum()
    }
}

/// Frees the `(buffer, bytes)` buffers given: each back to the backend, its bytes out of the
/// governor's `from` bucket on the host. A buffer whose free fails stays allocated, its bytes
/// quarantined, and is returned (to be tried again later). Returns the bytes given back and
/// the buffers that could not be freed.
pub(crate) fn free_buffers(
    backend: &dyn VirtualMemoryBackend,
    governor: &Governor,
    buffers: Vec<(HostBuffer, u64)>,
    from: Bucket,
) -> (u64, Vec<(HostBuffer, u64)>) {
    let mut freed = 0u64;
    let mut stuck = Vec::new();
    for (buffer, bytes) in buffers {
        match backend.host_free(buffer) {
            Ok(()) => {
                if let Err(e) = governor.free(DeviceId::HOST, from, bytes) {
                    tracing::error!(error = %e, "host tier: accounting error on free");
                }
                freed = freed.saturating_add(bytes);
            }
            Err(e) => {
                tracing::warn!(error = %e, %buffer, "host tier: a free failed; quarantined");
                if from != Bucket::Quarantined {
                    if let Err(e) =
                        governor.transfer(DeviceId::HOST, from, Bucket::Quarantined, bytes)
                    {
                        tracing::error!(error = %e, "host tier: accounting error on quarantine");
                    }
                }
                stuck.push((buffer, bytes));
            }
        }
    }
    (freed, stuck)
}
