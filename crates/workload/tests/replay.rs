//! The replay through every policy, on the simulator: orderings, determinism, the JSON keys,
//! backpressure and an empty driver ledger afterwards.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kvvm_hal::VirtualMemoryBackend;
use kvvm_sim::SimBackend;
use kvvm_workload::{
    render_svg, render_table, simulate, PolicyKind, SimulationConfig, SimulationReport,
    SyntheticTrace, TableWidth, Trace,
};

fn small_trace(requests: usize, seed: u64) -> Trace {
    Trace::synthetic(&SyntheticTrace {
        requests,
        seed,
        ..SyntheticTrace::default()
    })
    .unwrap()
}

fn run(trace: &Trace, config: &SimulationConfig) -> (SimulationReport, Arc<SimBackend>) {
    let sim = Arc::new(SimBackend::h200());
    let backend: Arc<dyn VirtualMemoryBackend> = sim.clone();
    let report = simulate(trace, backend, config, &mut |_| {}).unwrap();
    (report, sim)
}

fn waste(r: &SimulationReport, name: &str) -> f64 {
    r.policy(name).unwrap().waste_ratio
}

fn peak(r: &SimulationReport, name: &str) -> u64 {
    r.policy(name).unwrap().peak_committed_bytes
}

#[test]
fn token_major_wastes_less_than_seq_major_less_than_head_major_and_kvvm_peaks_below_static_max() {
    let trace = small_trace(60, 42);
    // An ample budget: only static-max meets it, and memory alone tells the others apart.
    let config = SimulationConfig {
        budget_bytes: 40 << 30,
        ..SimulationConfig::default()
    };
    let (r, sim) = run(&trace, &config);
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    let (t, s, h) = (
        waste(&r, "kvvm-token-major"),
        waste(&r, "kvvm-seq-major"),
        waste(&r, "kvvm-head-major"),
    );
    assert!(t < s && s < h, "token {t} seq {s} head {h}");
    let static_peak = peak(&r, "static-max");
    for p in r.policies.iter().filter(|p| p.through_manager) {
        assert!(
            p.peak_committed_bytes < static_peak,
            "{} peaks at {} >= static-max {static_peak}",
            p.name,
            p.peak_committed_bytes
        );
        assert_eq!(p.completed, 60, "{}", p.name);
        assert!(p.driver_calls > 0, "{}", p.name);
        assert!(p.driver_time_us > 0, "{}", p.name);
        assert_eq!(p.driver_time_source, "latency-model");
        // A handle from the pool is mapped again without being created.
        assert!(p.mappings > 0 && p.handles <= p.mappings, "{}", p.name);
        assert!(
            p.peak_mappings > 0 && p.peak_mappings <= p.mappings,
            "{}",
            p.name
        );
    }
    // static-max cannot hold the load within 40 GiB: it defers (429) and queues.
    let st = r.policy("static-max").unwrap();
    assert!(st.deferred > 0 && st.refusals >= st.deferred);
    assert_eq!(st.completed, 60);
    assert!(st.mean_queue_delay_ms > r.policy("kvvm-token-major").unwrap().mean_queue_delay_ms);
    // realloc-copy copies; paged-16 makes two calls for its pool.
    assert!(r.policy("realloc-copy").unwrap().copy_bytes > 0);
    assert_eq!(r.policy("paged-16").unwrap().driver_calls, 2);
    assert_eq!(r.policy("paged-16").unwrap().mappings, 1);
    // static-max: one allocation (one handle, one mapping) per admission.
    assert_eq!(st.mappings, st.handles);
    assert!(st.mappings >= 60 && st.peak_mappings <= 10, "{st:?}");
    // Prefix caching holds the system prompt's 128 blocks once: fewer bytes than paged-16.
    let pp = r.policy("paged-16+prefix").unwrap();
    assert!(peak(&r, "paged-16+prefix") < peak(&r, "paged-16"));
    assert!(pp.mean_committed_bytes < r.policy("paged-16").unwrap().mean_committed_bytes);
    assert_eq!(pp.prefix_shareable, Some(true));
    assert_eq!(pp.prefix_shared_bytes, Some(2048 * (128 << 10)));
    assert_eq!((pp.driver_calls, pp.mappings), (2, 1));
    assert_eq!(
        pp.peak_held_bytes,
        r.policy("paged-16").unwrap().peak_held_bytes
    );
    // Sharing the 2048-token system prompt commits less where the layout allows it...
    assert!(peak(&r, "kvvm-token-major+prefix") < peak(&r, "kvvm-token-major"));
    assert!(peak(&r, "kvvm-seq-major+prefix") < peak(&r, "kvvm-seq-major"));
    let tm = r.policy("kvvm-token-major+prefix").unwrap();
    assert_eq!(tm.prefix_shareable, Some(true));
    assert_eq!(tm.prefix_shared_bytes, Some(256 << 20));
    // ...and head-major cannot (2048 x 256 B < 2 MiB): a reason, the same figures.
    let hm = r.policy("kvvm-head-major+prefix").unwrap();
    assert_eq!(hm.prefix_shareable, Some(false));
    assert!(hm
        .prefix_refusal
        .as_deref()
        .unwrap()
        .contains("8192 tokens"));
    assert_eq!(hm.peak_committed_bytes, peak(&r, "kvvm-head-major"));
    // Waste is a ratio; the live bytes stored never exceed committed on average; the tokens
    // in flight are the same for every policy that ran the same schedule, shared or not.
    for p in &r.policies {
        assert!((0.0..1.0).contains(&p.waste_ratio), "{}", p.name);
        assert!(
            p.mean_stored_live_bytes <= p.mean_committed_bytes,
            "{}",
            p.name
        );
        assert!(p.mean_stored_live_bytes <= p.mean_live_bytes, "{}", p.name);
        assert!(p.peak_held_bytes >= p.peak_committed_bytes, "{}", p.name);
    }
    let live = r.policy("kvvm-token-major").unwrap().mean_live_bytes;
    assert_eq!(
        tm.mean_live_bytes, live,
        "tokens in flight do not halve with sharing"
    );
    assert!(tm.mean_stored_live_bytes < live);
    // Nothing waits but static-max's requests: their waits read 0, not a step.
    for p in r.policies.iter().filter(|p| p.name != "static-max") {
        assert_eq!(p.waited, 0, "{}", p.name);
        assert_eq!(
            (
                p.mean_queue_delay_ms,
                p.queue_delay_p50_ms,
                p.queue_delay_p99_ms
            ),
            (0.0, 0.0, 0.0),
            "{}",
            p.name
        );
    }
    assert!(st.queue_delay_p99_ms >= st.queue_delay_p50_ms && st.queue_delay_p50_ms > 0.0);
    // static-max holds 10 requests of 4 GiB at a time; the others run more at once.
    assert_eq!(st.peak_running, 10);
    assert!(tm.peak_running > st.peak_running && tm.mean_running > 0.0);
}

