//! A bounded soak: many clients of a few tenants lease, return, publish, open and close
//! prefixes, come and go (dropped as a crash would), while the broker is killed or stopped and
//! started again at random; after every event the broker's books are checked against the
//! clients' books, and the node's holding against the budget. Seeded (`KVVM_SOAK_SEED`
//! picks another run), bounded in events and in time.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{memfd, socket, wait_until};
use kvvm_broker::{Broker, BrokerClient, BrokerConfig, ClientOptions};
use kvvm_governor::ManualClock;

const BUDGET: u64 = 2048;
const EVENTS: usize = 10_000;
const TIME: Duration = Duration::from_secs(60);
const MAX_CLIENTS: usize = 10;
const TENANTS: [&str; 3] = ["a", "b", "c"];
const GUARD: Duration = Duration::from_secs(20);

/// xorshift64*: a seeded sequence, the same on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

struct Soak {
    path: PathBuf,
    clock: Arc<ManualClock>,
    broker: Option<Broker>,
    clients: Vec<(String, BrokerClient)>,
    rng: Rng,
}

fn start(path: &Path, clock: &Arc<ManualClock>) -> Broker {
    let mut c = BrokerConfig::new(path, BUDGET).tenant(
        "a",
        kvvm_broker::TenantPolicy {
            floor: 512,
            ..Default::default()
        },
    );
    c.clock = clock.clone();
    c.devices = 2;
    Broker::start(c).unwrap()
}

impl Soak {
    fn broker(&self) -> &Broker {
        self.broker.as_ref().unwrap()
    }

    fn pick(&mut self) -> Option<usize> {
        let n = self.clients.len() as u64;
        (n > 0).then(|| self.rng.below(n) as usize)
    }

    fn key(&mut self) -> String {
        format!("k{}", self.rng.below(4))
    }

