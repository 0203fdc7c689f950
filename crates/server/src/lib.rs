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
//! | `GET /v1/sequences` | | 200 + [`SequenceList`]: the caller's own |
//! | `POST /v1/sequences/{id}/append` | `{"tokens": k}` | 200 + [`SequenceInfo`] |
//! | `GET /v1/sequences/{id}` | | 200 + [`SequenceInfo`] |
//! | `DELETE /v1/sequences/{id}` | | 200 + [`Released`] |
//! | `GET /metrics` | | 200, Prometheus text ([`metrics::METRICS`]); with keys, an operator key's only |
//! | `GET /healthz` | | 200 (503 while shutting down); with keys and no key given, liveness only |
//!
//! Every error the server produces is JSON `{"error": "...", "kind": "..."}` with the status
//! of [`ServiceError::status`]; a 429 or a 503 from load shedding adds `retry_after_ms` and a
//! `Retry-After` header of `ceil(retry_after)` seconds (at least 1). A request that can never
//! fit (larger than the budget, the device, a limit of the server) is 413 `never_fits` naming
//! the limit, never 429. A refused request changes nothing. `docs/serve.md` has the details,
//! the flags and curl examples.
//!
//! ## Fit for a shared network
//!
//! [`HttpConfig`]: header, body and keep-alive timeouts, a cap on connections and on requests
//! in flight (load shedding answers 503 + `Retry-After`), an early 413 from
//! `Content-Length`, strict requests (`application/json` bodies, `Host`, no duplicate keys,
//! canonical ids), optional API keys with per-key ownership, prefix-cache namespaces and
//! [`Limits`] (and operator keys, the only ones that see server-wide figures: [`Role`]),
//! idle-sequence expiry, a shutdown deadline, an access log with request ids
//! ([`init_logging`]) and per-route metrics.
//!
//! ## Structure
//!
//! [`KvService`] is the core: it owns the backend, the governor, the manager, the layout plan,
//! the [`PrefixCache`](kvvm::kv::PrefixCache) and the table of live sequences
//! ([`SequenceKv`](kvvm::kv::SequenceKv)s), and is the only code that touches the KV layer.
//! Its [`Limits`] are the governor's tenant budgets ([`kvvm::governor::Tenants`], one tenant
//! per owner): the server keeps no books of its own.
//! [`router`] is the HTTP layer over it (`layers.rs` the middleware, `conn.rs` the
//! connections). [`serve`] runs it on a listener until a shutdown future completes, drains
//! within the shutdown deadline, then releases every sequence, the prefix caches and the
//! handle pool ([`KvService::shutdown`]): after it returns the service holds no device
//! memory (quarantine aside). [`serve_until_signal`] is what the CLI runs (Ctrl-C or
//! SIGTERM).
//!
//! ## Example
//!
//! ```no_run
//! # async fn example() -> Result<(), kvvm_server::ServeError> {
//! use std::sync::Arc;
//! use kvvm::layout::KvDtype;
//! use kvvm_server::{serve, HttpConfig, KvService, ServedModel, ServiceConfig};
//!
//! let backend = kvvm::open_backend("sim")?;
//! let model = ServedModel::preset("llama-3-8b", KvDtype::F16, 8192)
//!     .map_err(|e| kvvm_server::ServeError::Config(e.to_string()))?;
//! let service = Arc::new(KvService::new(ServiceConfig::new(backend, model))?);
//! let listener = kvvm_server::bind("127.0.0.1:8080").await?;
//! let report = serve(listener, service, HttpConfig::default(), async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await?;
//! println!("released {} sequences", report.sequences);
//! # Ok(())
//! # }
//! ```

#![forbid(unsafe_code)]
// Output goes through writers whose errors are handled (the log's counts and drops them): a
// print macro panics when stdout or stderr cannot be written.
#![warn(clippy::print_stdout, clippy::print_stderr)]

