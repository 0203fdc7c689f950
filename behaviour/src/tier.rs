//! The host tier's fault scenarios: a sequence swapped out, swapped back, both with a mapped
//! prefix, the tier's trim, and a host budget that runs out. Beside the books (`check.rs`),
//! each operation checks its own outcome against what the swap promises a caller, and notes
//! a broken promise in [`State::violations`] (which fails the run, faults or not):
//!
//! * a swap out that fails leaves the sequence with its tokens, byte-exact (the request goes
//!   on or is computed again; nothing lost);
//! * a swap out that succeeds leaves the sequence empty and the bytes on the host;
//! * a swap in that succeeds gives the sequence its tokens back, byte-exact, at its address;
//!   one that fails leaves the swap waiting on the host (refused for memory: the sequence
//!   empty) or failed (the request is computed again), never anything in between;
//! * with the host's budget spent, a swap out is refused on the host and changes nothing.

use std::sync::Arc;

use kvvm_hal::{DeviceId, Operation};
use kvvm_kv::{HostTier, KvCacheError, KvLayout, SequenceKv, SwapPhase, SwappedKv};

use crate::scenarios::{admit_prompt, plan, published, window_tokens, Scenario};
use crate::world::{with_tier, State, World, WorldSpec};

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

/// Bytes of one token (the scenarios' plan: 1 layer x 1 KV head x 64 dims, fp16).
const TOKEN_BYTES: u64 = 256;

/// The bytes written into tokens `first..first + n`: a pattern that differs from window to
/// window.
fn pattern(first: u64, n: u64) -> Vec<u8> {
    let start = first.saturating_mul(TOKEN_BYTES);
    let end = start.saturating_add(n.saturating_mul(TOKEN_BYTES));
    (start..end).map(|i| (i % 251) as u8 ^ 0x3c).collect()
}

/// Tokens of the swapped sequences: two and a half windows (3 windows token-major).
fn tokens(w: &World) -> u64 {
    window_tokens(w).saturating_mul(5) / 2
}

fn tier_of(w: &World) -> Result<Arc<HostTier>, String> {
    w.tier.clone().ok_or_else(|| "no host tier".to_owned())
}

/// A sequence of [`tokens`] tokens in `layout`, each written with [`pattern`].
fn written(w: &World, s: &mut State, layout: KvLayout) -> Result<(), String> {
    let p = plan(w, layout)?;
    let mut q = SequenceKv::new(&w.vm, &p, p.geometry().max_tokens()).map_err(e)?;
    let n = tokens(w);
    q.ensure_tokens(n).map_err(e)?;
    q.write_tokens(0, &pattern(0, n)).map_err(e)?;
    s.seqs.push(q);
    Ok(())
}

/// Whether `q` holds `expected` from token `first` (not checked while copies are in flight
/// over it: the device could not be proven idle, the request is computed again).
fn holds(q: &SequenceKv, first: u64, expected: &[u8]) -> Result<(), String> {
    if q.has_copies_in_flight() {
        return Ok(());
    }
    let n = expected.len() as u64 / TOKEN_BYTES;
    let end = first.saturating_add(n);
    if q.committed_tokens() < end {
        return Err(format!(
            "tokens lost: {} committed, {end} expected",
            q.committed_tokens()
        ));
    }
    let mut out = vec![0u8; expected.len()];
    q.read_tokens(first, &mut out).map_err(e)?;
    if out != expected {
        return Err(format!("tokens {first}..{end} changed"));
    }
    Ok(())
}

/// Swaps the first `n` tokens of `q` out and waits for it; checks the outcome (see the
/// module's documentation) into `violations`. The swap made, if any, and the result.
fn swap_out(
    tier: &Arc<HostTier>,
    q: &mut SequenceKv,
    expected: &[u8],
    violations: &mut Vec<String>,
) -> (Option<SwappedKv>, Result<(), KvCacheError>) {
    let n = expected.len() as u64 / TOKEN_BYTES;
    let mut swap = match q.swap_out(tier, n, None) {
        Ok(swap) => swap,
        Err(err) => {
            if let Err(v) = holds(q, 0, expected) {
                violations.push(format!("a refused swap out lost bytes: {v}"));
            }
            return (None, Err(err));
        }
    };
    let r = q.finish_swap_out(&mut swap).map(|_| ());
    let outcome = match (&r, swap.phase()) {
        (Ok(()), SwapPhase::OnHost) if q.committed_tokens() == 0 && swap.bytes() > 0 => Ok(()),
        (Err(_), SwapPhase::Failed) => holds(q, 0, expected),
        (Err(_), SwapPhase::OnHost) if swap.bytes() > 0 => Ok(()),
        (r, phase) => Err(format!(
            "a swap out ended {r:?} in {phase:?} with {} tokens left, {} bytes on the host",
            q.committed_tokens(),
            swap.bytes()
        )),
    };
    violations.extend(outcome.err());
    (Some(swap), r)
}

