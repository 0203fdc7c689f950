//! Prefixes shared across processes through the broker, on the host backend (memfd): a
//! publisher exports a prefix's handles as descriptors and passes them with `SCM_RIGHTS`;
//! readers of the same tenant import them read-only and verify every byte; the prefix is
//! billed once, outlives its publisher (SIGKILLed) while a reader uses it, is freed when the
//! last user lets go, and a crashed reader's use is dropped with its socket. Another tenant
//! cannot open it.
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::os::fd::AsFd;
use std::sync::Arc;

use common::{socket, wait_until, Proc, CHILD_ENV, LINE, SOCKET_ENV, TENANT_ENV};
use kvvm_broker::{leased_governor, Broker, BrokerClient, BrokerConfig, ClientOptions};
use kvvm_governor::{Governor, LeasePolicy};
use kvvm_hal::{AccessDescriptor, DeviceId, ShareableHandleType, VirtualMemoryBackend};
use kvvm_host::HostBackend;
use kvvm_vmm::{VirtualMemory, VmmConfig};

const D: DeviceId = DeviceId(0);
const KEY: &str = "system-prompt:v1";
const META: &str = "kvvm-prefix/1 64 0 2 0:1 4096:1";

fn byte(i: usize) -> u8 {
    (i.wrapping_mul(13) ^ (i >> 11)) as u8
}

fn granule(host: &Arc<HostBackend>) -> u64 {
    let backend: Arc<dyn VirtualMemoryBackend> = host.clone();
    VirtualMemory::new(backend, D, Governor::unlimited(), VmmConfig::default())
        .unwrap()
        .granule()
}

fn connect() -> (Governor, BrokerClient) {
    let options = ClientOptions::new(
        std::env::var(SOCKET_ENV).unwrap(),
        std::env::var(TENANT_ENV).unwrap(),
    );
    leased_governor(options, LeasePolicy::batches_of(1)).unwrap()
}

fn say(client: &BrokerClient, what: &str) {
    let id = client.welcome().map_or(0, |w| w.client);
    println!("{LINE}{what} client={id} held={}", client.held(0));
}

/// The publisher: commits a two-handle shared prefix through its manager, writes it,
/// publishes its handles, then releases everything of its own and waits to be killed.
#[test]
fn publisher() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    // SAFETY: alarm only arms a timer; a child that hangs dies and its parent sees EOF.
    unsafe { libc::alarm(60) };
    let host = Arc::new(HostBackend::open().unwrap());
    let g = granule(&host);
    let (gov, client) = connect();
    let backend: Arc<dyn VirtualMemoryBackend> = host.clone();
    let config = VmmConfig {
        handle_type: ShareableHandleType::PosixFd,
        ..VmmConfig::default().pool_cap_bytes(0)
    };
    let vm = VirtualMemory::new(backend, D, gov.clone(), config).unwrap();
    let mut owner = vm.reserve(4 * g).unwrap();
    let set = owner.commit_shared(&[(0, g), (g, g)]).unwrap();
    let data: Vec<u8> = (0..usize::try_from(2 * g).unwrap()).map(byte).collect();
    host.copy_to_device(owner.address(), &data).unwrap();
    let fds: Vec<_> = set
        .pieces()
        .iter()
        .map(|p| (host.export_posix_fd(p.handle).unwrap(), p.windows * g))
        .collect();
    let handles: Vec<_> = fds.iter().map(|(fd, size)| (fd.as_fd(), *size)).collect();
    let leased = client.held(0);
    client.publish_prefix(0, KEY, &handles, META).unwrap();
    assert_eq!(client.held(0), leased - 2 * g, "the prefix left the lease");
    drop(fds);
    owner.release().unwrap();
    drop(owner);
    drop(set);
    say(&client, "ready published");
    for _ in std::io::stdin().lines() {
        client.sync().unwrap();
        say(&client, "synced");
    }
}

