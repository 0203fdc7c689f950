//! The accept loop and the connections (hyper's HTTP/1.1 server over tokio): a header-read
//! timeout (hyper's), an idle keep-alive timeout, a cap on open connections below the
//! open-file limit (a new connection past it gets one 503 with `Retry-After` instead of a
//! hang), accept errors logged and counted, and the shutdown: stop accepting, answer 503 to
//! new requests while those in flight finish, close the rest at the deadline.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderValue, Request};
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tower::ServiceExt;

use crate::activity::{Activity, Tracked};
use crate::app::Peer;
use crate::error::ServiceError;
use crate::http_config::HttpConfig;
use crate::http_metrics::{ConnectionEnd, HttpMetrics};
use crate::response::error_response;
use crate::service::KvService;

/// File descriptors kept free of connections (listener, driver, logs, blocking work).
const FD_RESERVE: u64 = 64;
/// Connections past the cap that still get their 503 (beyond: closed at once).
const OVERFLOW: usize = 64;
/// Largest read buffer of a connection: bounds the memory a connection holds while its body
/// is read.
const MAX_BUF: usize = 64 << 10;
/// Largest request head (request line and headers): 431 beyond.
const MAX_HEAD: usize = 32 << 10;

/// The connection cap in force: the configured one, lowered to fit the open-file limit.
pub fn effective_max_connections(configured: usize) -> usize {
    let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
    let by_fds = soft.map_or(usize::MAX, |n| {
        usize::try_from(n.saturating_sub(FD_RESERVE) / 2).unwrap_or(usize::MAX)
    });
    configured.min(by_fds).max(1)
}

/// What the accept loop left behind.
#[derive(Debug, Default)]
pub(crate) struct Served {
    /// Connections still busy at the shutdown deadline (closed).
    pub(crate) abandoned: u64,
}

fn classify(e: &hyper::Error) -> ConnectionEnd {
    if e.is_timeout() {
        ConnectionEnd::HeaderTimeout
    } else if e.is_parse() || e.is_parse_too_large() || e.is_parse_status() {
        ConnectionEnd::ParseError
    } else {
        ConnectionEnd::Io
    }
}

/// Serves one connection until it ends, the keep-alive timeout closes it or the shutdown
/// tells it to stop.
async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    router: Router,
    http: HttpConfig,
    metrics: Arc<HttpMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Tracked::new(stream, activity.clone()));
    let tracked = activity.clone();
    let svc = tower::service_fn(move |mut req: Request<Incoming>| {
        req.extensions_mut().insert(Peer(peer));
        let busy = tracked.begin();
        let answer = router.clone().oneshot(req);
        async move {
            let r = answer.await;
            drop(busy);
            r
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(http.header_timeout)
        .max_buf_size(MAX_BUF)
        .max_header_size(MAX_HEAD)
        .keep_alive(true);
    let conn = builder.serve_connection(io, TowerToHyperService::new(svc));
    tokio::pin!(conn);
    let keep_alive = http.keep_alive_timeout;
    let mut stopping = false;
    loop {
        let check = tokio::time::sleep_until(activity.idle_deadline(keep_alive).into());
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    let why = classify(&e);
                    tracing::debug!(%peer, error = %e, ?why, "connection closed");
                    metrics.connection_end(why);
                }
                return;
            }
            changed = stop.changed(), if !stopping => {
                if changed.is_err() || *stop.borrow() {
                    stopping = true;
                    conn.as_mut().graceful_shutdown();
                    // Nothing in flight (idle, or a request head not yet complete): close.
                    if !activity.is_busy() {
                        return;
                    }
                }
            }
            () = check => {
                if activity.is_idle_for(keep_alive) {
                    metrics.connection_end(ConnectionEnd::IdleTimeout);
                    return;
                }
            }
        }
    }
}

