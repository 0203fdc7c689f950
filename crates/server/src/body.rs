//! Strict request input: a body is read only when it is declared `application/json` (415
//! otherwise), within the body timeout (408) and the body limit (413); it must be one JSON
//! object with no duplicate and no unknown key; a sequence id in a path is a canonical
//! decimal (`4`, never `+4`, `04` or `%34`).

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::de::DeserializeOwned;

use crate::error::ServiceError;

/// Bodies at least this large are parsed on a blocking thread, not on an async worker.
pub(crate) const PARSE_INLINE_MAX: usize = 16 << 10;

/// Whether the request declares a body (a non-zero `Content-Length`, or chunked).
fn has_body(headers: &HeaderMap) -> bool {
    let length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    match length {
        Some(n) => n > 0,
        None => headers.contains_key(header::TRANSFER_ENCODING),
    }
}

/// Refuses a body whose `Content-Type` is not `application/json` (parameters such as
/// `charset=utf-8` allowed).
pub(crate) fn check_content_type(headers: &HeaderMap) -> Result<(), ServiceError> {
    if !has_body(headers) {
        return Ok(());
    }
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let essence = ct.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json") {
        Ok(())
    } else {
        Err(ServiceError::UnsupportedMediaType(format!(
            "request bodies must be Content-Type: application/json, not {:?}",
            ct.chars().take(64).collect::<String>()
        )))
    }
}

/// Reads the whole body: at most `limit` bytes (413 beyond), all of it within `timeout`
/// (408 otherwise: a stalled or trickling upload holds no worker and no memory for long).
pub(crate) async fn read(
    body: Body,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, ServiceError> {
    let collect = Limited::new(body, limit).collect();
    match tokio::time::timeout(timeout, collect).await {
        Err(_) => Err(ServiceError::RequestTimeout(format!(
            "the request body did not arrive within {} ms",
            timeout.as_millis()
        ))),
        Ok(Err(e)) if over_limit(&*e) => Err(ServiceError::BodyTooLarge { limit }),
        Ok(Err(e)) => Err(ServiceError::MalformedBody(format!(
            "the body could not be read: {e}"
        ))),
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
    }
}

/// Whether a body error is (or was caused by) a body limit: this reader's own, or the body
/// limit layer's in front of the handler, which reaches here wrapped in the body's error type
/// (a chunked body has no `Content-Length` to refuse it by, so the layer cuts it mid-stream).
fn over_limit(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if c.is::<LengthLimitError>() {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Parses one JSON object into `T`. The derived `Deserialize` of every request body refuses
/// unknown and duplicate keys; an array (which serde would take for a struct) is refused
/// here.
pub(crate) fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ServiceError> {
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => {}
        Some(_) => return Err(ServiceError::MalformedBody("expected a JSON object".into())),
        None => return Err(ServiceError::MalformedBody("the body is empty".into())),
    }
    serde_json::from_slice(bytes).map_err(|e| ServiceError::MalformedBody(e.to_string()))
}

/// A sequence id as written in a path: a canonical decimal `u64` (no sign, no leading zero,
/// no percent-encoding).
pub(crate) fn parse_id(raw: &str) -> Result<u64, ServiceError> {
    let canonical = !raw.is_empty()
        && raw.bytes().all(|b| b.is_ascii_digit())
        && (raw == "0" || !raw.starts_with('0'));
    canonical
        .then(|| raw.parse::<u64>().ok())
        .flatten()
        .ok_or_else(|| ServiceError::InvalidId(raw.chars().take(64).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::CreateSequence;

    #[test]
    fn ids_are_canonical_decimals() {
        assert_eq!(parse_id("4").ok(), Some(4));
        assert_eq!(parse_id("0").ok(), Some(0));
        for bad in [
            "+4",
            "0004",
            "%2B4",
            "%34",
            "-1",
            "",
            " 4",
            "18446744073709551616",
        ] {
            assert!(parse_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bodies_are_one_object_without_duplicate_keys() {
        let ok: CreateSequence = parse(br#" {"prompt_tokens": 3}"#).unwrap();
        assert_eq!(ok.prompt_tokens, Some(3));
        for bad in [
            &br#"{"prompt_tokens": 3, "prompt_tokens": 4}"#[..],
            br#"[3, 10]"#,
            b"",
            br#"{"prompt_tokens": 3, "extra": 1}"#,
        ] {
            let e = parse::<CreateSequence>(bad).unwrap_err();
            assert_eq!(
                e.kind(),
                "malformed_body",
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let dup = parse::<CreateSequence>(br#"{"prompt_tokens": 3, "prompt_tokens": 4}"#);
        assert!(dup.unwrap_err().to_string().contains("duplicate"));
    }

    #[test]
    fn a_body_must_be_json() {
        let mut h = HeaderMap::new();
        assert!(check_content_type(&h).is_ok(), "no body, no type needed");
        h.insert(header::CONTENT_LENGTH, "5".parse().unwrap());
        assert_eq!(check_content_type(&h).unwrap_err().status(), 415);
        h.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
        assert_eq!(check_content_type(&h).unwrap_err().status(), 415);
        h.insert(
            header::CONTENT_TYPE,
            "Application/JSON; charset=utf-8".parse().unwrap(),
        );
        assert!(check_content_type(&h).is_ok());
    }
}
