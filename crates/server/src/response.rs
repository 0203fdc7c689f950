//! Rendering: JSON bodies, and the response of a [`ServiceError`] (its status, a JSON body,
//! `Retry-After` when retrying can help, `WWW-Authenticate` on 401, `Connection: close`
//! when the connection will not be reused).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::error::ServiceError;

/// A JSON response.
pub(crate) fn json<T: Serialize>(status: StatusCode, value: &T) -> Response {
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
        Err(e) => error_response(&ServiceError::Internal(format!("cannot render: {e}"))),
    }
}

/// The response of an error.
pub(crate) fn error_response(e: &ServiceError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = serde_json::to_vec(&e.to_json()).unwrap_or_default();
    let mut response = (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response();
    let headers = response.headers_mut();
    if let Some(secs) = e.retry_after_secs() {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    match e {
        ServiceError::Unauthorized(_) => {
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"kvvm\""),
            );
        }
        // The body was not read (or not all of it), or the server stops: the connection
        // is not reused.
        ServiceError::RequestTimeout(_)
        | ServiceError::ShuttingDown
        | ServiceError::BodyTooLarge { .. } => {
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        _ => {}
    }
    response
}

/// The kind and message of an error status produced below the handlers.
pub(crate) fn status_error(status: StatusCode) -> ServiceError {
    let (kind, message) = match status.as_u16() {
        400 => ("bad_request", "the request could not be parsed"),
        404 => (
            "not_found",
            "no such route: see /v1/sequences, /metrics, /healthz",
        ),
        405 => ("method_not_allowed", "this method is not allowed here"),
        408 => ("request_timeout", "the request did not arrive in time"),
        413 => (
            "body_too_large",
            "the request body is larger than the server accepts",
        ),
        414 => ("uri_too_long", "the request URI is too long"),
        415 => (
            "unsupported_media_type",
            "request bodies must be application/json",
        ),
        431 => ("headers_too_large", "the request headers are too large"),
        503 => ("unavailable", "the server cannot take this request now"),
        s if s >= 500 => ("internal", "internal error"),
        _ => ("bad_request", "the request was refused"),
    };
    ServiceError::Http {
        status: status.as_u16(),
        kind,
        message: message.into(),
    }
}
