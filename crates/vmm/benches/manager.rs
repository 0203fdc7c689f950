//! The manager's own CPU cost per commit and release, on the simulator with a zero latency
//! model (so the simulator's bookkeeping is included but no modelled driver time).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvvm_hal::{DeviceId, VirtualMemoryBackend};
use kvvm_sim::{LatencyMode, LatencyModel, SimBackend, SimConfig, MIB};
use kvvm_vmm::{Governor, VirtualMemory, VmmConfig};

fn sim(granules: u64) -> Arc<SimBackend> {
    Arc::new(SimBackend::new(
        SimConfig::single(2 * MIB, granules * 2 * MIB)
            .with_latency(LatencyModel::zero(), LatencyMode::Account),
    ))
}

fn manager(sim: &Arc<SimBackend>, pool_bytes: u64) -> VirtualMemory {
    let backend: Arc<dyn VirtualMemoryBackend> = sim.clone();
    VirtualMemory::new(
        backend,
        DeviceId(0),
        Governor::unlimited(),
        VmmConfig::default().pool_cap_bytes(pool_bytes),
    )
    .unwrap()
}

fn commit_release(c: &mut Criterion) {
    let mut group = c.benchmark_group("commit_then_release");
    for k in [1u64, 8, 64, 512] {
        group.throughput(Throughput::Elements(k));
        let s = sim(2 * k);
        let fresh = manager(&s, 0);
        let mut r = fresh.reserve(k * 2 * MIB).unwrap();
        group.bench_with_input(BenchmarkId::new("fresh", k), &k, |b, &k| {
            b.iter(|| {
                black_box(r.commit(k * 2 * MIB).unwrap());
                black_box(r.release().unwrap());
            })
        });
        let pooled = manager(&s, k * 2 * MIB);
        let mut r = pooled.reserve(k * 2 * MIB).unwrap();
        group.bench_with_input(BenchmarkId::new("pooled", k), &k, |b, &k| {
            b.iter(|| {
                black_box(r.commit(k * 2 * MIB).unwrap());
                black_box(r.release().unwrap());
            })
        });
    }
    group.finish();
}

fn raw_sequence(c: &mut Criterion) {
    // The same work straight on the simulator: the manager's overhead is the difference.
    use kvvm_hal::{AccessDescriptor, AllocationProperties};
    let mut group = c.benchmark_group("raw_commit_then_release");
    let g = 2 * MIB;
    for k in [1u64, 8, 64, 512] {
        group.throughput(Throughput::Elements(k));
        let s = sim(2 * k);
        let base = s.reserve(k * g, 0, None).unwrap();
        let props = AllocationProperties::device(DeviceId(0));
        let access = [AccessDescriptor::read_write(DeviceId(0))];
        let mut handles = Vec::with_capacity(k as usize);
        group.bench_with_input(BenchmarkId::new("raw", k), &k, |b, &k| {
            b.iter(|| {
                for i in 0..k {
                    let h = s.create(g, &props).unwrap();
                    s.map(kvvm_hal::DeviceAddress(base.0 + i * g), g, h)
                        .unwrap();
                    handles.push(h);
                }
                s.set_access(base, k * g, &access).unwrap();
                s.unmap(base, k * g).unwrap();
                for h in handles.drain(..) {
                    s.release(h).unwrap();
                }
            })
        });
    }
    group.finish();
}

fn reserve_drop(c: &mut Criterion) {
    let s = sim(16);
    let vm = manager(&s, 16 * 2 * MIB);
    c.bench_function("reserve_commit4_drop_pooled", |b| {
        b.iter(|| {
            let mut r = vm.reserve(1 << 30).unwrap();
            r.commit(4 * 2 * MIB).unwrap();
            drop(black_box(r));
        })
    });
}

criterion_group!(benches, commit_release, raw_sequence, reserve_drop);
criterion_main!(benches);
