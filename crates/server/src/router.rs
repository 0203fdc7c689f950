//! The HTTP layer: routes, JSON bodies, status codes and headers. Each handler parses its
//! input, calls one [`KvService`] method on a blocking thread and renders the result.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::api::{AppendTokens, CreateSequence};
use crate::error::ServiceError;
use crate::service::KvService;

/// Shared state of the handlers.
#[derive(Debug, Clone)]
struct App {
    service: Arc<KvService>,
    body_limit: usize,
}

/// The router of the API over `service`, refusing bodies larger than `body_limit` bytes (413).
pub fn router(service: Arc<KvService>, body_limit: usize) -> Router {
    let app = App {
        service,
        body_limit,
    };
    Router::new()
        .route("/v1/sequences", post(create).fallback(method_not_allowed))
        .route(
            "/v1/sequences/{id}",
            get(get_sequence)
                .delete(delete)
                .fallback(method_not_allowed),
        )
        .route(
            "/v1/sequences/{id}/append",
            post(append).fallback(method_not_allowed),
        )
        .route("/metrics", get(metrics).fallback(method_not_allowed))
        .route("/healthz", get(healthz).fallback(method_not_allowed))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(app)
}

/// A JSON response.
fn json<T: Serialize>(status: StatusCode, value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => (
            status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// The response of an error: its status, a JSON body and, for backpressure, `Retry-After`.
fn error_response(e: &ServiceError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = json(status, &e.to_json());
    if let Some(secs) = e.retry_after_secs() {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}

/// Counts the error and renders it.
fn refuse(app: &App, e: &ServiceError) -> Response {
    app.service.note_error(e);
    error_response(e)
}

/// Parses a JSON body; any failure is a 4xx and nothing else happens.
fn parse_body<T: DeserializeOwned>(
    app: &App,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ServiceError> {
    let bytes = body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ServiceError::BodyTooLarge {
                limit: app.body_limit,
            }
        } else {
            ServiceError::MalformedBody(r.body_text())
        }
    })?;
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| ServiceError::MalformedBody(e.to_string()))?;
    if !value.is_object() {
        return Err(ServiceError::MalformedBody("expected a JSON object".into()));
    }
    serde_json::from_value(value).map_err(|e| ServiceError::MalformedBody(e.to_string()))
}

fn parse_id(raw: &str) -> Result<u64, ServiceError> {
    raw.parse()
        .map_err(|_| ServiceError::InvalidId(raw.chars().take(64).collect()))
}

/// Runs `f` on a blocking thread (driver calls block) and renders its result.
async fn run<T, F>(app: App, success: StatusCode, f: F) -> Response
where
    T: Serialize + Send + 'static,
    F: FnOnce(&KvService) -> Result<T, ServiceError> + Send + 'static,
{
    match blocking(&app, f).await.and_then(|r| r) {
        Ok(value) => json(success, &value),
        Err(e) => refuse(&app, &e),
    }
}

async fn create(State(app): State<App>, body: Result<Bytes, BytesRejection>) -> Response {
    let req: CreateSequence = match parse_body(&app, body) {
        Ok(r) => r,
        Err(e) => return refuse(&app, &e),
    };
    run(app, StatusCode::CREATED, move |s| s.create(&req)).await
}

async fn append(
    State(app): State<App>,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let parsed = parse_id(&id).and_then(|id| Ok((id, parse_body::<AppendTokens>(&app, body)?)));
    let (id, req) = match parsed {
        Ok(p) => p,
        Err(e) => return refuse(&app, &e),
    };
    run(app, StatusCode::OK, move |s| s.append(id, &req)).await
}

async fn get_sequence(State(app): State<App>, Path(id): Path<String>) -> Response {
    let id = match parse_id(&id) {
        Ok(id) => id,
        Err(e) => return refuse(&app, &e),
    };
    run(app, StatusCode::OK, move |s| s.get(id)).await
}

async fn delete(State(app): State<App>, Path(id): Path<String>) -> Response {
    let id = match parse_id(&id) {
        Ok(id) => id,
        Err(e) => return refuse(&app, &e),
    };
    run(app, StatusCode::OK, move |s| s.release(id)).await
}

/// Runs `f` on a blocking thread: it takes the service's lock, which a driver call may hold
/// for a while, and an async worker must not wait on it.
async fn blocking<T: Send + 'static>(
    app: &App,
    f: impl FnOnce(&KvService) -> T + Send + 'static,
) -> Result<T, ServiceError> {
    let service = app.service.clone();
    tokio::task::spawn_blocking(move || f(&service))
        .await
        .map_err(|e| ServiceError::Internal(format!("worker failed: {e}")))
}

async fn metrics(State(app): State<App>) -> Response {
    match blocking(&app, |s| crate::metrics::render(&s.metrics())).await {
        Ok(text) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
            )],
            Body::from(text),
        )
            .into_response(),
        Err(e) => refuse(&app, &e),
    }
}

async fn healthz(State(app): State<App>) -> Response {
    let health = blocking(&app, |s| {
        let closed = s.is_closed();
        let body = serde_json::json!({
            "status": if closed { "shutting_down" } else { "ok" },
            "backend": s.backend_name(),
            "model": s.model(),
            "dtype": s.dtype().as_str(),
            "layout": s.layout().as_str(),
            "prefix_cache": s.prefix_cache().is_some(),
            "max_tokens": s.max_tokens(),
            "granule_bytes": s.manager().granule(),
            "live_sequences": s.live_sequences(),
        });
        (closed, body)
    })
    .await;
    match health {
        Ok((false, body)) => json(StatusCode::OK, &body),
        Ok((true, body)) => json(StatusCode::SERVICE_UNAVAILABLE, &body),
        Err(e) => refuse(&app, &e),
    }
}

async fn method_not_allowed(State(app): State<App>, method: Method, uri: Uri) -> Response {
    refuse(
        &app,
        &ServiceError::MethodNotAllowed(format!("{method} is not allowed on {}", uri.path())),
    )
}

async fn not_found(State(app): State<App>) -> Response {
    refuse(
        &app,
        &ServiceError::NotFound("no such route: see /v1/sequences, /metrics, /healthz".into()),
    )
}