#[test]
fn the_same_seed_gives_the_same_trace_and_the_same_figures() {
    let a = small_trace(30, 7);
    let b = small_trace(30, 7);
    let c = small_trace(30, 8);
    assert_eq!(a, b);
    assert_ne!(a.requests, c.requests);
    let config = SimulationConfig::default();
    let (ra, _) = run(&a, &config);
    let (rb, _) = run(&b, &config);
    let strip = |r: &SimulationReport| {
        let mut v = serde_json::to_value(r).unwrap();
        v.as_object_mut().unwrap().remove("elapsed_s");
        v
    };
    assert_eq!(strip(&ra), strip(&rb));
    assert_eq!(ra.policies.len(), PolicyKind::all().len());
    for (pa, pb) in ra.policies.iter().zip(&rb.policies) {
        assert_eq!(pa.samples, pb.samples, "{}", pa.name);
    }
}

#[test]
fn a_tight_budget_defers_kvvm_requests_which_retry_and_complete_with_an_empty_ledger() {
    let trace = small_trace(40, 3);
    let config = SimulationConfig {
        budget_bytes: 6 << 30,
        policies: vec![
            "kvvm-head-major".parse().unwrap(),
            "kvvm-seq-major+prefix".parse().unwrap(),
            "kvvm-token-major".parse().unwrap(),
            "realloc-copy".parse().unwrap(),
        ],
        ..SimulationConfig::default()
    };
    let (r, sim) = run(&trace, &config);
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    let hm = r.policy("kvvm-head-major").unwrap();
    assert!(hm.deferred > 0, "{hm:?}");
    assert!(hm.peak_committed_bytes <= 6 << 30);
    for p in &r.policies {
        assert!(p.peak_committed_bytes <= 6 << 30, "{}", p.name);
        assert_eq!(p.completed + p.rejected, 40, "{}", p.name);
        assert_eq!(p.completed, 40, "{}", p.name);
    }
}

