//! `GET /metrics`: the Prometheus text exposition format (version 0.0.4).

use std::fmt::Write;

use crate::api::MetricsSnapshot;

/// The content type of [`render`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Every metric [`render`] writes: name, type and help text.
pub const METRICS: [(&str, &str, &str); 28] = [
    (
        "kvvm_budget_bytes",
        "gauge",
        "Device memory budget of the governor (absent when unlimited).",
    ),
    (
        "kvvm_used_bytes",
        "gauge",
        "Physical device bytes held: committed + pooled + shared + quarantined.",
    ),
    (
        "kvvm_committed_bytes",
        "gauge",
        "Physical bytes of live sequences' own windows: the sum of their committed_bytes (shared prefix windows are in kvvm_shared_bytes).",
    ),
    (
        "kvvm_pooled_bytes",
        "gauge",
        "Bytes of released handles kept for reuse.",
    ),
    (
        "kvvm_shared_bytes",
        "gauge",
        "Bytes of shared prefix handles, counted once.",
    ),
    (
        "kvvm_quarantined_bytes",
        "gauge",
        "Bytes that could not be proven idle: never reused, never free.",
    ),
    (
        "kvvm_pending_bytes",
        "gauge",
        "Bytes granted and not yet settled.",
    ),
    (
        "kvvm_free_bytes",
        "gauge",
        "Budget nothing holds (absent when unlimited): pooled handles and cached prefixes are held, kvvm_available_bytes counts them.",
    ),
    (
        "kvvm_available_bytes",
        "gauge",
        "Bytes available to new requests: free budget plus what the handle pool and idle cached prefixes give back on demand (absent when unlimited).",
    ),
    ("kvvm_granule_bytes", "gauge", "The mapping granule."),
    ("kvvm_live_sequences", "gauge", "Live sequences."),
    (
        "kvvm_live_tokens",
        "gauge",
        "Live tokens over all sequences.",
    ),
    (
        "kvvm_sequences_created_total",
        "counter",
        "Sequences opened.",
    ),
    (
        "kvvm_sequences_released_total",
        "counter",
        "Sequences released (DELETE or shutdown).",
    ),
    (
        "kvvm_sequences_expired_total",
        "counter",
        "Sequences released because nobody used them for the idle timeout.",
    ),
    ("kvvm_appends_total", "counter", "Successful appends."),
    (
        "kvvm_grants_refused_total",
        "counter",
        "Requests refused with HTTP 429: lack of memory or a limit reached.",
    ),
    (
        "kvvm_bad_requests_total",
        "counter",
        "Requests refused as invalid (HTTP 4xx other than 429).",
    ),
    (
        "kvvm_unavailable_total",
        "counter",
        "Requests answered 503: load shedding, the connection cap, shutting down.",
    ),
    (
        "kvvm_internal_errors_total",
        "counter",
        "Requests that failed with a 5xx other than 503.",
    ),
    (
        "kvvm_prefix_hits_total",
        "counter",
        "Sequences whose prompt hit a shared prefix.",
    ),
    (
        "kvvm_prefix_hit_tokens_total",
        "counter",
        "Prompt tokens served from shared prefixes.",
    ),
    (
        "kvvm_prefixes_published_total",
        "counter",
        "Prefixes published to the prefix cache.",
    ),
    (
        "kvvm_prefix_cache_entries",
        "gauge",
        "Prefixes in the prefix cache (absent when it is off).",
    ),
    (
        "kvvm_prefix_cache_bytes",
        "gauge",
        "Physical bytes the cached prefixes hold, each counted once.",
    ),
    (
        "kvvm_prefix_cache_idle_bytes",
        "gauge",
        "Cached prefix bytes no live sequence maps (evictable now).",
    ),
    (
        "kvvm_prefix_bytes_saved_total",
        "counter",
        "Bytes mapped read-only from the cache instead of committed.",
    ),
    (
        "kvvm_prefix_evictions_total",
        "counter",
        "Prefixes evicted (LRU cap or the governor's reclaim).",
    ),
];

