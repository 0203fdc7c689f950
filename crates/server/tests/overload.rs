//! Overload: 8 client threads x 25 requests (200 in all, bounded in time) against a server on
//! 127.0.0.1 whose budget holds only a few sequences. Every answer is 2xx or 429, every 429
//! carries `Retry-After` and the bytes needed and available, and after everything is released
//! and the server shut down the simulated driver's ledger is empty.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{TestServer, MIB2};

const THREADS: usize = 8;
const REQUESTS_PER_THREAD: usize = 25;
const DEADLINE: Duration = Duration::from_secs(60);

#[derive(Debug, Default)]
struct Tally {
    created: u64,
    appended: u64,
    deleted: u64,
    refused: u64,
    other: Vec<(u16, String)>,
}

#[test]
fn overload_sees_only_2xx_and_429_and_leaves_nothing_behind() {
    // llama-3-8b seq-major: a sequence costs 64 windows (128 MiB) per 1024 tokens started.
    // The budget holds 6 one-window sequences, fewer once they grow.
    let budget = 6 * 64 * MIB2;
    let server = TestServer::start(Some(budget));
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
                                let body =
                                    format!(r#"{{"prompt_tokens": {prompt}, "max_tokens": 4096}}"#);
                                (
                                    common::post(&agent, &server.url("/v1/sequences"), &body),
                                    'c',
                                )
                            }
                            Some((id, appends)) if appends < 2 => (
                                common::post(
                                    &agent,
                                    &server.url(&format!("/v1/sequences/{id}/append")),
                                    r#"{"tokens": 700}"#,
                                ),
                                'a',
                            ),
                            Some((id, _)) => (server.delete(&format!("/v1/sequences/{id}")), 'd'),
                        };
                        match (r.status, kind) {
                            (201, 'c') => {
                                tally.created += 1;
                                live = Some((r.json()["id"].as_u64().unwrap(), 0));
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
    let (created, appended, deleted, refused) = (
        sum(|t| t.created),
        sum(|t| t.appended),
        sum(|t| t.deleted),
        sum(|t| t.refused),
    );
    println!(
        "{} requests in {elapsed:?}: {created} created, {appended} appended, {deleted} deleted, {refused} refused (429)",
        THREADS * REQUESTS_PER_THREAD
    );
    assert!(created > 0 && appended > 0, "nothing was served");
    assert!(
        refused > 0,
        "the budget never ran out: the test does not test overload"
    );
    assert_eq!(created, deleted);

    // The server counted what the clients saw, and nothing is live.
    assert_eq!(server.metric("kvvm_grants_refused_total"), refused);
    assert_eq!(server.metric("kvvm_live_sequences"), 0);
    assert_eq!(server.metric("kvvm_committed_bytes"), 0);
    assert_eq!(server.metric("kvvm_quarantined_bytes"), 0);
    assert!(server.metric("kvvm_used_bytes") <= budget);

    let (report, sim, service) = server.shutdown();
    assert_eq!(report.sequences, 0);
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    let snap = service.governor().snapshot();
    assert_eq!((snap.used(), snap.pending()), (0, 0));
    assert_eq!(service.manager().accounting_errors(), 0);
}
