//! What the HTTP side measures: requests by route, method and status, a latency histogram
//! per route, and the connections (open, accepted, refused at the cap, closed by a timeout
//! or an HTTP error that the HTTP layer answered itself), rendered in the Prometheus text
//! format after the service's own metrics.

use kvvm::hal::sync::lock;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Upper bounds of the latency histogram's buckets, in seconds.
pub const LATENCY_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// The routes, as the `route` label names them.
pub const ROUTES: [&str; 6] = [
    "/v1/sequences",
    "/v1/sequences/{id}",
    "/v1/sequences/{id}/append",
    "/metrics",
    "/healthz",
    "other",
];

/// The route label of a request path.
pub(crate) fn route_of(path: &str) -> &'static str {
    let parts: Vec<&str> = path.split('/').collect();
    match parts.as_slice() {
        ["", "v1", "sequences"] => ROUTES[0],
        ["", "v1", "sequences", _] => ROUTES[1],
        ["", "v1", "sequences", _, "append"] => ROUTES[2],
        ["", "metrics"] => ROUTES[3],
        ["", "healthz"] => ROUTES[4],
        _ => ROUTES[5],
    }
}

#[derive(Debug, Default)]
struct Histogram {
    buckets: [u64; LATENCY_BUCKETS.len()],
    count: u64,
    sum_seconds: f64,
}

/// Why the HTTP layer closed a connection without a handler's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum ConnectionEnd {
    /// No complete request head within the header timeout.
    HeaderTimeout,
    /// Idle longer than the keep-alive timeout.
    IdleTimeout,
    /// A request head the HTTP layer refused (it answered 400, 414 or 431 itself).
    ParseError,
    /// Cut by the shutdown deadline.
    ShutdownDeadline,
    /// The peer went away mid-request, or another I/O error.
    Io,
}

impl ConnectionEnd {
    fn as_str(self) -> &'static str {
        match self {
            ConnectionEnd::HeaderTimeout => "header_timeout",
            ConnectionEnd::IdleTimeout => "idle_timeout",
            ConnectionEnd::ParseError => "parse_error",
            ConnectionEnd::ShutdownDeadline => "shutdown_deadline",
            ConnectionEnd::Io => "io_error",
        }
    }
}

/// The HTTP side's measurements, shared by the router and the accept loop.
#[derive(Debug, Default)]
pub struct HttpMetrics {
    requests: Mutex<BTreeMap<(&'static str, String, u16), u64>>,
    latency: Mutex<BTreeMap<&'static str, Histogram>>,
    pub(crate) connections_open: AtomicU64,
    pub(crate) connections_accepted: AtomicU64,
    pub(crate) connections_refused: AtomicU64,
    pub(crate) accept_errors: AtomicU64,
    pub(crate) in_flight: AtomicU64,
    ends: Mutex<BTreeMap<ConnectionEnd, u64>>,
    /// Set when the shutdown starts: new requests are answered 503.
    pub(crate) draining: AtomicBool,
}

/// One unit of a gauge of [`HttpMetrics`] (a request in flight, an open connection), taken
/// back when this drops: however its holder ends, whether it returned, or its future was
/// dropped because the client reset the connection, or its task was aborted at the shutdown
/// deadline. A decrement written after an `.await` would be skipped in the last two cases.
#[derive(Debug)]
pub(crate) struct Held {
    metrics: Arc<HttpMetrics>,
    gauge: fn(&HttpMetrics) -> &AtomicU64,
}

impl Held {
    fn new(metrics: &Arc<HttpMetrics>, gauge: fn(&HttpMetrics) -> &AtomicU64) -> Self {
        gauge(metrics).fetch_add(1, Ordering::Relaxed);
        Held {
            metrics: Arc::clone(metrics),
            gauge,
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        (self.gauge)(&self.metrics).fetch_sub(1, Ordering::Relaxed);
    }
}

impl HttpMetrics {
    /// Counts a request in flight until the returned guard drops.
    pub(crate) fn request_in_flight(self: &Arc<Self>) -> Held {
        Held::new(self, |m| &m.in_flight)
    }

