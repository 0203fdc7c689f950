//! Copy-on-write forks, errors and page accounting of the host paged KV cache.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvvm_host_kv::{HostKvError, HostPageStore, PageWrite, PagedKvCache};
use kvvm_layout::{KvError, KvGeometry, KvKind};

/// 2 layers x 2 KV heads x head_dim 4, fp16: 64 bytes per token; per K/V per layer 16 bytes.
fn geometry(max_tokens: u64) -> KvGeometry {
    KvGeometry::new(2, 2, 4, 2, max_tokens).unwrap()
}

fn store() -> HostPageStore {
    HostPageStore::new(geometry(1024), 4).unwrap()
}

/// A token whose every byte encodes (seed, position) so mix-ups show.
fn token(seed: u8) -> Vec<u8> {
    (0..64u8)
        .map(|i| seed.wrapping_mul(31).wrapping_add(i))
        .collect()
}

fn filled(store: &HostPageStore, n: u8) -> PagedKvCache {
    let mut c = PagedKvCache::new(store, geometry(1024)).unwrap();
    for t in 0..n {
        assert_eq!(c.append_token(&token(t)).unwrap(), u64::from(t));
    }
    c
}

#[test]
fn append_and_read_back() {
    let s = store();
    let c = filled(&s, 10);
    assert_eq!(c.len(), 10);
    assert_eq!(c.page_count(), 3);
    assert_eq!(s.live_pages(), 3);
    for t in 0..10u8 {
        assert_eq!(c.token_to_vec(u64::from(t)).unwrap(), token(t));
        let tok = token(t);
        for layer in 0..2u32 {
            for kind in KvKind::BOTH {
                let run = (layer as usize * 2 + kind.index() as usize) * 16;
                assert_eq!(
                    c.token_kv(u64::from(t), layer, kind).unwrap(),
                    &tok[run..run + 16]
                );
            }
        }
    }
}

#[test]
fn fork_copies_nothing_and_first_write_copies_one_page() {
    let s = store();
    let mut a = filled(&s, 10);
    let mut b = a.fork();
    assert_eq!(s.live_pages(), 3, "fork allocated no page");
    for p in 0..3 {
        assert_eq!(a.page_table().ref_count(p), Some(2));
        assert_eq!(
            a.page_table().physical_page(p),
            b.page_table().physical_page(p)
        );
    }
    // a write into a shared page without ensure_page_for_write is refused
    assert_eq!(
        b.write_token(1, &token(99)),
        Err(HostKvError::PageShared {
            logical_page: 0,
            ref_count: 2
        })
    );
    // ensure copies once, then it is exclusive
    let from = a.page_table().physical_page(0).unwrap();
    match b.ensure_page_for_write(0).unwrap() {
        PageWrite::Copied { from: f, to } => {
            assert_eq!(f, from);
            assert_ne!(to, from);
        }
        other => panic!("expected a copy, got {other:?}"),
    }
    assert_eq!(s.live_pages(), 4);
    assert_eq!(b.ensure_page_for_write(0).unwrap(), PageWrite::Exclusive);
    assert_eq!(a.ensure_page_for_write(0).unwrap(), PageWrite::Exclusive);
    b.write_token(1, &token(99)).unwrap();
    assert_eq!(b.token_to_vec(1).unwrap(), token(99));
    assert_eq!(a.token_to_vec(1).unwrap(), token(1), "sibling unchanged");
    // appends after the fork diverge on the shared tail page
    assert_eq!(a.append_token(&token(50)).unwrap(), 10);
    assert_eq!(b.append_token(&token(60)).unwrap(), 10);
    assert_eq!(a.token_to_vec(10).unwrap(), token(50));
    assert_eq!(b.token_to_vec(10).unwrap(), token(60));
    assert_eq!(a.token_to_vec(9).unwrap(), token(9));
    assert_eq!(b.token_to_vec(9).unwrap(), token(9));
    // page 1 still shared
    assert_eq!(a.page_table().ref_count(1), Some(2));
    drop(a);
    drop(b);
    assert_eq!(s.live_pages(), 0);
    assert_eq!(s.free_pages(), 5);
}

