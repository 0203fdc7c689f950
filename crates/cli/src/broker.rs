//! `kvvm broker`: the node's memory broker (see `docs/broker.md`). Runs until SIGTERM or
//! SIGINT, then tells every client and exits 0.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use kvvm::broker::{signal, Broker, BrokerConfig, TenantPolicy};

use crate::error::{failed, CliResult};
use crate::flags;
use crate::output::Out;

/// Arguments of `kvvm broker`.
#[derive(Debug, Args)]
pub struct BrokerArgs {
    /// The Unix socket to listen on (its mode decides who may connect).
    #[arg(long)]
    socket: PathBuf,
    /// The node's KV budget on every device (8GiB, 512MiB or bytes).
    #[arg(long, value_parser = flags::size_in(1, u64::MAX))]
    budget_bytes: u64,
    /// A named tenant: NAME, NAME:FLOOR or NAME:FLOOR:CEILING (sizes); repeatable.
    #[arg(long = "tenant", value_parser = parse_tenant)]
    tenants: Vec<(String, TenantPolicy)>,
    /// A tenant's token, read from an environment variable (never from the command line):
    /// NAME=VARIABLE; repeatable.
    #[arg(long = "token-env")]
    tokens: Vec<String>,
    /// The users whose processes may be a tenant, checked against the peer's credentials
    /// (`SO_PEERCRED`): NAME=UID[,UID...]; repeatable (default: any user who may open the
    /// socket).
    #[arg(long = "tenant-users", value_parser = parse_users)]
    users: Vec<(String, Vec<u32>)>,
    /// Refuse tenants not named with --tenant.
    #[arg(long)]
    named_only: bool,
    /// The socket's file mode, in octal (permission bits: 0 to 777).
    #[arg(long, default_value = "600", value_parser = parse_mode)]
    mode: u32,
    /// The most connections served at once.
    #[arg(long, default_value_t = 64, value_parser = flags::int_in::<usize>(1, 4096))]
    max_clients: usize,
    /// The most connections of one user (uid) at once.
    #[arg(long, default_value_t = 32, value_parser = flags::int_in::<usize>(1, 4096))]
    max_clients_per_user: usize,
    /// How long a new connection has to say hello, in milliseconds.
    #[arg(long, default_value_t = 5000, value_parser = flags::int_in::<u64>(1, 3_600_000))]
    hello_timeout_ms: u64,
    /// How long a client may stay silent before it is dropped, in milliseconds (clients
    /// ping at a quarter of it).
    #[arg(long, default_value_t = 60_000, value_parser = flags::int_in::<u64>(4, 86_400_000))]
    idle_timeout_ms: u64,
    /// The devices budgeted: indices 0 to N-1.
    #[arg(long, default_value_t = 64, value_parser = flags::int_in::<u32>(1, 65_536))]
    devices: u32,
    /// The most descriptors kept for published prefixes, over all tenants.
    #[arg(long, default_value_t = 4096, value_parser = flags::int_in::<usize>(1, 1 << 20))]
    max_prefix_descriptors: usize,
    /// Where what the broker lent is recorded for the broker started after it (default:
    /// the socket's path with `.books` added).
    #[arg(long)]
    books_file: Option<PathBuf>,
    /// After a restart, how long what the previous broker lent is kept for its clients'
    /// claims, in milliseconds.
    #[arg(long, default_value_t = 10_000, value_parser = flags::int_in::<u64>(0, 3_600_000))]
    restart_grace_ms: u64,
    /// Write the broker's metrics to this file in Prometheus' text format (for
    /// node_exporter's textfile collector), at start, every --metrics-interval-ms and at stop.
    #[arg(long)]
    metrics_file: Option<PathBuf>,
    /// How often the metrics file is rewritten, in milliseconds.
    #[arg(long, default_value_t = 5000, value_parser = flags::int_in::<u64>(1, 86_400_000))]
    metrics_interval_ms: u64,
    /// Messages per second a client may send in the long run (bursts of four times that).
    #[arg(long, default_value_t = 1000, value_parser = flags::int_in::<u32>(1, 1_000_000))]
    messages_per_second: u32,
}

fn parse_tenant(s: &str) -> Result<(String, TenantPolicy), String> {
    let mut parts = s.split(':');
    let name = parts.next().unwrap_or_default().to_owned();
    if !kvvm::broker::proto::valid_tenant(&name) {
        return Err(format!(
            "{name:?} is not a tenant name (letters, digits, - _ .)"
        ));
    }
    let size = flags::size_in(0, u64::MAX);
    let floor = parts.next().map(&size).transpose()?.unwrap_or(0);
    let ceiling = parts.next().map(&size).transpose()?;
    if parts.next().is_some() {
        return Err(format!("{s}: NAME[:FLOOR[:CEILING]]"));
    }
    let policy = TenantPolicy {
        floor,
        ceiling,
        ..TenantPolicy::default()
    };
    Ok((name, policy))
}