/// Renders `m` in the Prometheus text format.
pub fn render(m: &MetricsSnapshot) -> String {
    let d = m.governor.device(m.device);
    let c = &m.counters;
    let value = |name: &str| -> Option<u64> {
        Some(match name {
            "kvvm_budget_bytes" => d.budget?,
            "kvvm_used_bytes" => d.used(),
            "kvvm_committed_bytes" => d.committed,
            "kvvm_pooled_bytes" => d.pooled,
            "kvvm_shared_bytes" => d.shared,
            "kvvm_quarantined_bytes" => d.quarantined,
            "kvvm_pending_bytes" => d.pending,
            "kvvm_free_bytes" => {
                d.budget?;
                d.free()
            }
            "kvvm_available_bytes" => {
                d.budget?;
                m.available_bytes
            }
            "kvvm_granule_bytes" => m.granule,
            "kvvm_live_sequences" => m.live_sequences,
            "kvvm_live_tokens" => m.live_tokens,
            "kvvm_sequences_created_total" => c.sequences_created,
            "kvvm_sequences_released_total" => c.sequences_released,
            "kvvm_sequences_expired_total" => c.sequences_expired,
            "kvvm_appends_total" => c.appends,
            "kvvm_grants_refused_total" => c.grants_refused,
            "kvvm_bad_requests_total" => c.bad_requests,
            "kvvm_unavailable_total" => c.unavailable,
            "kvvm_internal_errors_total" => c.internal_errors,
            "kvvm_prefix_hits_total" => c.prefix_hits,
            "kvvm_prefix_hit_tokens_total" => c.prefix_hit_tokens,
            "kvvm_prefixes_published_total" => c.prefixes_published,
            "kvvm_prefix_cache_entries" => m.prefix_cache?.cached_entries,
            "kvvm_prefix_cache_bytes" => m.prefix_cache?.cached_bytes,
            "kvvm_prefix_cache_idle_bytes" => m.prefix_cache?.idle_bytes,
            "kvvm_prefix_bytes_saved_total" => m.prefix_cache?.bytes_saved,
            "kvvm_prefix_evictions_total" => m.prefix_cache?.evictions,
            _ => return None,
        })
    };
    let mut out = String::new();
    let device = m.device.0;
    for (name, kind, help) in METRICS {
        if let Some(v) = value(name) {
            // Writing to a String cannot fail.
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let _ = writeln!(out, "{name}{{device=\"{device}\"}} {v}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Counters;
    use kvvm::governor::{DeviceSnapshot, GovernorSnapshot};
    use kvvm::kv::PrefixCacheStats;
    use kvvm::DeviceId;

    #[test]
    fn renders_every_metric_with_help_and_type() {
        let m = MetricsSnapshot {
            governor: GovernorSnapshot {
                devices: vec![DeviceSnapshot {
                    device: DeviceId(0),
                    budget: Some(100),
                    committed: 10,
                    pooled: 20,
                    shared: 0,
                    quarantined: 0,
                    pending: 0,
                }],
                process_budget: None,
            },
            available_bytes: 90,
            device: DeviceId(0),
            live_sequences: 2,
            live_tokens: 7,
            counters: Counters {
                grants_refused: 3,
                ..Counters::default()
            },
            granule: 2 << 20,
            prefix_cache: Some(PrefixCacheStats::default()),
        };
        let text = render(&m);
        for (name, kind, _) in METRICS {
            assert!(text.contains(&format!("# TYPE {name} {kind}\n")), "{name}");
        }
        assert!(text.contains("kvvm_used_bytes{device=\"0\"} 30\n"));
        assert!(text.contains("kvvm_free_bytes{device=\"0\"} 70\n"));
        assert!(text.contains("kvvm_available_bytes{device=\"0\"} 90\n"));
        assert!(text.contains("kvvm_grants_refused_total{device=\"0\"} 3\n"));
        assert!(text.contains("kvvm_live_sequences{device=\"0\"} 2\n"));
    }

    #[test]
    fn unlimited_budget_omits_budget_and_free() {
        let m = MetricsSnapshot {
            governor: GovernorSnapshot::default(),
            available_bytes: u64::MAX,
            device: DeviceId(0),
            live_sequences: 0,
            live_tokens: 0,
            counters: Counters::default(),
            granule: 1,
            prefix_cache: None,
        };
        let text = render(&m);
        assert!(!text.contains("kvvm_budget_bytes"));
        assert!(!text.contains("kvvm_free_bytes"));
        assert!(!text.contains("kvvm_available_bytes"));
        assert!(!text.contains("kvvm_prefix_cache_bytes"));
        assert!(text.contains("kvvm_used_bytes{device=\"0\"} 0\n"));
    }
}
