//! A shared prefix handed to another manager (as to another process) on the simulated driver:
//! exported as descriptors with its encoded descriptor, imported under the same plan, attached
//! read-only to the importer's sequences with every token read back, billed at the exporter
//! only, alive after the exporter let go; plans that do not match, unsealed prefixes and
//! foreign text are refused.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::fd::AsFd;
use std::sync::Arc;

use kvvm_governor::{Governor, GovernorConfig};
use kvvm_hal::{DeviceId, ShareableHandleType, VirtualMemoryBackend};
use kvvm_kv::synthetic::token_kv_bytes;
use kvvm_kv::{
    KvCacheError, KvDtype, KvGeometry, KvLayout, LayoutPlan, PrefixDescriptor, SequenceKv,
    SharedDevicePrefix,
};
use kvvm_sim::{LatencyMode, LatencyModel, SimBackend, SimConfig};
use kvvm_vmm::{GranularityChoice, VirtualMemory, VmmConfig};

const D0: DeviceId = DeviceId(0);
const G: u64 = 4096;

fn managers() -> (Arc<SimBackend>, [(VirtualMemory, Governor); 2]) {
    let sim = Arc::new(SimBackend::new(
        SimConfig::single(G, 4096 * G).with_latency(LatencyModel::zero(), LatencyMode::Account),
    ));
    let make = || {
        let gov = Governor::new(GovernorConfig::default().device_budget(D0, 1024 * G));
        let backend: Arc<dyn VirtualMemoryBackend> = sim.clone();
        let config = VmmConfig {
            handle_type: ShareableHandleType::PosixFd,
            ..VmmConfig::default()
                .pool_cap_bytes(0)
                .granularity(GranularityChoice::Minimum)
        };
        (
            VirtualMemory::new(backend, D0, gov.clone(), config).unwrap(),
            gov,
        )
    };
    let pair = [make(), make()];
    (sim, pair)
}

/// 2 layers, 2 KV heads, head_dim 32, fp16: 512 B a token.
fn geometry(max_tokens: u64) -> KvGeometry {
    KvGeometry::with_dtype(2, 2, 32, KvDtype::F16, max_tokens).unwrap()
}

fn fill(geo: &KvGeometry) -> impl FnMut(u64, &mut [u8]) + '_ {
    let bpt = geo.bytes_per_token() as usize;
    move |first, buf| {
        for (i, chunk) in buf.chunks_mut(bpt).enumerate() {
            let pos = first + i as u64;
            token_kv_bytes(geo, pos as u32, pos, chunk);
        }
    }
}

