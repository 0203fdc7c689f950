//! Engine processes with a real manager on the host backend (memfd + mmap), each governor
//! leased from one broker: committed bytes are written and read back, a released pool is
//! evicted when another engine needs the node's bytes, and a SIGKILLed engine's lease
//! returns to the node.
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use common::{books_agree, socket, wait_until, Proc, CHILD_ENV, LINE, SOCKET_ENV, TENANT_ENV};
use kvvm_broker::{leased_governor, Broker, BrokerConfig, ClientOptions};
use kvvm_governor::{Governor, LeasePolicy};
use kvvm_hal::{DeviceId, VirtualMemoryBackend};
use kvvm_host::HostBackend;
use kvvm_vmm::{VirtualMemory, VmmConfig, VmmError};

const D: DeviceId = DeviceId(0);

fn granule() -> u64 {
    let host: Arc<dyn VirtualMemoryBackend> = Arc::new(HostBackend::open().unwrap());
    VirtualMemory::new(host, D, Governor::unlimited(), VmmConfig::default())
        .unwrap()
        .granule()
}

fn byte(i: usize, seed: u64) -> u8 {
    (i.wrapping_mul(31) as u64 ^ seed) as u8
}

/// The engine child: a manager on the host backend charging a leased governor; commands
/// `commit N` (granules more, written and read back), `release` (everything, to the pool),
/// `sync`.
#[test]
fn engine() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    // SAFETY: alarm only arms a timer; a child that hangs dies and its parent sees EOF.
    unsafe { libc::alarm(60) };
    let host = Arc::new(HostBackend::open().unwrap());
    let backend: Arc<dyn VirtualMemoryBackend> = host.clone();
    let g = granule();
    let options = ClientOptions::new(
        std::env::var(SOCKET_ENV).unwrap(),
        std::env::var(TENANT_ENV).unwrap(),
    );
    let (gov, client) = leased_governor(options, LeasePolicy::batches_of(g)).unwrap();
    let vm = VirtualMemory::new(backend, D, gov.clone(), VmmConfig::default()).unwrap();
    let mut r = vm.reserve(128 * g).unwrap();
    let report = |what: &str| {
        let held = gov.lease_held(D).unwrap_or(0);
        let id = client.welcome().map_or(0, |w| w.client);
        println!("{LINE}{what} client={id} held={held}");
    };
    report("ready");
    for line in std::io::stdin().lines() {
        let line = line.unwrap();
        let mut words = line.split_whitespace();
        let cmd = words.next().unwrap_or("");
        let n: u64 = words.next().unwrap_or("0").parse().unwrap();
        let what = match cmd {
            "commit" => match r.commit(n * g) {
                Ok(_) => {
                    let len = usize::try_from(r.committed_bytes()).unwrap();
                    let seed = u64::from(std::process::id());
                    let data: Vec<u8> = (0..len).map(|i| byte(i, seed)).collect();
                    host.copy_to_device(r.address(), &data).unwrap();
                    let mut back = vec![0u8; len];
                    host.copy_from_device(&mut back, r.address()).unwrap();
                    assert!(back == data, "every committed byte reads back");
                    "committed".to_owned()
                }
                Err(VmmError::Backpressure(_)) => "backpressure".to_owned(),
                Err(VmmError::NeverFits(_)) => "never_fits".to_owned(),
                Err(e) => panic!("commit: {e}"),
            },
            "release" => {
                r.release().unwrap();
                "released".to_owned()
            }
            "sync" => "synced".to_owned(),
            _ => return,
        };
        let _ = client.sync();
        report(&what);
    }
}

#[test]
fn engines_share_the_node_and_a_pool_is_evicted_for_another_engine() {
    let g = granule();
    let path = socket("engines");
    let broker = Broker::start(BrokerConfig::new(&path, 8 * g)).unwrap();
    let mut a = Proc::spawn("engine", &path, "a");
    let mut b = Proc::spawn("engine", &path, "b");
    assert!(a.cmd("commit 6").starts_with("committed"));
    assert_eq!(a.held, 6 * g);
    assert!(b.cmd("commit 2").starts_with("committed"));
    books_agree(&broker, &[&a, &b]);
    assert!(b.cmd("commit 1").starts_with("backpressure"));
    books_agree(&broker, &[&a, &b]);
    // The refusal asked a for bytes; a takes the ask before it releases (its reader takes the
    // broker's messages in order, so its sync returns after the ask), when it has nothing idle
    // to give: otherwise the ask could land after the release and evict the pool below.
    assert!(a.cmd("sync").starts_with("synced"));
    assert_eq!(a.held, 6 * g, "nothing idle to give back yet");
    // a releases into its pool: still used, still leased, until someone needs the bytes.
    assert!(a.cmd("release").starts_with("released"));
    assert_eq!(a.held, 6 * g);
    assert!(b.cmd("commit 4").starts_with("backpressure"));
    let id = a.client;
    wait_until(
        &broker,
        "a evicted its pool and gave the bytes back",
        |br| {
            br.holdings()
                .iter()
                .any(|&(c, _, held)| c == id && held <= 2 * g)
        },
    );
    assert!(a.cmd("sync").starts_with("synced"));
    books_agree(&broker, &[&a, &b]);
    assert!(b.cmd("commit 4").starts_with("committed"));
    books_agree(&broker, &[&a, &b]);
    assert!(a.cmd("commit 100").starts_with("never_fits"));
    b.kill();
    wait_until(&broker, "the killed engine's lease is back", |br| {
        br.clients() == 1
    });
    assert!(a.cmd("commit 6").starts_with("committed"));
    books_agree(&broker, &[&a]);
    a.exit();
}
