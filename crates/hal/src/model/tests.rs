//! The model's checks, one contract row at a time.

use super::*;
use crate::{AccessDescriptor, BackendResult, DeviceAddress, PhysicalHandle};

const G: u64 = 4096;
const D0: DeviceId = DeviceId(0);

fn model() -> DriverModel {
    DriverModel::new(1, BackendError::raised)
}

fn kind<T: std::fmt::Debug>(r: BackendResult<T>) -> Option<ErrorKind> {
    r.err().map(|e| e.kind)
}

/// A model with a range of 8 granules at 16 G and one handle of 2 granules.
fn with_handle() -> (DriverModel, PhysicalHandle) {
    let mut m = model();
    m.insert_range(16 * G, 8 * G);
    let a = m.new_allocation(D0, 2 * G, ());
    let h = m.new_handle(a, ());
    (m, h)
}

#[test]
fn sizes_and_alignments_are_checked() {
    let m = model();
    let op = Operation::Create;
    assert_eq!(kind(m.check_size(op, 0, G)), Some(ErrorKind::InvalidValue));
    assert_eq!(
        kind(m.check_size(op, G + 1, G)),
        Some(ErrorKind::InvalidValue)
    );
    assert_eq!(kind(m.check_size(op, G, 0)), Some(ErrorKind::InvalidValue));
    assert!(m.check_size(op, 3 * G, G).is_ok());
    assert_eq!(m.check_reserve(G, 0, G).ok(), Some(G));
    assert_eq!(m.check_reserve(G, 8 * G, G).ok(), Some(8 * G));
    assert_eq!(
        kind(m.check_reserve(G, 3 * G, G)),
        Some(ErrorKind::InvalidValue)
    );
    let err = m.check_reserve(G / 2, 0, G).err();
    assert_eq!(err.map(|e| e.op), Some(Operation::Reserve));
}

#[test]
fn free_needs_the_whole_range_and_no_mapping() {
    let (mut m, h) = with_handle();
    assert_eq!(
        kind(m.check_free(DeviceAddress(15 * G), 8 * G)),
        Some(ErrorKind::InvalidValue)
    );
    assert_eq!(
        kind(m.check_free(DeviceAddress(16 * G), 4 * G)),
        Some(ErrorKind::InvalidValue)
    );
    assert!(m.check_free(DeviceAddress(16 * G), 8 * G).is_ok());
    assert!(m.insert_mapping(DeviceAddress(18 * G), 2 * G, h));
    assert_eq!(
        kind(m.check_free(DeviceAddress(16 * G), 8 * G)),
        Some(ErrorKind::InvalidValue)
    );
    m.unmap(DeviceAddress(18 * G), 2 * G);
    m.remove_range(16 * G);
    assert_eq!(
        kind(m.check_free(DeviceAddress(16 * G), 8 * G)),
        Some(ErrorKind::InvalidValue)
    );
}

#[test]
fn map_checks_follow_the_driver_order() {
    let (mut m, h) = with_handle();
    let at = |g: u64| DeviceAddress(g * G);
    // Part of a handle: NotSupported even at a bad address.
    assert_eq!(
        kind(m.check_map(DeviceAddress(1), G, h, G)),
        Some(ErrorKind::NotSupported)
    );
    assert_eq!(
        kind(m.check_map(at(16), 0, h, G)),
        Some(ErrorKind::InvalidValue)
    );
    assert_eq!(
        kind(m.check_map(at(16), 3 * G, h, G)),
        Some(ErrorKind::InvalidValue)
    );
    assert_eq!(
        kind(m.check_map(DeviceAddress(16 * G + 1), 2 * G, h, G)),
        Some(ErrorKind::InvalidValue)
    );
    // Not reserved, and past the end of the reservation.
    assert_eq!(
        kind(m.check_map(at(4), 2 * G, h, G)),
        Some(ErrorKind::InvalidValue)
    );
    assert_eq!(
        kind(m.check_map(at(23), 2 * G, h, G)),
        Some(ErrorKind::InvalidValue)
    );
    assert!(m.check_map(at(16), 2 * G, h, G).is_ok());
    assert!(m.insert_mapping(at(16), 2 * G, h));
    // Over a live mapping.
    assert_eq!(
        kind(m.check_map(at(17), 2 * G, h, G)),
        Some(ErrorKind::InvalidValue)
    );
    assert!(m.check_map(at(18), 2 * G, h, G).is_ok());
    // A handle that is not live.
    let gone = PhysicalHandle(7);
    assert_eq!(
        kind(m.check_map(at(18), 2 * G, gone, G)),
        Some(ErrorKind::InvalidValue)
    );
    assert!(!m.insert_mapping(at(18), 2 * G, gone));
}

