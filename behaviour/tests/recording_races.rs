//! The recording decorator's books when a call that frees something races a call that takes
//! it again. A driver hands a released handle's value, a freed range or an unmapped range to
//! the next call at once (CUDA reuses handle values), so a create, reserve or map on another
//! thread can run right after the driver's release, free or unmap returned and before the
//! books heard of it. Each test stops the freeing thread inside the driver's call, right
//! after it returned, and makes the other call then: the books must not report the value as
//! still taken. (Before the books were held across the freeing call, each of these noted an
//! anomaly: "create returned ..., already live", "reserve returned ..., inside a live
//! range", "map at ...: already mapped".)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::thread;

use kvvm_hal::decorate::Recording;
use kvvm_hal::{AllocationProperties, BackendResult, DeviceId, Operation, VirtualMemoryBackend};
use reusing::Reusing;

const G: u64 = 64 << 10;

/// The driver stand-in. Its own module: with `Forward` and `VirtualMemoryBackend` both in
/// scope, a call such as `recording.create(..)` names two methods.
mod reusing {
    use std::collections::HashMap;
    use std::sync::mpsc::{channel, Receiver, Sender};
    use std::sync::Mutex;
    use std::time::Duration;

    use kvvm_hal::decorate::Forward;
    use kvvm_hal::{
        AllocationProperties, BackendResult, DeviceAddress, Operation, PhysicalHandle,
        VirtualMemoryBackend,
    };
    use kvvm_sim::{SimBackend, SimConfig};

    use super::G;

    /// How long a paused call waits for the other thread's call to return before it goes on
    /// (with the books held across the freeing call, the other call cannot return first: the
    /// pause then ends by this time-out, and the test passes either way).
    const PAUSE: Duration = Duration::from_millis(300);

    /// A pause after one driver call of `op`: the paused thread says it is inside, then waits
    /// for `go` (or [`PAUSE`]).
    struct Pause {
        op: Operation,
        inside: Sender<()>,
        go: Receiver<()>,
    }

    /// The simulator with handle values reused the way the driver reuses them (a released
    /// value is the next one created) and a pause after one chosen call.
    pub struct Reusing {
        sim: SimBackend,
        handles: Mutex<Handles>,
        pause: Mutex<Option<Pause>>,
    }

    /// Handle values given out, each standing for one of the simulator's handles.
    #[derive(Default)]
    struct Handles {
        real: HashMap<u64, PhysicalHandle>,
        free: Vec<u64>,
        next: u64,
    }

    impl Reusing {
        pub fn new() -> Self {
            Reusing {
                sim: SimBackend::new(SimConfig::single(G, 64 * G)),
                handles: Mutex::new(Handles {
                    next: 1,
                    ..Handles::default()
                }),
                pause: Mutex::new(None),
            }
        }

        /// Pauses the next call of `op` right after the simulator returned; the receiver hears
        /// when it is paused, the sender lets it go.
        pub fn pause_after(&self, op: Operation) -> (Receiver<()>, Sender<()>) {
            let (inside, inside_rx) = channel();
            let (go_tx, go) = channel();
            *self.pause.lock().unwrap() = Some(Pause { op, inside, go });
            (inside_rx, go_tx)
        }

        fn paused(&self, op: Operation) {
            let mut slot = self.pause.lock().unwrap();
            if slot.as_ref().is_some_and(|p| p.op == op) {
                let p = slot.take().unwrap();
                drop(slot);
                p.inside.send(()).unwrap();
                let _ = p.go.recv_timeout(PAUSE);
            }
        }

        fn real(&self, h: PhysicalHandle) -> PhysicalHandle {
            self.handles.lock().unwrap().real[&h.0]
        }
    }

    impl Forward for Reusing {
        fn inner(&self) -> &dyn VirtualMemoryBackend {
            &self.sim
        }

        fn create(&self, size: u64, p: &AllocationProperties) -> BackendResult<PhysicalHandle> {
            let real = self.sim.create(size, p)?;
            let mut h = self.handles.lock().unwrap();
            let value = match h.free.pop() {
                Some(v) => v,
                None => {
                    h.next += 1;
                    h.next
                }
            };
            h.real.insert(value, real);
            Ok(PhysicalHandle(value))
        }

