//! Forks living, writing and dropping on several threads; the store ends with every page free.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Barrier};
use std::thread;

use kvvm_host_kv::{HostPageStore, PagedKvCache};
use kvvm_layout::KvGeometry;

fn geometry() -> KvGeometry {
    // 2 layers x 1 KV head x head_dim 4, fp16: 32 bytes per token.
    KvGeometry::new(2, 1, 4, 2, 4096).unwrap()
}

fn token(seed: u32) -> Vec<u8> {
    let b = seed.to_le_bytes();
    (0..32).map(|i| b[i % 4].wrapping_add(i as u8)).collect()
}

#[test]
fn forks_written_and_dropped_on_many_threads() {
    const THREADS: u32 = 8;
    const BASE: u32 = 101;
    let store = HostPageStore::new(geometry(), 8).unwrap();
    let mut base = PagedKvCache::new(&store, geometry()).unwrap();
    for t in 0..BASE {
        base.append_token(&token(t)).unwrap();
    }
    let base_pages = store.live_pages();
    let barrier = Arc::new(Barrier::new(THREADS as usize));
    let handles: Vec<_> = (0..THREADS)
        .map(|id| {
            // each thread gets its own fork (and a fork of it) and races the others on the
            // shared pages
            let mut fork = base.fork();
            let barrier = Arc::clone(&barrier);
            thread::spawn(move || {
                barrier.wait();
                let mut sub = fork.fork();
                for round in 0..20u32 {
                    let at = u64::from((id * 7 + round * 13) % BASE);
                    fork.ensure_token_for_write(at).unwrap();
                    fork.write_token(at, &token(1000 * id + round)).unwrap();
                    assert_eq!(fork.token_to_vec(at).unwrap(), token(1000 * id + round));
                    fork.append_token(&token(5000 + id)).unwrap();
                    sub.append_token(&token(9000 + id)).unwrap();
                }
                // the sub-fork still sees the base contents except its own appends
                for t in 0..BASE {
                    assert_eq!(sub.token_to_vec(u64::from(t)).unwrap(), token(t));
                }
                assert_eq!(sub.len(), u64::from(BASE + 20));
                let reads: u32 = fork.pages().map(|p| p.token_count() as u32).sum();
                assert_eq!(reads, BASE + 20);
                if id % 2 == 0 {
                    drop(sub);
                    fork
                } else {
                    drop(fork);
                    sub
                }
            })
        })
        .collect();
    let survivors: Vec<PagedKvCache> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    // the base never changed
    for t in 0..BASE {
        assert_eq!(base.token_to_vec(u64::from(t)).unwrap(), token(t));
    }
    assert!(store.live_pages() > base_pages);
    // drop the survivors on other threads, the base here
    let droppers: Vec<_> = survivors
        .into_iter()
        .map(|c| thread::spawn(move || drop(c)))
        .collect();
    drop(base);
    for d in droppers {
        d.join().unwrap();
    }
    let stats = store.stats();
    assert_eq!(stats.live_pages, 0);
    assert!(stats.free_pages >= base_pages);
}
