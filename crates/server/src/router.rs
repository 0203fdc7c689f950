//! The routes: each handler reads its input strictly (`body.rs`), calls one [`KvService`]
//! method on a blocking thread as the caller's [`Owner`](crate::Owner) and renders the
//! result. The middleware around them is `layers.rs`.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::api::{AppendTokens, CreateSequence, SequenceInfo, SequenceList};
use crate::app::App;
use crate::auth::Principal;
use crate::body::{check_content_type, parse, parse_id, read, PARSE_INLINE_MAX};
use crate::error::ServiceError;
use crate::http_config::HttpConfig;
use crate::http_metrics::HttpMetrics;
use crate::response::{error_response, json};
use crate::service::KvService;

/// The router of the API over `service` with every layer of `layers.rs`, configured by
/// `http` (body limit and timeout, in-flight limit, API keys).
pub fn router(service: Arc<KvService>, http: &HttpConfig) -> Router {
    router_with(service, http, Arc::new(HttpMetrics::default()))
}

/// [`router`] recording into `metrics` (shared with the accept loop).
pub(crate) fn router_with(
    service: Arc<KvService>,
    http: &HttpConfig,
    measured: Arc<HttpMetrics>,
) -> Router {
    let app = App {
        service,
        http: measured,
        keys: Arc::new(http.api_keys.clone()),
        body_limit: http.body_limit,
        body_timeout: http.body_timeout,
    };
    let api = Router::new()
        .route(
            "/v1/sequences",
            get(list).post(create).fallback(method_not_allowed),
        )
        .route(
            "/v1/sequences/{id}",
            get(get_sequence)
                .delete(delete)
                .fallback(method_not_allowed),
        )
        .route(
            "/v1/sequences/{id}/append",
            axum::routing::post(append).fallback(method_not_allowed),
        )
        .route("/metrics", get(metrics).fallback(method_not_allowed));
    let routes = crate::layers::shed_and_limit(api, &app, http.max_in_flight)
        .route("/healthz", get(healthz).fallback(method_not_allowed))
        .fallback(|| async { crate::layers::not_found() })
        .with_state(app.clone());
    crate::layers::apply(routes, &app)
}

/// The raw (not percent-decoded) id segment of `/v1/sequences/{id}[/append]`.
fn raw_id(uri: &Uri) -> &str {
    uri.path().split('/').nth(3).unwrap_or("")
}

/// The sequence id of `/v1/sequences/{id}[/append]`, parsed by `parse_id`; a bad one is
/// answered with its error.
struct SequenceId(u64);

impl<S: Send + Sync> FromRequestParts<S> for SequenceId {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        parse_id(raw_id(&parts.uri))
            .map(SequenceId)
            .map_err(|e| error_response(&e))
    }
}

/// Whether the request asks for device addresses (`?address=true`).
fn wants_address(uri: &Uri) -> bool {
    uri.query().is_some_and(|q| {
        q.split('&')
            .any(|kv| kv == "address=true" || kv == "address=1")
    })
}

fn shown(mut info: SequenceInfo, address: bool) -> SequenceInfo {
    if !address {
        info.address = None;
    }
    info
}

/// Runs `f` on a blocking thread (driver calls block, JSON parsing of a large body takes a
/// while: neither may hold an async worker) and renders its result.
async fn run<T, F>(app: &App, success: StatusCode, f: F) -> Response
where
    T: Serialize + Send + 'static,
    F: FnOnce(&KvService) -> Result<T, ServiceError> + Send + 'static,
{
    let service = app.service.clone();
    match tokio::task::spawn_blocking(move || f(&service)).await {
        Ok(Ok(value)) => json(success, &value),
        Ok(Err(e)) => error_response(&e),
        Err(e) => error_response(&ServiceError::Internal(format!("worker failed: {e}"))),
    }
}

/// Reads a body; small ones are parsed here, large ones later on the blocking thread.
enum Input<T> {
    Parsed(T),
    Raw(Bytes),
}

impl<T: DeserializeOwned> Input<T> {
    async fn read(app: &App, headers: &HeaderMap, body: Body) -> Result<Self, ServiceError> {
        check_content_type(headers)?;
        let bytes = read(body, app.body_limit, app.body_timeout).await?;
        if bytes.len() < PARSE_INLINE_MAX {
            Ok(Input::Parsed(parse(&bytes)?))
        } else {
            Ok(Input::Raw(bytes))
        }
    }

