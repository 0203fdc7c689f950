//! Typed errors: what the service refuses ([`ServiceError`], each mapped to one HTTP status)
//! and why a server could not start ([`ServeError`]).

use std::time::Duration;

use kvvm::kv::KvError;
use kvvm::vmm::VmmError;

/// Why a request to the [`KvService`](crate::KvService) was refused or failed.
///
/// Every variant maps to one HTTP status ([`ServiceError::status`]). Capacity is never a
/// server error: a governor refusal and a driver out-of-memory are both
/// [`ServiceError::Backpressure`] (429 + `Retry-After`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServiceError {
    /// Not enough device memory now: retry after `retry_after` or shed load (429).
    #[error(
        "not enough KV-cache memory: {needed_bytes} bytes needed, {available_bytes} available; retry after {retry_after:?}"
    )]
    Backpressure {
        /// Bytes the operation needed.
        needed_bytes: u64,
        /// Bytes the budget could have granted.
        available_bytes: u64,
        /// When a retry is likely to succeed (the governor's estimate).
        retry_after: Duration,
    },
    /// The request can never fit: it is larger than a limit no freeing can raise (the budget
    /// less its quarantine, or the device's memory). Retrying never helps, so there is no
    /// `Retry-After` (413).
    #[error("the request needs {needed_bytes} bytes, more than the {limit} allows ({limit_bytes} bytes): it can never fit")]
    NeverFits {
        /// Bytes the operation needed.
        needed_bytes: u64,
        /// The most the limit could ever grant.
        limit_bytes: u64,
        /// Which limit: `device_budget`, `process_budget` or `device_memory`.
        limit: &'static str,
    },
    /// A limit of this server (live sequences, reserved address space or committed bytes, per
    /// key or in total) is reached by what is live now; releasing can help, so this is 429
    /// with `Retry-After` estimated from what that scope released recently.
    #[error("{limit} reached: {used} in use, {requested} more requested, the limit is {limit_value}; retry after {retry_after:?}")]
    LimitReached {
        /// Which limit, e.g. `max_sequences_per_key` (see `docs/serve.md`).
        limit: &'static str,
        /// What the scope holds now (sequences or bytes).
        used: u64,
        /// What the request would add.
        requested: u64,
        /// The limit.
        limit_value: u64,
        /// When a retry is likely to succeed (from the scope's recent releases).
        retry_after: Duration,
    },
    /// No or a wrong API key (401 + `WWW-Authenticate: Bearer`).
    #[error("{0}")]
    Unauthorized(String),
    /// A valid key whose role may not use this route: a tenant key on `/metrics`, an
    /// operator key on a sequence route (403).
    #[error("{0}")]
    Forbidden(String),
    /// A request body that is not `application/json` (415).
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// A request the HTTP rules refuse: no `Host` on HTTP/1.1, a duplicate `Host`, an
    /// unparsable header (400).
    #[error("{0}")]
    BadRequest(String),
    /// The body did not arrive within the body timeout (408).
    #[error("{0}")]
    RequestTimeout(String),
    /// Too many requests in flight: shed without queueing (503 + `Retry-After`).
    #[error("the server is at its limit of requests in flight; retry after {retry_after:?}")]
    Overloaded {
        /// A hint for the retry.
        retry_after: Duration,
    },
    /// An error status produced below the handlers (the HTTP layer or a tower layer), given
    /// a JSON body by the error layer.
    #[error("{message}")]
    Http {
        /// The status.
        status: u16,
        /// The kind.
        kind: &'static str,
        /// What went wrong.
        message: String,
    },
    /// The request body is not valid JSON or not the expected object (400).
    #[error("malformed request body: {0}")]
    MalformedBody(String),
    /// A sequence id in the path is not a number (400).
    #[error(
        "invalid sequence id {0:?}: expected a decimal integer in 0..=18446744073709551615, with no sign, leading zero or escape"
    )]
    InvalidId(String),
    /// No live sequence has this id (404).
    #[error("no live sequence with id {0}")]
    UnknownSequence(u64),
    /// No such route (404).
    #[error("{0}")]
    NotFound(String),
    /// The route exists but not with this method (405).
    #[error("{0}")]
    MethodNotAllowed(String),
    /// The request is well-formed but its numbers are not acceptable (422).
    #[error("{0}")]
    InvalidRequest(String),
    /// The request body is larger than the server accepts (413).
    #[error("the request body is larger than the server's limit of {limit} bytes")]
    BodyTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The server is shutting down and accepts no new work (503).
    #[error("the server is shutting down")]
    ShuttingDown,
    /// A failure that is not the client's fault and not a lack of capacity (500): a driver
    /// error other than out-of-memory, or a bug.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ServiceError {
    /// The HTTP status code of this error.
    pub fn status(&self) -> u16 {
        match self {
            ServiceError::Backpressure { .. } | ServiceError::LimitReached { .. } => 429,
            ServiceError::MalformedBody(_)
            | ServiceError::InvalidId(_)
            | ServiceError::BadRequest(_) => 400,
            ServiceError::Unauthorized(_) => 401,
            ServiceError::Forbidden(_) => 403,
            ServiceError::RequestTimeout(_) => 408,
            ServiceError::UnsupportedMediaType(_) => 415,
            ServiceError::Overloaded { .. } => 503,
            ServiceError::Http { status, .. } => *status,
            ServiceError::UnknownSequence(_) | ServiceError::NotFound(_) => 404,
            ServiceError::MethodNotAllowed(_) => 405,
            ServiceError::BodyTooLarge { .. } | ServiceError::NeverFits { .. } => 413,
            ServiceError::InvalidRequest(_) => 422,
            ServiceError::ShuttingDown => 503,
            ServiceError::Internal(_) => 500,
        }
    }

    /// A short machine-readable name of the error kind (the `kind` field of error bodies).
    pub fn kind(&self) -> &'static str {
        match self {
            ServiceError::Backpressure { .. } => "backpressure",
            ServiceError::LimitReached { .. } => "limit_reached",
            ServiceError::Unauthorized(_) => "unauthorized",
            ServiceError::Forbidden(_) => "forbidden",
            ServiceError::UnsupportedMediaType(_) => "unsupported_media_type",
            ServiceError::BadRequest(_) => "bad_request",
            ServiceError::RequestTimeout(_) => "request_timeout",
            ServiceError::Overloaded { .. } => "overloaded",
            ServiceError::Http { kind, .. } => kind,
            ServiceError::MalformedBody(_) => "malformed_body",
            ServiceError::InvalidId(_) => "invalid_id",
            ServiceError::UnknownSequence(_) => "unknown_sequence",
            ServiceError::NotFound(_) => "not_found",
            ServiceError::MethodNotAllowed(_) => "method_not_allowed",
            ServiceError::InvalidRequest(_) => "invalid_request",
            ServiceError::BodyTooLarge { .. } => "body_too_large",
            ServiceError::NeverFits { .. } => "never_fits",
            ServiceError::ShuttingDown => "shutting_down",
            ServiceError::Internal(_) => "internal",
        }
    }

    /// When a retry can help: backpressure, a limit reached, load shedding. `None` when
    /// retrying the same request never helps (never-fits, bad input) or the server stops.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ServiceError::Backpressure { retry_after, .. }
            | ServiceError::LimitReached { retry_after, .. }
            | ServiceError::Overloaded { retry_after } => Some(*retry_after),
            _ => None,
        }
    }

    /// The `Retry-After` header value in whole seconds: `ceil(retry_after)`, at least 1.
    /// `None` when [`retry_after`](Self::retry_after) is.
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after().map(retry_after_header)
    }

    /// Whether this is [`ServiceError::Backpressure`].
    pub fn is_backpressure(&self) -> bool {
        matches!(self, ServiceError::Backpressure { .. })
    }

    /// The JSON body of the error response.
    pub fn to_json(&self) -> serde_json::Value {
        let mut body = serde_json::json!({
            "error": self.to_string(),
            "kind": self.kind(),
        });
        if let (
            ServiceError::Backpressure {
                needed_bytes,
                available_bytes,
                ..
            },
            Some(map),
        ) = (self, body.as_object_mut())
        {
            map.insert("needed_bytes".into(), (*needed_bytes).into());
            map.insert("available_bytes".into(), (*available_bytes).into());
        }
        if let (
            ServiceError::NeverFits {
                needed_bytes,
                limit_bytes,
                limit,
            },
            Some(map),
        ) = (self, body.as_object_mut())
        {
            map.insert("needed_bytes".into(), (*needed_bytes).into());
            map.insert("limit_bytes".into(), (*limit_bytes).into());
            map.insert("limit".into(), (*limit).into());
        }
        if let (
            ServiceError::LimitReached {
                limit,
                used,
                requested,
                limit_value,
                ..
            },
            Some(map),
        ) = (self, body.as_object_mut())
        {
            map.insert("limit".into(), (*limit).into());
            map.insert("used".into(), (*used).into());
            map.insert("requested".into(), (*requested).into());
            map.insert("limit_value".into(), (*limit_value).into());
        }
        if let (ServiceError::BodyTooLarge { limit }, Some(map)) = (self, body.as_object_mut()) {
            map.insert(
                "limit_bytes".into(),
                u64::try_from(*limit).unwrap_or(u64::MAX).into(),
            );
        }
        if let (Some(retry_after), Some(map)) = (self.retry_after(), body.as_object_mut()) {
            let ms = u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX);
            map.insert("retry_after_ms".into(), ms.into());
        }
        body
    }
}

