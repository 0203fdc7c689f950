//! The middleware every request passes, outermost first:
//!
//! 1. a request id (`x-request-id`, tower-http; a client's own id is kept) and a tracing
//!    span per request with it, the method, the path and the key's name; its response line
//!    is the access log (tower-http's `TraceLayer`);
//! 2. [`observe`]: latency and status by route, the service's counters, and a JSON body for
//!    any error a lower layer answered without one;
//! 3. [`drain`]: once the shutdown started, 503 `shutting_down` and `Connection: close`;
//! 4. [`strict`]: `Host` on HTTP/1.1 exactly once, `Authorization` at most once (a body must
//!    be `application/json`: checked where a route reads one, after the route and method
//!    matched);
//! 5. [`authenticate`]: the bearer key's [`Principal`](crate::Principal), and what its role
//!    may use (none needed for `/healthz`, which shows a caller without a key only that the
//!    server is alive);
//! 6. on the API routes (not `/healthz`): load shedding over a global limit of requests in
//!    flight (tower): 503 `overloaded` with `Retry-After` at once instead of a queue;
//! 7. the body limit (tower-http): a `Content-Length` over it is 413 before any byte is read
//!    and before `100 Continue` is sent.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::error_handling::HandleErrorLayer;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode, Version};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::Response;
use axum::{BoxError, Router};
use tower::ServiceBuilder;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::request_id::{
    MakeRequestId, PropagateRequestIdLayer, RequestId, SetRequestIdLayer,
};
use tower_http::trace::TraceLayer;

use crate::app::{App, Peer};
use crate::error::ServiceError;
use crate::http_metrics::route_of;
use crate::response::{error_response, status_error};

/// Request ids: a per-process prefix and a counter (`3f2a9c-17`): unique, and cheap.
#[derive(Debug, Clone)]
struct Ids {
    prefix: String,
    next: std::sync::Arc<AtomicU64>,
}

impl MakeRequestId for Ids {
    fn make_request_id<B>(&mut self, _: &axum::http::Request<B>) -> Option<RequestId> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        HeaderValue::from_str(&format!("{}-{n}", self.prefix))
            .ok()
            .map(RequestId::new)
    }
}

fn ids() -> Ids {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let seed = std::process::id().rotate_left(16) ^ nanos;
    Ids {
        prefix: format!("{:06x}", seed & 0xff_ffff),
        next: std::sync::Arc::new(AtomicU64::new(1)),
    }
}

/// The span of a request: what the access log line carries.
fn span(req: &axum::http::Request<Body>) -> tracing::Span {
    let id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let peer = req
        .extensions()
        .get::<Peer>()
        .map(|p| p.0.to_string())
        .unwrap_or_default();
    tracing::info_span!(
        "request",
        id,
        method = %req.method(),
        path = req.uri().path(),
        peer,
        key = tracing::field::Empty,
    )
}

/// Applies the middleware every request passes (1 to 5) to `router`.
pub(crate) fn apply(router: Router<()>, app: &App) -> Router<()> {
    let stack = ServiceBuilder::new()
        .layer(SetRequestIdLayer::x_request_id(ids()))
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(span)
                .on_request(())
                .on_response(|res: &Response<_>, took: Duration, _span: &tracing::Span| {
                    tracing::info!(
                        status = res.status().as_u16(),
                        micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
                        "served"
                    );
                }),
        )
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(from_fn_with_state(app.clone(), observe))
        .layer(from_fn_with_state(app.clone(), drain))
        .layer(from_fn_with_state(app.clone(), strict))
        .layer(from_fn_with_state(app.clone(), authenticate));
    router.layer(stack)
}

/// Applies load shedding and the body limit (6 and 7) to the API routes of `router`
/// (`/healthz` stays out: a probe must see a loaded server alive).
pub(crate) fn shed_and_limit(router: Router<App>, app: &App, max_in_flight: usize) -> Router<App> {
    let stack = ServiceBuilder::new()
        .layer(HandleErrorLayer::new(shed))
        .load_shed()
        .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
            max_in_flight.max(1),
        ))
        .layer(RequestBodyLimitLayer::new(app.body_limit));
    router.layer(stack)
}

