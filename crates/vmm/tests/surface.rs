//! What the manager reports about itself and its errors: its accessors, the typed refusal for a
//! driver that ran out, which errors are retryable, and the reserve calls' argument checks.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::single_range_in_vec_init
)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{World, WorldConfig, D0};
use kvvm_governor::{Bucket, Governor, GovernorConfig, ManualClock, RetryPolicy};
use kvvm_hal::{BackendError, ErrorKind, Operation, VirtualMemoryBackend};
use kvvm_sim::{SimBackend, SimConfig};
use kvvm_vmm::{VirtualMemory, VmmConfig, VmmError, DEFAULT_MAX_HANDLE_BYTES};

const G: u64 = 64 << 10;

#[test]
fn the_manager_reports_its_device_backend_granule_and_handle_size() {
    let mut c = WorldConfig::new(G);
    c.max_handle_granules = 8;
    c.pool_granules = 2;
    let w = World::new(c);
    assert_eq!(w.vm.device(), D0);
    assert_eq!(w.vm.granule(), G);
    assert_eq!(w.vm.max_handle_windows(), 8);
    assert_eq!(w.vm.backend().name(), w.sim.name());
    assert!(w.vm.governor().same_books(&w.gov));
    assert_eq!(w.vm.capabilities(), w.sim.capabilities());
    let d = format!("{:?}", w.vm);
    assert!(
        d.contains("VirtualMemory") && d.contains("granule: 65536"),
        "{d}"
    );
    assert_eq!(DEFAULT_MAX_HANDLE_BYTES, 512 << 20);
    assert_eq!(
        VmmConfig::default().max_handle_bytes,
        DEFAULT_MAX_HANDLE_BYTES
    );
}

#[test]
fn a_manager_on_another_device_reports_it() {
    let sim = Arc::new(SimBackend::new(SimConfig::uniform(2, G, 64 * G)));
    let backend: Arc<dyn VirtualMemoryBackend> = sim;
    let d1 = kvvm_hal::DeviceId(1);
    let vm = VirtualMemory::with_defaults(backend, d1).unwrap();
    assert_eq!(vm.device(), d1);
    let mut r = vm.reserve(4 * G).unwrap();
    let g = vm.granule();
    r.commit(g).unwrap();
    assert_eq!(vm.governor().snapshot().device(d1).committed, g);
}

#[test]
fn backpressure_from_the_driver_is_the_tighter_of_the_free_bytes_and_the_estimate() {
    let clock = Arc::new(ManualClock::new());
    let sim = Arc::new(SimBackend::new(SimConfig::single(G, 16 * G)));
    let gov = Governor::new(
        GovernorConfig::default()
            .device_budget(D0, 10 * G)
            .clock(clock.clone()),
    );
    let backend: Arc<dyn VirtualMemoryBackend> = sim;
    let vm = VirtualMemory::new(
        backend,
        D0,
        gov.clone(),
        VmmConfig::default().pool_cap_bytes(0),
    )
    .unwrap();
    let mut r = vm.reserve(16 * G).unwrap();
    let g = vm.granule();
    r.commit(4 * g).unwrap();
    // The governor has 6 granules free, the device 12: 6 are available.
    let b = vm.backpressure(8 * g);
    assert_eq!((b.device, b.needed, b.available), (D0, 8 * g, 6 * g));
    assert_eq!(
        b.retry_after,
        RetryPolicy::default().cap,
        "nothing freed yet"
    );
    // Four granules given back to the driver in the window: 10 of 12 are available, and
    // 2 short at 4 granules a second is half a second.
    r.release().unwrap();
    let b = vm.backpressure(12 * g);
    assert_eq!(b.available, 10 * g);
    assert_eq!(b.retry_after, Duration::from_millis(500));
    drop(r);
    assert_eq!(gov.snapshot().device(D0).used(), 0);
}

#[test]
fn which_errors_are_retryable() {
    let w = World::simple(G, 0);
    let oom = VmmError::Backend(BackendError::new(
        Operation::Create,
        ErrorKind::OutOfMemory,
        2,
        "OOM",
    ));
    let other = VmmError::Backend(BackendError::new(
        Operation::Create,
        ErrorKind::Other,
        1,
        "X",
    ));
    assert!(oom.is_retryable());
    assert!(!other.is_retryable());
    assert!(VmmError::Busy { offset: 0 }.is_retryable());
    assert!(!VmmError::ZeroSize.is_retryable());
    assert_eq!(
        oom.backend_error().map(|e| e.kind),
        Some(ErrorKind::OutOfMemory)
    );
    assert!(VmmError::ZeroSize.backend_error().is_none());
    // A refusal of the governor keeps its kind.
    let gov = Governor::with_device_budget(G);
    let e: VmmError = gov.try_grant(D0, 2 * G).unwrap_err().into();
    assert!(matches!(e, VmmError::NeverFits(_)), "{e}");
    let _held = gov.try_grant(D0, G).unwrap();
    let e: VmmError = gov.try_grant(D0, G).unwrap_err().into();
    assert!(
        matches!(e, VmmError::Backpressure(_)) && e.is_retryable(),
        "{e}"
    );
    drop(w);
}

