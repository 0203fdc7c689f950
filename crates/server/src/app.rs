//! The state every handler and middleware shares.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::auth::ApiKeys;
use crate::http_metrics::HttpMetrics;
use crate::service::KvService;

/// Shared state of the handlers and the middleware.
#[derive(Debug, Clone)]
pub(crate) struct App {
    pub(crate) service: Arc<KvService>,
    pub(crate) http: Arc<HttpMetrics>,
    pub(crate) keys: Arc<ApiKeys>,
    pub(crate) body_limit: usize,
    pub(crate) body_timeout: Duration,
}

/// The peer address of a request's connection (a request extension, for the access log).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Peer(pub(crate) SocketAddr);