/// A reader: `open` imports the prefix read-only and verifies it, `verify` reads it again,
/// `close` lets go of it.
#[test]
fn reader() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    // SAFETY: alarm only arms a timer; a child that hangs dies and its parent sees EOF.
    unsafe { libc::alarm(60) };
    let host = HostBackend::open().unwrap();
    let (_gov, client) = connect();
    let mut va = None;
    say(&client, "ready");
    for line in std::io::stdin().lines() {
        let what = match line.unwrap().trim() {
            "open" => match client.open_prefix(KEY) {
                Ok(p) => {
                    assert_eq!(
                        p.meta, META,
                        "the publisher's meta rides with the descriptors"
                    );
                    let total: u64 = p.sizes.iter().sum();
                    let base = host.reserve(total, 0, None).unwrap();
                    let mut at = base;
                    for (fd, size) in p.fds.iter().zip(&p.sizes) {
                        let h = host.import_posix_fd(D, fd.as_fd()).unwrap();
                        host.map(at, *size, h).unwrap();
                        host.release(h).unwrap();
                        at = at.offset(*size);
                    }
                    host.set_access(base, total, &[AccessDescriptor::read_only(D)])
                        .unwrap();
                    let refused = host.copy_to_device(base, b"x").is_err();
                    assert!(refused, "the prefix is read-only here");
                    va = Some((base, total));
                    "opened".to_owned()
                }
                Err(e) => format!("refused {e}"),
            },
            "verify" => {
                let (base, total) = va.unwrap();
                let mut got = vec![0u8; usize::try_from(total).unwrap()];
                host.copy_from_device(&mut got, base).unwrap();
                assert!(
                    got.iter().enumerate().all(|(i, b)| *b == byte(i)),
                    "every byte of the prefix"
                );
                format!("verified bytes={total}")
            }
            "close" => format!("closed users={}", client.close_prefix(KEY).unwrap()),
            _ => return,
        };
        client.sync().unwrap();
        say(&client, &what);
    }
}

fn users(broker: &Broker) -> Option<u32> {
    broker.prefixes().first().map(|p| p.4)
}

#[test]
fn a_prefix_is_shared_read_only_billed_once_and_outlives_its_publisher() {
    let g = granule(&Arc::new(HostBackend::open().unwrap()));
    let path = socket("prefix");
    let broker = Broker::start(BrokerConfig::new(&path, 8 * g)).unwrap();
    let publisher = Proc::spawn("publisher", &path, "t");
    let rows = broker.prefixes();
    assert_eq!(rows, vec![("t".into(), KEY.into(), 0, 2 * g, 1)]);
    assert_eq!(broker.total_held(0), publisher.held + 2 * g, "billed once");

    let mut r1 = Proc::spawn("reader", &path, "t");
    let mut r2 = Proc::spawn("reader", &path, "t");
    let mut thief = Proc::spawn("reader", &path, "other");
    assert!(r1.cmd("open").starts_with("opened"));
    assert_eq!(
        r1.cmd("verify"),
        format!("verified bytes={} client={} held=0", 2 * g, r1.client)
    );
    assert!(r2.cmd("open").starts_with("opened"));
    assert_eq!(users(&broker), Some(3));
    assert!(
        thief.cmd("open").starts_with("refused"),
        "another tenant's prefix"
    );
    assert_eq!(
        broker.total_held(0),
        publisher.held + 2 * g,
        "readers are not billed"
    );

    r2.kill();
    wait_until(&broker, "the crashed reader's use is dropped", |b| {
        users(b) == Some(2)
    });
    publisher.kill();
    wait_until(&broker, "the dead publisher's use is dropped", |b| {
        users(b) == Some(1)
    });
    assert_eq!(
        broker.total_held(0),
        2 * g,
        "the prefix alone, still billed"
    );
    assert!(
        r1.cmd("verify").starts_with("verified"),
        "outlives its publisher"
    );
    assert!(r1.cmd("close").starts_with("closed users=0"));
    assert!(broker.prefixes().is_empty());
    assert_eq!(broker.total_held(0), 0, "freed with its last user");
    assert!(
        r1.cmd("verify").starts_with("verified"),
        "a mapping keeps its memory"
    );
    r1.exit();
    thief.exit();
}