    /// Counts an open connection until the returned guard drops.
    pub(crate) fn connection_open(self: &Arc<Self>) -> Held {
        Held::new(self, |m| &m.connections_open)
    }

    /// Requests in flight now.
    pub(crate) fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Records one answered request.
    pub(crate) fn observe(&self, route: &'static str, method: &str, status: u16, took: Duration) {
        // Methods outside the standard few share one label (the label set stays bounded).
        let method = match method {
            "GET" | "POST" | "DELETE" | "PUT" | "HEAD" | "PATCH" | "OPTIONS" => method,
            _ => "other",
        };
        *lock(&self.requests)
            .entry((route, method.to_owned(), status))
            .or_default() += 1;
        let secs = took.as_secs_f64();
        let mut latency = lock(&self.latency);
        let h = latency.entry(route).or_default();
        for (bucket, le) in h.buckets.iter_mut().zip(LATENCY_BUCKETS) {
            if secs <= le {
                *bucket += 1;
            }
        }
        h.count += 1;
        h.sum_seconds += secs;
    }

    /// Records a connection closed by the HTTP layer.
    pub(crate) fn connection_end(&self, why: ConnectionEnd) {
        *lock(&self.ends).entry(why).or_default() += 1;
    }

    /// Requests answered with `status` so far, over every route and method.
    pub fn requests_with_status(&self, status: u16) -> u64 {
        lock(&self.requests)
            .iter()
            .filter(|((_, _, s), _)| *s == status)
            .map(|(_, n)| *n)
            .sum()
    }

    /// Whether the shutdown started.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Appends the HTTP metrics to a Prometheus text.
    pub(crate) fn render(&self, out: &mut String) {
        self.render_requests(out);
        self.render_latency(out);
        self.render_gauges(out);
        self.render_closed_connections(out);
    }

    /// The requests answered, by route, method and status.
    fn render_requests(&self, out: &mut String) {
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "# HELP kvvm_http_requests_total HTTP requests answered, by route, method and status.\n# TYPE kvvm_http_requests_total counter"
        );
        for ((route, method, status), n) in lock(&self.requests).iter() {
            let _ = writeln!(
                out,
                "kvvm_http_requests_total{{route=\"{route}\",method=\"{method}\",status=\"{status}\"}} {n}"
            );
        }
    }

    /// The latency histogram of each route: cumulative buckets, then `+Inf`, sum and count.
    fn render_latency(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP kvvm_http_request_duration_seconds Time from the request head to the response, by route.\n# TYPE kvvm_http_request_duration_seconds histogram"
        );
        for (route, h) in lock(&self.latency).iter() {
            for (n, le) in h.buckets.iter().zip(LATENCY_BUCKETS) {
                let _ = writeln!(
                    out,
                    "kvvm_http_request_duration_seconds_bucket{{route=\"{route}\",le=\"{le}\"}} {n}"
                );
            }
            let _ = writeln!(
                out,
                "kvvm_http_request_duration_seconds_bucket{{route=\"{route}\",le=\"+Inf\"}} {}\nkvvm_http_request_duration_seconds_sum{{route=\"{route}\"}} {}\nkvvm_http_request_duration_seconds_count{{route=\"{route}\"}} {}",
                h.count, h.sum_seconds, h.count
            );
        }
    }