    /// One random event; returns its name.
    fn event(&mut self) -> &'static str {
        let roll = self.rng.below(100);
        let Some(i) = self.pick().filter(|_| roll >= 6) else {
            return self.node_event(roll);
        };
        let device = self.rng.below(2) as u32;
        let amount = 1 + self.rng.below(700);
        let key = self.key();
        let c = &self.clients[i].1;
        match roll {
            6..=30 => match c.acquire_bytes(device, amount / 2, amount) {
                Ok(_) => "acquire (granted)",
                Err(_) => "acquire (refused)",
            },
            31..=50 => {
                c.return_bytes(device, amount);
                "return"
            }
            51..=62 => {
                let size = c.held(device).min(64);
                let fd = memfd(size.max(1));
                match c.publish_prefix(device, &key, &[(fd.as_fd(), size)], "m") {
                    Ok(()) => "publish (published)",
                    Err(_) => "publish (refused)",
                }
            }
            63..=75 => match c.open_prefix(&key) {
                Ok(_) => "open (opened)",
                Err(_) => "open (refused)",
            },
            76..=88 => {
                if let Some((k, ..)) = c.prefix_uses().into_iter().next() {
                    c.close_prefix(&k).unwrap();
                }
                "close"
            }
            _ => {
                self.clients.swap_remove(i);
                let n = self.clients.len();
                wait_until(self.broker(), "the dropped client is gone", |b| {
                    b.clients() == n
                });
                "drop a client"
            }
        }
    }

    /// An event of the node: a client more, a broker killed or stopped and started again.
    fn node_event(&mut self, roll: u64) -> &'static str {
        match roll {
            0..=1 => {
                self.broker.take().unwrap().abandon();
                self.broker = Some(start(&self.path, &self.clock));
                "kill and restart the broker"
            }
            2 => {
                drop(self.broker.take());
                self.broker = Some(start(&self.path, &self.clock));
                "stop and start the broker"
            }
            3 if !self.clients.is_empty() => {
                // A client dies while no broker runs: what it held is kept for a claim that
                // never comes, until the grace ends (time passes at once here).
                self.broker.take().unwrap().abandon();
                let i = self.rng.below(self.clients.len() as u64) as usize;
                self.clients.swap_remove(i);
                self.broker = Some(start(&self.path, &self.clock));
                self.clock.advance(self.broker().config().restart_grace);
                "kill the broker, a client dies, restart"
            }
            _ if self.clients.len() < MAX_CLIENTS => {
                let tenant = TENANTS[self.rng.below(3) as usize];
                let c = BrokerClient::connect(ClientOptions::new(&self.path, tenant)).unwrap();
                self.clients.push((tenant.to_owned(), c));
                "a client more"
            }
            _ => "nothing",
        }
    }

    /// The books check, at quiescence: every client back and synced.
    fn check(&self, what: &str) {
        let mut held = Vec::new();
        let mut uses = Vec::new();
        let mut prefixes: BTreeMap<(String, String), (u32, u64)> = BTreeMap::new();
        for (tenant, c) in &self.clients {
            assert!(
                c.wait_connected(GUARD),
                "{what}: a client did not come back"
            );
            c.sync().unwrap();
            let id = c.welcome().unwrap().client;
            held.extend(c.holdings().into_iter().map(|(d, b)| (id, d, b)));
            for (key, device, bytes, n) in c.prefix_uses() {
                uses.push((id, key.clone(), n));
                prefixes.insert((tenant.clone(), key), (device, bytes));
            }
        }
        let b = self.broker();
        // A client dropped while it was reconnecting may register once more before its
        // socket closes: the broker forgets it soon after.
        let live = self.clients.len();
        wait_until(b, "no dropped client is left", |b| b.clients() == live);
        let mut got = b.holdings();
        got.sort_unstable();
        held.sort_unstable();
        assert_eq!(got, held, "{what}: the broker's books are the clients'");
        let mut got_uses = b.prefix_uses();
        got_uses.sort();
        uses.sort();
        assert_eq!(got_uses, uses, "{what}: prefix uses");
        let kept = b.unclaimed();
        for device in 0..2 {
            let leases: u64 = held.iter().filter(|h| h.1 == device).map(|h| h.2).sum();
            let shared: u64 = prefixes
                .values()
                .filter(|p| p.0 == device)
                .map(|p| p.1)
                .sum();
            let kept: u64 = kept.iter().filter(|k| k.0 .1 == device).map(|k| k.1).sum();
            let all = leases + shared + kept;
            assert_eq!(b.total_held(device), all, "{what}: device {device}");
            assert!(all <= BUDGET, "{what}: over the budget");
        }
    }
}

#[test]
fn clients_and_brokers_that_come_and_go_keep_the_books_equal() {
    let seed = std::env::var("KVVM_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x05ee_d0fb_00c5_u64);
    let path = socket("soak");
    let clock = Arc::new(ManualClock::new());
    let mut soak = Soak {
        broker: Some(start(&path, &clock)),
        path,
        clock,
        clients: Vec::new(),
        rng: Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
    };
    let began = Instant::now();
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for n in 0..EVENTS {
        if began.elapsed() > TIME {
            break;
        }
        let what = soak.event();
        *counts.entry(what).or_default() += 1;
        soak.check(&format!("seed {seed:#x}, event {n} ({what})"));
    }
    eprintln!("soak, seed {seed:#x}: {counts:?} in {:?}", began.elapsed());
    for kind in [
        "kill and restart the broker",
        "stop and start the broker",
        "kill the broker, a client dies, restart",
        "acquire (granted)",
        "publish (published)",
        "open (opened)",
        "close",
        "drop a client",
    ] {
        assert!(
            counts.get(kind).copied().unwrap_or(0) > 0,
            "no {kind} in {counts:?}"
        );
    }
    // Whatever is still kept for claims goes once a request comes after the grace.
    soak.clock.advance(soak.broker().config().restart_grace);
    let mut n = common::raw::connect(&soak.path);
    common::raw::welcomed(&common::raw::hello(&mut n, "last"));
    drop(common::raw::acquire(&mut n, 0, 0));
    drop(n);
    assert!(soak.broker().unclaimed().is_empty());
    soak.check("the end");
    let books = soak.broker().config().books_path();
    soak.clients.clear();
    drop(soak.broker.take());
    let _ = std::fs::remove_file(books);
}