#[test]
fn forks_of_forks() {
    let s = store();
    let root = filled(&s, 6);
    let mut child = root.fork();
    child.append_token(&token(100)).unwrap();
    let mut grandchild = child.fork();
    assert_eq!(root.page_table().ref_count(0), Some(3));
    assert_eq!(child.page_table().ref_count(1), Some(2));
    grandchild.ensure_token_for_write(0).unwrap();
    grandchild.write_token(0, &token(200)).unwrap();
    grandchild.append_token(&token(201)).unwrap();
    assert_eq!(root.len(), 6);
    assert_eq!(child.len(), 7);
    assert_eq!(grandchild.len(), 8);
    assert_eq!(root.token_to_vec(0).unwrap(), token(0));
    assert_eq!(child.token_to_vec(0).unwrap(), token(0));
    assert_eq!(grandchild.token_to_vec(0).unwrap(), token(200));
    assert_eq!(child.token_to_vec(6).unwrap(), token(100));
    assert_eq!(grandchild.token_to_vec(6).unwrap(), token(100));
    assert_eq!(grandchild.token_to_vec(7).unwrap(), token(201));
    assert!(root.token_to_vec(6).is_err());
    // dropping the root first keeps the children intact
    drop(root);
    assert_eq!(child.token_to_vec(5).unwrap(), token(5));
    assert_eq!(grandchild.token_to_vec(5).unwrap(), token(5));
    drop(grandchild);
    assert!(s.live_pages() > 0);
    drop(child);
    assert_eq!(s.live_pages(), 0);
}

#[test]
fn dropped_pages_are_reused() {
    let s = store();
    let a = filled(&s, 8);
    let ids: Vec<_> = a.page_table().entries().map(|(id, _)| id).collect();
    drop(a);
    assert_eq!((s.live_pages(), s.free_pages()), (0, 2));
    let b = filled(&s, 8);
    let mut again: Vec<_> = b.page_table().entries().map(|(id, _)| id).collect();
    again.sort();
    let mut ids = ids;
    ids.sort();
    assert_eq!(ids, again, "no new allocation");
    assert_eq!(s.free_pages(), 0);
    drop(b);
    assert_eq!(s.release_free_pages(), 2);
    assert_eq!(s.stats().held_bytes(), 0);
}

#[test]
fn truncate_releases_pages() {
    let s = store();
    let mut a = filled(&s, 10);
    let b = a.fork();
    a.truncate(3);
    assert_eq!(a.len(), 3);
    assert_eq!(a.page_count(), 1);
    assert_eq!(s.live_pages(), 3, "b still maps them");
    a.append_token(&token(77)).unwrap();
    assert_eq!(a.token_to_vec(3).unwrap(), token(77));
    assert_eq!(b.token_to_vec(3).unwrap(), token(3));
    drop(b);
    assert_eq!(s.live_pages(), 1);
    a.truncate(0);
    assert!(a.is_empty());
    assert_eq!(s.live_pages(), 0);
}

#[test]
fn page_iterator_for_decode() {
    let s = store();
    let c = filled(&s, 10);
    let views: Vec<_> = c.pages().collect();
    assert_eq!(c.pages().len(), 3);
    assert_eq!(
        views.iter().map(|v| v.tokens()).collect::<Vec<_>>(),
        vec![0..4, 4..8, 8..10]
    );
    for v in &views {
        for layer in 0..2u32 {
            let keys = v.keys(layer).unwrap();
            let values = v.values(layer).unwrap();
            assert_eq!(keys.len(), v.token_count() * 16);
            for (i, t) in v.tokens().enumerate() {
                let run = layer as usize * 2 * 16;
                assert_eq!(&keys[i * 16..(i + 1) * 16], &token(t as u8)[run..run + 16]);
                assert_eq!(
                    &values[i * 16..(i + 1) * 16],
                    &token(t as u8)[run + 16..run + 32]
                );
            }
        }
        assert!(matches!(
            v.keys(2),
            Err(HostKvError::Geometry(KvError::LayerOutOfRange {
                layer: 2,
                layers: 2
            }))
        ));
    }
    let fork = c.fork();
    let shared: Vec<_> = fork.pages().map(|v| v.physical_page()).collect();
    assert_eq!(
        shared,
        views.iter().map(|v| v.physical_page()).collect::<Vec<_>>()
    );
}

