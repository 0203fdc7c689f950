//! A shared set's own books and the checks made before any of its handles is mapped: how many
//! mappings it has, what quarantine took of it, and which windows a sharer may name.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::single_range_in_vec_init
)]

mod common;

use common::{World, D0};
use kvvm_hal::{Access, Operation};
use kvvm_sim::FaultRule;
use kvvm_vmm::VmmError;

/// 2 MiB granules, handles of up to 8 windows.
fn world() -> World {
    World::multi(8, 0, false)
}

#[test]
fn the_set_counts_one_mapping_per_handle_and_holder() {
    let w = world();
    let g = w.g;
    let mut owner = w.vm.reserve(8 * g).unwrap();
    // An owned mapping of the owner is none of the set's.
    owner.commit_range(6 * g, g).unwrap();
    let set = owner.commit_shared(&[(0, 2 * g), (2 * g, 3 * g)]).unwrap();
    assert_eq!(set.mapped_count(), 2, "the owner maps its two handles");
    let mut sharer = w.vm.reserve(8 * g).unwrap();
    sharer
        .map_shared(&set, &[0, 1, 2, 3, 4], Access::Read)
        .unwrap();
    assert_eq!(set.mapped_count(), 4);
    assert_eq!(sharer.release().unwrap(), 5 * g);
    assert_eq!(set.mapped_count(), 2, "the sharer's two mappings are gone");
    assert!(format!("{set:?}").contains("SharedHandles"));
}

#[test]
fn a_sharer_names_whole_handles_only() {
    let w = world();
    let g = w.g;
    let mut owner = w.vm.reserve(8 * g).unwrap();
    let set = owner.commit_shared(&[(0, 2 * g), (2 * g, 3 * g)]).unwrap();
    let mut sharer = w.vm.reserve(8 * g).unwrap();
    let maps = w.sim.calls(Operation::Map);
    // Part of the first handle, part of the second: refused before any driver call.
    for named in [vec![0], vec![1], vec![0, 1, 2], vec![3, 4]] {
        let e = sharer.map_shared(&set, &named, Access::Read).unwrap_err();
        assert!(
            matches!(e, VmmError::InvalidArgument { .. }),
            "{named:?}: {e}"
        );
    }
    assert_eq!(w.sim.calls(Operation::Map), maps);
    // The first handle whole.
    assert_eq!(
        sharer.map_shared(&set, &[1, 0], Access::Read).unwrap(),
        2 * g
    );
    assert_eq!(w.shape(&sharer), vec![(0, 2)]);
}

#[test]
fn a_sharer_maps_exactly_the_windows_it_names() {
    let w = World::simple(64 << 10, 0);
    let g = w.g;
    let mut owner = w.vm.reserve(8 * g).unwrap();
    let set = owner.commit_shared(&[(0, 4 * g)]).unwrap();
    assert_eq!(set.handle_count(), 4, "one window per handle");
    let mut sharer = w.vm.reserve(8 * g).unwrap();
    assert_eq!(
        sharer.map_shared(&set, &[3, 0, 2], Access::Read).unwrap(),
        3 * g
    );
    assert_eq!(w.shape(&sharer), vec![(0, 1), (2, 1), (3, 1)]);
    assert!(!sharer.is_mapped(g));
}

#[test]
fn naming_a_window_past_the_set_is_out_of_bounds() {
    let w = world();
    let g = w.g;
    let mut owner = w.vm.reserve(8 * g).unwrap();
    let set = owner.commit_shared(&[(0, 5 * g)]).unwrap();
    let mut sharer = w.vm.reserve(8 * g).unwrap();
    assert_eq!(
        sharer
            .map_shared_ranges(&set, &[0..6], Access::Read)
            .unwrap_err(),
        VmmError::OutOfBounds {
            offset: 5,
            requested: 1,
            reserved: 5
        }
    );
    assert_eq!(
        sharer.map_shared(&set, &[7], Access::Read).unwrap_err(),
        VmmError::OutOfBounds {
            offset: 7,
            requested: 1,
            reserved: 5
        }
    );
    // Exactly up to the end is the whole set.
    assert_eq!(
        sharer
            .map_shared_ranges(&set, &[0..5], Access::Read)
            .unwrap(),
        5 * g
    );
}

