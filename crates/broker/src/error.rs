//! [`BrokerError`]: what can go wrong starting, running or talking to a broker.

use std::io;
use std::path::{Path, PathBuf};

/// A broker or client error.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// The configuration cannot be served (floors over the budget, ...).
    #[error("invalid broker configuration: {0}")]
    Config(String),
    /// A socket operation failed.
    #[error("broker socket: {0}")]
    Io(#[from] io::Error),
    /// A file the broker needs (its socket, its books file, its metrics file) cannot be made,
    /// read or used; the message names it.
    #[error("{what} {}: {source}", path.display())]
    Path {
        /// Which file, in words ("the socket").
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// What went wrong.
        source: io::Error,
    },
    /// The broker refused the client (unknown tenant, wrong token, too many clients, ...).
    #[error("the broker refused: {0}")]
    Refused(String),
    /// The peer sent something outside the protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The broker is not reachable now (stopped, restarting); what is held is kept.
    #[error("the broker is not reachable")]
    Disconnected,
}

impl BrokerError {
    /// A [`BrokerError::Path`]: `what` at `path` failed with `source`.
    pub fn path(what: &'static str, path: &Path, source: io::Error) -> Self {
        BrokerError::Path {
            what,
            path: path.to_owned(),
            source,
        }
    }
}