mod activity;
mod api;
mod app;
mod auth;
mod body;
mod caches;
mod config;
mod conn;
mod counters;
mod error;
mod http_config;
mod http_metrics;
mod layers;
mod limits;
mod logging;
pub mod metrics;
mod response;
mod router;
mod sequence;
mod service;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use api::{
    AppendTokens, Counters, CreateSequence, MetricsSnapshot, Released, SequenceInfo, SequenceList,
    ShutdownReport,
};
pub use auth::{ApiKeys, Owner, Principal, Role};
pub use config::{ServedModel, ServiceConfig, DEFAULT_IDLE_TIMEOUT};
pub use conn::effective_max_connections;
pub use error::{retry_after_header, ServeError, ServiceError};
pub use http_config::{HttpConfig, DEFAULT_BODY_LIMIT};
pub use http_metrics::HttpMetrics;
pub use limits::Limits;
pub use logging::{init_logging, log_write_errors, LogFormat};
pub use router::router;
pub use service::KvService;

pub use tokio::net::TcpListener;

/// Binds a TCP listener on `addr` (e.g. `"127.0.0.1:8080"`, or port 0 for an ephemeral port).
pub async fn bind(addr: &str) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Io {
            what: format!("cannot listen on {addr}"),
            source,
        })
}

/// Refuses to serve without API keys on an address other hosts can reach, unless `http`
/// allows it explicitly.
fn check_exposure(addr: SocketAddr, http: &HttpConfig) -> Result<(), ServeError> {
    if addr.ip().is_loopback() || !http.api_keys.is_empty() || http.allow_unauthenticated {
        return Ok(());
    }
    Err(ServeError::Refused(format!(
        "refusing to listen on {addr} without API keys: any host could use and release every \
         sequence. Give keys (--api-key, --api-keys-file, KVVM_API_KEYS), listen on a loopback \
         address, or pass --allow-unauthenticated"
    )))
}

/// How often idle sequences are looked for: a quarter of the timeout, within 100 ms..30 s.
fn expiry_period(idle: Duration) -> Duration {
    (idle / 4).clamp(Duration::from_millis(100), Duration::from_secs(30))
}

/// Serves the API of `service` on `listener` until `shutdown` completes; then stops
/// accepting, answers 503 to new requests while those in flight finish (at most
/// `http.shutdown_timeout`), closes what remains, releases every sequence and empties the
/// prefix caches and the handle pool.
///
/// Returns what the shutdown released. Refuses ([`ServeError::Refused`]) a non-loopback
/// listener without API keys unless `http.allow_unauthenticated`.
pub async fn serve<F>(
    listener: TcpListener,
    service: Arc<KvService>,
    http: HttpConfig,
    shutdown: F,
) -> Result<ShutdownReport, ServeError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let addr = listener.local_addr().map_err(|source| ServeError::Io {
        what: "cannot read the listening address".into(),
        source,
    })?;
    check_exposure(addr, &http)?;
    if let Some(reason) = service.never_fits_reason() {
        tracing::warn!(%reason, "no sequence can ever be opened with these settings");
    }
    if http.api_keys.lacks_operator() {
        tracing::warn!("API keys but no operator key: /metrics answers 403 to every key");
    }
    let metrics = Arc::new(HttpMetrics::default());
    let app = router::router_with(service.clone(), &http, metrics.clone());
    let expiry = service.idle_timeout().map(|idle| {
        let service = service.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(expiry_period(idle));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let s = service.clone();
                let _ = tokio::task::spawn_blocking(move || s.expire_idle()).await;
            }
        })
    });
    let served = conn::accept_loop(listener, app, service.clone(), http, metrics, shutdown).await;
    if let Some(task) = expiry {
        task.abort();
    }
    // Release everything.
    let worker = service.clone();
    let mut report = match tokio::task::spawn_blocking(move || worker.shutdown()).await {
        Ok(report) => report,
        Err(_) => service.shutdown(),
    };
    report.abandoned_connections = served.abandoned;
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

/// What `kvvm serve` runs: installs the log, builds a tokio runtime, creates the service,
/// listens on `listen`, installs the Ctrl-C and SIGTERM handlers, calls `on_listening` with
/// the bound address, and serves until either signal arrives; then drains, releases
/// everything and returns what was released.
pub fn serve_until_signal(
    config: ServiceConfig,
    listen: &str,
    http: HttpConfig,
    log: LogFormat,
    on_listening: impl FnOnce(SocketAddr, &KvService),
) -> Result<ShutdownReport, ServeError> {
    init_logging(log);
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
        check_exposure(addr, &http)?;
        // The handlers first: whoever is told the address may send SIGTERM at once.
        let shutdown = install_shutdown_signal();
        on_listening(addr, &service);
        serve(listener, service, http, shutdown).await
    })
}
