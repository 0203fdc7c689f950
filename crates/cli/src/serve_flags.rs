//! The flags of `kvvm serve` that make it fit for a shared network (timeouts, caps, API keys,
//! limits, the log format), turned into the server's settings (see `docs/serve.md`).

use std::time::Duration;

use clap::Args;
use kvvm_server::{ApiKeys, HttpConfig, Limits, LogFormat, DEFAULT_BODY_LIMIT};

/// `N`, or `N` followed by KiB, MiB, GiB or TiB (or K, M, G, T).
pub(crate) fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count (e.g. 8589934592 or 8GiB)"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        other => return Err(format!("unknown unit {other:?} (use KiB, MiB, GiB or TiB)")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{s:?} does not fit in 64 bits"))
}

/// Seconds (`10`, `10s`), milliseconds (`500ms`) or minutes (`2m`).
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (e.g. 10s, 500ms, 2m)"))?;
    match unit.trim() {
        "" | "s" => Ok(Duration::from_secs(n)),
        "ms" => Ok(Duration::from_millis(n)),
        "m" => n
            .checked_mul(60)
            .map(Duration::from_secs)
            .ok_or_else(|| format!("{s:?} is too long")),
        other => Err(format!("unknown unit {other:?} (use ms, s or m)")),
    }
}

/// Timeouts, caps, keys and limits of `kvvm serve`.
#[derive(Debug, Args)]
pub struct ServeFlags {
    /// Largest request body accepted, in bytes (larger: 413, from Content-Length before
    /// anything is read).
    #[arg(long, value_parser = parse_bytes, default_value_t = DEFAULT_BODY_LIMIT as u64)]
    body_limit_bytes: u64,
    /// A request head must be complete this long after the server starts waiting for it.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    header_timeout: Duration,
    /// A request body must arrive whole within this long (else 408).
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    body_timeout: Duration,
    /// An idle keep-alive connection is closed after this long.
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    keep_alive_timeout: Duration,
    /// On SIGTERM: how long requests in flight may finish before their connections close.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    shutdown_timeout: Duration,
    /// Release a sequence nobody used for this long (0: never).
    #[arg(long, value_parser = parse_duration, default_value = "10m")]
    idle_timeout: Duration,
    /// Most connections open at once (lowered to fit the open-file limit); past it: 503.
    #[arg(long, default_value_t = 4096)]
    max_connections: usize,
    /// Most requests handled at once; past it a request is shed with 503 + Retry-After.
    #[arg(long, default_value_t = 64)]
    max_in_flight: usize,
    /// Most live sequences in total.
    #[arg(long, default_value_t = Limits::default().max_sequences)]
    max_sequences: u64,
    /// Most address space reserved by live sequences in total (bytes, units accepted).
    #[arg(long, value_parser = parse_bytes, default_value_t = Limits::default().max_reserved_bytes)]
    max_reserved_bytes: u64,
    /// Most live sequences per API key (without keys: of all clients together).
    #[arg(long)]
    max_sequences_per_key: Option<u64>,
    /// Most address space reserved per API key.
    #[arg(long, value_parser = parse_bytes)]
    max_reserved_bytes_per_key: Option<u64>,
    /// Most bytes committed per API key.
    #[arg(long, value_parser = parse_bytes)]
    max_committed_bytes_per_key: Option<u64>,
    /// An API key (`KEY` or `NAME:KEY`, at least 16 characters); repeatable. Also read: the
    /// comma-separated KVVM_API_KEYS environment variable.
    #[arg(long = "api-key", value_name = "KEY")]
    api_keys: Vec<String>,
    /// A file of API keys, one `KEY` or `NAME:KEY` a line (`#` comments).
    #[arg(long, value_name = "PATH")]
    api_keys_file: Option<std::path::PathBuf>,
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
            keys.add(k).map_err(|e| e.to_string())?;
        }
        if let Some(path) = &self.api_keys_file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            keys.add_lines(&text).map_err(|e| e.to_string())?;
        }
        if let Ok(list) = std::env::var("KVVM_API_KEYS") {
            keys.add_list(&list).map_err(|e| e.to_string())?;
        }
        let log = match self.log_format.as_str() {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => return Err(format!("--log-format {other:?}: use text or json")),
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
    use super::{parse_bytes, parse_duration};
    use std::time::Duration;

    #[test]
    fn byte_counts_with_units() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("8GiB"), Ok(8 << 30));
        assert_eq!(parse_bytes("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("2k"), Ok(2048));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("1XB").is_err());
        assert!(parse_bytes("99999999TiB").is_err());
    }

    #[test]
    fn durations_with_units() {
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("3h").is_err());
    }
}
