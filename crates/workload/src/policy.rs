//! The memory policies a trace is replayed through: their names ([`PolicyKind`]) and the
//! interface the replay drives ([`Policy`]). The policies are `classic_policy.rs` (static-max,
//! realloc-copy, by formula), `paged_policy.rs` (paged-16 and paged-16+prefix, by formula) and
//! `kvvm_policy.rs` (through the real manager).

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use kvvm_layout::{KvGeometry, KvLayout, PrefixShareability};
use serde::Serialize;

use crate::error::{WorkloadError, WorkloadResult};
use crate::trace::Request;

/// Tokens in one block of the `paged-16` and `paged-16+prefix` policies.
pub const PAGED_BLOCK_TOKENS: u64 = 16;

/// A memory policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(into = "String")]
pub enum PolicyKind {
    /// Preallocate the maximum context for every request at admission (`cudaMalloc` once).
    StaticMax,
    /// Allocate for the prompt (next power of two), grow by allocate-copy-free, doubling.
    ReallocCopy,
    /// vLLM-style: a pool preallocated to the budget, 16-token blocks handed to sequences.
    Paged16,
    /// `Paged16` with automatic prefix caching (vLLM's default): the whole blocks of the
    /// common system prompt are held once and shared by every running request that opens
    /// with it.
    Paged16Prefix,
    /// kvvm: reserve the maximum context under `layout`, commit granule windows through the
    /// real manager as tokens arrive, release at the end.
    Kvvm {
        /// The physical KV layout.
        layout: KvLayout,
        /// Whether the common system prompt's whole windows are committed once and shared.
        prefix_sharing: bool,
    },
}

impl PolicyKind {
    /// Every policy, in report order.
    pub fn all() -> Vec<PolicyKind> {
        let mut v = vec![
            PolicyKind::StaticMax,
            PolicyKind::ReallocCopy,
            PolicyKind::Paged16,
            PolicyKind::Paged16Prefix,
        ];
        for layout in KvLayout::ALL {
            for prefix_sharing in [false, true] {
                v.push(PolicyKind::Kvvm {
                    layout,
                    prefix_sharing,
                });
            }
        }
        v
    }

    /// The policy's name in reports: `static-max`, `realloc-copy`, `paged-16`,
    /// `paged-16+prefix`, `kvvm-<layout>` and `kvvm-<layout>+prefix`.
    pub fn name(&self) -> String {
        match self {
            PolicyKind::StaticMax => "static-max".into(),
            PolicyKind::ReallocCopy => "realloc-copy".into(),
            PolicyKind::Paged16 => "paged-16".into(),
            PolicyKind::Paged16Prefix => "paged-16+prefix".into(),
            PolicyKind::Kvvm {
                layout,
                prefix_sharing,
            } => format!(
                "kvvm-{layout}{}",
                if *prefix_sharing { "+prefix" } else { "" }
            ),
        }
    }

    /// Whether the policy goes through the kvvm manager.
    pub fn is_kvvm(&self) -> bool {
        matches!(self, PolicyKind::Kvvm { .. })
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

impl From<PolicyKind> for String {
    fn from(p: PolicyKind) -> String {
        p.name()
    }
}

impl FromStr for PolicyKind {
    type Err = WorkloadError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::all()
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<String> = PolicyKind::all().iter().map(|p| p.name()).collect();
                WorkloadError::Config(format!(
                    "unknown policy {s:?} (expected one of: {})",
                    names.join(", ")
                ))
            })
    }
}

/// The result of asking a policy for memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Granted and done.
    Done,
    /// Refused for lack of budget (HTTP 429); the governor's `retry_after` when it gave one.
    Refused(Option<Duration>),
}

/// What a policy's driver activity came to, after everything was released.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Costs {
    pub driver_calls: u64,
    /// Mappings made (one per allocation for the policies without virtual memory).
    pub mappings: u64,
    /// Physical handles created (one per allocation for the policies without virtual memory).
    pub handles: u64,
    /// Most mappings live at once.
    pub peak_mappings: u64,
    pub driver_time: Duration,
    pub measured: bool,
    pub copy_bytes: u64,
    pub kv_write_bytes: u64,
    pub shareability: Option<PrefixShareability>,
    /// For `paged-16+prefix`: bytes of the system prompt's whole blocks, held once (`None`:
    /// the trace has no system prompt of a whole block).
    pub block_prefix_bytes: Option<u64>,
}

/// A copy of sequence `id` from a policy's books, or the error of `call` on an id it does not
/// hold.
pub(crate) fn seq_of<S: Copy>(
    seqs: &HashMap<usize, S>,
    call: &str,
    id: usize,
) -> WorkloadResult<S> {
    seqs.get(&id)
        .copied()
        .ok_or_else(|| WorkloadError::unknown_sequence(call, id))
}

/// Sequence `id` taken out of a policy's books, or the error of `call` on an id it does not
/// hold.
pub(crate) fn take_seq<S>(
    seqs: &mut HashMap<usize, S>,
    call: &str,
    id: usize,
) -> WorkloadResult<S> {
    seqs.remove(&id)
        .ok_or_else(|| WorkloadError::unknown_sequence(call, id))
}

/// A memory policy as the replay drives it. Token counts are absolute (the KV length).
pub(crate) trait Policy {
    fn admit(&mut self, id: usize, req: &Request, tokens: u64) -> WorkloadResult<Outcome>;
    fn grow(&mut self, id: usize, tokens: u64) -> WorkloadResult<Outcome>;
    fn finish(&mut self, id: usize) -> WorkloadResult<()>;
    /// Bytes committed to sequences now (for kvvm: mapped, shared prefix included once).
    fn committed_bytes(&self) -> u64;
    /// Physical bytes held now (committed plus pools).
    fn held_bytes(&self) -> u64;
    /// Bytes of live KV data the committed memory holds (a shared prefix counted once).
    fn live_bytes(&self) -> u64;
    /// The highest committed bytes reached inside an operation (a copy's two buffers).
    fn transient_peak(&self) -> u64 {
        0
    }
    /// Moves the policy's clock (the governor's release-rate estimate) forward.
    fn advance(&mut self, _dt: Duration) {}
    /// Ends the run: everything must have been finished.
    fn close(&mut self) -> WorkloadResult<Costs>;
}

/// Geometry shared by all policies of a run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub geometry: KvGeometry,
    pub bytes_per_token: u64,
    pub max_context: u64,
    pub budget: u64,
}