#[test]
fn an_exported_prefix_imports_under_the_same_plan_and_reads_back_in_every_layout() {
    for layout in [KvLayout::TokenMajor, KvLayout::SeqMajor] {
        let (_sim, [(exporter, gov_a), (importer, gov_b)]) = managers();
        let geo = geometry(1000);
        let plan = LayoutPlan::new(geo, layout, G).unwrap();
        let mut f = fill(&geo);
        let (prefix, owner) =
            SharedDevicePrefix::reserve_and_map_shared_prefix(&exporter, &plan, 300, 1000, &mut f)
                .unwrap();
        let (descriptor, fds) = prefix.export().unwrap();
        // Every token travels: the whole windows' and the tail's handles.
        assert_eq!((descriptor.tokens, prefix.tokens()), (300, 300));
        assert!(
            descriptor.tail_end_window > descriptor.end_window,
            "{layout:?}"
        );
        let text = descriptor.encode();
        let decoded = PrefixDescriptor::decode(&text).unwrap();
        assert_eq!(decoded, descriptor);
        let borrowed: Vec<_> = fds.iter().map(|fd| fd.as_fd()).collect();
        let imported = SharedDevicePrefix::import(&importer, &plan, &decoded, &borrowed).unwrap();
        drop(borrowed);
        drop(fds);
        assert!(imported.is_sealed() && imported.handles().is_imported());
        assert_eq!(imported.prefix_len(), descriptor.tokens);

        let mut reader = SequenceKv::new(&importer, &plan, 1000).unwrap();
        imported.attach_to(&mut reader).unwrap();
        // The prefix is billed at the exporter only; the reader pays for the windows it
        // copied the tail into (one per fragment).
        assert_eq!(
            gov_b.snapshot().device(D0).used(),
            plan.slice_count() * G,
            "{layout:?}"
        );
        assert_eq!(reader.additional_owned_bytes(), plan.slice_count() * G);
        let billed = gov_a.snapshot().device(D0).used();
        assert!(billed >= prefix.bytes(), "{layout:?}");

        // The exporter lets go of its prefix and its owner: the reader still reads it.
        drop(owner);
        drop(prefix);
        assert_eq!(gov_a.snapshot().device(D0).used(), 0);
        let bpt = geo.bytes_per_token();
        let n = descriptor.tokens;
        let mut got = vec![0u8; (n * bpt) as usize];
        reader.read_tokens(0, &mut got).unwrap();
        let mut want = vec![0u8; got.len()];
        fill(&geo)(0, &mut want);
        assert_eq!(got, want, "{layout:?}: every token of the prefix");
        // The reader grows privately past the prefix, billed to its own manager.
        reader.ensure_tokens(n + 40).unwrap();
        assert!(gov_b.snapshot().device(D0).used() > 0);
        drop(reader);
        drop(imported);
        assert_eq!(gov_b.snapshot().device(D0).used(), 0);
        assert_eq!(
            exporter.accounting_errors() + importer.accounting_errors(),
            0
        );
    }
}

#[test]
fn another_plan_an_unsealed_prefix_and_foreign_text_are_refused() {
    let (_sim, [(exporter, _), (importer, _)]) = managers();
    let geo = geometry(1000);
    let plan = LayoutPlan::new(geo, KvLayout::SeqMajor, G).unwrap();
    let (unsealed, mut owner) =
        SharedDevicePrefix::reserve_unwritten(&exporter, &plan, 300, 1000).unwrap();
    assert!(matches!(
        unsealed.export(),
        Err(KvCacheError::PrefixNotWritten { .. })
    ));
    owner.seal_prefix().unwrap();
    let (descriptor, fds) = unsealed.export().unwrap();
    let borrowed: Vec<_> = fds.iter().map(|fd| fd.as_fd()).collect();
    // Seq-major fragments lie at offsets that depend on the maximum length.
    let other = LayoutPlan::new(geometry(2000), KvLayout::SeqMajor, G).unwrap();
    let e = SharedDevicePrefix::import(&importer, &other, &descriptor, &borrowed).unwrap_err();
    assert!(matches!(e, KvCacheError::PlanMismatch { .. }), "{e}");
    let e = SharedDevicePrefix::import(&importer, &plan, &descriptor, &borrowed[1..]).unwrap_err();
    assert!(matches!(e, KvCacheError::PlanMismatch { .. }), "{e}");
    let mut shorter = descriptor.clone();
    shorter.tokens = 1;
    let e = SharedDevicePrefix::import(&importer, &plan, &shorter, &borrowed).unwrap_err();
    assert!(
        matches!(e, KvCacheError::PlanMismatch { .. }),
        "1 token fills no window: {e}"
    );
    let mut longer = descriptor.clone();
    longer.tokens = 100_000;
    let e = SharedDevicePrefix::import(&importer, &plan, &longer, &borrowed).unwrap_err();
    assert!(
        matches!(
            e,
            KvCacheError::PlanMismatch { .. } | KvCacheError::Layout(_)
        ),
        "{e}"
    );
    for text in [
        "",
        "kvvm-prefix/2 1 0 1 0:1",
        "kvvm-prefix/1 1 0",
        "kvvm-prefix/1 1 0 1 0-1",
    ] {
        assert!(PrefixDescriptor::decode(text).is_err(), "{text:?}");
    }
    // Numbers no prefix of this plan can have (a hostile tenant-mate's meta): refused before
    // anything is allocated for the windows they claim.
    let hostile = |f: &dyn Fn(&mut PrefixDescriptor)| {
        let mut d = descriptor.clone();
        f(&mut d);
        let text = d.encode();
        let d = PrefixDescriptor::decode(&text).unwrap();
        let fds: Vec<_> = borrowed
            .iter()
            .cycle()
            .take(d.handle_count())
            .copied()
            .collect();
        let e = SharedDevicePrefix::import(&importer, &plan, &d, &fds).unwrap_err();
        assert!(
            matches!(
                e,
                KvCacheError::PlanMismatch { .. } | KvCacheError::Layout(_)
            ),
            "{text}: {e}"
        );
    };
    hostile(&|d| {
        d.end_window = 4_000_000_000;
        d.tail_end_window = 4_000_000_000;
        d.pieces = vec![(0, 4_000_000_000)];
        d.tail_pieces.clear();
    });
    hostile(&|d| d.tokens = u64::MAX);
    hostile(&|d| d.pieces.iter_mut().for_each(|p| p.1 = u64::MAX));
    hostile(&|d| d.pieces.iter_mut().for_each(|p| p.1 = 0));
    hostile(&|d| d.pieces.iter_mut().for_each(|p| p.0 = u64::MAX));
    hostile(&|d| {
        let first = d.pieces[0];
        d.pieces.push(first);
    });
    hostile(&|d| d.first_window = d.end_window + 1);
    // The same plan imports.
    assert!(SharedDevicePrefix::import(&importer, &plan, &descriptor, &borrowed).is_ok());
}

