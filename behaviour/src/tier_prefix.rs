//! The prefix cache's host level under faults: a published prefix evicted to the host tier,
//! hit there by a later admission (copied back instead of prefilled), and both in one go.
//! Beside the books (`check.rs`), each operation checks what the host level promises:
//!
//! * an evicted prefix is on the host whole, or forgotten (counted as failed or forgotten),
//!   never half there;
//! * an admission that succeeds holds the prompt's bytes it says it hit, byte-exact, whether
//!   they came from the host or were left to prefill (a failed way back: the host entry is
//!   dropped, the request prefills); one that fails leaves nothing behind.

use kvvm_kv::SequenceKv;

use crate::scenarios::{plan, prompt, published, window_tokens, Scenario};
use crate::world::{with_tier, State, World};
use kvvm_kv::KvLayout;

fn e(x: impl std::fmt::Display) -> String {
    x.to_string()
}

/// The published prompt of 2 windows, its request gone (the entry idle), the cache given
/// the world's tier as its host level.
fn idle_published(w: &World, s: &mut State) -> Result<(), String> {
    published(w, s)?;
    s.seqs.clear();
    let cache = s.cache.clone().ok_or("no cache")?;
    let tier = w.tier.clone().ok_or("no tier")?;
    cache.attach_host_tier(tier).map_err(e)
}

/// Evicts every idle prefix (to the host level); checks the entry went whole or was
/// forgotten.
fn evict(_: &World, s: &mut State) -> Result<(), String> {
    let cache = s.cache.clone().ok_or("no cache")?;
    cache.evict(u64::MAX);
    let st = cache.stats();
    let accounted = st.host_entries + st.host_failed + st.host_forgotten;
    if st.cached_entries == 0 && accounted != 1 {
        s.violations.push(format!(
            "an evicted prefix is neither on the host nor counted as lost: {st:?}"
        ));
    }
    if st.host_entries == 1 && st.host_bytes == 0 {
        s.violations
            .push("a host entry holds no host memory".to_owned());
    }
    Ok(())
}

/// Admits the prompt and one more token; checks the tokens it hit hold the prompt's bytes.
fn admit(w: &World, s: &mut State) -> Result<(), String> {
    let cache = s.cache.clone().ok_or("no cache")?;
    let mut ids = prompt(w, 2);
    ids.push(1);
    let p = plan(w, KvLayout::TokenMajor)?;
    let mut q = SequenceKv::new(&w.vm, &p, p.geometry().max_tokens()).map_err(e)?;
    let r = cache.admit_into(&ids, &mut q);
    if let Ok(info) = &r {
        let full = 2 * window_tokens(w);
        if info.host_hit_tokens != 0 && info.host_hit_tokens != full {
            s.violations
                .push(format!("a host hit of {} tokens", info.host_hit_tokens));
        }
        if info.hit_tokens > 0 && !q.has_copies_in_flight() {
            let n = usize::try_from(info.hit_tokens * 256).map_err(e)?;
            let mut out = vec![0u8; n];
            q.read_tokens(0, &mut out).map_err(e)?;
            if out.iter().any(|b| *b != 7) {
                s.violations
                    .push("a hit's tokens differ from the prefix's".to_owned());
            }
        }
    }
    s.seqs.push(q);
    r.map(|_| ()).map_err(e)
}

/// The host level's scenarios, in report order.
pub(crate) fn tier_prefix_scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "tier_prefix_to_host",
            description: "an idle prefix of 2 windows evicted to the host tier: chunks taken, \
                          copied out window by window, its device memory freed",
            spec: with_tier(2),
            setup: idle_published,
            op: evict,
        },
        Scenario {
            name: "tier_prefix_from_host",
            description: "a prompt whose prefix is on the host admitted: the prompt committed, \
                          the prefix copied back (or prefilled when that fails)",
            spec: with_tier(2),
            setup: |w, s| {
                idle_published(w, s)?;
                evict(w, s)
            },
            op: admit,
        },
        Scenario {
            name: "tier_prefix_round_trip",
            description: "an idle prefix evicted to the host and admitted again in one go",
            spec: with_tier(4),
            setup: idle_published,
            op: |w, s| {
                evict(w, s)?;
                admit(w, s)
            },
        },
    ]
}
