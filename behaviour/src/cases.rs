//! The behaviour cases with no injected fault: what the manager and the KV layer promise a
//! user, on any backend. Each returns `Err` with what went wrong.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvvm_hal::decorate::{FaultInjecting, Recording};
use kvvm_hal::{Access, DeviceAddress, Operation};
use kvvm_kv::precommit::{Ensured, PrecommitConfig, PrecommittedSequence, Precommitter};
use kvvm_kv::{KvLayout, LayoutPlan, PrefixCache, SequenceKv};
use kvvm_vmm::{VirtualMemory, VmmError};

use crate::check::books;
use crate::scenarios::{plan, plan_windows, window_tokens};
use crate::world::{State, World};

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

fn ensure(cond: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(what())
    }
}

fn read(w: &World, at: DeviceAddress, n: usize) -> Result<Vec<u8>, String> {
    let mut v = vec![0u8; n];
    w.backend.copy_from_device(&mut v, at).map_err(e)?;
    Ok(v)
}

/// A reservation grows granule by granule at the same base, and bytes written before a
/// growth read back after it.
pub fn grows_in_place(w: &World, s: &mut State) -> Result<(), String> {
    let mut r = w.vm.reserve(8 * w.g).map_err(e)?;
    let base = r.address();
    r.commit(w.g).map_err(e)?;
    w.backend
        .copy_to_device(base, b"kept across growth")
        .map_err(e)?;
    for n in 2..=4 {
        r.ensure_committed(n * w.g).map_err(e)?;
        ensure(
            r.address() == base && r.committed_bytes() == n * w.g,
            || format!("after growth to {n} granules: {r:?}"),
        )?;
    }
    ensure(read(w, base, 18)? == b"kept across growth", || {
        "bytes lost".to_owned()
    })?;
    s.res.push(r);
    books(w, s)
}

/// A released reservation's handles go to the pool and the next commit takes them back with
/// no create call.
pub fn pool_reuse_makes_no_create(w: &World, s: &mut State) -> Result<(), String> {
    let mut r = w.vm.reserve(4 * w.g).map_err(e)?;
    r.commit(3 * w.g).map_err(e)?;
    r.release().map_err(e)?;
    ensure(w.vm.pooled_bytes() == 3 * w.g, || {
        "pool not filled".to_owned()
    })?;
    w.faults.arm(&[Operation::Create], &[]);
    let c = r.commit(3 * w.g).map_err(e)?;
    let creates = w.faults.counted();
    w.faults.disarm();
    ensure(creates == 0 && c.from_pool == 3, || {
        format!("{creates} creates, {} from the pool", c.from_pool)
    })?;
    s.res.push(r);
    books(w, s)
}

/// With parking, a released window committed again in the same reservation costs no driver
/// call at all.
pub fn parked_reuse_makes_no_driver_call(w: &World, s: &mut State) -> Result<(), String> {
    let mut r = w.vm.reserve(4 * w.g).map_err(e)?;
    r.commit(2 * w.g).map_err(e)?;
    r.release().map_err(e)?;
    let parked: u64 = r.parked().iter().map(|b| b.size).sum();
    ensure(parked == 2 * w.g, || "not parked".to_owned())?;
    w.faults.arm(&FaultInjecting::STEPS, &[]);
    r.commit(2 * w.g).map_err(e)?;
    let calls = w.faults.counted();
    w.faults.disarm();
    ensure(calls == 0, || format!("{calls} driver calls"))?;
    s.res.push(r);
    books(w, s)
}

/// Over what is free but within the budget: retryable backpressure; over the budget: the
/// never-fits error, with no retry time, counting what the reservation maps already; nothing
/// is committed by either.
pub fn backpressure_and_never_fits_are_typed(w: &World, s: &mut State) -> Result<(), String> {
    let mut holder = w.vm.reserve(64 * w.g).map_err(e)?;
    holder.commit(6 * w.g).map_err(e)?;
    let mut r = w.vm.reserve(64 * w.g).map_err(e)?;
    match r.commit(4 * w.g) {
        Err(VmmError::Backpressure(b)) if b.needed == 4 * w.g => {}
        other => return Err(format!("expected backpressure, got {other:?}")),
    }
    match r.commit(9 * w.g) {
        Err(err @ VmmError::NeverFits(_)) if !err.is_retryable() => {}
        other => return Err(format!("expected never-fits, got {other:?}")),
    }
    // 6 held and 3 more can never fit a budget of 8, whatever the others free.
    match holder.commit(3 * w.g) {
        Err(VmmError::NeverFits(n)) if n.needed == 9 * w.g => {}
        other => return Err(format!("expected never-fits of 9 granules, got {other:?}")),
    }
    ensure(
        r.committed_bytes() == 0 && holder.committed_bytes() == 6 * w.g,
        || "refusals committed".to_owned(),
    )?;
    s.res.push(holder);
    s.res.push(r);
    books(w, s)
}