#[test]
fn overlapping_shared_ranges_are_refused_adjacent_ones_are_not() {
    let w = world();
    let g = w.g;
    let mut r = w.vm.reserve(8 * g).unwrap();
    let e = r.commit_shared(&[(0, 3 * g), (2 * g, 2 * g)]).unwrap_err();
    assert!(matches!(e, VmmError::InvalidArgument { .. }), "{e}");
    let e = r.commit_shared(&[(2 * g, 2 * g), (0, 3 * g)]).unwrap_err();
    assert!(matches!(e, VmmError::InvalidArgument { .. }), "{e}");
    let e = r.commit_shared(&[(0, 0)]).unwrap_err();
    assert!(matches!(e, VmmError::InvalidArgument { .. }), "{e}");
    assert_eq!(w.sim.calls(Operation::Create), 0);
    let set = r.commit_shared(&[(2 * g, 2 * g), (0, 2 * g)]).unwrap();
    assert_eq!(set.len(), 4);
    // An unaligned range covers every window it touches.
    let mut s = w.vm.reserve(8 * g).unwrap();
    let set = s.commit_shared(&[(g + 1, g)]).unwrap();
    assert_eq!(set.len(), 2);
    assert_eq!(w.shape(&s), vec![(1, 2)]);
}

#[test]
fn a_shared_handle_a_sharer_cannot_prove_idle_is_quarantined_once() {
    let w = world();
    let g = w.g;
    let mut owner = w.vm.reserve(8 * g).unwrap();
    let set = owner.commit_shared(&[(0, 2 * g), (2 * g, 2 * g)]).unwrap();
    let mut a = w.vm.reserve(8 * g).unwrap();
    let mut b = w.vm.reserve(8 * g).unwrap();
    a.map_shared(&set, &[0, 1], Access::Read).unwrap();
    b.map_shared(&set, &[0, 1], Access::Read).unwrap();
    assert_eq!(set.quarantined_bytes(), 0);
    w.sim.inject(FaultRule::failing_synchronize());
    drop(a);
    assert_eq!(set.quarantined_bytes(), 2 * g);
    drop(b);
    w.sim.clear_faults();
    // The same handle quarantined by two sharers counts once.
    assert_eq!(set.quarantined_bytes(), 2 * g);
    let s = w.gov.snapshot().device(D0);
    assert_eq!((s.shared, s.quarantined), (2 * g, 2 * g));
    assert_eq!(s.used(), w.sim.ledger().physical_bytes[0]);
}

#[test]
fn each_window_says_who_owns_what_is_mapped_there() {
    use kvvm_vmm::BlockKind;

    let w = world();
    let g = w.g;
    let mut owner = w.vm.reserve(8 * g).unwrap();
    owner.commit_range(4 * g, g).unwrap();
    let set = owner.commit_shared(&[(0, 2 * g)]).unwrap();
    let mut sharer = w.vm.reserve(8 * g).unwrap();
    sharer.map_shared(&set, &[0, 1], Access::Read).unwrap();
    assert_eq!(owner.granule(), g);
    assert_eq!(
        owner.window_kind(g),
        Some(BlockKind::Shared { writable: true })
    );
    assert_eq!(owner.window_kind(4 * g), Some(BlockKind::Owned));
    assert_eq!(owner.window_kind(3 * g), None);
    assert_eq!(
        sharer.window_kind(0),
        Some(BlockKind::Shared { writable: false })
    );
    assert!(sharer.is_mapped(g) && !sharer.is_mapped(2 * g));
    let d = format!("{owner:?}");
    assert!(d.contains("Reservation") && d.contains("blocks: 2"), "{d}");
}