#[test]
fn a_request_larger_than_the_budget_is_rejected_not_looped_on() {
    let trace = Trace::parse_jsonl(
        "{\"arrival_s\": 0, \"prompt_tokens\": 20000, \"output_tokens\": 10}\n\
         {\"arrival_s\": 0.1, \"prompt_tokens\": 100, \"output_tokens\": 10}\n",
        "t.jsonl",
    )
    .unwrap();
    let config = SimulationConfig {
        budget_bytes: 1 << 30,
        policies: vec![
            "static-max".parse().unwrap(),
            "kvvm-token-major".parse().unwrap(),
        ],
        ..SimulationConfig::default()
    };
    let (r, sim) = run(&trace, &config);
    assert!(sim.ledger().is_empty());
    let st = r.policy("static-max").unwrap();
    assert_eq!((st.rejected, st.completed, st.admitted), (2, 0, 0));
    let tm = r.policy("kvvm-token-major").unwrap();
    assert_eq!((tm.rejected, tm.completed), (1, 1));
}

#[test]
fn the_report_serializes_with_the_documented_keys_and_renders() {
    let trace = small_trace(12, 1);
    let (r, _) = run(&trace, &SimulationConfig::default());
    let v = serde_json::to_value(&r).unwrap();
    for key in [
        "backend",
        "model",
        "budget_bytes",
        "granule_bytes",
        "max_context",
        "trace",
        "policies",
    ] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
    assert_eq!(v["trace"]["requests"], 12);
    assert_eq!(v["trace"]["seed"], 1);
    let policies = v["policies"].as_array().unwrap();
    assert_eq!(policies.len(), PolicyKind::all().len());
    assert_eq!(policies.len(), 10);
    for p in policies {
        for key in [
            "name",
            "peak_committed_bytes",
            "mean_committed_bytes",
            "waste_ratio",
            "admitted",
            "deferred",
            "driver_calls",
            "mappings",
            "handles",
            "peak_mappings",
            "driver_time_us",
        ] {
            assert!(p.get(key).is_some(), "missing {key} in {p}");
        }
        assert!(p.get("samples").is_none());
    }
    let table = render_table(&r, TableWidth::Wide);
    for p in &r.policies {
        assert!(table.contains(&p.name));
    }
    for key in ["completed", "rejected", "waited", "mappings", "handles"] {
        assert!(
            table.lines().any(|l| l.contains(key)),
            "{key} missing in {table}"
        );
    }
    let svg = render_svg(&r).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    for p in &r.policies {
        assert!(
            svg.contains(&format!(">\n{} (peak ", p.name)),
            "{} missing",
            p.name
        );
    }
}

#[test]
fn waited_counts_every_request_that_queued_refused_or_not() {
    // 30 requests at once; static-max preallocates 4 GiB each and the budget holds two.
    let lines: String = (0..30)
        .map(|_| "{\"arrival_s\": 0, \"prompt_tokens\": 100, \"output_tokens\": 50}\n")
        .collect();
    let trace = Trace::parse_jsonl(&lines, "burst.jsonl").unwrap();
    let config = SimulationConfig {
        budget_bytes: 8 << 30,
        policies: vec![
            "static-max".parse().unwrap(),
            "kvvm-token-major".parse().unwrap(),
        ],
        ..SimulationConfig::default()
    };
    let (r, sim) = run(&trace, &config);
    assert!(sim.ledger().is_empty());
    let s = r.policy("static-max").unwrap();
    assert_eq!(s.completed, 30);
    assert_eq!(s.waited, 28, "all but the two admitted at once waited");
    // Only the head of the queue is refused at each step: fewer were refused than waited.
    assert!(
        s.deferred <= s.waited,
        "{} deferred, {} waited",
        s.deferred,
        s.waited
    );
    let k = r.policy("kvvm-token-major").unwrap();
    assert_eq!(k.waited, 0, "token-major fits every request at once");
    // With room for everyone nobody waits.
    let roomy = SimulationConfig {
        budget_bytes: 139 << 30,
        ..config
    };
    let (r, _) = run(&trace, &roomy);
    assert!(r.policies.iter().all(|p| p.waited == 0), "{:?}", r.policies);
}

#[test]
fn a_request_longer_than_the_context_is_a_typed_error() {
    let trace = Trace::parse_jsonl(
        "{\"arrival_s\": 0, \"prompt_tokens\": 40000, \"output_tokens\": 10}\n",
        "t.jsonl",
    )
    .unwrap();
    let sim = Arc::new(SimBackend::h200());
    let e = simulate(&trace, sim, &SimulationConfig::default(), &mut |_| {}).unwrap_err();
    assert!(
        matches!(
            e,
            kvvm_workload::WorkloadError::RequestTooLong { index: 0, .. }
        ),
        "{e}"
    );
}

