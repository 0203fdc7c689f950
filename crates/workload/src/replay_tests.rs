//! The replay's figures pinned: two small seeded traces (one with a shared system prompt, one
//! without) through every policy on the simulator under a tight budget, as the wide table
//! shows them (every figure of every policy, the refusals of prefix sharing included).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::table::{render_table, TableWidth};
use crate::trace::SyntheticTrace;
use kvvm_sim::SimBackend;

fn table(shared_prefix_share: f64) -> String {
    let trace = Trace::synthetic(&SyntheticTrace {
        requests: 12,
        seed: 11,
        rate_per_s: 20.0,
        shared_prefix_share,
        ..SyntheticTrace::default()
    })
    .unwrap();
    let config = SimulationConfig {
        budget_bytes: 1 << 30,
        max_context: 8192,
        ..SimulationConfig::default()
    };
    let report = simulate(&trace, Arc::new(SimBackend::h200()), &config, &mut |_| {}).unwrap();
    render_table(&report, TableWidth::Wide)
}

#[test]
fn the_figures_with_a_shared_system_prompt_are_pinned() {
    assert_eq!(table(0.5), SHARED);
}

#[test]
fn the_figures_without_a_shared_system_prompt_are_pinned() {
    assert_eq!(table(0.0), UNSHARED);
}

const SHARED: &str = r#"trace: synthetic, seed 11, 20 req/s; 12 requests over 0.7 s, 15044 prompt + 6171 output tokens, 5 open with a 2048-token
  system prompt
model: llama-3-8b fp16 (128 KiB/token), max context 8192 tokens; backend sim, granule 2 MiB; decode step 20 ms
budget: 1 GiB for every policy

policy                   served  rejected  waited  wait p50  wait p99  wait mean  in flight        live        peak         mean      stored  waste         held  429s  preempt  mappings  handles  driver calls  driver ms  driver %
-------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------
static-max                   12         0      11    23.8 s    69.4 s     30.8 s          1  329.70 MiB    1.00 GiB  1022.17 MiB  329.70 MiB  67.7%     1.00 GiB  3502        0        12       12            24        5.7      0.0%
realloc-copy                 11         1       7     2.4 s    24.0 s      7.6 s          5  481.43 MiB    1.00 GiB   656.65 MiB  481.43 MiB  26.7%     1.00 GiB  1219        0        17       17            39        3.2      0.0%
paged-16                     12         0       6         0    10.5 s      3.1 s          6  630.18 MiB  996.00 MiB   631.97 MiB  630.18 MiB   0.3%     1.00 GiB   545        0         1        1             2        0.5      0.0%
paged-16+prefix              12         0       0         0         0          0         12  752.86 MiB  952.00 MiB   611.08 MiB  608.94 MiB   0.3%     1.00 GiB     0        0         1        1             2        0.5      0.0%
kvvm-head-major              12         0      11    23.8 s    69.4 s     30.8 s          1  329.70 MiB    1.00 GiB  1022.17 MiB  329.70 MiB  67.7%     1.00 GiB  3502        0        24        2            76        2.1      0.0%
kvvm-head-major+prefix       12         0      11    23.8 s    69.4 s     30.8 s          1  329.70 MiB    1.00 GiB  1022.17 MiB  329.70 MiB  67.7%     1.00 GiB  3502        0        24        2            76        2.1      0.0%
kvvm-seq-major               12         0       7     2.4 s    13.1 s      5.1 s          5  613.42 MiB    1.00 GiB   731.49 MiB  613.42 MiB  16.1%     1.00 GiB   673        0      1344      448          4058       64.5      0.1%
kvvm-seq-major+prefix        12         0       6         0     8.5 s      2.5 s          6  652.67 MiB    1.00 GiB   688.50 MiB  561.74 MiB  18.4%     1.00 GiB   442        0      1344      448          4376       66.6      0.1%
kvvm-token-major             12         0       6         0    10.5 s      3.1 s          6  630.18 MiB  996.00 MiB   631.97 MiB  630.18 MiB   0.3%  1022.00 MiB   545        0       425      307          1476       24.4      0.0%
kvvm-token-major+prefix      12         0       0         0         0          0         12  752.86 MiB  952.00 MiB   611.08 MiB  608.94 MiB   0.3%     1.00 GiB     0        0       425      197          1255       22.4      0.0%

kvvm-head-major+prefix: no sharing: prefix not shareable: each contiguous KV fragment is smaller than one mapping
  granule (fragment_bytes < granule), so no whole granule falls entirely inside the prefix (head-major layout:
  prefix_len 2048 tokens x 256 B/token = fragment_bytes 524288 B < granule 2097152 B, across 512 fragments; a prefix of
  at least 8192 tokens is needed)
