//! Shared sets across managers (as across processes): one manager exports a shared set's
//! handles as descriptors, another imports them and maps them read-only at the same offsets,
//! billed nowhere but at the exporter; the memory outlives the exporter's set while the
//! importer maps it; a failed import keeps nothing; bad pieces are refused before any driver
//! call; every handle is released in the end.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::fd::AsFd;
use std::sync::Arc;

use kvvm_governor::{Governor, GovernorConfig};
use kvvm_hal::{Access, DeviceId, ErrorKind, Operation, ShareableHandleType, VirtualMemoryBackend};
use kvvm_sim::{FaultRule, LatencyMode, LatencyModel, SimBackend, SimConfig, MIB};
use kvvm_vmm::{GranularityChoice, VirtualMemory, VmmConfig, VmmError};

const D0: DeviceId = DeviceId(0);
const G: u64 = 2 * MIB;

fn sim() -> Arc<SimBackend> {
    Arc::new(SimBackend::new(
        SimConfig::single(G, 64 * G).with_latency(LatencyModel::zero(), LatencyMode::Account),
    ))
}

/// A manager over `sim` with its own governor of `budget` granules, handles of up to 4
/// windows, exportable, no pool.
fn manager(sim: &Arc<SimBackend>, budget: u64) -> (VirtualMemory, Governor) {
    let gov = Governor::new(GovernorConfig::default().device_budget(D0, budget * G));
    let backend: Arc<dyn VirtualMemoryBackend> = sim.clone();
    let config = VmmConfig {
        handle_type: ShareableHandleType::PosixFd,
        ..VmmConfig::default()
            .pool_cap_bytes(0)
            .granularity(GranularityChoice::Minimum)
            .max_handle_bytes(4 * G)
    };
    (
        VirtualMemory::new(backend, D0, gov.clone(), config).unwrap(),
        gov,
    )
}

fn byte(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 9)) as u8
}

#[test]
fn an_imported_set_maps_read_only_is_billed_at_the_exporter_only_and_outlives_it() {
    let sim = sim();
    let (exporter, gov_a) = manager(&sim, 16);
    let (importer, gov_b) = manager(&sim, 16);
    let mut owner = exporter.reserve(8 * G).unwrap();
    // Two ranges: windows 0..5 (a handle of 4 and one of 1) and 6..7.
    let set = owner.commit_shared(&[(0, 5 * G), (6 * G, G)]).unwrap();
    let data: Vec<u8> = (0..(7 * G) as usize).map(byte).collect();
    let (head, rest) = data.split_at((5 * G) as usize);
    sim.copy_to_device(owner.address(), head).unwrap();
    sim.copy_to_device(owner.address().offset(6 * G), &rest[G as usize..])
        .unwrap();
    let exported = set.export_fds().unwrap();
    assert_eq!(exported.len(), set.handle_count());
    let pieces: Vec<_> = exported
        .iter()
        .map(|(fd, p)| (fd.as_fd(), p.offset, p.windows))
        .collect();
    let imported = importer.import_shared(&pieces).unwrap();
    assert!(imported.is_imported() && !set.is_imported());
    assert!(importer.owns_set(&imported) && exporter.owns_set(&set));
    assert!(!importer.owns_set(&set) && !exporter.owns_set(&imported));
    assert_eq!(imported.len(), set.len());
    assert_eq!(imported.bytes(), 6 * G);
    drop(pieces);
    drop(exported);

    let mut reader = importer.reserve(8 * G).unwrap();
    let all: Vec<usize> = (0..imported.len()).collect();
    let writable = reader.map_shared(&imported, &all, Access::ReadWrite);
    assert!(matches!(writable, Err(VmmError::InvalidArgument { .. })));
    assert_eq!(
        reader.map_shared(&imported, &all, Access::Read).unwrap(),
        6 * G
    );
    assert_eq!(
        gov_b.snapshot().device(D0).used(),
        0,
        "billed at the exporter only"
    );
    assert_eq!(gov_a.snapshot().device(D0).used(), 6 * G);
    assert!(
        sim.copy_to_device(reader.address(), b"x").is_err(),
        "read-only"
    );

    // The exporter lets go of everything: the importer's mappings keep the memory.
    owner.release().unwrap();
    drop(owner);
    drop(set);
    assert_eq!(gov_a.snapshot().device(D0).used(), 0);
    let mut got = vec![0u8; (5 * G) as usize];
    sim.copy_from_device(&mut got, reader.address()).unwrap();
    assert!(got.iter().enumerate().all(|(i, b)| *b == byte(i)));
    let mut last = vec![0u8; G as usize];
    sim.copy_from_device(&mut last, reader.address().offset(6 * G))
        .unwrap();
    assert!(last
        .iter()
        .enumerate()
        .all(|(i, b)| *b == byte(i + (6 * G) as usize)));

    assert_eq!(reader.release().unwrap(), 6 * G);
    drop(reader);
    assert_eq!(imported.mapped_count(), 0);
    drop(imported);
    let ledger = sim.ledger();
    assert!(
        ledger.handles.is_empty(),
        "every handle released: {:?}",
        ledger.handles
    );
    assert!(ledger.allocations.is_empty(), "the memory is freed");
    assert_eq!(
        importer.accounting_errors() + exporter.accounting_errors(),
        0
    );
}

#[test]
fn a_failed_import_keeps_no_handle_and_bad_pieces_are_refused_first() {
    let sim = sim();
    let (exporter, _) = manager(&sim, 16);
    let (importer, _) = manager(&sim, 16);
    let mut owner = exporter.reserve(8 * G).unwrap();
    let set = owner.commit_shared(&[(0, 2 * G), (2 * G, 2 * G)]).unwrap();
    let exported = set.export_fds().unwrap();
    let fd = exported[0].0.as_fd();
    let imports = sim.calls(Operation::Import);
    for bad in [
        vec![],
        vec![(fd, G / 2, 1)],
        vec![(fd, 0, 0)],
        vec![(fd, 0, 2), (fd, G, 2)],
        vec![(fd, u64::MAX - G + 1, 2)],
    ] {
        let e = importer.import_shared(&bad).unwrap_err();
        assert!(matches!(e, VmmError::InvalidArgument { .. }), "{e}");
    }
    assert_eq!(
        sim.calls(Operation::Import),
        imports,
        "refused before any driver call"
    );

    let handles_before = sim.ledger().handles.len();
    sim.inject(FaultRule::nth(
        Operation::Import,
        imports + 2,
        ErrorKind::Other,
    ));
    let pieces: Vec<_> = exported
        .iter()
        .map(|(fd, p)| (fd.as_fd(), p.offset, p.windows))
        .collect();
    assert!(importer.import_shared(&pieces).is_err());
    assert_eq!(
        sim.ledger().handles.len(),
        handles_before,
        "the first import was released"
    );
    sim.clear_faults();
    let again = importer.import_shared(&pieces).unwrap();
    assert_eq!(again.handle_count(), 2);
    drop(again);
    assert_eq!(sim.ledger().handles.len(), handles_before);
}
