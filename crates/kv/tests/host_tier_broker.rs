//! The host tier under a node's broker: the page-locked bytes of every engine come out of one
//! node-wide budget on the host "device" ([`DeviceId::HOST`], device number `u32::MAX` on the
//! wire), as device bytes do on each GPU. One engine's idle pinned memory is given back to
//! the broker when another needs it; a swap the node's host budget cannot hold now is refused
//! on the host, changing nothing.
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{tiny, tokens_bytes, D0};
use kvvm_broker::{leased_governor, Broker, BrokerClient, BrokerConfig, ClientOptions};
use kvvm_governor::LeasePolicy;
use kvvm_hal::{DeviceId, VirtualMemoryBackend};
use kvvm_host::HostBackend;
use kvvm_kv::{HostTier, HostTierConfig, KvCacheError, KvLayout, LayoutPlan, SequenceKv};
use kvvm_vmm::{GranularityChoice, VirtualMemory, VmmConfig};

const HOST: u32 = u32::MAX;

struct Engine {
    vm: VirtualMemory,
    tier: Arc<HostTier>,
    client: BrokerClient,
}

fn granule(backend: &Arc<dyn VirtualMemoryBackend>) -> u64 {
    VirtualMemory::new(
        Arc::clone(backend),
        D0,
        kvvm_governor::Governor::unlimited(),
        VmmConfig::default().granularity(GranularityChoice::Minimum),
    )
    .unwrap()
    .granule()
}

fn engine(
    backend: &Arc<dyn VirtualMemoryBackend>,
    socket: &std::path::Path,
    tenant: &str,
) -> Engine {
    let g = granule(backend);
    let (gov, client) = leased_governor(
        ClientOptions::new(socket, tenant),
        LeasePolicy::batches_of(g),
    )
    .unwrap();
    let vm = VirtualMemory::new(
        Arc::clone(backend),
        D0,
        gov,
        VmmConfig::default().granularity(GranularityChoice::Minimum),
    )
    .unwrap();
    let tier = HostTier::new(&vm, HostTierConfig::default().slab_windows(1)).unwrap();
    Engine { vm, tier, client }
}

/// Polls `cond` (a failure guard of 20 s, never an outcome).
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(20), "never: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn engines_share_the_node_host_budget_and_idle_pinned_memory_goes_to_who_needs_it() {
    let backend: Arc<dyn VirtualMemoryBackend> = match HostBackend::open() {
        Ok(b) => Arc::new(b),
        Err(e) => {
            println!("skipped: no host backend here ({e})");
            return;
        }
    };
    let socket =
        std::env::temp_dir().join(format!("kvvm-kv-host-tier-{}.sock", std::process::id()));
    let g = granule(&backend);
    // 6 windows a device, the host's included.
    let mut broker = Broker::start(BrokerConfig::new(&socket, 6 * g)).unwrap();
    let a = engine(&backend, &socket, "a");
    let b = engine(&backend, &socket, "b");
    // a pins 5 windows ahead of need: leased from the node's host budget.
    a.tier.prewarm(5 * g).unwrap();
    a.client.sync().unwrap();
    assert_eq!(broker.total_held(HOST), 5 * g);
    // b's sequence of 2 windows (its device bytes leased on device 0, apart).
    let plan = LayoutPlan::new(tiny(4096), KvLayout::TokenMajor, g).unwrap();
    let tokens = 2 * g / plan.geometry().bytes_per_token();
    let mut seq = SequenceKv::new(&b.vm, &plan, 4096).unwrap();
    seq.ensure_tokens(tokens).unwrap();
    let data = tokens_bytes(plan.geometry(), 1, 0, tokens, 0);
    seq.write_tokens(0, &data).unwrap();
    // The node's host budget has 1 window left: b's swap is refused on the host, nothing
    // changed, and the broker asks a for its idle pinned memory.
    let refused = seq.swap_out(&b.tier, tokens, None).unwrap_err();
    assert!(
        matches!(&refused, KvCacheError::Backpressure(x) if x.device == DeviceId::HOST),
        "{refused:?}"
    );
    assert_eq!(seq.committed_tokens(), tokens);
    wait_until("a gave its idle pinned slabs back to the node", || {
        broker.total_held(HOST) < 5 * g
    });
    assert!(a.tier.stats().slabs < 5);
    // b's retry is granted: its pinned bytes now come out of the node's host budget.
    let mut swap = loop {
        match seq.swap_out(&b.tier, tokens, None) {
            Ok(s) => break s,
            Err(e) if e.backpressure().is_some() => {
                wait_until("the node's host bytes free up", || {
                    broker.total_held(HOST) <= 4 * g
                });
            }
            Err(e) => panic!("{e}"),
        }
    };
    seq.finish_swap_out(&mut swap).unwrap();
    b.client.sync().unwrap();
    a.client.sync().unwrap();
    let held = b.vm.governor().lease_held(DeviceId::HOST).unwrap_or(0);
    assert!(held >= 2 * g, "b leases its pinned bytes: {held}");
    assert!(broker.total_held(HOST) <= 6 * g);
    seq.swap_in(&mut swap).unwrap();
    seq.finish_swap_in(&mut swap).unwrap();
    let mut back = vec![0u8; data.len()];
    seq.read_tokens(0, &mut back).unwrap();
    assert_eq!(back, data);
    drop(swap);
    drop(seq);
    drop(b);
    drop(a);
    broker.stop();
}