#[test]
fn reserving_nothing_is_refused_and_reserving_rounds_up_to_the_granule() {
    let w = World::simple(G, 0);
    assert_eq!(w.vm.reserve(0).unwrap_err(), VmmError::ZeroSize);
    assert_eq!(w.vm.reserve(G + 1).unwrap().size(), 2 * G);
    assert_eq!(w.vm.reserve_strided(0, G).unwrap_err(), VmmError::ZeroSize);
    assert_eq!(w.vm.reserve_strided(2, 0).unwrap_err(), VmmError::ZeroSize);
    let slots = w.vm.reserve_strided(3, G + 1).unwrap();
    assert_eq!(slots.len(), 3);
    assert_eq!(
        slots[1].address().0 - slots[0].address().0,
        2 * G,
        "the stride is rounded up"
    );
    assert!(slots
        .iter()
        .all(|s| s.is_strided_slot() && s.size() == 2 * G));
    assert!(!w.vm.reserve(G).unwrap().is_strided_slot());
    assert_eq!(w.sim.ledger().reservations.len(), 1, "one driver range");
}

#[test]
fn a_strided_range_is_freed_when_its_last_slot_is_gone() {
    let w = World::simple(G, 0);
    let mut slots = w.vm.reserve_strided(2, G).unwrap();
    slots[0].commit(G).unwrap();
    let last = slots.pop().unwrap();
    drop(slots);
    assert_eq!(
        w.sim.ledger().reservations.len(),
        1,
        "the last slot holds it"
    );
    assert_eq!(
        w.sim.ledger().mappings.len(),
        0,
        "the first slot's teardown unmapped"
    );
    drop(last);
    assert!(w.sim.ledger().reservations.is_empty());
    assert_eq!(w.gov.snapshot().device(D0).used(), 0);
}

#[test]
fn the_config_builders_set_what_they_name() {
    let c = VmmConfig::default()
        .pool_cap_bytes(3 * G)
        .park_released(true)
        .max_handle_bytes(4 * G)
        .granularity(kvvm_vmm::GranularityChoice::Minimum);
    assert_eq!(c.pool_cap_bytes, 3 * G);
    assert!(c.park_released);
    assert_eq!(c.max_handle_bytes, 4 * G);
    assert_eq!(c.granularity, kvvm_vmm::GranularityChoice::Minimum);
    let d = VmmConfig::default();
    assert!(!d.park_released);
    assert_eq!(d.granularity, kvvm_vmm::GranularityChoice::Recommended);
}

#[test]
fn the_quarantine_lists_its_entries_and_their_bytes() {
    let w = World::simple(G, 0);
    let mut r = w.vm.reserve(4 * G).unwrap();
    r.commit(2 * G).unwrap();
    w.sim.inject(kvvm_sim::FaultRule::failing_synchronize());
    drop(r);
    let q = w.vm.quarantine();
    assert_eq!(q.len(), 1);
    assert_eq!(q[0].bytes, 2 * G);
    assert_eq!(q[0].mappings.len(), 2);
    assert_eq!(w.vm.quarantined_bytes(), 2 * G);
    assert_eq!(w.gov.snapshot().device(D0).quarantined, 2 * G);
    // Quarantined bytes never leave the books.
    assert!(w.gov.free(D0, Bucket::Quarantined, 0).is_ok());
}

#[test]
fn a_shared_commit_names_the_first_window_it_cannot_take() {
    let w = World::simple(G, 0);
    // In flight at window 1, mapped at window 3: the busy window comes first.
    let mut r = w.vm.reserve(8 * G).unwrap();
    r.commit_range(3 * G, G).unwrap();
    let job = r.begin_commit_ranges(&[(G, G)]).unwrap().unwrap();
    assert_eq!(
        r.commit_shared(&[(0, 4 * G)]).unwrap_err(),
        VmmError::Busy { offset: G }
    );
    r.finish_commit(job).unwrap();
    // Mapped at window 1, in flight at window 3: the mapped window comes first.
    let mut s = w.vm.reserve(8 * G).unwrap();
    s.commit_range(G, G).unwrap();
    let job = s.begin_commit_ranges(&[(3 * G, G)]).unwrap().unwrap();
    assert_eq!(
        s.commit_shared(&[(0, 4 * G)]).unwrap_err(),
        VmmError::AlreadyMapped { offset: G }
    );
    s.finish_commit(job).unwrap();
    w.check(&[&r, &s]);
}

