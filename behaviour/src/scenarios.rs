//! The fault scenarios: every multi-step operation of the manager and the KV layer, each as a
//! setup (run with no fault armed) and the operation itself, whose driver steps the harness
//! fails one at a time and two at a time (`faults.rs`).

use std::sync::Arc;
use std::time::Duration;

use kvvm_hal::Access;
use kvvm_kv::precommit::{PrecommitConfig, Precommitter};
use kvvm_kv::{KvDtype, KvGeometry, KvLayout, LayoutPlan, PrefixCache, SequenceKv};

use crate::world::{State, World, WorldSpec};

/// A setup or an operation: an `Err` is an error the operation reported (expected under
/// faults; a failure of the case only when no fault was armed).
pub type Step = fn(&World, &mut State) -> Result<(), String>;

/// One fault scenario.
#[derive(Clone, Copy)]
pub struct Scenario {
    /// Stable name (`fault_<name>` in reports).
    pub name: &'static str,
    /// What the operation is.
    pub description: &'static str,
    /// The manager's settings.
    pub spec: WorldSpec,
    /// Builds the state, with no fault armed.
    pub setup: Step,
    /// The operation whose driver steps are failed.
    pub op: Step,
}

impl std::fmt::Debug for Scenario {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scenario")
            .field("name", &self.name)
            .finish()
    }
}

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

/// 1 layer x 1 KV head x 64 dims, fp16: 256 B a token, 4 windows of tokens at most.
pub(crate) fn plan(w: &World, layout: KvLayout) -> Result<LayoutPlan, String> {
    plan_windows(w, layout, 4)
}

/// [`plan`] with `windows` windows of tokens at most.
pub(crate) fn plan_windows(
    w: &World,
    layout: KvLayout,
    windows: u64,
) -> Result<LayoutPlan, String> {
    let per_token = 256u64;
    let max_tokens = w.g.saturating_mul(windows) / per_token;
    let geometry = KvGeometry::with_dtype(1, 1, 64, KvDtype::F16, max_tokens).map_err(e)?;
    LayoutPlan::new(geometry, layout, w.g).map_err(e)
}

/// Tokens in one window.
pub(crate) fn window_tokens(w: &World) -> u64 {
    w.g / 256
}

fn reserve(w: &World, s: &mut State, granules: u64) -> Result<(), String> {
    s.res
        .push(w.vm.reserve(granules.saturating_mul(w.g)).map_err(e)?);
    Ok(())
}

/// A reservation of `granules` with its first `committed` granules committed.
fn reserve_and_commit(
    w: &World,
    s: &mut State,
    granules: u64,
    committed: u64,
) -> Result<(), String> {
    reserve(w, s, granules)?;
    first(s)?.commit(committed * w.g).map(|_| ()).map_err(e)
}

fn first(s: &mut State) -> Result<&mut kvvm_vmm::Reservation, String> {
    s.res.first_mut().ok_or_else(|| "no reservation".to_owned())
}

fn seq(w: &World, s: &mut State, layout: KvLayout, tokens: u64) -> Result<(), String> {
    let p = plan(w, layout)?;
    let mut q = SequenceKv::new(&w.vm, &p, p.geometry().max_tokens()).map_err(e)?;
    q.ensure_tokens(tokens).map_err(e)?;
    s.seqs.push(q);
    Ok(())
}

/// The pre-committer's worker grows the setup's sequence (4 windows committed, none ahead):
/// the headroom (one window) asks for 2 windows more, the committed end can start a handle of
/// 4 windows, and the room to grow and the bound (8 windows) allow it, so it commits
/// windows 4-7 as one handle.
/// Then the sequence is dropped. An error is the worker's (the last it reported).
fn precommit_grow(w: &World, s: &mut State) -> Result<(), String> {
    let q = s.seqs.pop().ok_or("no sequence")?;
    let wt = window_tokens(w);
    let config = PrecommitConfig {
        headroom_tokens: wt,
        max_headroom_bytes: w.g.saturating_mul(8),
        poll_interval: Duration::from_micros(50),
    };
    let pre = Precommitter::start(&w.vm, config).map_err(e)?;
    // One headroom is up to 3 windows ahead: up to 8 with the room to grow.
    pre.set_grow_ahead_bytes(w.g.saturating_mul(5));
    let q = pre.attach(q);
    pre.wait_idle();
    pre.shutdown();
    let grown = q.committed_tokens();
    let error = pre.last_error();
    drop(q);
    if let Some(err) = error {
        return Err(e(err));
    }
    if grown != wt.saturating_mul(8) {
        return Err(format!(
            "grown to {grown} tokens, not to the end of the 4-window handle ({})",
            wt.saturating_mul(8)
        ));
    }
    Ok(())
}

