//! The log: tracing to stderr through `tracing-subscriber`, filtered by `KVVM_LOG` (or
//! `RUST_LOG`; default `info`: the access log, accept errors, shutdown), as text or JSON
//! lines.

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
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().with_current_span(true).try_init(),
    };
}