/// Brings `swap` back into `q` and waits for it; checks the outcome into `violations`.
fn swap_in(
    w: &World,
    q: &mut SequenceKv,
    swap: &mut SwappedKv,
    first: u64,
    expected: &[u8],
    violations: &mut Vec<String>,
) -> Result<(), KvCacheError> {
    let base = q.address();
    let r = q
        .swap_in(swap)
        .and_then(|()| q.finish_swap_in(swap).map(|_| ()));
    // An unmap or release that failed under the sequence's release keeps what it could not
    // give back mapped (and committed): the books check that.
    let kept = w.faults.fired().iter().any(|f| {
        matches!(
            f.op,
            Operation::Unmap | Operation::Release | Operation::Synchronize
        )
    });
    let outcome = match (&r, swap.phase()) {
        (Ok(()), SwapPhase::Done) if q.address() == base && swap.bytes() == 0 => {
            holds(q, first, expected)
        }
        (Err(_), SwapPhase::OnHost) if q.committed_tokens() == 0 && swap.bytes() > 0 => Ok(()),
        // Failed: the request is computed again, into an empty sequence (unless the device
        // could not be proven idle: then nothing was unmapped under the copies).
        (Err(_), SwapPhase::Failed)
            if swap.bytes() == 0
                && (q.committed_tokens() == 0 || q.has_copies_in_flight() || kept) =>
        {
            Ok(())
        }
        (r, phase) => Err(format!(
            "a swap in ended {r:?} in {phase:?} with {} tokens committed, {} bytes on the host",
            q.committed_tokens(),
            swap.bytes()
        )),
    };
    violations.extend(outcome.err());
    r
}

/// A sequence written in `layout`, swapped out (no fault armed), the swap kept.
fn swapped_out(w: &World, s: &mut State, layout: KvLayout) -> Result<(), String> {
    written(w, s, layout)?;
    swap_first_out(w, s)
}

/// The world's host tier and the parts of a [`State`] a swap works on.
struct Swapping<'a> {
    tier: Arc<HostTier>,
    seqs: &'a mut Vec<SequenceKv>,
    swaps: &'a mut Vec<SwappedKv>,
    violations: &'a mut Vec<String>,
}

/// The tier (none: an error) and the state's sequences, swaps and violations, borrowed apart.
fn swapping<'a>(w: &World, s: &'a mut State) -> Result<Swapping<'a>, String> {
    let State {
        seqs,
        swaps,
        violations,
        ..
    } = s;
    Ok(Swapping {
        tier: tier_of(w)?,
        seqs,
        swaps,
        violations,
    })
}

/// The first sequence swapped out, the swap kept.
fn swap_first_out(w: &World, s: &mut State) -> Result<(), String> {
    let expected = pattern(0, tokens(w));
    let sw = swapping(w, s)?;
    let q = sw.seqs.first_mut().ok_or("no sequence")?;
    let (swap, r) = swap_out(&sw.tier, q, &expected, sw.violations);
    sw.swaps.extend(swap);
    r.map_err(e)
}

/// Swaps sequence `index` out, then back (`missing`: the error if there is none), each step
/// checked into the violations; the swap kept.
fn out_and_back(
    w: &World,
    s: &mut State,
    (index, missing): (usize, &str),
    expected: &[u8],
) -> Result<(), String> {
    let sw = swapping(w, s)?;
    let q = sw.seqs.get_mut(index).ok_or(missing)?;
    let (swap, r) = swap_out(&sw.tier, q, expected, sw.violations);
    r.map_err(e)?;
    let mut swap = swap.ok_or("no swap")?;
    let r = swap_in(w, q, &mut swap, 0, expected, sw.violations);
    sw.swaps.push(swap);
    r.map_err(e)
}

/// Swaps the first sequence out, then back.
fn round_trip(w: &World, s: &mut State) -> Result<(), String> {
    out_and_back(w, s, (0, "no sequence"), &pattern(0, tokens(w)))
}

/// A published prompt of 2 windows and a second request that maps it read-only, its own
/// tokens (half a window past the prompt) written with [`pattern`].
fn prefix_hit(w: &World, s: &mut State) -> Result<(), String> {
    published(w, s)?;
    let cache = s.cache.clone().ok_or("no cache")?;
    let mut q = admit_prompt(w, &cache)?;
    let n = q.committed_tokens().max(2 * window_tokens(w));
    let own = window_tokens(w) / 2;
    q.ensure_tokens(n.saturating_add(own)).map_err(e)?;
    q.write_tokens(n, &pattern(n, own)).map_err(e)?;
    s.seqs.push(q);
    Ok(())
}

