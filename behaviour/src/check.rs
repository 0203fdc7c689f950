//! The invariants (DESIGN.md) checked after every run, against the [`Recording`] books instead
//! of a simulator's ledger, and the leak check after teardown.
//!
//! [`Recording`]: kvvm_hal::decorate::Recording

use std::collections::BTreeSet;

use kvvm_vmm::BlockKind;

use crate::world::{State, World};

/// Invariants 1-3 with `state` alive: no rule broken; committed bytes = granule x windows of the blocks and
/// the driver maps exactly the manager's blocks and parked windows; the governor's used bytes
/// equal the live physical bytes; nothing pending; no accounting error; every committed token
/// of a sequence lies in mapped windows.
pub fn books(w: &World, state: &State) -> Result<(), String> {
    let rec = w.recording.record();
    if let Some(a) = rec.anomalies.first() {
        return Err(format!(
            "driver rule broken: {a} ({} in all)",
            rec.anomalies.len()
        ));
    }
    let snap = w.gov.snapshot().device(w.device);
    if snap.pending != 0 {
        return Err(format!("a grant is outstanding: {snap:?}"));
    }
    if w.vm.accounting_errors() != 0 {
        return Err(format!("{} accounting errors", w.vm.accounting_errors()));
    }
    if snap.used() != rec.live_bytes() {
        return Err(format!(
            "governor used {} bytes, the driver holds {} ({snap:?})",
            snap.used(),
            rec.live_bytes()
        ));
    }
    if snap.pooled != w.vm.pooled_bytes() || snap.quarantined != w.vm.quarantined_bytes() {
        return Err(format!(
            "pool {} / quarantine {} vs governor {snap:?}",
            w.vm.pooled_bytes(),
            w.vm.quarantined_bytes()
        ));
    }
    let owned = mappings_agree(w, state, &rec)?;
    if snap.committed != owned {
        return Err(format!(
            "invariant 2: committed {} vs owned blocks {owned}",
            snap.committed
        ));
    }
    for s in &state.seqs {
        tokens_mapped(w, s)?;
    }
    host_books(w, state)?;
    if let Some(v) = state.violations.first() {
        return Err(format!("{v} ({} in all)", state.violations.len()));
    }
    Ok(())
}

/// Invariants 1 and 3 over the mappings: every reservation's committed bytes are its blocks',
/// and the driver maps exactly the manager's blocks, parked windows and quarantined mappings.
/// Returns the bytes of the blocks the reservations own.
fn mappings_agree(
    w: &World,
    state: &State,
    rec: &kvvm_hal::decorate::Record,
) -> Result<u64, String> {
    let recorded: BTreeSet<(u64, u64, u64)> = rec
        .mappings
        .iter()
        .map(|m| (m.address.0, m.size, m.handle.0))
        .collect();
    let mut ours: BTreeSet<(u64, u64, u64)> = BTreeSet::new();
    let mut owned = 0u64;
    for r in state.reservations() {
        let blocks = r.mappings();
        let mapped: u64 = blocks.iter().map(|b| b.size).sum();
        if blocks.iter().any(|b| b.size == 0 || b.size % w.g != 0) || r.committed_bytes() != mapped
        {
            return Err(format!(
                "invariant 1: {r:?} committed {}",
                r.committed_bytes()
            ));
        }
        for b in blocks.iter().chain(r.parked().iter()) {
            if !ours.insert((b.address.0, b.size, b.handle.0)) {
                return Err(format!("block at {} recorded twice", b.address));
            }
        }
        owned += blocks
            .iter()
            .filter(|b| b.kind == BlockKind::Owned)
            .map(|b| b.size)
            .sum::<u64>();
    }
    for q in w.vm.quarantine() {
        for b in &q.mappings {
            ours.insert((b.address.0, b.size, b.handle.0));
        }
    }
    if ours != recorded {
        let missing: Vec<_> = recorded.difference(&ours).take(3).collect();
        let extra: Vec<_> = ours.difference(&recorded).take(3).collect();
        return Err(format!(
            "invariant 3: mappings differ: driver-only {missing:x?}, manager-only {extra:x?}"
        ));
    }
    Ok(owned)
}