#[test]
fn release_defers_the_free_until_the_last_unmap() {
    let (mut m, h) = with_handle();
    assert!(m.insert_mapping(DeviceAddress(16 * G), 2 * G, h));
    assert_eq!(m.used_on(D0), 2 * G);
    let r = m.release(h);
    assert_eq!(r.as_ref().map(|r| r.size).ok(), Some(2 * G));
    assert_eq!(
        kind(m.release(h)),
        Some(ErrorKind::InvalidValue),
        "second release"
    );
    assert_eq!(m.used_on(D0), 2 * G, "still mapped: not freed");
    assert_eq!(m.unmap(DeviceAddress(16 * G), 8 * G), (1, 2 * G));
    assert_eq!(m.used_on(D0), 0);
    m.remove_range(16 * G);
    assert!(m.is_empty());
}

#[test]
fn an_allocation_lives_while_any_handle_does() {
    let mut m = model();
    let a = m.new_allocation(D0, G, ());
    let first = m.new_handle(a, ());
    let second = m.new_handle(a, ());
    assert_ne!(first, second);
    assert_eq!(m.used_on(D0), G, "one allocation, counted once");
    assert!(m.release(first).is_ok());
    assert!(m.allocation(a).is_some());
    assert!(m.release(second).is_ok());
    assert!(m.allocation(a).is_none());
    assert_eq!(m.used_on(D0), 0);
}

#[test]
fn capacity_and_adopted_handles() {
    let mut m = model();
    assert!(m
        .check_capacity(Operation::Create, DeviceId(2), 4 * G, 4 * G)
        .is_ok());
    assert!(m.adopt_handle(PhysicalHandle(0xa0), DeviceId(2), 3 * G, (), ()));
    assert!(
        !m.adopt_handle(PhysicalHandle(0xa0), DeviceId(2), G, (), ()),
        "live already"
    );
    assert_eq!(m.used(), &[0, 0, 3 * G]);
    assert_eq!(
        kind(m.check_capacity(Operation::Create, DeviceId(2), 2 * G, 4 * G)),
        Some(ErrorKind::OutOfMemory)
    );
    let id = m.allocation_of(Operation::Map, PhysicalHandle(0xa0));
    assert!(id.is_ok());
    m.free_bytes_now(id.unwrap_or(0));
    assert_eq!(m.used(), &[0, 0, 0]);
}

#[test]
fn set_access_needs_whole_mappings_and_peer_links() {
    let (mut m, h) = with_handle();
    let b = m.new_allocation(DeviceId(1), 2 * G, ());
    let other = m.new_handle(b, ());
    assert!(m.insert_mapping(DeviceAddress(16 * G), 2 * G, h));
    assert!(m.insert_mapping(DeviceAddress(18 * G), 2 * G, other));
    let rw = [AccessDescriptor::read_write(D0)];
    let linked = |owner: DeviceId, d: DeviceId| owner == d;
    let check = |m: &DriverModel, g: u64, n: u64| {
        kind(m.check_set_access(DeviceAddress(g * G), n * G, &rw, linked))
    };
    assert_eq!(check(&m, 16, 2), None);
    assert_eq!(
        check(&m, 16, 1),
        Some(ErrorKind::InvalidValue),
        "ends inside"
    );
    assert_eq!(
        check(&m, 17, 1),
        Some(ErrorKind::InvalidValue),
        "starts inside"
    );
    assert_eq!(check(&m, 16, 6), Some(ErrorKind::InvalidValue), "a hole");
    assert_eq!(
        check(&m, 16, 4),
        Some(ErrorKind::NotSupported),
        "no peer link"
    );
    assert_eq!(check(&m, 16, 0), Some(ErrorKind::InvalidValue));
    let none = m.check_set_access(DeviceAddress(16 * G), 2 * G, &[], linked);
    assert_eq!(kind(none), Some(ErrorKind::InvalidValue));
    assert_eq!(m.extent_in(DeviceAddress(16 * G), 4 * G, true), (2, 4 * G));
    assert_eq!(m.set_access(DeviceAddress(16 * G), 2 * G, &rw), (1, 2 * G));
    assert_eq!(m.set_access(DeviceAddress(16 * G), 2 * G, &rw), (0, 0));
    assert_eq!(m.extent_in(DeviceAddress(16 * G), 4 * G, true), (1, 2 * G));
    assert_eq!(m.extent_in(DeviceAddress(16 * G), 4 * G, false), (2, 4 * G));
}

