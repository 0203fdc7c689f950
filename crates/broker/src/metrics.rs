//! What a broker reports to a monitoring system: [`BrokerCounters`] (what happened since it
//! started, kept by the books) and [`BrokerMetrics`] (the books at one moment, with the
//! counters), rendered in Prometheus' text exposition format for node_exporter's textfile
//! collector (`kvvm broker --metrics-file`).

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// What the books did since the broker started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BrokerCounters {
    /// Clients registered (hellos welcomed).
    pub clients_registered: u64,
    /// Clients whose socket closed (everything they held went back to the node).
    pub clients_dropped: u64,
    /// Leases granted.
    pub grants: u64,
    /// Bytes granted by them.
    pub granted_bytes: u64,
    /// Leases refused for now (backpressure).
    pub backpressure: u64,
    /// Leases refused for good (never fits).
    pub never_fits: u64,
    /// Reclaim asks sent to tenants over their floor.
    pub reclaim_asks: u64,
    /// Bytes those asks wanted back.
    pub reclaim_asked_bytes: u64,
    /// Bytes given back: returns, and everything a dropped client or prefix held.
    pub returned_bytes: u64,
    /// Connections the acceptor could not take (`accept` failed: out of descriptors, ...).
    pub accept_failures: u64,
    /// Connections refused for want of a slot (every slot, or every slot of their user, taken).
    pub connections_refused: u64,
    /// Connections dropped for saying hello too late or staying silent too long.
    pub connections_timed_out: u64,
}

/// The books at one moment, with the counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BrokerMetrics {
    /// The node's budget on every device.
    pub budget: u64,
    /// Clients registered now.
    pub clients: u64,
    /// Tenants the books know now (with a client or bytes).
    pub tenants: u64,
    /// Bytes held per (tenant, device): its clients' leases, its prefixes and what is kept
    /// for its clients' claims after a restart.
    pub held: BTreeMap<(String, u32), u64>,
    /// Bytes kept for claims after a restart and not claimed yet, per (tenant, device).
    pub unclaimed: BTreeMap<(String, u32), u64>,
    /// Bytes of published prefixes per (tenant, device).
    pub prefix_bytes: BTreeMap<(String, u32), u64>,
    /// Published prefixes per tenant.
    pub prefixes: BTreeMap<String, u64>,
    /// What happened since the broker started.
    pub counters: BrokerCounters,
}

impl BrokerMetrics {
    /// The metrics in Prometheus' text exposition format (version 0.0.4), every metric
    /// prefixed `kvvm_broker_`.
    pub fn to_prometheus(&self) -> String {
        let mut out = String::new();
        self.write_gauges(&mut out);
        self.counters.write(&mut out);
        out
    }

    fn write_gauges(&self, out: &mut String) {
        let budget = [("", self.budget)];
        gauge(
            out,
            "budget_bytes",
            "The node's KV budget on every device.",
            &budget,
        );
        gauge(
            out,
            "clients",
            "Clients registered now.",
            &[("", self.clients)],
        );
        gauge(
            out,
            "tenants",
            "Tenants known now (with a client or bytes).",
            &[("", self.tenants)],
        );
        let held = labelled(&self.held);
        let help = "Bytes held per tenant and device (leases, prefixes, kept for claims).";
        gauge(out, "held_bytes", help, &held);
        let unclaimed = labelled(&self.unclaimed);
        let help = "Bytes kept after a restart for claims not made yet, per tenant and device.";
        gauge(out, "unclaimed_bytes", help, &unclaimed);
        let prefix = labelled(&self.prefix_bytes);
        let help = "Bytes of published prefixes per tenant and device.";
        gauge(out, "prefix_bytes", help, &prefix);
        let count: Vec<(String, u64)> = self
            .prefixes
            .iter()
            .map(|(t, n)| (format!("tenant=\"{}\"", escape(t)), *n))
            .collect();
        gauge(out, "prefixes", "Published prefixes per tenant.", &count);
    }
}