/// A shared set is billed once however many map it; a sharer reads the owner's bytes and
/// cannot write them; the memory outlives the owner until the last sharer unmaps it.
pub fn shared_windows_are_billed_once_and_read_only(
    w: &World,
    s: &mut State,
) -> Result<(), String> {
    let mut owner = w.vm.reserve(4 * w.g).map_err(e)?;
    let set = owner.commit_shared(&[(0, 2 * w.g)]).map_err(e)?;
    w.backend
        .copy_to_device(owner.address(), b"prefix")
        .map_err(e)?;
    let mut sharers = Vec::new();
    for _ in 0..3 {
        let mut r = w.vm.reserve(4 * w.g).map_err(e)?;
        r.map_shared(&set, &[0, 1], Access::Read).map_err(e)?;
        sharers.push(r);
    }
    let snap = w.gov.snapshot().device(w.device);
    ensure(snap.shared == 2 * w.g && snap.used() == 2 * w.g, || {
        format!("billed {snap:?}")
    })?;
    let sharer = sharers.first().ok_or("no sharer")?.address();
    ensure(w.backend.copy_to_device(sharer, b"x").is_err(), || {
        "a write through a read-only sharer succeeded".to_owned()
    })?;
    owner.release().map_err(e)?;
    drop(owner);
    drop(set);
    ensure(read(w, sharer, 6)? == b"prefix", || {
        "sharer lost the prefix".to_owned()
    })?;
    s.res.extend(sharers);
    books(w, s)
}

/// Strided slots: one driver range, slot `i` at `base + i x stride`, each committed and torn
/// down on its own.
pub fn strided_slots_commit_independently(w: &World, s: &mut State) -> Result<(), String> {
    let slots = w.vm.reserve_strided(4, 2 * w.g).map_err(e)?;
    let base = slots.first().ok_or("no slot")?.address().0;
    for (i, mut r) in slots.into_iter().enumerate() {
        ensure(r.address().0 == base + i as u64 * 2 * w.g, || {
            "stride".to_owned()
        })?;
        r.commit(w.g).map_err(e)?;
        s.res.push(r);
    }
    books(w, s)
}

/// A head-major sequence's tokens written across a window boundary read back unchanged; a
/// write past the committed tokens is refused.
pub fn sequence_round_trip(w: &World, s: &mut State) -> Result<(), String> {
    let p = plan(w, KvLayout::SeqMajor)?;
    let mut q = SequenceKv::new(&w.vm, &p, p.geometry().max_tokens()).map_err(e)?;
    let first = window_tokens(w) - 2;
    q.ensure_tokens(first + 4).map_err(e)?;
    let src: Vec<u8> = (0..4 * 256).map(|i| (i * 7 % 251) as u8).collect();
    q.write_tokens(first, &src).map_err(e)?;
    let mut out = vec![0u8; src.len()];
    q.read_tokens(first, &mut out).map_err(e)?;
    ensure(out == src, || "bytes differ".to_owned())?;
    ensure(q.write_tokens(first + 4, &src[..256]).is_err(), || {
        "a write past the committed tokens succeeded".to_owned()
    })?;
    s.seqs.push(q);
    books(w, s)
}

