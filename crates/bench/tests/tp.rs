//! The tensor-parallel bench on simulated nodes of 1, 2 and 4 devices: every case measured,
//! the peer rows only with a peer, nothing left behind.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kvvm::hal::VirtualMemoryBackend;
use kvvm::sim::{PeerLinks, SimBackend, SimConfig};
use kvvm_bench::tp::measure_tp;

#[test]
fn every_case_is_measured_on_every_rank_and_nothing_leaks() {
    for (devices, peers) in [
        (1u32, PeerLinks::AllToAll),
        (2, PeerLinks::AllToAll),
        (4, PeerLinks::None),
    ] {
        let sim = Arc::new(SimBackend::new(
            SimConfig::uniform(devices, 64 << 10, 64 << 20).with_peers(peers.clone()),
        ));
        let backend: Arc<dyn VirtualMemoryBackend> = sim.clone();
        let s = measure_tp(&backend, 4, 3).unwrap();
        assert_eq!((s.ranks, s.windows, s.granule), (devices, 4, 64 << 10));
        assert_eq!(
            (s.transaction.len(), s.independent.len(), s.raw.len()),
            (3, 3, 3)
        );
        let has_peer = devices > 1 && peers == PeerLinks::AllToAll;
        assert_eq!(
            s.peer_set_access.len(),
            if has_peer { 3 } else { 0 },
            "{devices} devices"
        );
        assert_eq!(s.own_set_access.len(), s.peer_set_access.len());
        assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    }
}
