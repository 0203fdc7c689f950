//! Argument types for counts and sizes: a negative or too large Python int is an
//! `InvalidArgumentError` that names the argument's limit, not an `OverflowError`.

use pyo3::prelude::*;
use pyo3::types::PyInt;
use pyo3::Borrowed;

use crate::errors;

/// A non-negative count or size that fits `u64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Count(pub(crate) u64);

/// A non-negative dimension that fits `u32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Dim(pub(crate) u32);

fn refuse(obj: Borrowed<'_, '_, PyAny>, max: &str) -> PyErr {
    let py = obj.py();
    let shown = obj
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "the value".to_owned());
    errors::invalid(
        py,
        format!("{shown} is not a count or size: expected an int in 0..={max}"),
    )
}

/// `obj` as an unsigned int of type `T`, whose largest value is `max`: an int out of range is
/// refused naming `max`; what is not an int keeps pyo3's own error.
fn bounded<'a, 'py, T>(obj: Borrowed<'a, 'py, PyAny>, max: T) -> PyResult<T>
where
    T: FromPyObject<'a, 'py, Error = PyErr> + std::fmt::Display,
{
    match obj.extract::<T>() {
        Ok(v) => Ok(v),
        Err(e) if obj.is_instance_of::<PyInt>() => {
            drop(e);
            Err(refuse(obj, &max.to_string()))
        }
        Err(e) => Err(e),
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for Count {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        bounded(obj, u64::MAX).map(Count)
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for Dim {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        bounded(obj, u32::MAX).map(Dim)
    }
}

/// Token ids: a sequence of ints, each in `0..=u32::MAX`. Another int (a negative one, one
/// too large) is an `InvalidArgumentError` naming its index and the range, not an
/// `OverflowError`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TokenIds(pub(crate) Vec<u32>);

impl<'a, 'py> FromPyObject<'a, 'py> for TokenIds {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.extract::<Vec<u32>>() {
            Ok(v) => Ok(TokenIds(v)),
            Err(e) => {
                if let Ok(items) = obj.try_iter() {
                    for (i, item) in items.enumerate() {
                        let Ok(item) = item else { break };
                        if item.is_instance_of::<PyInt>() && item.extract::<u32>().is_err() {
                            let shown = item
                                .repr()
                                .map(|r| r.to_string())
                                .unwrap_or_else(|_| "the value".to_owned());
                            return Err(errors::invalid(
                                obj.py(),
                                format!(
                                    "token_ids[{i}] = {shown} is not a token id: expected an int \
                                     in 0..={}",
                                    u32::MAX
                                ),
                            ));
                        }
                    }
                }
                Err(e)
            }
        }
    }
}
