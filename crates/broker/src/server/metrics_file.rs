//! The metrics file: the broker's [`BrokerMetrics`](crate::BrokerMetrics) in Prometheus' text
//! format, rewritten every interval (and once more when the broker stops) for
//! node_exporter's textfile collector. Each write goes to `<path>.tmp` first and is renamed
//! over the file, so that a reader never sees half of one.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::{lock, Shared};

/// The thread that writes the file, and how to stop it.
pub(super) struct MetricsWriter {
    stop: Sender<()>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsWriter {
    /// Writes the file now, then every `interval` until [`stop`](Self::stop).
    pub(super) fn start(
        shared: &Arc<Shared>,
        path: PathBuf,
        interval: Duration,
    ) -> io::Result<Self> {
        write(shared, &path)?;
        let (stop, stopped) = mpsc::channel::<()>();
        let s = Arc::clone(shared);
        let thread = std::thread::Builder::new()
            .name("kvvm-broker-metrics".into())
            .spawn(move || loop {
                let last = !matches!(
                    stopped.recv_timeout(interval),
                    Err(RecvTimeoutError::Timeout)
                );
                if let Err(e) = write(&s, &path) {
                    tracing::warn!(error = %e, path = %path.display(), "metrics file not written");
                }
                if last {
                    break;
                }
            })?;
        Ok(MetricsWriter {
            stop,
            thread: Some(thread),
        })
    }

    /// Writes the file a last time and joins the thread.
    pub(super) fn stop(&mut self) {
        let _ = self.stop.send(());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn write(shared: &Shared, path: &Path) -> io::Result<()> {
    let text = lock(&shared.books).metrics().to_prometheus();
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}
