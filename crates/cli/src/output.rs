//! Where output goes. Commands write their report to the `out` they are given (stdout in the
//! binary) with `writeln!(out, ...)?`, so a write error (a closed pipe) becomes a
//! `CliError::Output` instead of the panic of `println!`.
//! Notices and progress go to stderr through [`note`], which never fails.

use std::fmt::Display;
use std::io::{self, Write};

/// The stream a command writes its report to.
pub type Out<'a> = &'a mut dyn Write;

/// A line on stderr; a write error there is ignored (there is nowhere left to report it).
pub fn note(message: impl Display) {
    let mut err = io::stderr().lock();
    let _ = writeln!(err, "{message}");
    let _ = err.flush();
}

/// Writes `text` as it is (a table that ends with its own newline).
pub fn text(out: Out<'_>, text: &str) -> io::Result<()> {
    out.write_all(text.as_bytes())
}

/// Writes `value` as one line of JSON.
pub fn json_line(out: Out<'_>, value: &serde_json::Value) -> io::Result<()> {
    writeln!(out, "{value}")
}

/// Writes `value` as indented JSON.
pub fn json_pretty(out: Out<'_>, value: &serde_json::Value) -> io::Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(io::Error::other)?;
    writeln!(out, "{text}")
}
