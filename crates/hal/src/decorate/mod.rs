//! Decorators: backends that wrap any other backend and add one concern, so that tests written
//! once over `dyn VirtualMemoryBackend` can do on every backend what only the simulator could:
//!
//! * [`FaultInjecting`] fails chosen calls (the Nth call among chosen operations, counted from
//!   when it was armed) with a chosen [`ErrorKind`](crate::ErrorKind), without calling the
//!   backend underneath: a driver call is all-or-nothing. It also counts calls, so a test can
//!   first learn how many driver steps an operation takes and then fail each of them (and
//!   each pair of them).
//! * [`Recording`] keeps its own books of every address range, physical handle and mapping
//!   created and destroyed through it, with the drivers' semantics (a handle released while
//!   mapped lives until its last unmap), and notes every call the driver would refuse or that
//!   would leak or free twice. Its [`Record`] is what "nothing leaked" is checked against on
//!   CUDA and HIP, where there is no simulator's ledger.
//!
//!
//! Both are written over [`Forward`], the one forwarding base: a decorator names the backend
//! underneath and writes only the calls it changes.
//!
//! Stack them as `Recording(FaultInjecting(backend))`: the record then sees an injected
//! failure as the failure it is, and books nothing for it.

use crate::sync::lock;
mod faults;
mod forward;
mod record;

pub use faults::{CallHook, FaultInjecting, InjectedFault};
pub use forward::Forward;
pub use record::{Record, RecordedHandle, RecordedMapping, Recording};
