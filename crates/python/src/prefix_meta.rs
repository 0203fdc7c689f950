//! A published prefix's `meta`: the KV layer's encoded `PrefixDescriptor` (where each handle
//! lies), then, after the word [`READER_MARK`], what its readers must agree with to read its
//! bytes (written and checked by the Python layer: the KV dtype, the geometry, an FP8 prefix's
//! scales). A meta without the mark (a publisher of before it) has no reader words.

use kvvm::broker::proto::{valid_meta, MAX_META};
use pyo3::prelude::*;

use crate::errors;

/// The word that ends the descriptor and starts the reader words.
pub(crate) const READER_MARK: &str = ";";

/// The meta of a prefix whose descriptor encodes as `descriptor`, with `reader` (none: the
/// descriptor alone). `InvalidArgumentError` when it would not ride with the prefix (more than
/// the broker's [`MAX_META`] bytes, or not printable ASCII): refused here, before the broker
/// sees it (it would close the connection).
pub(crate) fn compose(py: Python<'_>, descriptor: String, reader: &str) -> PyResult<String> {
    let meta = if reader.is_empty() {
        descriptor
    } else {
        format!("{descriptor} {READER_MARK} {reader}")
    };
    if !valid_meta(&meta) {
        return Err(errors::invalid(
            py,
            format!(
                "a prefix's meta is at most {MAX_META} bytes of printable ASCII on one line; this \
                 one is {} bytes",
                meta.len()
            ),
        ));
    }
    Ok(meta)
}

/// The descriptor's text and the reader words of `meta` (empty when it has none).
pub(crate) fn split(meta: &str) -> (&str, &str) {
    let mark = format!(" {READER_MARK} ");
    match meta.split_once(&mark) {
        Some((descriptor, reader)) => (descriptor, reader.trim()),
        None => (meta, ""),
    }
}
