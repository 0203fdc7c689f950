//! Typed errors of the workload crate.

use kvvm_hal::BackendError;
use kvvm_kv::KvCacheError;
use kvvm_layout::KvError;
use kvvm_vmm::VmmError;

/// An error of trace loading, validation or replay.
///
/// Running out of budget is *not* an error: it is a refusal (HTTP 429 in a server), counted in
/// the report as a deferral. Errors are what stops a replay: a bad trace, a bad configuration,
/// an arithmetic overflow, or a driver failure the manager could not turn into backpressure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkloadError {
    /// A line of a JSONL trace is malformed (line numbers start at 1).
    #[error("trace line {line}: {message}")]
    TraceLine {
        /// The 1-based line number.
        line: usize,
        /// What is wrong with it.
        message: String,
    },
    /// The trace file could not be read.
    #[error("cannot read trace {path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The trace holds no request.
    #[error("the trace holds no request")]
    EmptyTrace,
    /// A request needs more tokens than the maximum context.
    #[error(
        "{}: the request needs {} tokens (prompt {prompt_tokens} + output {output_tokens}), more than the maximum context of {max_context} tokens",
        match line { Some(l) => format!("trace line {l}"), None => format!("request {index} of the synthetic trace") },
        prompt_tokens.saturating_add(*output_tokens)
    )]
    RequestTooLong {
        /// The request's index in the trace (in arrival order).
        index: usize,
        /// The 1-based line of the JSONL file it came from (None: synthetic).
        line: Option<usize>,
        /// Its prompt tokens.
        prompt_tokens: u64,
        /// Its output tokens.
        output_tokens: u64,
        /// The maximum context.
        max_context: u64,
    },
    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The replay stopped making progress (a bug in a policy or the engine).
    #[error(
        "the replay made no progress for {} decode steps (at {t_s:.3} s)",
        100_000
    )]
    Stalled {
        /// Trace time when it gave up, in seconds.
        t_s: f64,
    },
    /// A size or time computation overflowed.
    #[error("arithmetic overflow: {0}")]
    Overflow(&'static str),
    /// Drawing the plot failed.
    #[error("cannot draw the plot: {0}")]
    Plot(String),
    /// The KV layout arithmetic refused.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The KV layer failed in a way that is not backpressure.
    #[error(transparent)]
    KvCache(#[from] KvCacheError),
    /// The manager failed in a way that is not backpressure.
    #[error(transparent)]
    Vmm(#[from] VmmError),
    /// A driver call outside the manager failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

impl WorkloadError {
    /// The error of `call` (`grow`, `finish`) on a sequence id a policy does not hold.
    pub(crate) fn unknown_sequence(call: &str, id: usize) -> Self {
        WorkloadError::Config(format!("{call} of unknown sequence {id}"))
    }
}

/// Result type of this crate.
pub type WorkloadResult<T> = Result<T, WorkloadError>;

impl From<kvvm_num::Overflow> for WorkloadError {
    fn from(o: kvvm_num::Overflow) -> Self {
        WorkloadError::Overflow(o.what)
    }
}