#[test]
fn bad_input_is_a_typed_error() {
    let s = store();
    // geometry mismatch between store and cache
    let other = KvGeometry::new(2, 2, 8, 2, 16).unwrap();
    assert!(matches!(
        PagedKvCache::new(&s, other),
        Err(HostKvError::GeometryMismatch {
            store: (2, 2, 4, 2),
            cache: (2, 2, 8, 2)
        })
    ));
    assert_eq!(
        HostPageStore::new(geometry(4), 0).unwrap_err(),
        HostKvError::ZeroTokensPerPage
    );
    let mut c = filled(&s, 3);
    assert_eq!(
        c.token_to_vec(3),
        Err(HostKvError::TokenOutOfRange { token: 3, len: 3 })
    );
    assert_eq!(
        c.write_token(7, &token(0)),
        Err(HostKvError::TokenOutOfRange { token: 7, len: 3 })
    );
    assert_eq!(
        c.append_token(&[0; 63]),
        Err(HostKvError::WrongTokenBytes {
            expected: 64,
            got: 63
        })
    );
    assert_eq!(
        c.append_tokens(&[0; 65]),
        Err(HostKvError::WrongTokenBytes {
            expected: 64,
            got: 65
        })
    );
    let mut buf = [0u8; 10];
    assert!(matches!(
        c.read_token(0, &mut buf),
        Err(HostKvError::WrongTokenBytes { .. })
    ));
    assert!(matches!(
        c.token_kv(0, 9, KvKind::Key),
        Err(HostKvError::Geometry(KvError::LayerOutOfRange { .. }))
    ));
    assert!(matches!(
        c.write_token_kv(0, 0, KvKind::Value, &[0; 3]),
        Err(HostKvError::WrongTokenBytes {
            expected: 16,
            got: 3
        })
    ));
    assert_eq!(
        c.ensure_page_for_write(5),
        Err(HostKvError::LogicalPageOutOfRange { page: 5, pages: 1 })
    );
    // a full sequence
    let mut small = PagedKvCache::new(&s, geometry(2)).unwrap();
    small.append_tokens(&[token(0), token(1)].concat()).unwrap();
    assert_eq!(
        small.append_token(&token(2)),
        Err(HostKvError::CapacityExceeded {
            len: 2,
            max_tokens: 2
        })
    );
    c.write_token_kv(0, 1, KvKind::Value, &[9; 16]).unwrap();
    assert_eq!(c.token_kv(0, 1, KvKind::Value).unwrap(), &[9; 16]);
}

#[test]
fn store_limit_is_an_error_and_appends_are_all_or_nothing() {
    let s = HostPageStore::with_page_limit(geometry(1024), 4, 2).unwrap();
    let mut c = PagedKvCache::new(&s, geometry(1024)).unwrap();
    c.append_tokens(&vec![1u8; 64 * 6]).unwrap();
    let before = c.len();
    // 6 tokens + 4 more need a third page
    assert_eq!(
        c.append_tokens(&vec![2u8; 64 * 4]),
        Err(HostKvError::StoreExhausted { limit: 2 })
    );
    assert_eq!(c.len(), before);
    assert_eq!(c.page_count(), 2);
    // a fork cannot copy its shared tail page either
    let mut f = c.fork();
    assert_eq!(
        f.append_token(&token(1)),
        Err(HostKvError::StoreExhausted { limit: 2 })
    );
    assert_eq!(f.len(), 6);
    drop(c);
    // now f is the only owner: no copy needed
    f.append_token(&token(1)).unwrap();
    assert_eq!(f.token_to_vec(6).unwrap(), token(1));
}

#[test]
fn ensure_with_a_foreign_store_is_refused() {
    let s = store();
    let s2 = store();
    let c = filled(&s, 2);
    let mut table = c.page_table().fork();
    assert_eq!(
        table.ensure_page_for_write(0, &s2),
        Err(HostKvError::StoreMismatch)
    );
    assert_eq!(s2.live_pages(), 0);
    assert!(matches!(
        table.ensure_page_for_write(0, &s),
        Ok(PageWrite::Copied { .. })
    ));
}

#[test]
fn send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<HostPageStore>();
    assert_send_sync::<PagedKvCache>();
    assert_send_sync::<kvvm_host_kv::PageTable>();
    assert_send_sync::<HostKvError>();
}
