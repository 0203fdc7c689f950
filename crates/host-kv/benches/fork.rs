//! Fork and first-write-after-fork of the host paged KV cache, at 1K, 32K and 128K tokens.
//!
//! Geometry: 2 layers x 2 KV heads x head_dim 64, fp16 (1024 bytes per token), 16 tokens per
//! page (16 KiB pages), so 128K tokens are 128 MiB in 8192 pages.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use kvvm_host_kv::{HostPageStore, PagedKvCache};
use kvvm_layout::KvGeometry;

const TOKENS: [u64; 3] = [1 << 10, 32 << 10, 128 << 10];
const TOKENS_PER_PAGE: u32 = 16;

fn base(tokens: u64) -> (HostPageStore, PagedKvCache) {
    let geometry = KvGeometry::new(2, 2, 64, 2, tokens).unwrap();
    let store = HostPageStore::new(geometry, TOKENS_PER_PAGE).unwrap();
    let mut cache = PagedKvCache::new(&store, geometry).unwrap();
    let per_token = geometry.bytes_per_token() as usize;
    let mut token = vec![0u8; per_token];
    for t in 0..tokens {
        token.fill(t as u8);
        cache.append_token(&token).unwrap();
    }
    (store, cache)
}

fn benches(c: &mut Criterion) {
    let mut fork = c.benchmark_group("fork");
    for tokens in TOKENS {
        let (_store, cache) = base(tokens);
        fork.bench_with_input(BenchmarkId::from_parameter(tokens), &cache, |b, cache| {
            b.iter_with_large_drop(|| black_box(cache).fork())
        });
    }
    fork.finish();

    let mut fork_drop = c.benchmark_group("fork_and_drop");
    for tokens in TOKENS {
        let (_store, cache) = base(tokens);
        fork_drop.bench_with_input(BenchmarkId::from_parameter(tokens), &cache, |b, cache| {
            b.iter(|| drop(black_box(cache).fork()))
        });
    }
    fork_drop.finish();

    let mut write = c.benchmark_group("first_write_after_fork");
    for tokens in TOKENS {
        let (_store, cache) = base(tokens);
        let at = tokens / 2;
        let bytes = vec![0xAB; cache.geometry().bytes_per_token() as usize];
        write.bench_with_input(BenchmarkId::from_parameter(tokens), &cache, |b, cache| {
            b.iter_batched(
                || cache.fork(),
                |mut f| {
                    f.ensure_token_for_write(at).unwrap();
                    f.write_token(at, black_box(&bytes)).unwrap();
                    f
                },
                BatchSize::SmallInput,
            )
        });
    }
    write.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
}

criterion_group! {
    name = fork_benches;
    config = config();
    targets = benches
}
criterion_main!(fork_benches);