/// The synthetic prompt of `n` tokens (`salt` makes another one).
fn ids(n: u64, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i.wrapping_mul(7919) ^ salt).collect()
}

fn write(geo: &KvGeometry, seq: &mut SequenceKv, ids: &[u32], from: u64) {
    let bpt = geo.bytes_per_token() as usize;
    let mut buf = vec![0u8; (ids.len() - from as usize) * bpt];
    for (k, tok) in buf.chunks_mut(bpt).enumerate() {
        let p = from + k as u64;
        token_kv_bytes(geo, ids[p as usize], p, tok);
    }
    seq.write_tokens(from, &buf).unwrap();
}

#[test]
fn a_prefix_cache_entry_of_two_segments_is_exported_and_hit_in_another_cache() {
    use kvvm_kv::{PrefixCache, PrefixCacheConfig, PublishOutcome};

    let (_sim, [(exporter, _), (importer, gov_b)]) = managers();
    let geo = geometry(1000);
    let plan = LayoutPlan::new(geo, KvLayout::SeqMajor, G).unwrap();
    // Blocks of one window: 4096 / 64 B a token per fragment.
    let blocks = PrefixCacheConfig::default().block_tokens(G / 64);
    let ours = PrefixCache::with_config(exporter.clone(), plan, blocks).unwrap();
    let block = ours.block_tokens();
    // Two publishes make a chain: blocks 0..2, then 2..5 on top of them.
    let long = ids(5 * block + 3, 0);
    let mut a = ours.admit(&long[..2 * block as usize + 1], 1000).unwrap();
    write(&geo, &mut a.sequence, &long[..2 * block as usize + 1], 0);
    ours.publish(&mut a.sequence).unwrap();
    let mut b = ours.admit(&long, 1000).unwrap();
    assert_eq!(b.hit_tokens, 2 * block);
    let hit = b.hit_tokens;
    write(&geo, &mut b.sequence, &long, hit);
    ours.publish(&mut b.sequence).unwrap();
    let prefix = &long[..5 * block as usize];
    let segments = ours.segments(prefix).unwrap();
    assert_eq!(segments.len(), 2);
    assert!(
        ours.segments(&long[..4 * block as usize]).is_none(),
        "no entry of 4 blocks"
    );

    // Across: each segment exported and imported.
    let theirs = PrefixCache::with_config(importer.clone(), plan, blocks).unwrap();
    let imported: Vec<_> = segments
        .iter()
        .map(|s| {
            let (d, fds) = s.export().unwrap();
            let fds: Vec<_> = fds.iter().map(|fd| fd.as_fd()).collect();
            SharedDevicePrefix::import(
                &importer,
                &plan,
                &PrefixDescriptor::decode(&d.encode()).unwrap(),
                &fds,
            )
            .unwrap()
        })
        .collect();
    // Refused: more tokens than the segments hold, a segment missing, segments out of order,
    // a segment no token needs.
    for (tokens, segs) in [
        (&long[..5 * block as usize + 1], imported.clone()),
        (prefix, imported[1..].to_vec()),
        (prefix, vec![imported[1].clone(), imported[0].clone()]),
        (&long[..2 * block as usize], imported.clone()),
    ] {
        let e = theirs.insert(tokens.to_vec(), segs).unwrap_err();
        assert!(matches!(e, KvCacheError::PlanMismatch { .. }), "{e}");
    }
    // Refused: no token; a segment of another manager (the exporter's own), unsealed, or
    // of another plan.
    assert!(theirs.insert(Vec::new(), imported.clone()).is_err());
    let e = theirs
        .insert(prefix.to_vec(), segments.clone())
        .unwrap_err();
    assert!(matches!(e, KvCacheError::PlanMismatch { .. }), "{e}");
    let (unsealed, mut owner) =
        SharedDevicePrefix::reserve_unwritten(&importer, &plan, 5 * block, 1000).unwrap();
    let e = theirs
        .insert(prefix.to_vec(), vec![Arc::clone(&unsealed)])
        .unwrap_err();
    assert!(matches!(e, KvCacheError::PlanMismatch { .. }), "{e}");
    owner.seal_prefix().unwrap();
    assert!(
        matches!(
            theirs.insert(prefix.to_vec(), vec![Arc::clone(&unsealed)]),
            Ok(PublishOutcome::Published { .. })
        ),
        "a sealed segment of this manager and plan is taken"
    );
    theirs.clear();
    let other_plan = LayoutPlan::new(geometry(2000), KvLayout::SeqMajor, G).unwrap();
    let (foreign, mut owner2) =
        SharedDevicePrefix::reserve_unwritten(&importer, &other_plan, 5 * block, 2000).unwrap();
    owner2.seal_prefix().unwrap();
    let e = theirs.insert(prefix.to_vec(), vec![foreign]).unwrap_err();
    assert!(matches!(e, KvCacheError::PlanMismatch { .. }), "{e}");
    drop((unsealed, owner, owner2));
    assert!(matches!(
        theirs.insert(prefix.to_vec(), imported.clone()).unwrap(),
        PublishOutcome::Published { .. }
    ));
    assert_eq!(
        theirs.insert(prefix.to_vec(), imported).unwrap(),
        PublishOutcome::AlreadyCached
    );
    // The exporter lets go of everything; the importer's cache still holds the prefix.
    drop((a, b, segments));
    ours.clear();
    let mut c = theirs.admit(&long, 1000).unwrap();
    assert_eq!(c.hit_tokens, 5 * block, "the imported prefix is hit");
    let hit = c.hit_tokens;
    write(&geo, &mut c.sequence, &long, hit);
    let bpt = geo.bytes_per_token() as usize;
    let mut back = vec![0u8; long.len() * bpt];
    c.sequence.read_tokens(0, &mut back).unwrap();
    let mut want = vec![0u8; back.len()];
    for (p, tok) in want.chunks_mut(bpt).enumerate() {
        token_kv_bytes(&geo, long[p], p as u64, tok);
    }
    assert_eq!(back, want, "every token, the imported ones included");
    // Imported segments are billed elsewhere: nothing to evict here for them.
    drop(c);
    assert_eq!(theirs.stats().idle_bytes, 0);
    assert_eq!(theirs.evict(u64::MAX), 0);
    assert_eq!(gov_b.snapshot().device(D0).used(), 0);
}