/// The host's books: the governor's host bytes equal the live page-locked buffers; the
/// tier's chunks holding a window are billed as committed and are exactly the swaps' and the
/// prefix cache's host level's (none held by no one), its free chunks as pooled.
fn host_books(w: &World, state: &State) -> Result<(), String> {
    let rec = w.recording.record();
    let host = w.gov.snapshot().device(kvvm_hal::DeviceId::HOST);
    if host.pending != 0 || host.used() != rec.host_bytes() {
        return Err(format!(
            "host: governor {host:?}, the driver holds {} page-locked bytes",
            rec.host_bytes()
        ));
    }
    let Some(tier) = &w.tier else {
        return Ok(());
    };
    let t = tier.stats();
    let on_host = state.cache.as_ref().map_or(0, |c| c.stats().host_bytes);
    let swapped: u64 = state
        .swaps
        .iter()
        .map(kvvm_kv::SwappedKv::bytes)
        .sum::<u64>()
        + on_host;
    if t.held_bytes != host.committed || t.pooled_bytes != host.pooled || t.held_bytes != swapped {
        return Err(format!(
            "host tier: {t:?} vs governor {host:?}; the swaps and the host prefixes hold {swapped} bytes"
        ));
    }
    Ok(())
}

/// Every window holding a byte of a sequence's committed tokens is mapped.
fn tokens_mapped(w: &World, s: &kvvm_kv::SequenceKv) -> Result<(), String> {
    let n = s.committed_tokens();
    let windows = s
        .plan()
        .windows_for_tokens(n)
        .map_err(|e| format!("window arithmetic: {e}"))?;
    for range in windows {
        for i in range {
            let o = i.saturating_mul(w.g);
            if !s.reservation().is_mapped(o) {
                return Err(format!(
                    "{n} tokens reported committed but the window at offset {o} is unmapped"
                ));
            }
        }
    }
    Ok(())
}

/// After everything of a run was dropped: the governor holds only quarantined bytes, and the
/// driver holds exactly what the quarantine lists. Then the quarantine (made of injected
/// failures, which the driver never saw) is given back through the stack, and the books must
/// be empty: nothing leaked, nothing freed twice. Returns the quarantined bytes cleaned up.
pub fn clean(w: World) -> Result<u64, String> {
    let quarantine = w.vm.quarantine();
    let q_bytes = w.vm.quarantined_bytes();
    let World {
        backend,
        recording,
        faults,
        vm,
        gov,
        device,
        tier,
        ..
    } = w;
    faults.disarm();
    // The tier first: it holds the manager and frees its page-locked memory, quarantine
    // included, and the events it could not destroy.
    drop(tier);
    let host = gov.snapshot().device(kvvm_hal::DeviceId::HOST);
    if host.used() != 0 || host.pending != 0 {
        return Err(format!("after teardown the host's books hold {host:?}"));
    }
    // The last holder of the manager's state: the pool goes back to the driver.
    drop(vm);
    let snap = gov.snapshot().device(device);
    if snap.used() != q_bytes || snap.pending != 0 {
        return Err(format!(
            "after teardown the governor holds {snap:?}, quarantine {q_bytes}"
        ));
    }
    let rec = recording.record();
    if let Some(a) = rec.anomalies.first() {
        return Err(format!("driver rule broken during teardown: {a}"));
    }
    let listed_maps: usize = quarantine.iter().map(|q| q.mappings.len()).sum();
    if rec.mappings.len() != listed_maps {
        return Err(format!(
            "after teardown {} mappings live, the quarantine lists {listed_maps}",
            rec.mappings.len()
        ));
    }
    // Give back what the injected faults quarantined.
    let mut handles = BTreeSet::new();
    for q in &quarantine {
        for b in &q.mappings {
            backend
                .unmap(b.address, b.size)
                .map_err(|e| format!("cleanup unmap: {e}"))?;
            handles.insert(b.handle);
        }
        handles.extend(q.handles.iter().copied());
    }
    for h in handles {
        backend
            .release(h)
            .map_err(|e| format!("cleanup release: {e}"))?;
    }
    for q in &quarantine {
        if let Some((a, s)) = q.range {
            backend
                .free(a, s)
                .map_err(|e| format!("cleanup free: {e}"))?;
        }
    }
    let rec = recording.record();
    if !rec.is_empty() {
        return Err(format!("leaked after teardown: {rec:?}"));
    }
    Ok(q_bytes)
}