/// A published prompt is a cache hit for the next request, mapped read-only, billed once.
pub fn prefix_cache_hit_shares_memory(w: &World, s: &mut State) -> Result<(), String> {
    let cache = PrefixCache::new(w.vm.clone(), plan(w, KvLayout::TokenMajor)?).map_err(e)?;
    let ids: Vec<u32> = (0..2 * window_tokens(w)).map(|i| i as u32).collect();
    let n = ids.len() as u64;
    let mut a = cache.admit(&ids, n + window_tokens(w)).map_err(e)?;
    let bytes = vec![3u8; (n * 256) as usize];
    a.sequence.write_tokens(0, &bytes).map_err(e)?;
    cache.publish(&mut a.sequence).map_err(e)?;
    let used = w.gov.snapshot().device(w.device).used();
    let b = cache.admit(&ids, n + window_tokens(w)).map_err(e)?;
    ensure(b.hit_tokens == n, || format!("hit {} of {n}", b.hit_tokens))?;
    let after = w.gov.snapshot().device(w.device).used();
    ensure(after == used, || {
        format!("a hit committed {} bytes", after - used)
    })?;
    let mut out = vec![0u8; 256];
    b.sequence.read_tokens(n - 1, &mut out).map_err(e)?;
    ensure(out.iter().all(|&x| x == 3), || {
        "hit reads other bytes".to_owned()
    })?;
    s.seqs.push(a.sequence);
    s.seqs.push(b.sequence);
    s.cache = Some(cache);
    books(w, s)
}

/// The pre-committer against reclaim and release: a decode thread per sequence asks for one
/// more token at a time while another thread forces reclaims (grants that need the headroom)
/// and releases; at every `Ready` the windows of those tokens are mapped in the driver's
/// books (the recording backend), never unmapped underneath.
pub fn precommit_ready_is_always_mapped(w: &World, s: &mut State) -> Result<(), String> {
    let p = plan(w, KvLayout::TokenMajor)?;
    let config = PrecommitConfig {
        headroom_tokens: window_tokens(w) / 2,
        max_headroom_bytes: 8 * w.g,
        poll_interval: std::time::Duration::from_micros(50),
    };
    let pre = Arc::new(Precommitter::start(&w.vm, config).map_err(e)?);
    let stop = Arc::new(AtomicBool::new(false));
    let max = p.geometry().max_tokens();
    let mut decoders = Vec::new();
    for _ in 0..3 {
        let seq = SequenceKv::new(&w.vm, &p, max).map_err(e)?;
        let seq = pre.attach(seq);
        let (rec, stop) = (w.recording.clone(), stop.clone());
        let base = seq.with_sequence(|q| q.address());
        let g = w.g;
        decoders.push(std::thread::spawn(move || {
            decode_checking_ready(&seq, &rec, &stop, base, g, max)
        }));
    }
    let pressure = spawn_reclaim_pressure(w.vm.clone(), w.g, stop.clone());
    let failure = first_failure(decoders);
    stop.store(true, Ordering::Relaxed);
    let _ = pressure.join();
    if let Some(m) = failure {
        pre.shutdown();
        return Err(m);
    }
    // How many steps above found their tokens ready depends on the schedule. With the
    // pressure gone the worker gets ahead by construction: one Ready over a mapped window.
    ready_without_pressure(w, &pre, &p)?;
    books(w, s)
}

/// Whether the recording holds a mapping over address `at`.
fn is_mapped(rec: &Recording, at: u64) -> bool {
    rec.record()
        .mappings
        .iter()
        .any(|m| m.address.0 <= at && at < m.address.0 + m.size)
}

/// A decode thread's rounds: `seq` (at `base`) grows to `max` tokens a step at a time, at a
/// decode step's pace, then releases everything; every `Ready` must find its window mapped.
/// Stops early once `stop` is set.
fn decode_checking_ready(
    seq: &PrecommittedSequence,
    rec: &Recording,
    stop: &AtomicBool,
    base: DeviceAddress,
    g: u64,
    max: u64,
) -> Result<(), String> {
    for round in 0..20u64 {
        let step = (max / 64).max(1);
        for n in (1..=max).step_by(usize::try_from(step).unwrap_or(1)) {
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            // A decode step's pace: the worker gets time to commit ahead.
            std::thread::sleep(std::time::Duration::from_micros(100));
            if let Ok(Ensured::Ready) = seq.ensure_tokens(n) {
                // Token n-1 lies in window (n-1) x 256 / g of this token-major range.
                let window = (n - 1) * 256 / g * g;
                let at = base.0 + window;
                if !is_mapped(rec, at) {
                    return Err(format!(
                        "round {round}: Ready for {n} tokens, window at {at:#x} unmapped"
                    ));
                }
            }
        }
        seq.release().map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// A thread that, until `stop` is set, asks for a grant just over what is free (the governor
/// asks the pool and the pre-committer to give back headroom first) and trims the pool.
fn spawn_reclaim_pressure(
    vm: VirtualMemory,
    g: u64,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let free = vm.governor().snapshot().device(vm.device()).free();
            if let Ok(grant) = vm.try_grant(free.saturating_add(2 * g)) {
                grant.rollback();
            }
            vm.trim_pool(0);
            std::thread::yield_now();
        }
    })
}