fn first_seq(s: &mut State) -> Result<&mut SequenceKv, String> {
    s.seqs.first_mut().ok_or_else(|| "no sequence".to_owned())
}

/// 3 granules committed and released: pooled handles, or parked windows with parking.
fn committed_then_released(w: &World, s: &mut State) -> Result<(), String> {
    reserve(w, s, 8)?;
    first(s)?.commit(3 * w.g).map_err(e)?;
    first(s)?.release().map(|_| ()).map_err(e)
}

/// The pool gives everything it holds back to the driver.
fn trim_pool(w: &World, _: &mut State) -> Result<(), String> {
    w.vm.trim_pool(0);
    Ok(())
}

fn owner_and_sharer(w: &World, s: &mut State) -> Result<(), String> {
    reserve(w, s, 8)?;
    reserve(w, s, 8)?;
    let set = first(s)?.commit_shared(&[(0, 2 * w.g)]).map_err(e)?;
    s.sets.push(set);
    Ok(())
}

pub(crate) fn prompt(w: &World, blocks: u64) -> Vec<u32> {
    (0..blocks.saturating_mul(window_tokens(w)))
        .map(|i| i as u32 ^ 0x5a5a)
        .collect()
}

/// Admits the prompt of 2 blocks into `cache`, with room to grow by one window.
pub(crate) fn admit_prompt(w: &World, cache: &PrefixCache) -> Result<SequenceKv, String> {
    let ids = prompt(w, 2);
    let n = ids.len() as u64;
    let a = cache
        .admit(&ids, n.saturating_add(window_tokens(w)))
        .map_err(e)?;
    Ok(a.sequence)
}

/// Writes every token of the prompt of 2 blocks into `seq` (256 bytes of 7s a token).
fn write_prompt(w: &World, seq: &mut SequenceKv) -> Result<(), String> {
    let n = prompt(w, 2).len() as u64;
    let bytes = vec![7u8; usize::try_from(n.saturating_mul(256)).map_err(e)?];
    seq.write_tokens(0, &bytes).map_err(e)
}

fn written_admission(w: &World, s: &mut State) -> Result<(), String> {
    let cache = PrefixCache::new(w.vm.clone(), plan(w, KvLayout::TokenMajor)?).map_err(e)?;
    let mut seq = admit_prompt(w, &cache)?;
    write_prompt(w, &mut seq)?;
    s.seqs.push(seq);
    s.cache = Some(cache);
    Ok(())
}

pub(crate) fn published(w: &World, s: &mut State) -> Result<(), String> {
    written_admission(w, s)?;
    let cache = s.cache.clone().ok_or("no cache")?;
    cache.publish(first_seq(s)?).map_err(e)?;
    Ok(())
}

fn cache_of(s: &State) -> Result<Arc<PrefixCache>, String> {
    s.cache.clone().ok_or_else(|| "no cache".to_owned())
}

/// The manager's and the KV layer's fault scenarios, in report order (the host tier's are
/// `tier.rs`'s).
pub(crate) fn manager_scenarios() -> Vec<Scenario> {
    [
        reservation_scenarios(),
        sequence_scenarios(),
        shared_set_scenarios(),
        pool_scenarios(),
        prefix_cache_scenarios(),
    ]
    .concat()
}

/// A pool of 8 granules.
fn pooled() -> WorldSpec {
    WorldSpec {
        pool_granules: 8,
        ..WorldSpec::default()
    }
}

/// A pool of 8 granules that parks released windows in their reservation.
fn parked() -> WorldSpec {
    WorldSpec {
        pool_granules: 8,
        park: true,
        ..WorldSpec::default()
    }
}

/// Multi-window handles of up to 8 granules, and a pool of 4 (so that some handles are
/// pooled and the 8-window one is released).
fn multi() -> WorldSpec {
    WorldSpec {
        pool_granules: 4,
        max_handle_granules: 8,
        ..WorldSpec::default()
    }
}