#[test]
fn under_pressure_running_sequences_are_preempted_not_thrashed() {
    // 30 requests at 8/s, all after the 2048-token system prompt, in 8 GiB: growth is refused,
    // the youngest is preempted and recomputed, and everything completes.
    let trace = Trace::synthetic(&SyntheticTrace {
        requests: 30,
        seed: 9,
        rate_per_s: 8.0,
        shared_prefix_share: 1.0,
        ..SyntheticTrace::default()
    })
    .unwrap();
    let config = SimulationConfig {
        budget_bytes: 8 << 30,
        policies: vec![
            "paged-16".parse().unwrap(),
            "kvvm-token-major".parse().unwrap(),
            "kvvm-token-major+prefix".parse().unwrap(),
        ],
        ..SimulationConfig::default()
    };
    let (r, sim) = run(&trace, &config);
    assert!(sim.ledger().is_empty());
    let tm = r.policy("kvvm-token-major").unwrap();
    assert!(tm.preemptions > 0, "{tm:?}");
    for p in &r.policies {
        assert_eq!(p.completed, 30, "{}", p.name);
        assert!(p.peak_committed_bytes <= 8 << 30, "{}", p.name);
    }
    // Sharing the prompt relieves the pressure.
    let shared = r.policy("kvvm-token-major+prefix").unwrap();
    assert!(shared.refusals < tm.refusals, "{shared:?} vs {tm:?}");
}

#[test]
fn a_sequence_that_cannot_grow_even_alone_is_rejected() {
    // The prompt fits in 64 MiB, the whole request (1100 tokens x 128 KiB) does not.
    let trace = Trace::parse_jsonl(
        "{\"arrival_s\": 0, \"prompt_tokens\": 100, \"output_tokens\": 1000}\n\
         {\"arrival_s\": 0.01, \"prompt_tokens\": 10, \"output_tokens\": 10}\n",
        "t.jsonl",
    )
    .unwrap();
    let config = SimulationConfig {
        budget_bytes: 64 << 20,
        policies: vec![
            "kvvm-token-major".parse().unwrap(),
            "paged-16".parse().unwrap(),
        ],
        ..SimulationConfig::default()
    };
    let (r, sim) = run(&trace, &config);
    assert!(sim.ledger().is_empty());
    for p in &r.policies {
        assert_eq!((p.rejected, p.completed), (1, 1), "{}", p.name);
    }
}

#[test]
fn driver_failures_roll_back_out_of_memory_is_a_refusal_and_nothing_leaks() {
    use kvvm_hal::{ErrorKind, Operation};
    use kvvm_sim::FaultRule;
    let trace = small_trace(20, 5);
    let config = SimulationConfig {
        policies: vec!["kvvm-seq-major".parse().unwrap()],
        ..SimulationConfig::default()
    };
    // A driver bug in the middle of a commit: a typed error, rolled back, nothing leaked.
    let sim = Arc::new(SimBackend::h200());
    sim.inject(FaultRule::nth(Operation::Map, 300, ErrorKind::InvalidValue));
    let e = simulate(&trace, sim.clone(), &config, &mut |_| {}).unwrap_err();
    assert!(
        matches!(
            e,
            kvvm_workload::WorkloadError::KvCache(_) | kvvm_workload::WorkloadError::Vmm(_)
        ),
        "{e}"
    );
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    // The driver running out of memory: retryable, so a refusal (429), and the run goes on
    // (a refusal when nothing else runs rejects that request: it cannot fit the device).
    let sim = Arc::new(SimBackend::h200());
    sim.inject(FaultRule::nth(
        Operation::Create,
        40,
        ErrorKind::OutOfMemory,
    ));
    let r = simulate(&trace, sim.clone(), &config, &mut |_| {}).unwrap();
    let p = r.policy("kvvm-seq-major").unwrap();
    assert_eq!(p.completed + p.rejected, 20, "{p:?}");
    assert!(p.completed >= 19, "{p:?}");
    assert!(p.refusals >= 1, "{p:?}");
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
}