/// Joins every decode thread; the first failure, if any.
fn first_failure(decoders: Vec<std::thread::JoinHandle<Result<(), String>>>) -> Option<String> {
    let mut failure = None;
    for d in decoders {
        match d.join() {
            Ok(Ok(())) => {}
            Ok(Err(m)) => failure = failure.or(Some(m)),
            Err(_) => failure = failure.or(Some("a decode thread panicked".to_owned())),
        }
    }
    failure
}

/// With nothing else running, the worker gets ahead of a new sequence: its second token is
/// `Ready`, over a mapped window. Shuts the pre-committer down.
fn ready_without_pressure(w: &World, pre: &Precommitter, p: &LayoutPlan) -> Result<(), String> {
    let max = p.geometry().max_tokens();
    let seq = pre.attach(SequenceKv::new(&w.vm, p, max).map_err(e)?);
    seq.ensure_tokens(1).map_err(e)?;
    pre.wait_idle();
    let got = seq.ensure_tokens(2).map_err(e)?;
    let at = seq.with_sequence(|q| q.address().0);
    let mapped = is_mapped(&w.recording, at);
    pre.shutdown();
    drop(seq);
    ensure(got == Ensured::Ready && mapped, || {
        format!("with no pressure the worker did not get ahead: {got:?}, mapped {mapped}")
    })
}

/// The pre-committer grows ahead in buddy-aligned multi-window handles, within its bound: a
/// sequence decodes a quarter window at a time (the worker catching up between steps), every
/// step finds its tokens committed and their window mapped in the recording, the bytes ahead
/// never exceed the bound, and the worker's commits map several windows each.
pub fn precommit_grows_in_handles_within_its_bound(w: &World, s: &mut State) -> Result<(), String> {
    let p = plan_windows(w, KvLayout::TokenMajor, 32)?;
    let wt = window_tokens(w);
    let bound = 8 * w.g;
    let config = PrecommitConfig {
        headroom_tokens: wt,
        max_headroom_bytes: bound,
        poll_interval: std::time::Duration::from_micros(50),
    };
    let pre = Precommitter::start(&w.vm, config).map_err(e)?;
    // One headroom is up to 3 windows ahead: up to 8 with the room to grow.
    pre.set_grow_ahead_bytes(5 * w.g);
    let mut q = SequenceKv::new(&w.vm, &p, p.geometry().max_tokens()).map_err(e)?;
    q.ensure_tokens(4 * wt).map_err(e)?;
    let base = q.address();
    let seq = pre.attach(q);
    let (step, last) = ((wt / 4).max(1), 24 * wt);
    let mut n = 4 * wt;
    while n < last {
        n = n.saturating_add(step).min(last);
        pre.wait_idle();
        let got = seq.ensure_tokens(n).map_err(e)?;
        ensure(got == Ensured::Ready, || {
            format!("{n} tokens: {got:?} (the worker fell behind)")
        })?;
        // Token n-1 lies in window (n-1) x 256 / g of this token-major range.
        let at = base.0 + (n - 1) * 256 / w.g * w.g;
        ensure(
            w.recording
                .record()
                .mappings
                .iter()
                .any(|m| m.address.0 <= at && at < m.address.0 + m.size),
            || format!("Ready for {n} tokens, window at {at:#x} unmapped"),
        )?;
    }
    pre.shutdown();
    let stats = pre.stats();
    ensure(stats.peak_headroom_bytes <= bound, || {
        format!(
            "{} bytes ahead, over the bound of {bound}",
            stats.peak_headroom_bytes
        )
    })?;
    let rec = w.recording.record();
    let mappings = rec.mappings.len() as u64;
    let windows = rec.mappings.iter().map(|m| m.size).sum::<u64>() / w.g;
    ensure(mappings.saturating_mul(2) <= windows, || {
        format!("{windows} windows in {mappings} mappings: not grown in multi-window handles")
    })?;
    drop(seq);
    books(w, s)
}