/// The manager's own operations on a reservation: commits (pooled, over ranges, as
/// multi-window handles), release and truncate.
fn reservation_scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "commit",
            description: "commit of 3 granules after one committed",
            spec: WorldSpec::default(),
            setup: |w, s| reserve_and_commit(w, s, 8, 1),
            op: |w, s| first(s)?.commit(3 * w.g).map(|_| ()).map_err(e),
        },
        Scenario {
            name: "commit_pooled",
            description: "commit of 3 granules, 2 from the pool",
            spec: pooled(),
            setup: |w, s| {
                reserve(w, s, 8)?;
                first(s)?.commit(2 * w.g).map_err(e)?;
                first(s)?.release().map(|_| ()).map_err(e)
            },
            op: |w, s| first(s)?.commit(3 * w.g).map(|_| ()).map_err(e),
        },
        Scenario {
            name: "commit_ranges",
            description: "one transaction over two ranges of windows",
            spec: WorldSpec::default(),
            setup: |w, s| reserve_and_commit(w, s, 8, 1),
            op: |w, s| {
                first(s)?
                    .commit_ranges(&[(2 * w.g, 2 * w.g), (6 * w.g, w.g)])
                    .map(|_| ())
                    .map_err(e)
            },
        },
        Scenario {
            name: "release",
            description: "release of 4 committed granules (unmap and release)",
            spec: WorldSpec::default(),
            setup: |w, s| reserve_and_commit(w, s, 8, 4),
            op: |_, s| first(s)?.release().map(|_| ()).map_err(e),
        },
        Scenario {
            name: "truncate",
            description: "truncate of 4 granules to 2 (one byte into the second)",
            spec: WorldSpec::default(),
            setup: |w, s| reserve_and_commit(w, s, 8, 4),
            op: |w, s| first(s)?.truncate(w.g + 1).map(|_| ()).map_err(e),
        },
        Scenario {
            name: "commit_multi_handle",
            description: "a commit of 13 windows from window 1 as 5 buddy-aligned handles \
                          (1, 2, 4, 4, 2 windows; handles of at most 8)",
            spec: multi(),
            setup: |w, s| reserve_and_commit(w, s, 32, 1),
            op: |w, s| first(s)?.commit(13 * w.g).map(|_| ()).map_err(e),
        },
        Scenario {
            name: "truncate_multi_window",
            description: "truncate through a 4-window handle: it stays whole, the 2 handles \
                          past it go (to the pool or the driver)",
            spec: multi(),
            setup: |w, s| reserve_and_commit(w, s, 32, 15),
            op: |w, s| first(s)?.truncate(9 * w.g + 1).map(|_| ()).map_err(e),
        },
        Scenario {
            name: "release_inside_handle",
            description: "release of windows 0..10: the 8-window handle goes, the 4-window \
                          handle it cuts into stays mapped and committed",
            spec: multi(),
            setup: |w, s| reserve_and_commit(w, s, 32, 12),
            op: |w, s| {
                first(s)?
                    .release_ranges(&[(0, 10 * w.g)])
                    .map(|_| ())
                    .map_err(e)
            },
        },
    ]
}

/// A KV sequence growing, shrinking and releasing, and the pre-committer's steps.
fn sequence_scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "kv_ensure",
            description: "a head-major sequence grows to its maximum (2 windows per fragment)",
            spec: WorldSpec::default(),
            setup: |w, s| seq(w, s, KvLayout::SeqMajor, 1),
            op: |w, s| {
                first_seq(s)?
                    .ensure_tokens(4 * window_tokens(w))
                    .map(|_| ())
                    .map_err(e)
            },
        },
        Scenario {
            name: "kv_shrink",
            description: "a sequence gives back the windows committed ahead of its live end",
            spec: pooled(),
            setup: |w, s| seq(w, s, KvLayout::SeqMajor, 3 * window_tokens(w)),
            op: |w, s| {
                first_seq(s)?
                    .shrink_committed(window_tokens(w) / 2)
                    .map(|_| ())
                    .map_err(e)
            },
        },
        Scenario {
            name: "kv_release",
            description: "a sequence releases everything and keeps its range",
            spec: WorldSpec::default(),
            setup: |w, s| seq(w, s, KvLayout::SeqMajor, 2 * window_tokens(w)),
            op: |_, s| first_seq(s)?.release().map(|_| ()).map_err(e),
        },
        Scenario {
            name: "precommit_job",
            description: "the pre-committer's steps: begin, run unlocked, finish",
            spec: pooled(),
            setup: |w, s| seq(w, s, KvLayout::TokenMajor, 1),
            op: |w, s| {
                let q = first_seq(s)?;
                let job = q.begin_ensure(3 * window_tokens(w)).map_err(e)?;
                if let Some(mut job) = job {
                    job.run();
                    q.finish_ensure(job).map_err(e)?;
                }
                Ok(())
            },
        },
        Scenario {
            name: "precommit_grow",
            description: "the pre-committer grows a sequence ahead in one 4-window handle, \
                          then the sequence is dropped",
            spec: multi(),
            setup: |w, s| {
                let p = plan_windows(w, KvLayout::TokenMajor, 16)?;
                let mut q = SequenceKv::new(&w.vm, &p, p.geometry().max_tokens()).map_err(e)?;
                q.ensure_tokens(4 * window_tokens(w)).map_err(e)?;
                s.seqs.push(q);
                Ok(())
            },
            op: precommit_grow,
        },
    ]
}