/// The request mapping a prefix swapped out and back: its own tokens byte-exact, the
/// prefix's too.
fn prefix_round_trip(w: &World, s: &mut State) -> Result<(), String> {
    let n = 2 * window_tokens(w);
    let own = window_tokens(w) / 2;
    let mut expected = vec![7u8; usize::try_from(n * TOKEN_BYTES).map_err(e)?];
    expected.extend(pattern(n, own));
    out_and_back(w, s, (1, "no second sequence"), &expected)
}

/// Two sequences of 3 windows under a host budget of 3: the first swapped out, the second
/// refused on the host (nothing changed), the first back, then the second out.
fn host_budget(w: &World, s: &mut State) -> Result<(), String> {
    let expected = pattern(0, tokens(w));
    let sw = swapping(w, s)?;
    let [a, b] = sw.seqs.as_mut_slice() else {
        return Err("two sequences expected".to_owned());
    };
    let (first, r) = swap_out(&sw.tier, a, &expected, sw.violations);
    r.map_err(e)?;
    let mut first = first.ok_or("no swap")?;
    let (second, r) = swap_out(&sw.tier, b, &expected, sw.violations);
    if first.phase() == SwapPhase::OnHost {
        let refused_on_host = r.as_ref().err().is_some_and(|err| {
            err.backpressure()
                .is_some_and(|x| x.device == DeviceId::HOST)
                || err.never_fits().is_some_and(|x| x.device == DeviceId::HOST)
        });
        if !refused_on_host || second.is_some() {
            sw.violations.push(format!(
                "with the host's budget spent a swap out was not refused on the host: {r:?}"
            ));
        }
    }
    sw.swaps.extend(second);
    let r = swap_in(w, a, &mut first, 0, &expected, sw.violations);
    sw.swaps.push(first);
    r.map_err(e)?;
    let (again, r) = swap_out(&sw.tier, b, &expected, sw.violations);
    sw.swaps.extend(again);
    r.map_err(e)
}

/// The host tier's scenarios, in report order.
pub(crate) fn tier_scenarios() -> Vec<Scenario> {
    [swap_scenarios(), tier_memory_scenarios()].concat()
}

/// A sequence's swap: out, in, both, with a mapped prefix.
fn swap_scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "tier_swap_out",
            description: "a head-major sequence of 4 windows swapped to the host (one free \
                          chunk pooled, one more page-locked allocation), its memory released",
            spec: with_tier(2),
            setup: |w, s| {
                tier_of(w)?.prewarm(w.g).map_err(e)?;
                written(w, s, KvLayout::SeqMajor)
            },
            op: swap_first_out,
        },
        Scenario {
            name: "tier_swap_in",
            description: "a swapped sequence of 3 windows brought back: committed again at its \
                          offsets, copied back, byte-exact at its address",
            spec: with_tier(2),
            setup: |w, s| swapped_out(w, s, KvLayout::TokenMajor),
            op: |w, s| {
                let expected = pattern(0, tokens(w));
                let sw = swapping(w, s)?;
                let q = sw.seqs.first_mut().ok_or("no sequence")?;
                let swap = sw.swaps.first_mut().ok_or("no swap")?;
                swap_in(w, q, swap, 0, &expected, sw.violations).map_err(e)
            },
        },
        Scenario {
            name: "tier_round_trip",
            description: "a token-major sequence swapped out and back in one go",
            spec: with_tier(4),
            setup: |w, s| written(w, s, KvLayout::TokenMajor),
            op: round_trip,
        },
        Scenario {
            name: "tier_prefix",
            description: "a request mapping a cached prefix read-only swapped out and back: \
                          the prefix stays, is mapped again, its own window moves",
            spec: with_tier(2),
            setup: prefix_hit,
            op: prefix_round_trip,
        },
    ]
}

/// The tier's memory: its trim, a host budget spent.
fn tier_memory_scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "tier_trim",
            description: "the tier frees its 2 idle page-locked allocations, then again \
                          (retrying the frees that failed)",
            spec: with_tier(1),
            setup: |w, s| {
                tier_of(w)?.prewarm(w.g).map_err(e)?;
                written(w, s, KvLayout::TokenMajor)?;
                round_trip(w, s)?;
                s.swaps.clear();
                Ok(())
            },
            op: |w, _| {
                let tier = tier_of(w)?;
                tier.trim(0);
                tier.trim(0);
                Ok(())
            },
        },
        Scenario {
            name: "tier_host_budget",
            description: "a host budget of 3 windows: one swap out fits (its 4-window \
                          allocation cut to 3), a second is refused on the host, the first \
                          comes back, the second goes out",
            spec: WorldSpec {
                host_budget_granules: Some(3),
                ..with_tier(4)
            },
            setup: |w, s| {
                written(w, s, KvLayout::TokenMajor)?;
                written(w, s, KvLayout::TokenMajor)
            },
            op: host_budget,
        },
    ]
}