/// The answer to a request shed by the in-flight limit.
async fn shed(e: BoxError) -> Response {
    if e.is::<tower::load_shed::error::Overloaded>() {
        error_response(&ServiceError::Overloaded {
            retry_after: Duration::from_secs(1),
        })
    } else {
        error_response(&ServiceError::Internal(format!("middleware: {e}")))
    }
}

/// Measures and counts every answer; gives a JSON body to errors that lack one.
async fn observe(State(app): State<App>, req: Request, next: Next) -> Response {
    let start = Instant::now();
    let route = route_of(req.uri().path());
    let method = req.method().as_str().to_owned();
    // Taken back when the guard drops: also when this future is dropped before it completes
    // (the client reset the connection, the shutdown deadline aborted the connection).
    let in_flight = app.http.request_in_flight();
    let mut res = next.run(req).await;
    drop(in_flight);
    let status = res.status();
    let is_json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if (status.is_client_error() || status.is_server_error()) && !is_json {
        let e = if status == StatusCode::PAYLOAD_TOO_LARGE {
            // The body limit's own 413: say what the limit is.
            ServiceError::BodyTooLarge {
                limit: app.body_limit,
            }
        } else {
            status_error(status)
        };
        res = error_response(&e);
    }
    app.service.note_status(status.as_u16());
    app.http
        .observe(route, &method, status.as_u16(), start.elapsed());
    res
}

/// After the shutdown started: 503 and close the connection.
async fn drain(State(app): State<App>, req: Request, next: Next) -> Response {
    if app.http.is_draining() || app.service.is_closed() {
        return error_response(&ServiceError::ShuttingDown);
    }
    next.run(req).await
}

/// HTTP rules the server holds every request to.
async fn strict(req: Request, next: Next) -> Response {
    if req.version() == Version::HTTP_11 {
        let hosts = req.headers().get_all(header::HOST).iter().count();
        if hosts != 1 {
            let e = ServiceError::BadRequest(if hosts == 0 {
                "HTTP/1.1 requests need a Host header".into()
            } else {
                "more than one Host header".into()
            });
            return error_response(&e);
        }
    }
    // Which one would count? Refused rather than guessed, with keys or without.
    if req.headers().get_all(header::AUTHORIZATION).iter().count() > 1 {
        let e = ServiceError::BadRequest("more than one Authorization header".into());
        return error_response(&e);
    }
    next.run(req).await
}

/// The caller's key: a [`Principal`](crate::Principal) extension for the handlers, 401
/// without a valid key, 403 for a key whose role may not use the route. `/healthz` needs no
/// key (without one, and with keys configured, it gets no principal and shows only that
/// the server is alive); a key it is given must be valid.
async fn authenticate(State(app): State<App>, mut req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let header = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    if path == "/healthz" && header.is_none() && !app.keys.is_empty() {
        return next.run(req).await;
    }
    let p = match app.keys.authenticate(header) {
        Ok(p) => p,
        Err(e) => return error_response(&e),
    };
    tracing::Span::current().record("key", p.name.as_str());
    if path == "/metrics" && !p.sees_every_owner() {
        return error_response(&ServiceError::Forbidden(
            "/metrics shows every key's activity: it needs an operator key (--operator-key)".into(),
        ));
    }
    if path.starts_with("/v1/") && !p.may_use_sequences() {
        return error_response(&ServiceError::Forbidden(
            "an operator key reads /metrics and /healthz; sequences need a tenant key".into(),
        ));
    }
    req.extensions_mut().insert(p);
    next.run(req).await
}

/// A 404 for requests no route matches.
pub(crate) fn not_found() -> Response {
    error_response(&status_error(StatusCode::NOT_FOUND))
}