        fn release(&self, handle: PhysicalHandle) -> BackendResult<()> {
            self.sim.release(self.real(handle))?;
            {
                let mut h = self.handles.lock().unwrap();
                h.real.remove(&handle.0);
                h.free.push(handle.0);
            }
            self.paused(Operation::Release);
            Ok(())
        }

        fn map(
            &self,
            address: DeviceAddress,
            size: u64,
            handle: PhysicalHandle,
        ) -> BackendResult<()> {
            self.sim.map(address, size, self.real(handle))
        }

        fn free(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
            self.sim.free(address, size)?;
            self.paused(Operation::Free);
            Ok(())
        }

        fn unmap(&self, address: DeviceAddress, size: u64) -> BackendResult<()> {
            self.sim.unmap(address, size)?;
            self.paused(Operation::Unmap);
            Ok(())
        }
    }
}

fn stack() -> (Arc<Recording>, Arc<Reusing>) {
    let reusing = Arc::new(Reusing::new());
    let recording = Arc::new(Recording::new(reusing.clone()));
    (recording, reusing)
}

/// Runs `freeing` on another thread, paused after the driver's `op`; runs `taking` while it
/// is paused, then lets it go; returns what `taking` returned.
fn race<T>(
    reusing: &Reusing,
    op: Operation,
    freeing: impl FnOnce() -> BackendResult<()> + Send + 'static,
    taking: impl FnOnce() -> T,
) -> T {
    let (inside, go) = reusing.pause_after(op);
    let t = thread::spawn(freeing);
    inside.recv().unwrap();
    let taken = taking();
    let _ = go.send(());
    t.join().unwrap().unwrap();
    taken
}

#[test]
fn a_handle_value_created_again_right_after_its_release_is_not_live_twice() {
    let (rec, reusing) = stack();
    let props = AllocationProperties::device(DeviceId(0));
    let h = rec.create(G, &props).unwrap();
    let releasing = rec.clone();
    let again = race(
        &reusing,
        Operation::Release,
        move || releasing.release(h),
        || rec.create(G, &props).unwrap(),
    );
    assert_eq!(again, h, "the driver handed the released value out again");
    assert_eq!(rec.take_anomalies(), Vec::<String>::new());
    rec.release(again).unwrap();
    let record = rec.record();
    assert!(record.handles.is_empty(), "{record:?}");
}

#[test]
fn a_range_reserved_again_right_after_its_free_is_not_inside_a_live_range() {
    let (rec, reusing) = stack();
    let a = rec.reserve(4 * G, G, None).unwrap();
    let freeing = rec.clone();
    let again = race(
        &reusing,
        Operation::Free,
        move || freeing.free(a, 4 * G),
        || rec.reserve(4 * G, G, None).unwrap(),
    );
    assert_eq!(again, a, "first fit gives the freed range again");
    assert_eq!(rec.take_anomalies(), Vec::<String>::new());
    rec.free(again, 4 * G).unwrap();
    assert!(rec.record().ranges.is_empty());
}

#[test]
fn a_range_mapped_again_right_after_its_unmap_is_not_already_mapped() {
    let (rec, reusing) = stack();
    let props = AllocationProperties::device(DeviceId(0));
    let a = rec.reserve(G, G, None).unwrap();
    let h = rec.create(G, &props).unwrap();
    rec.map(a, G, h).unwrap();
    let unmapping = rec.clone();
    race(
        &reusing,
        Operation::Unmap,
        move || unmapping.unmap(a, G),
        || rec.map(a, G, h).unwrap(),
    );
    assert_eq!(rec.take_anomalies(), Vec::<String>::new());
    assert_eq!(rec.record().mappings.len(), 1);
    rec.unmap(a, G).unwrap();
    rec.release(h).unwrap();
    rec.free(a, G).unwrap();
    assert_eq!(rec.take_anomalies(), Vec::<String>::new());
}
