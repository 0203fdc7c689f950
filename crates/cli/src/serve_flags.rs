//! The flags of `kvvm serve` that make it fit for a shared network (timeouts, caps, API keys,
//! limits, the log format), turned into the server's settings (see `docs/serve.md`). Like
//! every flag of the CLI, each is checked against its range ([`crate::flags`]), never
//! clamped; sizes take the one size syntax, durations `500ms`, `10s`, `2m`, `1h`.

use std::time::Duration;

use clap::Args;
use kvvm_server::{ApiKeys, HttpConfig, Limits, LogFormat};

use crate::flags::{duration_in, int_in, size_in, MAX_DURATION};

/// The most connections, and requests in flight, a flag accepts.
const MAX_CONNECTIONS: u64 = 1_000_000;
/// The shortest timeout that still lets a request through.
const MIN_TIMEOUT: Duration = Duration::from_millis(1);

/// `--max-reserved-bytes`' default as `--help` shows it: `Limits::default()`'s, in units.
const MAX_RESERVED_DEFAULT: &str = "64TiB";
/// `--body-limit-bytes`' default as `--help` shows it: `kvvm_server::DEFAULT_BODY_LIMIT`, in units.
const BODY_LIMIT_DEFAULT: &str = "1MiB";

/// Timeouts, caps, keys and limits of `kvvm serve`.
#[derive(Debug, Args)]
pub struct ServeFlags {
    /// Largest request body accepted (a size, 1KiB to 1GiB; larger: 413, from Content-Length
    /// before anything is read).
    #[arg(long, value_parser = size_in(1 << 10, 1 << 30), default_value = BODY_LIMIT_DEFAULT)]
    body_limit_bytes: u64,
    /// A request head must be complete this long after the server starts waiting for it.
    #[arg(long, value_parser = duration_in(MIN_TIMEOUT, MAX_DURATION), default_value = "10s")]
    header_timeout: Duration,
    /// A request body must arrive whole within this long (else 408).
    #[arg(long, value_parser = duration_in(MIN_TIMEOUT, MAX_DURATION), default_value = "10s")]
    body_timeout: Duration,
    /// An idle keep-alive connection is closed after this long.
    #[arg(long, value_parser = duration_in(MIN_TIMEOUT, MAX_DURATION), default_value = "5s")]
    keep_alive_timeout: Duration,
    /// On SIGTERM: how long requests in flight may finish before their connections close
    /// (0: close them at once).
    #[arg(long, value_parser = duration_in(Duration::ZERO, MAX_DURATION), default_value = "10s")]
    shutdown_timeout: Duration,
    /// Release a sequence nobody used for this long (0: never).
    #[arg(long, value_parser = duration_in(Duration::ZERO, MAX_DURATION), default_value = "10m")]
    idle_timeout: Duration,
    /// Most connections open at once (lowered to fit the open-file limit); past it: 503.
    #[arg(long, default_value_t = 4096, value_parser = int_in::<usize>(1, MAX_CONNECTIONS))]
    max_connections: usize,
    /// Most requests handled at once; past it a request is shed with 503 + Retry-After.
    #[arg(long, default_value_t = 64, value_parser = int_in::<usize>(1, MAX_CONNECTIONS))]
    max_in_flight: usize,
    /// Most live sequences in total.
    #[arg(long, default_value_t = Limits::default().max_sequences, value_parser = int_in::<u64>(1, u64::MAX))]
    max_sequences: u64,
    /// Most address space reserved by live sequences in total (a size).
    #[arg(long, value_parser = size_in(1, u64::MAX), default_value = MAX_RESERVED_DEFAULT)]
    max_reserved_bytes: u64,
    /// Most live sequences per API key (without keys: of all clients together).
    #[arg(long, value_parser = int_in::<u64>(1, u64::MAX))]
    max_sequences_per_key: Option<u64>,
    /// Most address space reserved per API key (a size).
    #[arg(long, value_parser = size_in(1, u64::MAX))]
    max_reserved_bytes_per_key: Option<u64>,
    /// Most bytes committed per API key (a size).
    #[arg(long, value_parser = size_in(1, u64::MAX))]
    max_committed_bytes_per_key: Option<u64>,
    /// An API key (`KEY` or `NAME:KEY`, at least 16 characters); repeatable. Also read: the
    /// comma-separated KVVM_API_KEYS environment variable.
    #[arg(long = "api-key", value_name = "KEY")]
    api_keys: Vec<String>,
    /// A file of API keys, one `KEY` or `NAME:KEY` a line (`#` comments).
    #[arg(long, value_name = "PATH")]
    api_keys_file: Option<std::path::PathBuf>,
    /// An operator key (`KEY` or `NAME:KEY`): reads /metrics and all of /healthz, uses no
    /// sequence; repeatable. Also read: the comma-separated KVVM_OPERATOR_KEYS variable.
    #[arg(long = "operator-key", value_name = "KEY")]
    operator_keys: Vec<String>,
    /// With API keys: one prefix cache for every key (prompts of one key can hit another's).
    #[arg(long)]
    shared_prefix_cache: bool,
    /// Listen on a non-loopback address without API keys.
    #[arg(long)]
    allow_unauthenticated: bool,
    /// Log format on stderr: text or json (filter: KVVM_LOG or RUST_LOG, default info).
    #[arg(long, default_value = "text")]
    log_format: String,
}

