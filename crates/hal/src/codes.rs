//! [`ErrorCodes`]: a vendor's error codes as one table of `(code, name, kind)` rows, read for
//! both the name and the [`ErrorKind`] of a code, so that the two never disagree.

use std::fmt::Display;

use crate::{BackendError, ErrorKind, Operation};

/// A vendor's error codes: `(code, name, kind)` rows, at most one per code.
#[derive(Debug, Clone, Copy)]
pub struct ErrorCodes<C: 'static> {
    rows: &'static [(C, &'static str, ErrorKind)],
}

impl<C: Copy + PartialEq> ErrorCodes<C> {
    /// The table of `rows`.
    pub const fn new(rows: &'static [(C, &'static str, ErrorKind)]) -> Self {
        ErrorCodes { rows }
    }

    /// Every row, in the table's order.
    pub fn rows(&self) -> &'static [(C, &'static str, ErrorKind)] {
        self.rows
    }

    fn row(&self, code: C) -> Option<&'static (C, &'static str, ErrorKind)> {
        self.rows.iter().find(|(c, _, _)| *c == code)
    }

    /// The name of `code`, or `None` if the table does not know it.
    pub fn name(&self, code: C) -> Option<&'static str> {
        self.row(code).map(|(_, name, _)| *name)
    }

    /// The kind `code` maps onto; [`ErrorKind::Other`] for a code the table does not know.
    pub fn kind(&self, code: C) -> ErrorKind {
        self.row(code)
            .map_or(ErrorKind::Other, |(_, _, kind)| *kind)
    }
}

impl<C: Copy + PartialEq + Display + Into<i64>> ErrorCodes<C> {
    /// A [`BackendError`] for `op` carrying `code`, its name (`"{unnamed} {code}"` for a code
    /// the table does not know) and its kind.
    pub fn error(&self, op: Operation, code: C, unnamed: &str) -> BackendError {
        let name = match self.name(code) {
            Some(name) => name.to_owned(),
            None => format!("{unnamed} {code}"),
        };
        BackendError::new(op, self.kind(code), code.into(), name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CODES: ErrorCodes<u32> = ErrorCodes::new(&[
        (1, "E_ONE", ErrorKind::InvalidValue),
        (2, "E_TWO", ErrorKind::OutOfMemory),
    ]);

    #[test]
    fn one_row_names_and_classifies_a_code() {
        assert_eq!(CODES.name(2), Some("E_TWO"));
        assert_eq!(CODES.kind(2), ErrorKind::OutOfMemory);
        assert_eq!(CODES.name(3), None);
        assert_eq!(CODES.kind(3), ErrorKind::Other);
        assert_eq!(CODES.rows().len(), 2);
    }

    #[test]
    fn errors_carry_the_name_or_the_fallback() {
        let e = CODES.error(Operation::Map, 1, "code");
        assert_eq!(
            (e.kind, e.code, e.code_name.as_str()),
            (ErrorKind::InvalidValue, 1, "E_ONE")
        );
        let e = CODES.error(Operation::Map, 7, "code");
        assert_eq!(
            (e.kind, e.code, e.code_name.as_str()),
            (ErrorKind::Other, 7, "code 7")
        );
    }
}
