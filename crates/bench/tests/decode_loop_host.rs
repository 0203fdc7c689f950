//! The synthetic decode loop on the host backend (moved here from the host backend's tests with
//! the loop itself): every layout, every byte verified, the host's ledger empty at the end.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kvvm::host::HostBackend;

#[test]
fn the_kv_decode_loop_verifies_every_byte_on_every_layout() {
    use kvvm::kv::{KvDtype, KvGeometry, KvLayout};
    use kvvm_bench::decode::{run_decode_loop, DecodeLoopConfig};
    for layout in [
        KvLayout::HeadMajor,
        KvLayout::SeqMajor,
        KvLayout::TokenMajor,
    ] {
        let host = Arc::new(HostBackend::open().unwrap());
        let mut config = DecodeLoopConfig::reference().unwrap();
        config.geometry = KvGeometry::with_dtype(2, 2, 32, KvDtype::F16, 1).unwrap();
        config.layout = layout;
        config.granularity = kvvm::vmm::GranularityChoice::Minimum;
        config.sequences = 4;
        config.prompt_tokens = 1000;
        config.decode_tokens = 40;
        let r = run_decode_loop(host.clone(), &config).unwrap();
        assert!(r.verified && r.bytes_verified > 0, "{layout:?}: {r:?}");
        assert_eq!(r.used_bytes_at_end, 0);
        if r.prompt_shareable {
            assert!(r.committed_bytes_with_sharing < r.committed_bytes_without_sharing);
        }
        assert!(host.ledger().is_empty(), "{layout:?}: {:?}", host.ledger());
    }
}
