//! What the API exchanges: the request bodies, the answers, the service's counters and the
//! `/metrics` snapshot. Plain serializable records; the behaviour is `service.rs`.

use kvvm::governor::GovernorSnapshot;
use kvvm::kv::PrefixCacheStats;
use kvvm::DeviceId;
use serde::{Deserialize, Serialize};

use crate::error::ServiceError;

/// `POST /v1/sequences`: open a sequence.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSequence {
    /// Tokens of the prompt (committed now). Optional when `token_ids` is given (its length);
    /// when both are given they must agree.
    #[serde(default)]
    pub prompt_tokens: Option<u64>,
    /// The most tokens the sequence will hold (its address space is reserved for this many);
    /// default: the model's limit.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// The prompt's token ids, used to find a shared prefix.
    #[serde(default)]
    pub token_ids: Option<Vec<u32>>,
}

impl CreateSequence {
    /// The prompt's tokens and the sequence's `max_tokens`, checked against the model's
    /// `limit`: 422 when they do not make sense together.
    pub(crate) fn checked(&self, limit: u64) -> Result<(u64, u64), ServiceError> {
        let prompt = match (self.prompt_tokens, &self.token_ids) {
            (Some(n), Some(ids)) if u64::try_from(ids.len()).ok() != Some(n) => {
                return Err(ServiceError::InvalidRequest(format!(
                    "prompt_tokens is {n} but token_ids holds {} ids",
                    ids.len()
                )))
            }
            (Some(n), _) => n,
            (None, Some(ids)) => u64::try_from(ids.len())
                .map_err(|_| ServiceError::InvalidRequest("too many token_ids".into()))?,
            (None, None) => {
                return Err(ServiceError::InvalidRequest(
                    "prompt_tokens (or token_ids) is required".into(),
                ))
            }
        };
        let max = self.max_tokens.unwrap_or(limit);
        if max == 0 {
            return Err(ServiceError::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        if max > limit {
            return Err(ServiceError::InvalidRequest(format!(
                "max_tokens {max} exceeds the model's limit of {limit} tokens"
            )));
        }
        if prompt > max {
            return Err(ServiceError::InvalidRequest(format!(
                "prompt_tokens {prompt} exceeds max_tokens {max}"
            )));
        }
        Ok((prompt, max))
    }
}

/// `POST /v1/sequences/{id}/append`: grow a sequence.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AppendTokens {
    /// Tokens to add (at least 1).
    pub tokens: u64,
}

/// A live sequence as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceInfo {
    /// The sequence's id.
    pub id: u64,
    /// Live tokens.
    pub tokens: u64,
    /// The most tokens it may hold.
    pub max_tokens: u64,
    /// Its committed bytes, as the governor and `kvvm_committed_bytes` count them: the
    /// physical bytes of its own windows. Shared prefix windows are not in it (they are
    /// counted once, in `kvvm_shared_bytes`).
    pub committed_bytes: u64,
    /// The same as `committed_bytes` (its earlier name, kept for clients that read it).
    pub owned_bytes: u64,
    /// Bytes of shared prefix windows mapped in its range: read-only from the prefix cache,
    /// or a prefix segment it published. Mapped, not committed for it.
    pub shared_bytes: u64,
    /// Bytes mapped in its range: `committed_bytes + shared_bytes` (granule x windows holding
    /// live bytes).
    pub mapped_bytes: u64,
    /// Bytes of address space reserved for it (never committed as a whole).
    pub reserved_bytes: u64,
    /// Physical bytes this request added: its new windows, and a prefix segment it
    /// published (0 when every needed window was already mapped).
    pub added_bytes: u64,
    /// Tokens of the prompt served from a shared prefix (not committed again).
    pub prefix_hit_tokens: u64,
    /// The base device address of its KV cache (never changes while it lives); shown only
    /// to a request that asks for it (`?address=true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<u64>,
}

/// `DELETE /v1/sequences/{id}`: what was released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Released {
    /// The sequence's id.
    pub id: u64,
    /// Tokens it held.
    pub tokens: u64,
    /// Physical bytes given back: its own windows, and a shared prefix nothing else held.
    /// A prefix still cached or mapped by other sequences stays and is not counted.
    pub released_bytes: u64,
}

/// What `KvService::shutdown` released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShutdownReport {
    /// Sequences released.
    pub sequences: u64,
    /// Device bytes given back: the sequences' own windows, every cached prefix (each
    /// counted once) and the handle pool.
    pub released_bytes: u64,
    /// Device bytes still held afterwards (quarantine: memory that could not be proven idle).
    pub held_bytes: u64,
    /// Connections still open when the shutdown deadline passed (closed then).
    pub abandoned_connections: u64,
    /// Releases that failed (their memory is quarantined by the manager, never forgotten).
    pub failures: u64,
}

/// Counters of the service, as `/metrics` shows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    /// Sequences opened.
    pub sequences_created: u64,
    /// Sequences released (by `DELETE`, idle expiry or at shutdown).
    pub sequences_released: u64,
    /// Sequences released because nobody used them for the idle timeout.
    pub sequences_expired: u64,
    /// Successful appends.
    pub appends: u64,
    /// Requests refused for lack of memory (429).
    pub grants_refused: u64,
    /// Requests refused as the client's error (4xx other than 429).
    pub bad_requests: u64,
    /// Requests that failed for another reason (5xx other than 503).
    pub internal_errors: u64,
    /// Requests answered 503 (load shedding, too many connections, shutting down).
    pub unavailable: u64,
    /// Sequences whose prompt hit a shared prefix.
    pub prefix_hits: u64,
    /// Prompt tokens served from shared prefixes.
    pub prefix_hit_tokens: u64,
    /// Prefixes published to the prefix cache by this server's requests.
    pub prefixes_published: u64,
}

/// `GET /v1/sequences`: the caller's own live sequences.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceList {
    /// Its sequences, by id.
    pub sequences: Vec<SequenceInfo>,
}

/// A point-in-time view of the service for `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// The governor's books.
    pub governor: GovernorSnapshot,
    /// Bytes available to new requests on the device (`Governor::available_bytes`: free
    /// budget plus what the handle pool and idle cached prefixes give back on demand).
    pub available_bytes: u64,
    /// The device served.
    pub device: DeviceId,
    /// Live sequences.
    pub live_sequences: u64,
    /// Live tokens over all sequences.
    pub live_tokens: u64,
    /// The counters.
    pub counters: Counters,
    /// The manager's granule.
    pub granule: u64,
    /// The prefix caches' counters and sizes, summed over every key's cache (`None` when
    /// the cache is off).
    pub prefix_cache: Option<PrefixCacheStats>,
}
