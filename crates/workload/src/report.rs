//! What a replay reports: per policy ([`PolicyReport`], with its committed-memory curve of
//! [`Sample`]s), the trace ([`TraceSummary`]) and the whole run ([`SimulationReport`]).
//! Plain serializable records; `replay.rs` fills them, `render.rs` prints them.

use serde::Serialize;

/// A point of the committed-memory curve.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Sample {
    /// Seconds from the start of the trace.
    pub t_s: f64,
    /// Committed bytes at that time.
    pub committed_bytes: u64,
}

/// The figures of one policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyReport {
    /// Policy name (`static-max`, `realloc-copy`, `paged-16[+prefix]`, `kvvm-<layout>[+prefix]`).
    pub name: String,
    /// Whether it ran through the kvvm manager on the backend.
    pub through_manager: bool,
    /// Highest committed bytes at any time (including a copy's two buffers for
    /// `realloc-copy`).
    pub peak_committed_bytes: u64,
    /// Time-averaged committed bytes.
    pub mean_committed_bytes: u64,
    /// Time-averaged KV bytes of the tokens in flight: the tokens of the running requests
    /// times the bytes per token, each request counted whole (the same for every policy
    /// that runs the same schedule).
    pub mean_live_bytes: u64,
    /// Time-averaged live KV bytes the memory must store: a shared prefix counted once (less
    /// than [`mean_live_bytes`](Self::mean_live_bytes) with prefix sharing).
    pub mean_stored_live_bytes: u64,
    /// `integral(committed - stored live) / integral(committed)` over the run.
    pub waste_ratio: f64,
    /// Highest physical bytes held (committed plus the manager's handle pool; the whole
    /// preallocated pool for `paged-16` and `paged-16+prefix`).
    pub peak_held_bytes: u64,
    /// Requests admitted (at least once).
    pub admitted: u64,
    /// Requests refused at least once, at admission or while growing (HTTP 429), that waited
    /// and retried.
    pub deferred: u64,
    /// Requests that waited in the queue at least one decode step before their first
    /// admission (or before being rejected), whether they were refused themselves or queued
    /// behind a refused request: every request that waited.
    pub waited: u64,
    /// Refusals in total (every 429, retries included).
    pub refusals: u64,
    /// Requests that could never fit the budget, alone, and were dropped.
    pub rejected: u64,
    /// Running sequences evicted to let others progress (recomputed later).
    pub preemptions: u64,
    /// Requests completed.
    pub completed: u64,
    /// Mean wait of the admitted requests, in milliseconds: from the decode step a request
    /// arrived in to its first admission (0 for one admitted at the step it arrived in).
    pub mean_queue_delay_ms: f64,
    /// Median of that wait, in milliseconds.
    pub queue_delay_p50_ms: f64,
    /// 99th percentile of that wait (nearest rank), in milliseconds.
    pub queue_delay_p99_ms: f64,
    /// Most requests running at once: the concurrency the policy reached.
    pub peak_running: u64,
    /// Time-averaged requests running.
    pub mean_running: f64,
    /// Time from the first arrival to the last completion, in seconds.
    pub makespan_s: f64,
    /// Driver calls (reserve, free, create, release, map, set access, unmap, synchronize).
    pub driver_calls: u64,
    /// Mappings made over the run (what the driver's cost follows: on the H200 a commit costs
    /// about 28 us a mapping, far more than per byte). For the policies without virtual
    /// memory, one per allocation.
    pub mappings: u64,
    /// Physical handles created over the run (a handle reused from the manager's pool is not
    /// created again). For the policies without virtual memory, one per allocation.
    pub handles: u64,
    /// Most mappings live at once.
    pub peak_mappings: u64,
    /// Driver time in microseconds: modelled on the simulator, measured on a GPU.
    pub driver_time_us: u64,
    /// Driver time as a share of the makespan (0.01: 1 %): what the driver calls cost against
    /// the time the requests took.
    pub driver_time_share: f64,
    /// `"latency-model"` or `"measured"`.
    pub driver_time_source: &'static str,
    /// Bytes copied by reallocation (`realloc-copy`).
    pub copy_bytes: u64,
    /// KV bytes written to the device (real GPUs).
    pub kv_write_bytes: u64,
    /// For `+prefix` policies: the shareability verdict of the system prompt (for
    /// `paged-16+prefix`: whether it holds at least one whole block).
    pub prefix_shareable: Option<bool>,
    /// For `+prefix` policies: bytes of the prefix committed once and shared (for
    /// `paged-16+prefix`: its whole blocks).
    pub prefix_shared_bytes: Option<u64>,
    /// For `+prefix` policies that cannot share: why.
    pub prefix_refusal: Option<String>,
    /// The committed-memory curve (for plots; not serialized).
    #[serde(skip)]
    pub samples: Vec<Sample>,
}

/// Trace figures in a report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceSummary {
    /// `synthetic` or `jsonl`.
    pub kind: &'static str,
    /// The JSONL file, if any.
    pub path: Option<String>,
    /// The seed of a synthetic trace.
    pub seed: Option<u64>,
    /// The arrival rate of a synthetic trace.
    pub rate_per_s: Option<f64>,
    /// Requests.
    pub requests: usize,
    /// Prompt tokens in total.
    pub prompt_tokens: u64,
    /// Output tokens in total.
    pub output_tokens: u64,
    /// Length of the common system prompt.
    pub system_prompt_tokens: u64,
    /// Requests that open with it.
    pub shared_prefix_requests: usize,
    /// Arrival time of the last request.
    pub duration_s: f64,
}

/// The report of a whole run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimulationReport {
    /// The backend the kvvm policies ran on.
    pub backend: String,
    /// Model preset.
    pub model: String,
    /// KV element type.
    pub dtype: String,
    /// KV bytes per token (all layers, K and V).
    pub bytes_per_token: u64,
    /// Maximum context in tokens.
    pub max_context: u64,
    /// The mapping granule of the backend.
    pub granule_bytes: u64,
    /// The budget every policy ran under.
    pub budget_bytes: u64,
    /// Decode step in milliseconds.
    pub step_ms: f64,
    /// The trace.
    pub trace: TraceSummary,
    /// One entry per policy, in the order asked.
    pub policies: Vec<PolicyReport>,
    /// Wall time of the whole replay, in seconds.
    pub elapsed_s: f64,
}

impl SimulationReport {
    /// The report of the policy called `name`.
    pub fn policy(&self, name: &str) -> Option<&PolicyReport> {
        self.policies.iter().find(|p| p.name == name)
    }
}