impl BrokerCounters {
    fn write(&self, out: &mut String) {
        let refusals = [
            ("kind=\"backpressure\"", self.backpressure),
            ("kind=\"never_fits\"", self.never_fits),
        ];
        counter(out, "refusals_total", "Leases refused, by kind.", &refusals);
        for (name, help, value) in [
            (
                "clients_registered_total",
                "Clients registered since the start.",
                self.clients_registered,
            ),
            (
                "clients_dropped_total",
                "Clients whose socket closed.",
                self.clients_dropped,
            ),
            ("grants_total", "Leases granted.", self.grants),
            ("granted_bytes_total", "Bytes granted.", self.granted_bytes),
            (
                "reclaim_asks_total",
                "Reclaim asks sent to tenants over their floor.",
                self.reclaim_asks,
            ),
            (
                "reclaim_asked_bytes_total",
                "Bytes reclaim asks wanted back.",
                self.reclaim_asked_bytes,
            ),
            (
                "returned_bytes_total",
                "Bytes given back (returns, dropped clients and prefixes).",
                self.returned_bytes,
            ),
            (
                "accept_failures_total",
                "Connections the acceptor could not take.",
                self.accept_failures,
            ),
            (
                "connections_refused_total",
                "Connections refused for want of a slot.",
                self.connections_refused,
            ),
            (
                "connections_timed_out_total",
                "Connections dropped for a late hello or a long silence.",
                self.connections_timed_out,
            ),
        ] {
            counter(out, name, help, &[("", value)]);
        }
    }
}

fn labelled(map: &BTreeMap<(String, u32), u64>) -> Vec<(String, u64)> {
    map.iter()
        .map(|((tenant, device), v)| {
            (
                format!("tenant=\"{}\",device=\"{device}\"", escape(tenant)),
                *v,
            )
        })
        .collect()
}

/// A label value as the exposition format wants it (tenant names are plain already).
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn gauge<L: AsRef<str>>(out: &mut String, name: &str, help: &str, samples: &[(L, u64)]) {
    family(out, name, help, "gauge", samples);
}

fn counter<L: AsRef<str>>(out: &mut String, name: &str, help: &str, samples: &[(L, u64)]) {
    family(out, name, help, "counter", samples);
}

fn family<L: AsRef<str>>(
    out: &mut String,
    name: &str,
    help: &str,
    kind: &str,
    samples: &[(L, u64)],
) {
    let _ = writeln!(out, "# HELP kvvm_broker_{name} {help}");
    let _ = writeln!(out, "# TYPE kvvm_broker_{name} {kind}");
    for (labels, value) in samples {
        let labels = labels.as_ref();
        if labels.is_empty() {
            let _ = writeln!(out, "kvvm_broker_{name} {value}");
        } else {
            let _ = writeln!(out, "kvvm_broker_{name}{{{labels}}} {value}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_has_a_help_and_type_line_per_family_and_labelled_samples() {
        let mut m = BrokerMetrics {
            budget: 1000,
            clients: 2,
            ..BrokerMetrics::default()
        };
        m.held.insert(("a".into(), 0), 600);
        m.prefix_bytes.insert(("a".into(), 0), 200);
        m.prefixes.insert("a".into(), 1);
        m.counters.backpressure = 3;
        let text = m.to_prometheus();
        for line in [
            "# TYPE kvvm_broker_budget_bytes gauge",
            "kvvm_broker_budget_bytes 1000",
            "kvvm_broker_clients 2",
            "kvvm_broker_held_bytes{tenant=\"a\",device=\"0\"} 600",
            "kvvm_broker_prefix_bytes{tenant=\"a\",device=\"0\"} 200",
            "kvvm_broker_prefixes{tenant=\"a\"} 1",
            "# TYPE kvvm_broker_refusals_total counter",
            "kvvm_broker_refusals_total{kind=\"backpressure\"} 3",
            "kvvm_broker_refusals_total{kind=\"never_fits\"} 0",
            "kvvm_broker_returned_bytes_total 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from\n{text}"
            );
        }
        let helps = text.lines().filter(|l| l.starts_with("# HELP")).count();
        let types = text.lines().filter(|l| l.starts_with("# TYPE")).count();
        assert_eq!((helps, types), (18, 18));
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