rejected, never fitting the budget (1 GiB) even alone: realloc-copy 1 of 12
served = requests completed; rejected = requests that could not fit the budget even alone; waited = requests that queued
  at least one decode step; wait = from the decode step a request arrived in to its admission; in flight = most requests
  running at once; live = mean KV bytes of the tokens in flight; peak/mean = committed bytes; stored = mean live bytes
  the memory holds (a shared prefix once); waste = time-averaged (committed - stored) / committed; held = peak physical
  bytes held (pools included); 429s = refusals (admission or growth, retries included); preempt = running requests
  evicted and recomputed later; mappings, handles = mappings made and physical handles created (one each per allocation
  without virtual memory); driver % = driver time over the run's time (the H200 latency model, not measured).
"#;
const UNSHARED: &str = r#"trace: synthetic, seed 11, 20 req/s; 12 requests over 0.7 s, 4804 prompt + 6171 output tokens
model: llama-3-8b fp16 (128 KiB/token), max context 8192 tokens; backend sim, granule 2 MiB; decode step 20 ms
budget: 1 GiB for every policy

policy                   served  rejected  waited  wait p50  wait p99  wait mean  in flight        live        peak         mean      stored  waste        held  429s  preempt  mappings  handles  driver calls  driver ms  driver %
------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------------
static-max                   12         0      11    23.8 s    69.4 s     30.8 s          1  154.56 MiB    1.00 GiB  1022.17 MiB  154.56 MiB  84.9%    1.00 GiB  3502        0        12       12            24        5.7      0.0%
realloc-copy                 12         0       0         0         0          0         12  346.73 MiB    1.00 GiB   497.22 MiB  346.73 MiB  30.3%    1.00 GiB    78        0        27       27            69        5.3      0.0%
paged-16                     12         0       0         0         0          0         12  352.94 MiB  696.00 MiB   355.08 MiB  352.94 MiB   0.6%    1.00 GiB     0        0         1        1             2        0.5      0.0%
paged-16+prefix              12         0       0         0         0          0         12  352.94 MiB  696.00 MiB   355.08 MiB  352.94 MiB   0.6%    1.00 GiB     0        0         1        1             2        0.5      0.0%
kvvm-head-major              12         0      11    23.8 s    69.4 s     30.8 s          1  154.56 MiB    1.00 GiB  1022.17 MiB  154.56 MiB  84.9%    1.00 GiB  3502        0        24        2            76        2.1      0.0%
kvvm-head-major+prefix       12         0      11    23.8 s    69.4 s     30.8 s          1  154.56 MiB    1.00 GiB  1022.17 MiB  154.56 MiB  84.9%    1.00 GiB  3502        0        24        2            76        2.1      0.0%
kvvm-seq-major               12         0       4         0     4.5 s     880 ms          8  326.01 MiB    1.00 GiB   461.29 MiB  326.01 MiB  29.3%    1.00 GiB   230        0      1024      512          3864       53.7      0.1%
kvvm-seq-major+prefix        12         0       4         0     4.5 s     880 ms          8  326.01 MiB    1.00 GiB   461.29 MiB  326.01 MiB  29.3%    1.00 GiB   230        0      1024      512          3864       53.7      0.1%
kvvm-token-major             12         0       0         0         0          0         12  352.94 MiB  696.00 MiB   355.08 MiB  352.94 MiB   0.6%  934.00 MiB     0        0       420      196          1243       22.0      0.0%
kvvm-token-major+prefix      12         0       0         0         0          0         12  352.94 MiB  696.00 MiB   355.08 MiB  352.94 MiB   0.6%  934.00 MiB     0        0       420      196          1243       22.0      0.0%

paged-16+prefix: no sharing: the trace has no common system prompt of at least one 16-token block
kvvm-head-major+prefix: no sharing: the trace has no common system prompt
kvvm-seq-major+prefix: no sharing: the trace has no common system prompt
kvvm-token-major+prefix: no sharing: the trace has no common system prompt
served = requests completed; rejected = requests that could not fit the budget even alone; waited = requests that queued
  at least one decode step; wait = from the decode step a request arrived in to its admission; in flight = most requests
  running at once; live = mean KV bytes of the tokens in flight; peak/mean = committed bytes; stored = mean live bytes
  the memory holds (a shared prefix once); waste = time-averaged (committed - stored) / committed; held = peak physical
  bytes held (pools included); 429s = refusals (admission or growth, retries included); preempt = running requests
  evicted and recomputed later; mappings, handles = mappings made and physical handles created (one each per allocation
  without virtual memory); driver % = driver time over the run's time (the H200 latency model, not measured).
"#;