fn parse_mode(s: &str) -> Result<u32, String> {
    match u32::from_str_radix(s, 8) {
        Ok(m) if m <= 0o777 => Ok(m),
        Ok(_) => Err(format!(
            "{s} is not a file mode of permission bits (0 to 777, octal)"
        )),
        Err(e) => Err(format!("{s}: {e} (an octal mode, 0 to 777)")),
    }
}

fn parse_users(s: &str) -> Result<(String, Vec<u32>), String> {
    let (name, ids) = s
        .split_once('=')
        .ok_or_else(|| format!("{s}: NAME=UID[,UID...]"))?;
    let users = ids
        .split(',')
        .map(|id| {
            id.trim()
                .parse::<u32>()
                .map_err(|e| format!("{s}: user id {id:?}: {e}"))
        })
        .collect::<Result<Vec<u32>, String>>()?;
    Ok((name.to_owned(), users))
}

/// The named tenants, each once and each ceiling within the budget.
fn tenants(args: &BrokerArgs, mut config: BrokerConfig) -> CliResult<BrokerConfig> {
    for (name, policy) in &args.tenants {
        if config.tenants.contains_key(name) {
            return Err(failed(format!("--tenant {name} is given twice")));
        }
        if let Some(c) = policy.ceiling.filter(|c| *c > args.budget_bytes) {
            return Err(failed(format!(
                "--tenant {name}: its ceiling of {c} bytes is over --budget-bytes {}",
                args.budget_bytes
            )));
        }
        config = config.tenant(name.clone(), policy.clone());
    }
    if args.named_only && args.tenants.is_empty() {
        return Err(failed(
            "--named-only with no --tenant: no tenant could connect",
        ));
    }
    for t in &args.tokens {
        let (name, var) = t
            .split_once('=')
            .ok_or_else(|| failed(format!("--token-env {t}: NAME=VARIABLE")))?;
        let token = std::env::var(var).map_err(|e| failed(format!("--token-env {t}: {e}")))?;
        let policy = config
            .tenants
            .get_mut(name)
            .ok_or_else(|| failed(format!("--token-env {t}: no --tenant {name}")))?;
        policy.token = Some(token);
    }
    for (name, users) in &args.users {
        let policy = config
            .tenants
            .get_mut(name)
            .ok_or_else(|| failed(format!("--tenant-users {name}=...: no --tenant {name}")))?;
        policy.users = Some(users.clone());
    }
    Ok(config)
}

fn config(args: &BrokerArgs) -> CliResult<BrokerConfig> {
    let ms = std::time::Duration::from_millis;
    let mut config = tenants(args, BrokerConfig::new(&args.socket, args.budget_bytes))?;
    if args.named_only {
        config.default_tenant = None;
    }
    config.socket_mode = args.mode;
    config.max_clients = args.max_clients;
    config.max_clients_per_user = args.max_clients_per_user;
    config.hello_timeout = ms(args.hello_timeout_ms);
    config.idle_timeout = ms(args.idle_timeout_ms);
    config.devices = args.devices;
    config.max_prefix_descriptors = args.max_prefix_descriptors;
    config.books_file.clone_from(&args.books_file);
    config.restart_grace = ms(args.restart_grace_ms);
    config.metrics_file.clone_from(&args.metrics_file);
    config.metrics_interval = ms(args.metrics_interval_ms);
    config.messages_per_second = args.messages_per_second;
    config.burst = args.messages_per_second.saturating_mul(4);
    config.validate().map_err(failed)?;
    Ok(config)
}

/// Runs the broker until SIGTERM or SIGINT.
pub fn run(args: &BrokerArgs, out: Out<'_>) -> CliResult<ExitCode> {
    let config = config(args)?;
    // Before any thread starts, so every thread inherits the blocked signals.
    signal::block_termination_signals().map_err(failed)?;
    let mut broker = Broker::start(config).map_err(failed)?;
    writeln!(
        out,
        "kvvm broker: listening on {} ({} bytes per device)",
        args.socket.display(),
        args.budget_bytes
    )?;
    out.flush()?;
    let sig = signal::wait_for_termination().map_err(failed)?;
    broker.stop();
    writeln!(
        out,
        "kvvm broker: stopped by signal {sig}; every client was told"
    )?;
    Ok(ExitCode::SUCCESS)
}