/// `ceil(retry_after)` in whole seconds, at least 1 (a `Retry-After` of 0 invites a retry
/// storm).
pub fn retry_after_header(retry_after: Duration) -> u64 {
    let secs = retry_after.as_secs();
    let secs = if retry_after.subsec_nanos() > 0 {
        secs.saturating_add(1)
    } else {
        secs
    };
    secs.max(1)
}

impl From<KvError> for ServiceError {
    /// Token counts out of range are the client's (422); anything else from the layout
    /// arithmetic is internal.
    fn from(e: KvError) -> Self {
        match e {
            KvError::TooManyTokens { .. }
            | KvError::TokenOutOfRange { .. }
            | KvError::ZeroDimension { .. } => ServiceError::InvalidRequest(e.to_string()),
            other => ServiceError::Internal(other.to_string()),
        }
    }
}

/// Why a server could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The backend could not be opened.
    #[error(transparent)]
    Open(#[from] kvvm::OpenError),
    /// The configuration is not usable (unknown model, bad layout, zero max tokens, ...).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The server's own settings refuse to start (no API key on a non-loopback address,
    /// an unreadable keys file, ...).
    #[error("{0}")]
    Refused(String),
    /// The memory manager could not be created on the device.
    #[error("memory manager: {0}")]
    Manager(#[from] VmmError),
    /// Binding or serving the listening socket failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds_at_least_one() {
        assert_eq!(retry_after_header(Duration::ZERO), 1);
        assert_eq!(retry_after_header(Duration::from_millis(10)), 1);
        assert_eq!(retry_after_header(Duration::from_secs(1)), 1);
        assert_eq!(retry_after_header(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_header(Duration::from_secs(5)), 5);
    }

    #[test]
    fn capacity_is_never_a_server_error() {
        let e = ServiceError::Backpressure {
            needed_bytes: 10,
            available_bytes: 2,
            retry_after: Duration::from_millis(1500),
        };
        assert_eq!(e.status(), 429);
        assert_eq!(e.retry_after_secs(), Some(2));
        let body = e.to_json();
        assert_eq!(body["needed_bytes"], 10);
        assert_eq!(body["available_bytes"], 2);
        assert_eq!(body["retry_after_ms"], 1500);
    }
}
