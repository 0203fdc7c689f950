//! Counters and sizes handed to Python as a `dict` of name to int.

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// A dict of `items` (name, value), in their order.
pub(crate) fn counters<'py>(
    py: Python<'py>,
    items: &[(&str, u64)],
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (name, value) in items {
        d.set_item(name, value)?;
    }
    Ok(d)
}
