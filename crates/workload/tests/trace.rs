//! Traces: the JSONL parser (good and bad lines) and the synthetic generator.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use kvvm_workload::{SyntheticTrace, Trace, TraceSource, WorkloadError};

fn line_error(text: &str) -> (usize, String) {
    match Trace::parse_jsonl(text, "t.jsonl").unwrap_err() {
        WorkloadError::TraceLine { line, message } => (line, message),
        e => panic!("expected a line error, got {e}"),
    }
}

#[test]
fn parses_counts_ids_comments_and_blank_lines() {
    let text = "# a comment\n\
        \n\
        {\"arrival_s\": 0.5, \"prompt_tokens\": 300, \"output_tokens\": 20, \"shared_prefix_tokens\": 100}\n\
        {\"arrival_s\": 0.25, \"prompt_tokens\": 50, \"output_tokens\": 5}\n";
    let t = Trace::parse_jsonl(text, "x.jsonl").unwrap();
    assert_eq!(t.requests.len(), 2);
    // Sorted by arrival.
    assert_eq!(t.requests[0].arrival_us, 250_000);
    assert_eq!(t.requests[0].prompt_tokens, 50);
    assert_eq!(t.requests[1].shared_prefix_tokens, 100);
    assert_eq!(t.requests[1].total_tokens(), 320);
    assert_eq!(t.system_prompt_tokens, 100);
    assert_eq!(
        t.source,
        TraceSource::Jsonl {
            path: "x.jsonl".into()
        }
    );
}

#[test]
fn token_ids_share_their_common_prefix() {
    let text = "{\"arrival_s\": 0, \"token_ids\": [1,2,3,4,5,6], \"output_tokens\": 3}\n\
        {\"arrival_s\": 1, \"token_ids\": [1,2,3,4,9], \"output_tokens\": 3}\n\
        {\"arrival_s\": 2, \"token_ids\": [1,2,8], \"output_tokens\": 3}\n\
        {\"arrival_s\": 3, \"token_ids\": [7,7], \"output_tokens\": 3}\n";
    let t = Trace::parse_jsonl(text, "ids.jsonl").unwrap();
    let shared: Vec<u64> = t.requests.iter().map(|r| r.shared_prefix_tokens).collect();
    assert_eq!(shared, vec![4, 4, 2, 0]);
    assert_eq!(t.system_prompt_tokens, 4);
    assert_eq!(t.requests[0].prompt_tokens, 6);
    assert_eq!(t.shared_prefix_requests(), 2);
}

#[test]
fn a_bad_line_is_a_typed_error_naming_its_line_number() {
    let good = "{\"arrival_s\": 0, \"prompt_tokens\": 10, \"output_tokens\": 1}\n";
    let cases: [(&str, &str); 16] = [
        ("{\"arrival_s\": 0, \"prompt_tokens\": 10", "EOF while parsing an object (column"),
        ("{\"arrival_s\": 0, \"output_tokens\": 3}", "missing prompt_tokens"),
        (
            "{\"arrival_s\": 0, \"prompt_tokens\": 3, \"token_ids\": [1], \"output_tokens\": 3}",
            "not both",
        ),
        ("{\"arrival_s\": -1, \"prompt_tokens\": 3, \"output_tokens\": 3}", "arrival_s"),
        ("{\"arrival_s\": 0, \"prompt_tokens\": 3, \"output_tokens\": 0}", "output_tokens"),
        ("{\"arrival_s\": 0, \"prompt_tokens\": 0, \"output_tokens\": 2}", "at least one token"),
        (
            "{\"arrival_s\": 0, \"prompt_tokens\": 3, \"output_tokens\": 2, \"shared_prefix_tokens\": 4}",
            "exceeds the prompt",
        ),
        (
            "{\"arrival_s\": 0, \"prompt_tokens\": 3, \"output_tokens\": 2, \"colour\": 1}",
            "unknown field",
        ),
        ("[1, 2, 3]", "one JSON object per line"),
        (
            "[{\"arrival_s\": 0, \"prompt_tokens\": 3, \"output_tokens\": 2}]",
            "a JSON array: a JSONL trace holds one JSON object per line",
        ),
        ("42", "each line of a JSONL trace is one JSON object"),
        (
            "{\"arrival_s\": 0, \"prompt_tokens\": 3, \"output_tokens\": \"5\"}",
            "output_tokens must be a whole number >= 1, not the string \"5\"",
        ),
        (
            "{\"arrival_s\": \"soon\", \"prompt_tokens\": 3, \"output_tokens\": 2}",
            "arrival_s must be a number of seconds >= 0, not the string \"soon\"",
        ),
        (
            "{\"arrival_s\": 1e300, \"prompt_tokens\": 3, \"output_tokens\": 2}",
            "is too large: at most 4611686018427 seconds",
        ),
        (
            "{\"arrival_s\": 0, \"token_ids\": [1, -2], \"output_tokens\": 2}",
            "token_ids[1] must be a whole number >= 0, not -2",
        ),
        (
            "{\"arrival_s\": 0, \"prompt_tokens\": 3, \"prompt_tokens\": 4, \"output_tokens\": 2}",
            "given twice",
        ),
    ];
    for (bad, needle) in cases {
        // Two good lines, a comment, then the bad one: line 4.
        let text = format!("{good}{good}# note\n{bad}\n{good}");
        let (line, message) = line_error(&text);
        assert_eq!(line, 4, "{bad}: {message}");
        assert!(message.contains(needle), "{bad}: {message}");
        let shown = Trace::parse_jsonl(&text, "t").unwrap_err().to_string();
        assert!(shown.starts_with("trace line 4: "), "{shown}");
    }
    assert!(matches!(
        Trace::parse_jsonl("# only a comment\n\n", "t"),
        Err(WorkloadError::EmptyTrace)
    ));
}

