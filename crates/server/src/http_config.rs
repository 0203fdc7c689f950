//! How the HTTP side behaves: timeouts, caps, the body limit, API keys, the shutdown
//! deadline. The defaults are the `kvvm serve` flags' (`docs/serve.md`).

use std::time::Duration;

use crate::auth::ApiKeys;

/// How the HTTP side of [`serve`](crate::serve) behaves.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Largest request body in bytes: a larger `Content-Length` is 413 before anything is
    /// read (and before `100 Continue`), a larger chunked body 413 once it passes the limit.
    pub body_limit: usize,
    /// A request head must be complete this long after the server starts waiting for it
    /// (the connection opened, or the previous response was sent); else the connection is
    /// closed.
    pub header_timeout: Duration,
    /// A whole request body must arrive within this long once its handler reads it (408).
    pub body_timeout: Duration,
    /// A keep-alive connection that sends nothing for this long after a response is closed
    /// (the header timeout bounds it too).
    pub keep_alive_timeout: Duration,
    /// Most connections open at once; beyond it a new connection gets one 503 with
    /// `Retry-After` and is closed (or, past a small overflow, closed at once).
    pub max_connections: usize,
    /// Most requests handled at once; beyond it a request is shed with 503 + `Retry-After`
    /// rather than queued.
    pub max_in_flight: usize,
    /// On shutdown: how long requests in flight may still run before their connections are
    /// closed and everything is released.
    pub shutdown_timeout: Duration,
    /// API keys, tenant and operator (empty: no authentication).
    pub api_keys: ApiKeys,
    /// Listen on a non-loopback address without API keys.
    pub allow_unauthenticated: bool,
}

/// The default request body limit: 1 MiB (about 150,000 token ids).
pub const DEFAULT_BODY_LIMIT: usize = 1 << 20;

impl Default for HttpConfig {
    /// 1 MiB bodies, header 10 s, body 10 s, keep-alive 5 s, 4096 connections (fewer when
    /// the open-file limit is lower), 64 requests in flight, a 10 s shutdown deadline, no
    /// keys.
    fn default() -> Self {
        HttpConfig {
            body_limit: DEFAULT_BODY_LIMIT,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(5),
            max_connections: 4096,
            max_in_flight: 64,
            shutdown_timeout: Duration::from_secs(10),
            api_keys: ApiKeys::none(),
            allow_unauthenticated: false,
        }
    }
}