/// A connection past the cap: one 503 `too_many_connections` with `Retry-After`, closed.
async fn refuse(stream: TcpStream, header_timeout: Duration) {
    let svc = hyper::service::service_fn(|_req: Request<Incoming>| async {
        let mut res = error_response(&ServiceError::Http {
            status: 503,
            kind: "too_many_connections",
            message: "the server is at its connection limit; retry shortly".into(),
        });
        res.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        res.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        Ok::<_, Infallible>(res)
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout.min(Duration::from_secs(2)))
        .max_buf_size(MAX_BUF)
        .max_header_size(MAX_HEAD)
        .keep_alive(false);
    let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
}

/// Accepts connections on `listener` until `shutdown` completes, then drains them within
/// the shutdown deadline.
pub(crate) async fn accept_loop<F>(
    listener: TcpListener,
    router: Router,
    service: Arc<KvService>,
    http: HttpConfig,
    metrics: Arc<HttpMetrics>,
    shutdown: F,
) -> Served
where
    F: Future<Output = ()> + Send + 'static,
{
    let cap = effective_max_connections(http.max_connections);
    if cap < http.max_connections {
        tracing::warn!(
            configured = http.max_connections,
            cap,
            "connection cap lowered to fit the open-file limit"
        );
    }
    let permits = Arc::new(Semaphore::new(cap));
    let overflow = Arc::new(Semaphore::new(OVERFLOW));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
            // Reap finished connection tasks so the set does not grow.
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                metrics.accept_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "accept failed");
                // Out of file descriptors, say: let connections close before retrying.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        if let Ok(permit) = permits.clone().try_acquire_owned() {
            metrics.connections_accepted.fetch_add(1, Ordering::Relaxed);
            // Both given back when the task ends, also when the shutdown deadline aborts it.
            let open = metrics.connection_open();
            let (router, http, metrics, stop) = (
                router.clone(),
                http.clone(),
                metrics.clone(),
                stop_rx.clone(),
            );
            tasks.spawn(async move {
                connection(stream, peer, router, http, metrics, stop).await;
                drop(open);
                drop(permit);
            });
        } else {
            metrics.connections_refused.fetch_add(1, Ordering::Relaxed);
            service.note_status(503);
            tracing::warn!(%peer, cap, "connection refused: at the connection cap");
            if let Ok(permit) = overflow.clone().try_acquire_owned() {
                let timeout = http.header_timeout;
                tasks.spawn(async move {
                    refuse(stream, timeout).await;
                    drop(permit);
                });
            }
            // Else the stream is dropped: closed at once.
        }
    }
    drop(listener);
    drain(&mut tasks, &stop_tx, &metrics, http.shutdown_timeout).await
}

/// The shutdown: new requests get 503 while those in flight finish; then every connection
/// is told to stop (idle ones close now); at the deadline the rest are closed.
async fn drain(
    tasks: &mut JoinSet<()>,
    stop: &watch::Sender<bool>,
    metrics: &HttpMetrics,
    timeout: Duration,
) -> Served {
    let deadline = tokio::time::Instant::now() + timeout;
    metrics.draining.store(true, Ordering::Relaxed);
    tracing::info!(
        in_flight = metrics.in_flight(),
        connections = tasks.len(),
        timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        "shutting down: draining"
    );
    while metrics.in_flight() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = stop.send(true);
    let all_done = async { while tasks.join_next().await.is_some() {} };
    let mut served = Served::default();
    if tokio::time::timeout_at(deadline, all_done).await.is_err() {
        served.abandoned = tasks.len() as u64;
        for _ in 0..served.abandoned {
            metrics.connection_end(ConnectionEnd::ShutdownDeadline);
        }
        tracing::warn!(
            connections = served.abandoned,
            "shutdown deadline passed: closing the connections still busy"
        );
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
    }
    served
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ServiceConfig;
    use std::io::Write;

    /// A connection whose upload stalls is cut at the shutdown deadline (its task aborted):
    /// it must no longer count as open, nor its request as in flight.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_cut_at_the_deadline_is_no_longer_counted() {
        let sim = Arc::new(kvvm::sim::SimBackend::h200());
        let model =
            crate::ServedModel::preset("llama-3-8b", kvvm::layout::KvDtype::F16, 8192).unwrap();
        let service = Arc::new(KvService::new(ServiceConfig::new(sim, model)).unwrap());
        let http = HttpConfig {
            shutdown_timeout: Duration::from_millis(100),
            body_timeout: Duration::from_secs(120),
            ..HttpConfig::default()
        };
        let metrics = Arc::new(HttpMetrics::default());
        let router = crate::router::router_with(service.clone(), &http, metrics.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(accept_loop(
            listener,
            router,
            service,
            http,
            metrics.clone(),
            async move {
                let _ = stopped.await;
            },
        ));
        // A few bytes on a loopback socket: the blocking client never blocks here.
        let mut upload = std::net::TcpStream::connect(addr).unwrap();
        upload
            .write_all(
                b"POST /v1/sequences HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                  Content-Length: 100\r\n\r\n{",
            )
            .unwrap();
        // Its handler is reading the body (a state the server reaches by itself: the bound
        // only decides how long a failure takes to report).
        let wait = tokio::time::Instant::now() + Duration::from_secs(20);
        while metrics.in_flight() == 0 {
            assert!(
                tokio::time::Instant::now() < wait,
                "the upload never got in"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(metrics.connections_open.load(Ordering::Relaxed), 1);
        let _ = stop.send(());
        let served = served.await.unwrap();
        assert_eq!(served.abandoned, 1);
        assert_eq!(metrics.connections_open.load(Ordering::Relaxed), 0);
        assert_eq!(metrics.in_flight(), 0);
        drop(upload);
    }
}