#[test]
fn the_shipped_example_traces_parse() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/traces");
    let small = Trace::from_jsonl_file(&root.join("small.jsonl")).unwrap();
    assert_eq!(small.requests.len(), 40);
    assert_eq!(small.system_prompt_tokens, 2048);
    small.check_fits(32_768).unwrap();
    let ids = Trace::from_jsonl_file(&root.join("token-ids.jsonl")).unwrap();
    assert_eq!(ids.system_prompt_tokens, 24);
    assert!(matches!(
        Trace::from_jsonl_file(&root.join("missing.jsonl")),
        Err(WorkloadError::Io { .. })
    ));
}

#[test]
fn the_synthetic_trace_follows_its_parameters() {
    let p = SyntheticTrace {
        requests: 2000,
        ..SyntheticTrace::default()
    };
    let t = Trace::synthetic(&p).unwrap();
    assert_eq!(t.requests.len(), 2000);
    // Poisson arrivals at 4/s: about 500 s for 2000 requests.
    let d = t.duration_s();
    assert!((450.0..550.0).contains(&d), "{d}");
    assert!(t
        .requests
        .windows(2)
        .all(|w| w[0].arrival_us <= w[1].arrival_us));
    let shared = t.shared_prefix_requests() as f64 / 2000.0;
    assert!((0.45..0.55).contains(&shared), "{shared}");
    for r in &t.requests {
        assert!(r.total_tokens() <= p.max_tokens);
        assert!(r.prompt_tokens >= 1 && r.output_tokens >= 1);
        assert!(r.shared_prefix_tokens == 0 || r.shared_prefix_tokens == 2048);
    }
    let none = Trace::synthetic(&SyntheticTrace {
        shared_prefix_share: 0.0,
        requests: 50,
        ..SyntheticTrace::default()
    })
    .unwrap();
    assert_eq!(none.system_prompt_tokens, 0);
    for bad in [
        SyntheticTrace {
            requests: 0,
            ..SyntheticTrace::default()
        },
        SyntheticTrace {
            rate_per_s: 0.0,
            ..SyntheticTrace::default()
        },
        SyntheticTrace {
            shared_prefix_share: 1.5,
            ..SyntheticTrace::default()
        },
        SyntheticTrace {
            max_tokens: 1000,
            ..SyntheticTrace::default()
        },
    ] {
        assert!(matches!(
            Trace::synthetic(&bad),
            Err(WorkloadError::Config(_))
        ));
    }
}

#[test]
fn a_byte_order_mark_is_not_part_of_the_first_line() {
    let t = Trace::parse_jsonl(
        "\u{feff}{\"arrival_s\": 0, \"prompt_tokens\": 10, \"output_tokens\": 1}\n",
        "t",
    )
    .unwrap();
    assert_eq!(t.requests.len(), 1);
    assert_eq!(t.requests[0].line, Some(1));
}

#[test]
fn a_request_too_long_is_named_by_its_line_in_the_file() {
    // Line 3 arrives first: sorted by arrival it is request 0, but the user wrote line 3.
    let text = "{\"arrival_s\": 5, \"prompt_tokens\": 10, \"output_tokens\": 1}\n\
                # a comment\n\
                {\"arrival_s\": 0.1, \"prompt_tokens\": 900, \"output_tokens\": 200}\n";
    let t = Trace::parse_jsonl(text, "t").unwrap();
    let e = t.check_fits(1000).unwrap_err();
    assert!(
        matches!(
            e,
            WorkloadError::RequestTooLong {
                index: 0,
                line: Some(3),
                ..
            }
        ),
        "{e:?}"
    );
    let shown = e.to_string();
    assert!(
        shown.starts_with("trace line 3: the request needs 1100 tokens (prompt 900 + output 200)"),
        "{shown}"
    );
    assert!(shown.contains("maximum context of 1000 tokens"), "{shown}");
}