#[test]
fn a_shared_handle_is_never_mapped_past_the_sharers_end() {
    let w = World::multi(8, 0, false);
    let g = w.g;
    let mut owner = w.vm.reserve(8 * g).unwrap();
    let set = owner.commit_shared(&[(2 * g, 4 * g)]).unwrap();
    assert_eq!(w.shape(&owner), vec![(2, 4)], "one handle of four windows");
    // The sharer ends in the middle of the handle: refused before any driver call.
    let mut sharer = w.vm.reserve(4 * g).unwrap();
    let maps = w.sim.calls(Operation::Map);
    assert_eq!(
        sharer
            .map_shared_ranges(&set, &[0..4], kvvm_hal::Access::Read)
            .unwrap_err(),
        VmmError::OutOfBounds {
            offset: 4 * g,
            requested: g,
            reserved: 4 * g
        }
    );
    assert_eq!(w.sim.calls(Operation::Map), maps);
    assert!(sharer.mappings().is_empty());
}

#[test]
fn adjacent_shared_ranges_are_cut_at_each_range_start() {
    let w = World::multi(8, 0, false);
    let g = w.g;
    let mut r = w.vm.reserve(8 * g).unwrap();
    r.commit_shared(&[(0, 2 * g), (2 * g, 3 * g)]).unwrap();
    assert_eq!(w.shape(&r), vec![(0, 2), (2, 3)]);
}

#[test]
fn an_empty_shared_range_cuts_nothing() {
    let w = World::multi(8, 0, false);
    let g = w.g;
    let mut r = w.vm.reserve(8 * g).unwrap();
    r.commit_shared(&[(0, 6 * g), (3 * g, 0)]).unwrap();
    assert_eq!(w.shape(&r), vec![(0, 6)]);
}

#[test]
fn a_shared_set_reports_its_windows_handles_and_bytes() {
    let w = World::multi(8, 0, false);
    let g = w.g;
    let mut r = w.vm.reserve(8 * g).unwrap();
    let set = r.commit_shared(&[(0, 2 * g), (2 * g, 3 * g)]).unwrap();
    assert_eq!((set.len(), set.handle_count()), (5, 2));
    assert!(!set.is_empty());
    assert_eq!(set.bytes(), 5 * g);
    assert_eq!(w.gov.snapshot().device(D0).shared, 5 * g);
    // Handle boundaries: windows 0 and 2, and one past the last window.
    let starts: Vec<usize> = (0..7).filter(|&i| set.starts_handle(i)).collect();
    assert_eq!(starts, vec![0, 2, 5]);
    assert_eq!(set.window(3), Some((3 * g, set.pieces()[1].handle)));
    assert_eq!(set.window(5), None);
    assert_eq!(set.windows().len(), 5);
}

#[test]
fn a_shared_set_of_another_manager_is_refused() {
    let w = World::simple(G, 0);
    let backend: Arc<dyn VirtualMemoryBackend> = w.sim.clone();
    let other = VirtualMemory::new(backend, D0, w.gov.clone(), VmmConfig::default()).unwrap();
    let mut owner = w.vm.reserve(4 * G).unwrap();
    let set = owner.commit_shared(&[(0, 2 * G)]).unwrap();
    let mut stranger = other.reserve(4 * G).unwrap();
    let e = stranger
        .map_shared(&set, &[0, 1], kvvm_hal::Access::Read)
        .unwrap_err();
    assert!(matches!(e, VmmError::GrantMismatch { .. }), "{e}");
    assert!(stranger.mappings().is_empty());
    // The same manager's reservation maps it.
    let mut sharer = w.vm.reserve(4 * G).unwrap();
    assert_eq!(
        sharer
            .map_shared(&set, &[1, 0], kvvm_hal::Access::Read)
            .unwrap(),
        2 * G
    );
    assert_eq!(set.mapped_count(), 4);
}

#[test]
fn a_quarantined_slot_keeps_the_strided_range_reserved_for_good() {
    let w = World::simple(G, 0);
    let mut slots = w.vm.reserve_strided(2, G).unwrap();
    slots[0].commit(G).unwrap();
    w.sim.inject(kvvm_sim::FaultRule::failing_synchronize());
    let last = slots.pop().unwrap();
    drop(slots);
    w.sim.clear_faults();
    drop(last);
    // The quarantined slot's mapping is still live: the range is never given back, not even
    // tried, when its last slot goes.
    assert_eq!(w.sim.calls(Operation::Free), 0);
    assert_eq!(w.sim.ledger().reservations.len(), 1);
    let q = w.vm.quarantine();
    assert_eq!(q.len(), 1, "{q:?}");
    assert_eq!(w.vm.quarantined_bytes(), G);
}
