//! Progress of a long command, on stderr only (stdout stays the report).
//!
//! On a terminal: an indicatif bar (a spinner when the amount of work is unknown), cleared
//! when the command ends. Elsewhere (CI logs, a file): one line every
//! `KVVM_PROGRESS_INTERVAL_S` seconds (default 10; `0` turns them off), so a long run off a
//! terminal is never silent and a short one prints nothing:
//!
//! ```text
//! kvvm simulate: 41% (policy 4/9 kvvm-head-major, 1200/20000 requests), 40 s elapsed
//! ```

use kvvm::hal::sync::Unpoison;
use std::io::IsTerminal;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// The environment variable that sets the interval of the off-terminal lines, in seconds.
pub const INTERVAL_ENV: &str = "KVVM_PROGRESS_INTERVAL_S";

const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct State {
    done: u64,
    total: Option<u64>,
    message: String,
    finished: bool,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere cannot leave the counters in a state worth refusing to print.
        self.state.lock().unpoisoned()
    }
}

/// Progress of one command; dropping it clears the bar and stops the periodic lines.
#[derive(Debug)]
pub struct Progress {
    shared: Arc<Shared>,
    bar: Option<ProgressBar>,
    ticker: Option<JoinHandle<()>>,
}

fn interval() -> Option<Duration> {
    match std::env::var(INTERVAL_ENV) {
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s > 0.0 && s.is_finite() => Some(Duration::from_secs_f64(s)),
            Ok(_) => None,
            Err(_) => Some(DEFAULT_INTERVAL),
        },
        Err(_) => Some(DEFAULT_INTERVAL),
    }
}

fn line(label: &str, state: &State, elapsed: Duration) -> String {
    let amount = match state.total {
        Some(total) if total > 0 => format!(
            "{}% ",
            (state.done.min(total) as u128 * 100 / u128::from(total))
        ),
        _ => String::new(),
    };
    let message = if state.message.is_empty() {
        String::new()
    } else {
        format!("({}), ", state.message)
    };
    format!(
        "kvvm {label}: {amount}{message}{} s elapsed",
        elapsed.as_secs()
    )
}

fn bar_style() -> ProgressStyle {
    ProgressStyle::with_template("kvvm {prefix} [{bar:30}] {percent:>3}% {msg} ({elapsed})")
        .map(|s| s.progress_chars("#>."))
        .unwrap_or_else(|_| ProgressStyle::default_bar())
}

fn bar_for(label: &str, total: Option<u64>) -> ProgressBar {
    let bar = match total {
        Some(n) => {
            let b = ProgressBar::with_draw_target(Some(n), ProgressDrawTarget::stderr());
            b.set_style(bar_style());
            b
        }
        None => {
            let b = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template("kvvm {prefix} {spinner} {msg} ({elapsed})")
                .unwrap_or_else(|_| ProgressStyle::default_spinner());
            b.set_style(style);
            b.enable_steady_tick(Duration::from_millis(120));
            b
        }
    };
    bar.set_prefix(label.to_owned());
    bar
}

impl Progress {
    /// Starts the progress of `label` (the command's name) over `total` units of work
    /// (`None`: unknown, a spinner).
    pub fn start(label: &str, total: Option<u64>) -> Progress {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                done: 0,
                total,
                message: String::new(),
                finished: false,
            }),
            wake: Condvar::new(),
        });
        if std::io::stderr().is_terminal() {
            return Progress {
                shared,
                bar: Some(bar_for(label, total)),
                ticker: None,
            };
        }
        let ticker = interval().and_then(|every| {
            let shared = Arc::clone(&shared);
            let label = label.to_owned();
            let start = Instant::now();
            std::thread::Builder::new()
                .name("kvvm-progress".into())
                .spawn(move || loop {
                    let state = shared.lock();
                    let (state, _) = shared
                        .wake
                        .wait_timeout_while(state, every, |s| !s.finished)
                        .unpoisoned();
                    if state.finished {
                        return;
                    }
                    crate::output::note(line(&label, &state, start.elapsed()));
                })
                .ok()
        });
        Progress {
            shared,
            bar: None,
            ticker,
        }
    }

    /// Sets the work done (out of `total`, which may change) and what is being done.
    pub fn update(&self, done: u64, total: Option<u64>, message: impl Into<String>) {
        let message = message.into();
        if let Some(bar) = &self.bar {
            if let Some(t) = total {
                // A spinner becomes a bar once the amount of work is known.
                if bar.length().is_none() {
                    bar.set_style(bar_style());
                }
                bar.set_length(t);
            }
            bar.set_position(done);
            bar.set_message(message.clone());
        }
        let mut s = self.shared.lock();
        s.done = done;
        if total.is_some() {
            s.total = total;
        }
        s.message = message;
    }

    /// Changes only the message (a phase of work of unknown length).
    pub fn message(&self, message: impl Into<String>) {
        let message = message.into();
        if let Some(bar) = &self.bar {
            bar.set_message(message.clone());
        }
        self.shared.lock().message = message;
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        self.shared.lock().finished = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_periodic_line_says_how_far_and_how_long() {
        let state = State {
            done: 41,
            total: Some(100),
            message: "policy 4/9 kvvm-head-major".into(),
            finished: false,
        };
        assert_eq!(
            line("simulate", &state, Duration::from_secs(40)),
            "kvvm simulate: 41% (policy 4/9 kvvm-head-major), 40 s elapsed"
        );
        let unknown = State {
            done: 0,
            total: None,
            message: String::new(),
            finished: false,
        };
        assert_eq!(
            line("bench kv", &unknown, Duration::from_secs(3)),
            "kvvm bench kv: 3 s elapsed"
        );
    }
}