    /// The connections (open, accepted, refused, accept errors) and the requests in flight,
    /// one family each.
    fn render_gauges(&self, out: &mut String) {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let gauges = [
            (
                "kvvm_http_connections_open",
                "gauge",
                "Connections open now.",
                get(&self.connections_open),
            ),
            (
                "kvvm_http_connections_accepted_total",
                "counter",
                "Connections accepted.",
                get(&self.connections_accepted),
            ),
            (
                "kvvm_http_connections_refused_total",
                "counter",
                "Connections answered 503 (or closed) at the connection cap.",
                get(&self.connections_refused),
            ),
            (
                "kvvm_http_accept_errors_total",
                "counter",
                "Errors accepting a connection (e.g. out of file descriptors).",
                get(&self.accept_errors),
            ),
            (
                "kvvm_http_requests_in_flight",
                "gauge",
                "Requests being handled now.",
                get(&self.in_flight),
            ),
        ];
        for (name, kind, help, v) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        }
    }

    /// The connections the HTTP layer closed itself, by reason (every reason, 0 included).
    fn render_closed_connections(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP kvvm_http_connections_closed_total Connections the HTTP layer closed without a handler's answer, by reason.\n# TYPE kvvm_http_connections_closed_total counter"
        );
        let ends = lock(&self.ends);
        for why in [
            ConnectionEnd::HeaderTimeout,
            ConnectionEnd::IdleTimeout,
            ConnectionEnd::ParseError,
            ConnectionEnd::ShutdownDeadline,
            ConnectionEnd::Io,
        ] {
            let n = ends.get(&why).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "kvvm_http_connections_closed_total{{reason=\"{}\"}} {n}",
                why.as_str()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_are_labelled_by_template() {
        assert_eq!(route_of("/v1/sequences"), "/v1/sequences");
        assert_eq!(route_of("/v1/sequences/17"), "/v1/sequences/{id}");
        assert_eq!(
            route_of("/v1/sequences/x/append"),
            "/v1/sequences/{id}/append"
        );
        assert_eq!(route_of("/v1/nothing/at/all"), "other");
    }

    #[test]
    fn a_histogram_is_cumulative() {
        let m = HttpMetrics::default();
        m.observe("/healthz", "GET", 200, Duration::from_micros(700));
        m.observe("/healthz", "GET", 200, Duration::from_secs(2));
        let mut out = String::new();
        m.render(&mut out);
        assert!(out.contains(
            "kvvm_http_request_duration_seconds_bucket{route=\"/healthz\",le=\"0.0005\"} 0\n"
        ));
        assert!(out.contains(
            "kvvm_http_request_duration_seconds_bucket{route=\"/healthz\",le=\"0.001\"} 1\n"
        ));
        assert!(out.contains(
            "kvvm_http_request_duration_seconds_bucket{route=\"/healthz\",le=\"+Inf\"} 2\n"
        ));
        assert!(out.contains(
            "kvvm_http_requests_total{route=\"/healthz\",method=\"GET\",status=\"200\"} 2\n"
        ));
        assert_eq!(m.requests_with_status(200), 2);
    }

    #[test]
    fn the_exposition_is_pinned() {
        let m = Arc::new(HttpMetrics::default());
        m.observe("/healthz", "GET", 200, Duration::from_micros(700));
        m.observe("/v1/sequences", "POST", 201, Duration::from_millis(3));
        m.observe("/v1/sequences", "POST", 429, Duration::from_millis(30));
        m.observe("other", "BREW", 404, Duration::from_secs(7));
        m.connections_accepted.store(5, Ordering::Relaxed);
        m.connections_refused.store(2, Ordering::Relaxed);
        m.accept_errors.store(1, Ordering::Relaxed);
        let _open = m.connection_open();
        let _busy = m.request_in_flight();
        m.connection_end(ConnectionEnd::IdleTimeout);
        m.connection_end(ConnectionEnd::IdleTimeout);
        m.connection_end(ConnectionEnd::Io);
        let mut out = String::new();
        m.render(&mut out);
        assert_eq!(out, EXPOSITION);
        let mut empty = String::new();
        HttpMetrics::default().render(&mut empty);
        assert_eq!(empty, EMPTY);
    }

    const EXPOSITION: &str = r#"# HELP kvvm_http_requests_total HTTP requests answered, by route, method and status.
# TYPE kvvm_http_requests_total counter
kvvm_http_requests_total{route="/healthz",method="GET",status="200"} 1
kvvm_http_requests_total{route="/v1/sequences",method="POST",status="201"} 1
kvvm_http_requests_total{route="/v1/sequences",method="POST",status="429"} 1
kvvm_http_requests_total{route="other",method="other",status="404"} 1
# HELP kvvm_http_request_duration_seconds Time from the request head to the response, by route.
# TYPE kvvm_http_request_duration_seconds histogram
kvvm_http_request_duration_seconds_bucket{route="/healthz",le="0.0005"} 0
kvvm_http_request_duration_seconds_bucket{route="/healthz",le="0.001"} 1
kvvm_http_request_duration_seconds_bucket{route="/healthz",le="0.0025"} 1
kvvm_http_request_duration_seconds_bucket{route="/healthz",le="0.005"} 1
kvvm_http_request_duration_seconds_bucket{route="/healthz",le="0.01"} 1
kvvm_http_request_duration_seconds_bucket{route="/healthz",le="0.025"} 1
kvvm_http_request_duration_seconds_bucket{route="/healthz",le="0.05"} 1
kvvm_http_request_duration_seconds_bucket{route="/healthz",le="0.1"} 1
kvvm_http_request_duration_seconds_bucket{route="/healthz",le="0.25"} 1
kvvm_http_request_duration_seconds_bucket{route="/healthz",le="0.5"} 1
kvvm_http_request_duration_seconds_bucket{route="/healthz",le="1"} 1
kvvm_http_request_duration_seconds_bucket{route="/healthz",le="5"} 1
kvvm_http_request_duration_seconds_bucket{route="/healthz",le="+Inf"} 1
kvvm_http_request_duration_seconds_sum{route="/healthz"} 0.0007
kvvm_http_request_duration_seconds_count{route="/healthz"} 1
kvvm_http_request_duration_seconds_bucket{route="/v1/sequences",le="0.0005"} 0
kvvm_http_request_duration_seconds_bucket{route="/v1/sequences",le="0.001"} 0
kvvm_http_request_duration_seconds_bucket{route="/v1/sequences",le="0.0025"} 0
kvvm_http_request_duration_seconds_bucket{route="/v1/sequences",le="0.005"} 1
kvvm_http_request_duration_seconds_bucket{route="/v1/sequences",le="0.01"} 1
kvvm_http_request_duration_seconds_bucket{route="/v1/sequences",le="0.025"} 1
kvvm_http_request_duration_seconds_bucket{route="/v1/sequences",le="0.05"} 2
kvvm_http_request_duration_seconds_bucket{route="/v1/sequences",le="0.1"} 2
kvvm_http_request_duration_seconds_bucket{route="/v1/sequences",le="0.25"} 2
kvvm_http_request_duration_seconds_bucket{route="/v1/sequences",le="0.5"} 2
kvvm_http_request_duration_seconds_bucket{route="/v1/sequences",le="1"} 2
kvvm_http_request_duration_seconds_bucket{route="/v1/sequences",le="5"} 2
kvvm_http_request_duration_seconds_bucket{route="/v1/sequences",le="+Inf"} 2
kvvm_http_request_duration_seconds_sum{route="/v1/sequences"} 0.033
kvvm_http_request_duration_seconds_count{route="/v1/sequences"} 2
kvvm_http_request_duration_seconds_bucket{route="other",le="0.0005"} 0
kvvm_http_request_duration_seconds_bucket{route="other",le="0.001"} 0
kvvm_http_request_duration_seconds_bucket{route="other",le="0.0025"} 0
kvvm_http_request_duration_seconds_bucket{route="other",le="0.005"} 0
kvvm_http_request_duration_seconds_bucket{route="other",le="0.01"} 0
kvvm_http_request_duration_seconds_bucket{route="other",le="0.025"} 0
kvvm_http_request_duration_seconds_bucket{route="other",le="0.05"} 0
kvvm_http_request_duration_seconds_bucket{route="other",le="0.1"} 0
kvvm_http_request_duration_seconds_bucket{route="other",le="0.25"} 0
kvvm_http_request_duration_seconds_bucket{route="other",le="0.5"} 0
kvvm_http_request_duration_seconds_bucket{route="other",le="1"} 0
kvvm_http_request_duration_seconds_bucket{route="other",le="5"} 0
kvvm_http_request_duration_seconds_bucket{route="other",le="+Inf"} 1
kvvm_http_request_duration_seconds_sum{route="other"} 7
kvvm_http_request_duration_seconds_count{route="other"} 1
# HELP kvvm_http_connections_open Connections open now.
# TYPE kvvm_http_connections_open gauge
kvvm_http_connections_open 1
# HELP kvvm_http_connections_accepted_total Connections accepted.
# TYPE kvvm_http_connections_accepted_total counter
kvvm_http_connections_accepted_total 5
# HELP kvvm_http_connections_refused_total Connections answered 503 (or closed) at the connection cap.
# TYPE kvvm_http_connections_refused_total counter
kvvm_http_connections_refused_total 2
# HELP kvvm_http_accept_errors_total Errors accepting a connection (e.g. out of file descriptors).
# TYPE kvvm_http_accept_errors_total counter
kvvm_http_accept_errors_total 1
# HELP kvvm_http_requests_in_flight Requests being handled now.
# TYPE kvvm_http_requests_in_flight gauge
kvvm_http_requests_in_flight 1
# HELP kvvm_http_connections_closed_total Connections the HTTP layer closed without a handler's answer, by reason.
# TYPE kvvm_http_connections_closed_total counter
kvvm_http_connections_closed_total{reason="header_timeout"} 0
kvvm_http_connections_closed_total{reason="idle_timeout"} 2
kvvm_http_connections_closed_total{reason="parse_error"} 0
kvvm_http_connections_closed_total{reason="shutdown_deadline"} 0
kvvm_http_connections_closed_total{reason="io_error"} 1
"#;
    const EMPTY: &str = r#"# HELP kvvm_http_requests_total HTTP requests answered, by route, method and status.
# TYPE kvvm_http_requests_total counter
# HELP kvvm_http_request_duration_seconds Time from the request head to the response, by route.
# TYPE kvvm_http_request_duration_seconds histogram
# HELP kvvm_http_connections_open Connections open now.
# TYPE kvvm_http_connections_open gauge
kvvm_http_connections_open 0
# HELP kvvm_http_connections_accepted_total Connections accepted.
# TYPE kvvm_http_connections_accepted_total counter
kvvm_http_connections_accepted_total 0
# HELP kvvm_http_connections_refused_total Connections answered 503 (or closed) at the connection cap.
# TYPE kvvm_http_connections_refused_total counter
kvvm_http_connections_refused_total 0
# HELP kvvm_http_accept_errors_total Errors accepting a connection (e.g. out of file descriptors).
# TYPE kvvm_http_accept_errors_total counter
kvvm_http_accept_errors_total 0
# HELP kvvm_http_requests_in_flight Requests being handled now.
# TYPE kvvm_http_requests_in_flight gauge
kvvm_http_requests_in_flight 0
# HELP kvvm_http_connections_closed_total Connections the HTTP layer closed without a handler's answer, by reason.
# TYPE kvvm_http_connections_closed_total counter
kvvm_http_connections_closed_total{reason="header_timeout"} 0
kvvm_http_connections_closed_total{reason="idle_timeout"} 0
kvvm_http_connections_closed_total{reason="parse_error"} 0
kvvm_http_connections_closed_total{reason="shutdown_deadline"} 0
kvvm_http_connections_closed_total{reason="io_error"} 0
"#;
}