/// Shared sets: an owner's commit, a sharer's attach and withdrawal, and the teardown of a
/// reservation holding both.
fn shared_set_scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "shared_commit",
            description: "an owner commits 2 windows as a shared set",
            spec: WorldSpec::default(),
            setup: |w, s| reserve(w, s, 8),
            op: |w, s| {
                let set = first(s)?.commit_shared(&[(0, 2 * w.g)]).map_err(e)?;
                s.sets.push(set);
                Ok(())
            },
        },
        Scenario {
            name: "shared_attach",
            description: "a sharer maps a shared set's 2 windows read-only",
            spec: WorldSpec::default(),
            setup: owner_and_sharer,
            op: |_, s| {
                let set = s.sets.first().cloned().ok_or("no set")?;
                let sharer = s.res.get_mut(1).ok_or("no sharer")?;
                sharer
                    .map_shared(&set, &[0, 1], Access::Read)
                    .map(|_| ())
                    .map_err(e)
            },
        },
        Scenario {
            name: "shared_withdraw",
            description: "a sharer unmaps its shared windows after the owner let go",
            spec: WorldSpec::default(),
            setup: |w, s| {
                owner_and_sharer(w, s)?;
                let set = s.sets.first().cloned().ok_or("no set")?;
                let sharer = s.res.get_mut(1).ok_or("no sharer")?;
                sharer.map_shared(&set, &[0, 1], Access::Read).map_err(e)?;
                first(s)?.release().map(|_| ()).map_err(e)?;
                s.sets.clear();
                Ok(())
            },
            op: |_, s| {
                let sharer = s.res.get_mut(1).ok_or("no sharer")?;
                sharer.release().map(|_| ()).map_err(e)
            },
        },
        Scenario {
            name: "teardown",
            description: "dropping a reservation with owned and shared blocks",
            spec: pooled(),
            setup: |w, s| {
                owner_and_sharer(w, s)?;
                let set = s.sets.first().cloned().ok_or("no set")?;
                let sharer = s.res.get_mut(1).ok_or("no sharer")?;
                sharer.map_shared(&set, &[0], Access::Read).map_err(e)?;
                sharer.commit_range(2 * w.g, 2 * w.g).map_err(e)?;
                Ok(())
            },
            op: |_, s| {
                s.res.truncate(1);
                Ok(())
            },
        },
    ]
}

/// The pool giving back parked windows and free handles.
fn pool_scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "unpark",
            description: "the pool gives back parked windows (unmap and release)",
            spec: parked(),
            setup: committed_then_released,
            op: trim_pool,
        },
        Scenario {
            name: "pool_trim",
            description: "the pool releases its free handles",
            spec: pooled(),
            setup: committed_then_released,
            op: trim_pool,
        },
    ]
}

/// The prefix cache: publish, hit and evict.
fn prefix_cache_scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "prefix_publish",
            description: "a missed prompt of 2 blocks is admitted, written and published",
            spec: WorldSpec::default(),
            setup: |w, s| {
                let cache = PrefixCache::new(w.vm.clone(), plan(w, KvLayout::TokenMajor)?);
                s.cache = Some(cache.map_err(e)?);
                Ok(())
            },
            op: |w, s| {
                let cache = cache_of(s)?;
                let mut seq = admit_prompt(w, &cache)?;
                let written = write_prompt(w, &mut seq);
                let published = written.and_then(|()| cache.publish(&mut seq).map_err(e));
                s.seqs.push(seq);
                published.map(|_| ())
            },
        },
        Scenario {
            name: "prefix_hit",
            description: "a second request admits the cached prompt (read-only attach)",
            spec: WorldSpec::default(),
            setup: published,
            op: |w, s| {
                let cache = cache_of(s)?;
                s.seqs.push(admit_prompt(w, &cache)?);
                Ok(())
            },
        },
        Scenario {
            name: "prefix_evict",
            description: "the prefix cache evicts an idle prompt",
            spec: pooled(),
            setup: |w, s| {
                published(w, s)?;
                s.seqs.clear();
                Ok(())
            },
            op: |_, s| {
                cache_of(s)?.evict(u64::MAX);
                Ok(())
            },
        },
    ]
}
