//! # kvvm-server: KV-cache memory over HTTP, with 429 backpressure
//!
//! `kvvm serve` runs this: an HTTP/1.1 server (axum on tokio) over the device memory manager
//! and the prefix cache. A client opens a sequence with its prompt (a length, or token ids),
//! grows it as tokens are generated and releases it when done; the server reserves each
//! sequence's address space once, commits physical granules as it grows (the pointer never
//! moves), maps a cached prompt prefix read-only instead of committing it again, and answers
//! a lack of memory with **429 Too Many Requests + `Retry-After`**, never with a 5xx.
//!
//! | method and path | body | success |
//! |---|---|---|
//! | `POST /v1/sequences` | `{"prompt_tokens": n, "max_tokens": m, "token_ids": [..]}` | 201 + [`SequenceInfo`] |
//! | `POST /v1/sequences/{id}/append` | `{"tokens": k}` | 200 + [`SequenceInfo`] |
//! | `GET /v1/sequences/{id}` | | 200 + [`SequenceInfo`] |
//! | `DELETE /v1/sequences/{id}` | | 200 + [`Released`] |
//! | `GET /metrics` | | 200, Prometheus text ([`metrics::METRICS`]) |
//! | `GET /healthz` | | 200 (503 while shutting down) |
//!
//! Errors are JSON `{"error": "...", "kind": "..."}` with the status of
//! [`ServiceError::status`]; a 429 adds `needed_bytes`, `available_bytes` and
//! `retry_after_ms`, and a `Retry-After` header of `ceil(retry_after)` seconds (at least 1).
//! A refused request changes nothing. `docs/serve.md` has the details and curl examples.
//!
//! ## Structure
//!
//! [`KvService`] is the core: it owns the backend, the governor, the manager, the layout plan,
//! the [`PrefixCache`](kvvm_kv::PrefixCache) and the table of live sequences
//! ([`SequenceKv`](kvvm_kv::SequenceKv)s), and is the only code that touches the KV layer.
//! [`router`] is the HTTP layer over it. [`serve`] runs the router on a listener until a
//! shutdown future completes, then releases every sequence, the prefix cache and the handle
//! pool ([`KvService::shutdown`]): after it returns the service holds no device memory
//! (quarantine aside). [`serve_until_signal`] is what the CLI runs (Ctrl-C or SIGTERM).
//!
//! ## Example
//!
//! ```no_run
//! # async fn example() -> Result<(), kvvm_server::ServeError> {
//! use std::sync::Arc;
//! use kvvm_server::{serve, KvService, ServiceConfig, DEFAULT_BODY_LIMIT};
//!
//! let backend = kvvm::open_backend("sim")?;
//! let service = Arc::new(KvService::new(ServiceConfig::new(backend))?);
//! let listener = kvvm_server::bind("127.0.0.1:8080").await?;
//! let report = serve(listener, service, DEFAULT_BODY_LIMIT, async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await?;
//! println!("released {} sequences", report.sequences);
//! # Ok(())
//! # }
//! ```

mod api;
mod error;
pub mod metrics;
mod router;
mod sequence;
mod service;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

pub use api::{
    AppendTokens, Counters, CreateSequence, MetricsSnapshot, Released, SequenceInfo, ShutdownReport,
};
pub use error::{retry_after_header, ServeError, ServiceError};
pub use router::router;
pub use service::{KvService, ServiceConfig};

pub use tokio::net::TcpListener;

/// The default request body limit: 1 MiB (about 150,000 token ids).
pub const DEFAULT_BODY_LIMIT: usize = 1 << 20;

/// Binds a TCP listener on `addr` (e.g. `"127.0.0.1:8080"`, or port 0 for an ephemeral port).
pub async fn bind(addr: &str) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Io {
            what: format!("cannot listen on {addr}"),
            source,
        })
}

/// Serves the API of `service` on `listener` until `shutdown` completes, then lets the
/// requests in flight finish, releases every sequence and empties the handle pool.
///
/// Returns what the shutdown released. Bodies larger than `body_limit` bytes get a 413.
pub async fn serve<F>(
    listener: TcpListener,
    service: Arc<KvService>,
    body_limit: usize,
    shutdown: F,
) -> Result<ShutdownReport, ServeError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let app = router(service.clone(), body_limit);
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await;
    // Release everything even when serving failed.
    let worker = service.clone();
    let report = match tokio::task::spawn_blocking(move || worker.shutdown()).await {
        Ok(report) => report,
        Err(_) => service.shutdown(),
    };
    served.map_err(|source| ServeError::Io {
        what: "serving failed".into(),
        source,
    })?;
    Ok(report)
}

/// Completes on Ctrl-C (SIGINT) or, on Unix, SIGTERM. If a handler cannot be installed that
/// signal is ignored (and logged); the other still works.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

/// Installs the Ctrl-C (SIGINT) and SIGTERM handlers now, in the current tokio runtime, and
/// returns a future that completes when either arrives. Unlike [`shutdown_signal`], which
/// installs them when first polled, a signal that arrives any time after this call stops the
/// server gracefully instead of killing the process with the signal's default action.
#[cfg(unix)]
pub fn install_shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let install = |kind: SignalKind, name: &'static str| match signal(kind) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for {name}");
            None
        }
    };
    let mut int = install(SignalKind::interrupt(), "Ctrl-C");
    let mut term = install(SignalKind::terminate(), "SIGTERM");
    async move {
        tokio::select! {
            () = wait_for(int.as_mut()) => {}
            () = wait_for(term.as_mut()) => {}
        }
    }
}

/// Completes when `signal` arrives; never when it could not be installed.
#[cfg(unix)]
async fn wait_for(signal: Option<&mut tokio::signal::unix::Signal>) {
    match signal {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending::<()>().await,
    }
}

/// [`shutdown_signal`] where there are no Unix signals.
#[cfg(not(unix))]
pub fn install_shutdown_signal() -> impl std::future::Future<Output = ()> {
    shutdown_signal()
}

/// What `kvvm serve` runs: builds a tokio runtime, creates the service, listens on `listen`,
/// calls `on_listening` with the bound address, and serves until Ctrl-C or SIGTERM; then
/// releases everything and returns what was released.
pub fn serve_until_signal(
    config: ServiceConfig,
    listen: &str,
    body_limit: usize,
    on_listening: impl FnOnce(SocketAddr, &KvService),
) -> Result<ShutdownReport, ServeError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|source| ServeError::Io {
            what: "cannot start the tokio runtime".into(),
            source,
        })?;
    let service = Arc::new(KvService::new(config)?);
    runtime.block_on(async move {
        let listener = bind(listen).await?;
        let addr = listener.local_addr().map_err(|source| ServeError::Io {
            what: "cannot read the listening address".into(),
            source,
        })?;
        // The handlers first: whoever is told the address may send SIGTERM at once.
        let shutdown = install_shutdown_signal();
        on_listening(addr, &service);
        serve(listener, service, body_limit, shutdown).await
    })
}
