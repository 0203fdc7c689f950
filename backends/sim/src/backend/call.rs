//! How one call of the simulated driver runs: the fault check, the state's lock, one tracing
//! span, and the latency the model charges for what the call covered ([`Covered`]).

use std::time::Instant;

use kvvm_hal::{traced, BackendError, BackendResult, Operation};

use super::SimBackend;
use crate::config::LatencyMode;
use crate::error::injected;
use crate::state::State;

impl SimBackend {
    /// Runs `f` on the locked state inside one tracing span (the driver call), accounts its
    /// latency for what `f` says the call covered ([`Covered`]), and spins for it if
    /// configured. A failed call is charged as one that covered nothing.
    pub(super) fn call<T>(
        &self,
        op: Operation,
        f: impl FnOnce(&mut State) -> Result<(T, Covered), BackendError>,
    ) -> BackendResult<T> {
        traced(tracing::debug_span!("kvvm_sim", op = op.as_str()), || {
            self.call_untraced(op, f)
        })
    }

    fn call_untraced<T>(
        &self,
        op: Operation,
        f: impl FnOnce(&mut State) -> Result<(T, Covered), BackendError>,
    ) -> BackendResult<T> {
        let (result, cost) = {
            let mut s = self.lock();
            let fault = s.count_and_check(op);
            let (result, covered) = match fault {
                Some(kind) => (Err(injected(op, kind)), Covered::NOTHING),
                None => match f(&mut s) {
                    Ok((v, covered)) => (Ok(v), covered),
                    Err(e) => (Err(e), Covered::NOTHING),
                },
            };
            let cost = self
                .config
                .latency
                .cost(op, covered.bytes, covered.mappings);
            s.add_driver_time(cost);
            (result, cost)
        };
        if self.config.latency_mode == LatencyMode::Spin && !cost.is_zero() {
            let start = Instant::now();
            while start.elapsed() < cost {
                std::hint::spin_loop();
            }
        }
        result
    }
}

/// What one call covered, as the latency model charges it ([`LatencyModel::cost`]): the
/// handle's bytes for create and release, the mappings and their bytes for map, set access
/// (the fresh mappings only) and unmap, the bytes of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Covered {
    bytes: u64,
    mappings: u64,
}

impl Covered {
    pub(super) const NOTHING: Covered = Covered {
        bytes: 0,
        mappings: 0,
    };

    pub(super) fn bytes(bytes: u64) -> Self {
        Covered { bytes, mappings: 0 }
    }

    pub(super) fn mappings((mappings, bytes): (u64, u64)) -> Self {
        Covered { bytes, mappings }
    }
}
