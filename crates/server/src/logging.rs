//! The log: tracing to stderr through `tracing-subscriber`, filtered by `KVVM_LOG` (or
//! `RUST_LOG`; default `info`: the access log, accept errors, shutdown), as text or JSON
//! lines.
//!
//! A log line that cannot be written (stderr a closed pipe, a full disk, `/dev/full`) is
//! dropped and counted ([`log_write_errors`], `kvvm_log_write_errors_total` in `/metrics`):
//! never reported on stderr, there is nowhere else to report it. tracing-subscriber's own
//! report of a failed write is an `eprintln!`, which panics when stderr cannot be written, in
//! whatever task logged: a request's, or the shutdown's. The writer here never fails, so that
//! report never runs.

use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};

use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line (with the request's span fields).
    Json,
}

/// Log lines that could not be written, since the process started.
static WRITE_ERRORS: AtomicU64 = AtomicU64::new(0);

/// Log lines dropped because stderr could not be written, since the process started.
pub fn log_write_errors() -> u64 {
    WRITE_ERRORS.load(Ordering::Relaxed)
}

/// Appends `kvvm_log_write_errors_total` to a Prometheus text.
pub(crate) fn render(out: &mut String) {
    use std::fmt::Write as _;
    // Writing to a String cannot fail.
    let _ = writeln!(
        out,
        "# HELP kvvm_log_write_errors_total Log lines dropped because stderr could not be written.\n# TYPE kvvm_log_write_errors_total counter\nkvvm_log_write_errors_total {}",
        log_write_errors()
    );
}

/// The log's writer: stderr, one event per write; a failed write is counted and dropped.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Stderr;

impl<'a> MakeWriter<'a> for Stderr {
    type Writer = Stderr;

    fn make_writer(&'a self) -> Self::Writer {
        Stderr
    }
}

impl Write for Stderr {
    /// Writes all of `buf` (one formatted event) or counts it as dropped; never an error.
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if io::stderr().lock().write_all(buf).is_err() {
            WRITE_ERRORS.fetch_add(1, Ordering::Relaxed);
        }
        Ok(buf.len())
    }

    /// Stderr is unbuffered: nothing to flush.
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Installs the global subscriber (once; a second call, or one after another subscriber was
/// installed, changes nothing).
pub fn init_logging(format: LogFormat) {
    let filter = std::env::var("KVVM_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .ok()
        .and_then(|f| EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(Stderr)
        .log_internal_errors(false);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().with_current_span(true).try_init(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_writer_never_fails() {
        let mut w = Stderr.make_writer();
        assert_eq!(w.write(b"").ok(), Some(0));
        assert!(w.write_all(b"").is_ok());
        assert!(w.flush().is_ok());
        let mut text = String::new();
        render(&mut text);
        assert!(text.contains("# TYPE kvvm_log_write_errors_total counter\n"));
        assert!(text.ends_with(&format!(
            "kvvm_log_write_errors_total {}\n",
            log_write_errors()
        )));
    }
}