#[test]
fn unmap_takes_whole_mappings_only() {
    let (mut m, h) = with_handle();
    assert!(m.insert_mapping(DeviceAddress(18 * G), 2 * G, h));
    let unmap = |m: &DriverModel, g: u64, n: u64| m.check_unmap(DeviceAddress(g * G), n * G);
    assert_eq!(
        kind(unmap(&m, 19, 2)),
        Some(ErrorKind::InvalidValue),
        "starts inside"
    );
    assert_eq!(
        kind(unmap(&m, 17, 2)),
        Some(ErrorKind::InvalidValue),
        "ends inside"
    );
    assert_eq!(kind(unmap(&m, 18, 0)), Some(ErrorKind::InvalidValue));
    assert_eq!(unmap(&m, 16, 8).ok(), Some(vec![(18 * G, 2 * G)]));
    assert_eq!(
        unmap(&m, 20, 4).ok(),
        Some(vec![]),
        "nothing mapped is fine"
    );
    assert_eq!(m.unmap(DeviceAddress(20 * G), 4 * G), (0, 0));
}

#[test]
fn copies_need_access_on_every_byte() {
    let (mut m, h) = with_handle();
    let b = m.new_allocation(D0, 2 * G, ());
    let other = m.new_handle(b, ());
    assert!(m.insert_mapping(DeviceAddress(16 * G), 2 * G, h));
    assert!(m.insert_mapping(DeviceAddress(18 * G), 2 * G, other));
    let op = Operation::CopyToDevice;
    let pieces = |m: &DriverModel, start: u64, len: u64, need| m.pieces(op, start, len, need, None);
    assert_eq!(
        kind(pieces(&m, 16 * G, 10, Need::Read)),
        Some(ErrorKind::InvalidValue)
    );
    assert!(pieces(&m, 16 * G, 10, Need::Mapped).is_ok());
    m.set_access(
        DeviceAddress(16 * G),
        2 * G,
        &[AccessDescriptor::read_write(D0)],
    );
    m.set_access(
        DeviceAddress(18 * G),
        2 * G,
        &[AccessDescriptor::read_only(D0)],
    );
    let both = pieces(&m, 18 * G - 1, 2, Need::Read).unwrap_or_default();
    assert_eq!(both.len(), 2);
    assert_eq!(
        both.first().map(|p| (p.offset, p.len)),
        Some((2 * G - 1, 1))
    );
    assert_eq!(both.get(1).map(|p| (p.offset, p.len)), Some((0, 1)));
    assert!(pieces(&m, 16 * G, 2 * G, Need::Write).is_ok());
    assert_eq!(
        kind(pieces(&m, 18 * G - 1, 2, Need::Write)),
        Some(ErrorKind::InvalidValue)
    );
    assert_eq!(
        kind(pieces(&m, 20 * G - 1, 2, Need::Read)),
        Some(ErrorKind::InvalidValue)
    );
    // Another device's access is its own.
    let peer = m.pieces(op, 16 * G, 1, Need::Read, Some(DeviceId(1)));
    assert_eq!(kind(peer), Some(ErrorKind::InvalidValue));
}

#[test]
fn ranges_are_found_and_bounded() {
    let mut m = model();
    m.insert_range(16 * G, 8 * G);
    assert_eq!(m.range_containing(20 * G), Some((16 * G, 8 * G)));
    assert_eq!(m.range_containing(24 * G), None);
    assert!(!m.range_free(20 * G, 30 * G));
    assert!(m.range_free(24 * G, 30 * G));
    assert!(m.range_free(0, 16 * G));
    assert_eq!(m.end_of(Operation::Map, 10, 5).ok(), Some(15));
    assert!(m.end_of(Operation::Map, u64::MAX, 1).is_err());
    let overflow = m.check_map_target(Operation::Map, DeviceAddress(u64::MAX), 2);
    assert_eq!(kind(overflow), Some(ErrorKind::InvalidValue));
    let spans = [(0, 4), (4, 4), (6, 4)];
    assert_eq!(bytes_within(spans.into_iter(), 0, 8), 8);
}