#[test]
fn writing_real_kv_bytes_respects_the_read_only_prefix_and_leaks_nothing() {
    // What a GPU run does, on the simulator (which enforces read-only mappings on copies):
    // every token's KV is written; sharers never write into the shared windows.
    let trace = Trace::synthetic(&SyntheticTrace {
        requests: 8,
        seed: 11,
        prompt_median: 40.0,
        output_median: 30.0,
        system_prompt_tokens: 48,
        shared_prefix_share: 0.75,
        ..SyntheticTrace::default()
    })
    .unwrap();
    let config = SimulationConfig {
        write_kv: Some(true),
        policies: PolicyKind::all()
            .into_iter()
            .filter(PolicyKind::is_kvvm)
            .collect(),
        ..SimulationConfig::default()
    };
    let (r, sim) = run(&trace, &config);
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    let all_tokens = trace.prompt_tokens() + trace.output_tokens();
    let bpt = r.bytes_per_token;
    for p in &r.policies {
        assert_eq!(p.completed, 8, "{}", p.name);
        if p.name == "kvvm-token-major+prefix" {
            // 48 tokens = 3 whole windows shared: the owner writes them once.
            assert_eq!(p.prefix_shared_bytes, Some(3 * (2 << 20)));
            assert!(p.kv_write_bytes < all_tokens * bpt, "{p:?}");
        } else if !p.name.ends_with("+prefix") {
            assert_eq!(p.kv_write_bytes, all_tokens * bpt, "{}", p.name);
        }
    }
}

#[test]
fn prefix_caching_saves_only_when_requests_share_a_prompt() {
    let config = SimulationConfig {
        policies: vec![
            "paged-16".parse().unwrap(),
            "paged-16+prefix".parse().unwrap(),
        ],
        ..SimulationConfig::default()
    };
    let shared = Trace::synthetic(&SyntheticTrace {
        requests: 40,
        shared_prefix_share: 1.0,
        ..SyntheticTrace::default()
    })
    .unwrap();
    let (r, _) = run(&shared, &config);
    let (plain, cached) = (
        r.policy("paged-16").unwrap(),
        r.policy("paged-16+prefix").unwrap(),
    );
    // Every request opens with the 2048-token prompt: its 128 blocks are held once.
    assert!(cached.peak_committed_bytes < plain.peak_committed_bytes);
    assert!(
        cached.mean_committed_bytes * 2 < plain.mean_committed_bytes,
        "{cached:?} vs {plain:?}"
    );
    assert_eq!(cached.completed, 40);
    let none = Trace::synthetic(&SyntheticTrace {
        requests: 40,
        shared_prefix_share: 0.0,
        ..SyntheticTrace::default()
    })
    .unwrap();
    let (r, _) = run(&none, &config);
    let (plain, cached) = (
        r.policy("paged-16").unwrap(),
        r.policy("paged-16+prefix").unwrap(),
    );
    assert_eq!(cached.peak_committed_bytes, plain.peak_committed_bytes);
    assert_eq!(cached.mean_committed_bytes, plain.mean_committed_bytes);
    assert_eq!(cached.driver_time_us, plain.driver_time_us);
}

#[test]
fn the_verdict_weighs_the_best_kvvm_policy_against_the_best_other_honestly() {
    // The default run: the default trace under the default budget.
    let config = SimulationConfig::default();
    assert_eq!(config.budget_bytes, 8 << 30);
    let (r, _) = run(&small_trace(200, 42), &config);
    let v = kvvm_workload::verdict(&r).unwrap();
    assert_eq!(
        (v.kvvm.as_str(), v.baseline.as_str()),
        ("kvvm-token-major+prefix", "paged-16+prefix")
    );
    let k = r.policy(&v.kvvm).unwrap();
    let b = r.policy(&v.baseline).unwrap();
    assert_eq!(v.served, [k.completed, b.completed]);
    assert_eq!(v.held_bytes, [k.peak_held_bytes, b.peak_held_bytes]);
    assert!(
        v.text.contains("the same service") && v.text.contains("less memory held"),
        "{}",
        v.text
    );
    // A kvvm policy that serves worse is said to: no gain, with what it lost.
    let worse = SimulationConfig {
        policies: vec![
            PolicyKind::Paged16,
            PolicyKind::Kvvm {
                layout: kvvm_layout::KvLayout::HeadMajor,
                prefix_sharing: false,
            },
        ],
        ..SimulationConfig::default()
    };
    let trace = small_trace(60, 42);
    let (r, _) = run(&trace, &worse);
    let v = kvvm_workload::verdict(&r).unwrap();
    assert!(v.text.contains("no gain: a p99 wait of"), "{}", v.text);
    // Without a policy on each side there is nothing to weigh.
    let only = SimulationConfig {
        policies: vec![PolicyKind::Paged16],
        ..SimulationConfig::default()
    };
    let (r, _) = run(&trace, &only);
    assert!(kvvm_workload::verdict(&r).is_none());
    assert!(kvvm_workload::render_verdict(&r).starts_with("verdict: none"));
}
