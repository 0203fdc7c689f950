//! [`FaultInjecting`]: a backend that fails chosen calls of the backend it wraps.

use std::sync::{Arc, Mutex};

use super::{lock, Forward};

use crate::{BackendError, BackendResult, ErrorKind, Operation, VirtualMemoryBackend};

/// Called with each operation before it is counted and, unless it fails, forwarded (a test
/// may block in it to hold a call in flight).
pub type CallHook = Arc<dyn Fn(Operation) + Send + Sync>;

/// A fault that fired: which counted call, of which operation, with which kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InjectedFault {
    /// The call's number among the counted calls since arming, from 1.
    pub call: u64,
    /// Its operation.
    pub op: Operation,
    /// The error kind it failed with.
    pub kind: ErrorKind,
}

#[derive(Default)]
struct Plan {
    /// Operations counted (and failable) while armed; empty when disarmed.
    ops: Vec<Operation>,
    /// Counted calls since arming.
    counted: u64,
    /// `(call, kind)`: the counted calls that fail (`None`: the operation's default kind).
    faults: Vec<(u64, Option<ErrorKind>)>,
    fired: Vec<InjectedFault>,
}

/// A backend that fails chosen calls of the one it wraps (see the module docs of
/// `decorate`). Calls of operations it does not count, and every call while disarmed, go
/// straight through.
pub struct FaultInjecting {
    inner: Arc<dyn VirtualMemoryBackend>,
    plan: Mutex<Plan>,
    hook: Mutex<Option<CallHook>>,
}

impl std::fmt::Debug for FaultInjecting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultInjecting")
            .field("inner", &self.inner.name())
            .field("counted", &self.counted())
            .finish()
    }
}

impl FaultInjecting {
    /// The operations a multi-step manager operation is made of: what [`arm`](Self::arm)
    /// usually counts.
    pub const STEPS: [Operation; 8] = Operation::VMM_CALLS;

    /// Wraps `inner`, disarmed.
    pub fn new(inner: Arc<dyn VirtualMemoryBackend>) -> Self {
        FaultInjecting {
            inner,
            plan: Mutex::new(Plan::default()),
            hook: Mutex::new(None),
        }
    }

    /// The backend underneath.
    pub fn inner(&self) -> &Arc<dyn VirtualMemoryBackend> {
        &self.inner
    }

    /// The error kind an injected failure of `op` has unless told otherwise: out of memory
    /// for what allocates (pinned host memory included), device lost for a synchronization,
    /// invalid value for the rest.
    pub fn default_kind(op: Operation) -> ErrorKind {
        match op {
            Operation::Create | Operation::Reserve | Operation::HostAlloc => ErrorKind::OutOfMemory,
            Operation::Synchronize => ErrorKind::DeviceLost,
            _ => ErrorKind::InvalidValue,
        }
    }

    /// Starts counting the calls of `ops` from 1 and fails the counted calls numbered in
    /// `fail_at`, each with its operation's [`default_kind`](Self::default_kind). An empty
    /// `fail_at` only counts. Replaces any earlier plan.
    pub fn arm(&self, ops: &[Operation], fail_at: &[u64]) {
        let faults = fail_at.iter().map(|&n| (n, None)).collect();
        self.arm_plan(ops, faults);
    }

    /// Like [`arm`](Self::arm), each failing call with its own kind.
    pub fn arm_with(&self, ops: &[Operation], fail_at: &[(u64, ErrorKind)]) {
        let faults = fail_at.iter().map(|&(n, k)| (n, Some(k))).collect();
        self.arm_plan(ops, faults);
    }

    fn arm_plan(&self, ops: &[Operation], faults: Vec<(u64, Option<ErrorKind>)>) {
        *lock(&self.plan) = Plan {
            ops: ops.to_vec(),
            counted: 0,
            faults,
            fired: Vec::new(),
        };
    }

    /// Stops counting and failing; returns the faults that fired.
    pub fn disarm(&self) -> Vec<InjectedFault> {
        let mut plan = lock(&self.plan);
        let fired = std::mem::take(&mut plan.fired);
        *plan = Plan::default();
        fired
    }

    /// Calls counted since arming.
    pub fn counted(&self) -> u64 {
        lock(&self.plan).counted
    }

    /// The faults that fired since arming.
    pub fn fired(&self) -> Vec<InjectedFault> {
        lock(&self.plan).fired.clone()
    }

    /// Installs (or removes) a hook called before every call.
    pub fn set_hook(&self, hook: Option<CallHook>) {
        *lock(&self.hook) = hook;
    }

    /// Counts a call of `op` and decides whether it fails.
    fn check(&self, op: Operation) -> BackendResult<()> {
        let hook = lock(&self.hook).clone();
        if let Some(h) = hook {
            h(op);
        }
        let mut plan = lock(&self.plan);
        if !plan.ops.contains(&op) {
            return Ok(());
        }
        plan.counted = plan.counted.saturating_add(1);
        let call = plan.counted;
        let Some(&(_, kind)) = plan.faults.iter().find(|(n, _)| *n == call) else {
            return Ok(());
        };
        let kind = kind.unwrap_or(FaultInjecting::default_kind(op));
        plan.fired.push(InjectedFault { call, op, kind });
        Err(BackendError::raised(
            op,
            kind,
            format!("injected fault at counted call {call}"),
        ))
    }
}

impl Forward for FaultInjecting {
    fn inner(&self) -> &dyn VirtualMemoryBackend {
        &*self.inner
    }

    fn before(&self, op: Operation) -> BackendResult<()> {
        self.check(op)
    }
}