/// What the flags set up.
pub struct Settings {
    pub http: HttpConfig,
    pub limits: Limits,
    pub idle_timeout: Option<Duration>,
    pub shared_prefix_cache: bool,
    pub log: LogFormat,
}

impl ServeFlags {
    /// The server's settings, keys read from the flags, the keys file and the environment.
    pub fn settings(&self) -> Result<Settings, String> {
        let mut keys = ApiKeys::none();
        for k in &self.api_keys {
            keys.add(k).map_err(|e| format!("--api-key: {e}"))?;
        }
        if let Some(path) = &self.api_keys_file {
            let file = path.display();
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("--api-keys-file {file}: cannot read it: {e}"))?;
            keys.add_lines(&text)
                .map_err(|e| format!("--api-keys-file {file}: {e}"))?;
        }
        if let Ok(list) = std::env::var("KVVM_API_KEYS") {
            keys.add_list(&list)
                .map_err(|e| format!("KVVM_API_KEYS: {e}"))?;
        }
        for k in &self.operator_keys {
            keys.add_operator(k)
                .map_err(|e| format!("--operator-key: {e}"))?;
        }
        if let Ok(list) = std::env::var("KVVM_OPERATOR_KEYS") {
            keys.add_operator_list(&list)
                .map_err(|e| format!("KVVM_OPERATOR_KEYS: {e}"))?;
        }
        let log = match self.log_format.as_str() {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => return Err(format!("--log-format {other:?}: allowed text or json")),
        };
        let body_limit = usize::try_from(self.body_limit_bytes)
            .map_err(|_| "--body-limit-bytes is too large".to_owned())?;
        Ok(Settings {
            http: HttpConfig {
                body_limit,
                header_timeout: self.header_timeout,
                body_timeout: self.body_timeout,
                keep_alive_timeout: self.keep_alive_timeout,
                max_connections: self.max_connections,
                max_in_flight: self.max_in_flight,
                shutdown_timeout: self.shutdown_timeout,
                api_keys: keys,
                allow_unauthenticated: self.allow_unauthenticated,
            },
            limits: Limits {
                max_sequences: self.max_sequences,
                max_reserved_bytes: self.max_reserved_bytes,
                max_sequences_per_key: self.max_sequences_per_key,
                max_reserved_bytes_per_key: self.max_reserved_bytes_per_key,
                max_committed_bytes_per_key: self.max_committed_bytes_per_key,
            },
            idle_timeout: (!self.idle_timeout.is_zero()).then_some(self.idle_timeout),
            shared_prefix_cache: self.shared_prefix_cache,
            log,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_shown_in_units_are_the_librarys() {
        assert_eq!(
            kvvm::num::parse_size(MAX_RESERVED_DEFAULT),
            Ok(Limits::default().max_reserved_bytes)
        );
        assert_eq!(
            kvvm::num::parse_size(BODY_LIMIT_DEFAULT),
            Ok(kvvm_server::DEFAULT_BODY_LIMIT as u64)
        );
    }
}
