//! Overload: 8 client threads x 25 requests (200 in all, bounded in time) against a server on
//! 127.0.0.1 whose budget holds only a few sequences; half the prompts open with a common
//! system prompt (sent as token ids, shared through the prefix cache). Every answer is 2xx or
//! 429, every 429 carries `Retry-After` and the bytes needed and available, and after
//! everything is released and the server shut down the simulated driver's ledger is empty.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{TestServer, MIB2};
use kvvm::sim::SimBackend;

const THREADS: usize = 8;
const REQUESTS_PER_THREAD: usize = 25;
const DEADLINE: Duration = Duration::from_secs(60);
/// Tokens of the common system prompt: 4 blocks of 16 (token-major, 2 MiB windows).
const SYSTEM: u32 = 64;

fn ids(prompt: u32, tail_start: u32) -> String {
    let v: Vec<String> = (0..SYSTEM)
        .chain(tail_start..tail_start + prompt - SYSTEM)
        .map(|i| i.to_string())
        .collect();
    v.join(",")
}

#[derive(Debug, Default)]
struct Tally {
    created: u64,
    hits: u64,
    appended: u64,
    deleted: u64,
    refused: u64,
    other: Vec<(u16, String)>,
}

#[test]
fn overload_sees_only_2xx_and_429_and_leaves_nothing_behind() {
    // llama-3-8b fp16 token-major: 128 KiB a token, 16 tokens a 2 MiB window. A prompt of
    // 100..1000 tokens costs 7..63 windows, an append of 300 tokens 19 more: the budget of
    // 128 windows holds a few sequences at a time.
    let budget = 128 * MIB2;
    let sim = Arc::new(SimBackend::h200());
    let mut config = common::config(&sim, Some(budget));
    config.layout = kvvm::kv::KvLayout::TokenMajor;
    let server = TestServer::start_with(sim, config, 64 << 10);
    // A sequence holding the system prompt lives throughout, so the cached prefix is mapped
    // and never evicted: every prompt that opens with it hits it.
    let pin = server.post(
        "/v1/sequences",
        &format!(
            r#"{{"token_ids": [{}], "max_tokens": 100}}"#,
            ids(SYSTEM, 0)
        ),
    );
    assert_eq!(pin.status, 201, "{}", pin.body);
    let pin = pin.json()["id"].as_u64().unwrap();
    let start = Instant::now();
    let tallies: Vec<Tally> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let server = &server;
                scope.spawn(move || {
                    let agent = common::agent();
                    let mut tally = Tally::default();
                    let mut live: Option<(u64, u32)> = None; // (id, appends done)
                    for i in 0..REQUESTS_PER_THREAD {
                        if start.elapsed() > DEADLINE {
                            break;
                        }
                        let (r, kind) = match live {
                            None => {
                                let prompt = 100 + 97 * ((t * 31 + i * 7) % 10);
                                let (body, kind) = if i % 2 == 0 {
                                    let tail = 1000 * (t as u32 + 1) + 10 * i as u32;
                                    let ids = ids(prompt as u32, tail);
                                    let b =
                                        format!(r#"{{"token_ids": [{ids}], "max_tokens": 4096}}"#);
                                    (b, 'i')
                                } else {
                                    let b = format!(
                                        r#"{{"prompt_tokens": {prompt}, "max_tokens": 4096}}"#
                                    );
                                    (b, 'c')
                                };
                                let url = server.url("/v1/sequences");
                                (common::post(&agent, &url, &body), kind)
                            }
                            Some((id, appends)) if appends < 2 => (
                                common::post(
                                    &agent,
                                    &server.url(&format!("/v1/sequences/{id}/append")),
                                    r#"{"tokens": 300}"#,
                                ),
                                'a',
                            ),
                            Some((id, _)) => (server.delete(&format!("/v1/sequences/{id}")), 'd'),
                        };
                        match (r.status, kind) {
                            (201, 'c' | 'i') => {
                                tally.created += 1;
                                let j = r.json();
                                let hit = j["prefix_hit_tokens"].as_u64().unwrap();
                                let expected = if kind == 'i' { u64::from(SYSTEM) } else { 0 };
                                assert_eq!(hit, expected, "{j}");
                                tally.hits += u64::from(hit > 0);
                                live = Some((j["id"].as_u64().unwrap(), 0));
                            }
                            (200, 'a') => {
                                tally.appended += 1;
                                if let Some((_, n)) = live.as_mut() {
                                    *n += 1;
                                }
                            }
                            (200, 'd') => {
                                tally.deleted += 1;
                                live = None;
                            }
                            (429, _) => {
                                tally.refused += 1;
                                let secs: u64 = r
                                    .retry_after
                                    .as_deref()
                                    .unwrap_or_else(|| panic!("429 without Retry-After"))
                                    .parse()
                                    .unwrap();
                                assert!((1..=5).contains(&secs), "Retry-After {secs}");
                                let j = r.json();
                                assert_eq!(j["kind"], "backpressure");
                                let needed = j["needed_bytes"].as_u64().unwrap();
                                let available = j["available_bytes"].as_u64().unwrap();
                                assert!(needed > available, "{j}");
                                assert!(j["retry_after_ms"].as_u64().is_some());
                                // A refused append leaves the sequence as it was; give up on
                                // growing it and release it instead (what a client shedding
                                // load would do), without sleeping for Retry-After.
                                if kind == 'a' {
                                    if let Some((_, n)) = live.as_mut() {
                                        *n = u32::MAX;
                                    }
                                }
                            }
                            (status, _) => tally.other.push((status, r.body)),
                        }
                    }
                    // Release what is still live (not counted in the 200).
                    if let Some((id, _)) = live {
                        let r = server.delete(&format!("/v1/sequences/{id}"));
                        assert_eq!(r.status, 200, "{}", r.body);
                        tally.deleted += 1;
                    }
                    tally
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let elapsed = start.elapsed();
    assert!(elapsed < DEADLINE + Duration::from_secs(10), "{elapsed:?}");

    let other: Vec<_> = tallies.iter().flat_map(|t| t.other.iter()).collect();
    assert!(
        other.is_empty(),
        "answers other than 2xx and 429: {other:?}"
    );
    let sum = |f: fn(&Tally) -> u64| tallies.iter().map(f).sum::<u64>();
    let (created, hits, appended, deleted, refused) = (
        sum(|t| t.created),
        sum(|t| t.hits),
        sum(|t| t.appended),
        sum(|t| t.deleted),
        sum(|t| t.refused),
    );
    println!(
        "{} requests in {elapsed:?}: {created} created ({hits} with a prefix hit), {appended} appended, {deleted} deleted, {refused} refused (429)",
        THREADS * REQUESTS_PER_THREAD
    );
    assert!(created > 0 && appended > 0, "nothing was served");
    assert!(
        refused > 0,
        "the budget never ran out: the test does not test overload"
    );
    assert_eq!(created, deleted);
    assert!(hits > 0, "no prompt hit the system prompt");
    assert_eq!(server.metric("kvvm_prefix_hits_total"), hits);
    assert_eq!(server.delete(&format!("/v1/sequences/{pin}")).status, 200);

    // The server counted what the clients saw, and nothing is live.
    assert_eq!(server.metric("kvvm_grants_refused_total"), refused);
    assert_eq!(server.metric("kvvm_live_sequences"), 0);
    assert_eq!(server.metric("kvvm_committed_bytes"), 0);
    assert_eq!(
        server.metric("kvvm_prefix_cache_bytes"),
        server.metric("kvvm_shared_bytes")
    );
    assert_eq!(server.metric("kvvm_quarantined_bytes"), 0);
    assert!(server.metric("kvvm_used_bytes") <= budget);

    let (report, sim, service) = server.shutdown();
    assert_eq!(report.sequences, 0);
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    let snap = service.governor().snapshot();
    assert_eq!((snap.used(), snap.pending()), (0, 0));
    assert_eq!(service.manager().accounting_errors(), 0);
}