    fn get(self) -> Result<T, ServiceError> {
        match self {
            Input::Parsed(t) => Ok(t),
            Input::Raw(bytes) => parse(&bytes),
        }
    }
}

/// Reads the body as a `T` and runs `f` on it as [`run`] does; the sequence `f` returns is
/// shown with its address when the query asks for it.
async fn run_on_body<T, F>(
    app: &App,
    uri: &Uri,
    headers: &HeaderMap,
    body: Body,
    success: StatusCode,
    f: F,
) -> Response
where
    T: DeserializeOwned + Send + 'static,
    F: FnOnce(&KvService, &T) -> Result<SequenceInfo, ServiceError> + Send + 'static,
{
    let input = match Input::<T>::read(app, headers, body).await {
        Ok(i) => i,
        Err(e) => return error_response(&e),
    };
    let address = wants_address(uri);
    run(app, success, move |s| {
        let req = input.get()?;
        f(s, &req).map(|i| shown(i, address))
    })
    .await
}

async fn create(
    State(app): State<App>,
    Extension(who): Extension<Principal>,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let call = move |s: &KvService, req: &CreateSequence| s.create(who.owner, req);
    run_on_body(&app, &uri, &headers, body, StatusCode::CREATED, call).await
}

async fn append(
    State(app): State<App>,
    Extension(who): Extension<Principal>,
    SequenceId(id): SequenceId,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let call = move |s: &KvService, req: &AppendTokens| s.append(who.owner, id, req);
    run_on_body(&app, &uri, &headers, body, StatusCode::OK, call).await
}

async fn get_sequence(
    State(app): State<App>,
    Extension(who): Extension<Principal>,
    SequenceId(id): SequenceId,
    uri: Uri,
) -> Response {
    let address = wants_address(&uri);
    run(&app, StatusCode::OK, move |s| {
        s.get(who.owner, id).map(|i| shown(i, address))
    })
    .await
}

async fn list(State(app): State<App>, Extension(who): Extension<Principal>, uri: Uri) -> Response {
    let address = wants_address(&uri);
    run(&app, StatusCode::OK, move |s| {
        let sequences = s
            .list(who.owner)?
            .into_iter()
            .map(|i| shown(i, address))
            .collect();
        Ok(SequenceList { sequences })
    })
    .await
}

async fn delete(
    State(app): State<App>,
    Extension(who): Extension<Principal>,
    SequenceId(id): SequenceId,
) -> Response {
    run(&app, StatusCode::OK, move |s| s.release(who.owner, id)).await
}

async fn metrics(State(app): State<App>) -> Response {
    let http = app.http.clone();
    let service = app.service.clone();
    let text = tokio::task::spawn_blocking(move || {
        let mut text = crate::metrics::render(&service.metrics());
        http.render(&mut text);
        crate::logging::render(&mut text);
        text
    })
    .await;
    match text {
        Ok(text) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
            )],
            Body::from(text),
        )
            .into_response(),
        Err(e) => error_response(&ServiceError::Internal(format!("worker failed: {e}"))),
    }
}

/// Liveness for anyone; the settings and a count of live sequences for a caller with a key:
/// its own sequences for a tenant key, every owner's for an operator key or without keys.
async fn healthz(State(app): State<App>, who: Option<Extension<Principal>>) -> Response {
    let Some(Extension(who)) = who else {
        return json(StatusCode::OK, &serde_json::json!({ "status": "ok" }));
    };
    // Only what the service knows without a lock held across a driver call: no blocking.
    let s = &app.service;
    let live_sequences = if who.sees_every_owner() {
        s.live_sequences() as u64
    } else {
        s.held_by(who.owner).0
    };
    let body = serde_json::json!({
        "status": "ok",
        "backend": s.backend_name(),
        "model": s.model(),
        "dtype": s.dtype().as_str(),
        "layout": s.layout().as_str(),
        "prefix_cache": s.prefix_cache().is_some(),
        "max_tokens": s.max_tokens(),
        "granule_bytes": s.manager().granule(),
        "live_sequences": live_sequences,
        "authentication": !app.keys.is_empty(),
    });
    json(StatusCode::OK, &body)
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    error_response(&ServiceError::MethodNotAllowed(format!(
        "{method} is not allowed on {}",
        uri.path()
    )))
}
