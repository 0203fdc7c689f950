//! A broker killed (no word to its clients, its socket left stale) and started again at every
//! step of a script that several clients play, and again while a request is in flight: the
//! clients notice at once, reconnect and claim what they hold (nobody asks them to); until
//! they have, the new broker keeps what its predecessor lent, so the leases never add up to
//! more than the budget; once they have, the broker's books are the clients' books. A client
//! on a raw socket is stepped through its reconnect (hello, claim) with the books checked at
//! each step.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::raw::{acquire, code, connect, give_back, hello, send, welcomed};
use common::{memfd, socket};
use kvvm_broker::proto::ErrorCode;
use kvvm_broker::{Broker, BrokerClient, BrokerConfig, ClientOptions, Reply, Request};
use kvvm_governor::ManualClock;

const BUDGET: u64 = 1000;
/// A failure guard for reconnects, never an outcome.
const GUARD: Duration = Duration::from_secs(20);

struct World {
    path: PathBuf,
    clock: Arc<ManualClock>,
    broker: Option<Broker>,
    /// a, a2 (tenant a), b (tenant b).
    clients: Vec<BrokerClient>,
    /// A client on a raw socket (tenant r): its connection, number and holding.
    raw: Option<UnixStream>,
    raw_id: u64,
    raw_held: u64,
    /// Whether the broker must hold exactly what the clients hold (no request whose answer
    /// was lost).
    exact: bool,
}

fn config(path: &Path, clock: &Arc<ManualClock>) -> BrokerConfig {
    let mut c = BrokerConfig::new(path, BUDGET);
    c.clock = clock.clone();
    c
}

impl World {
    fn new(name: &str) -> World {
        let path = socket(name);
        let clock = Arc::new(ManualClock::new());
        let broker = Broker::start(config(&path, &clock)).unwrap();
        let client = |t: &str| BrokerClient::connect(ClientOptions::new(&path, t)).unwrap();
        let clients = vec![client("a"), client("a"), client("b")];
        let mut raw = connect(&path);
        let raw_id = welcomed(&hello(&mut raw, "r"));
        assert!(matches!(
            acquire(&mut raw, 0, 50),
            Reply::Held { held: 50, .. }
        ));
        World {
            path,
            clock,
            broker: Some(broker),
            clients,
            raw: Some(raw),
            raw_id,
            raw_held: 50,
            exact: true,
        }
    }

    fn broker(&self) -> &Broker {
        self.broker.as_ref().unwrap()
    }

    /// What every client holds, by its own books: (client number, device, bytes).
    fn clients_books(&self) -> Vec<(u64, u32, u64)> {
        let mut all: Vec<(u64, u32, u64)> = self
            .clients
            .iter()
            .flat_map(|c| {
                let id = c.welcome().unwrap().client;
                c.holdings().into_iter().map(move |(d, b)| (id, d, b))
            })
            .collect();
        if self.raw_held > 0 {
            all.push((self.raw_id, 0, self.raw_held));
        }
        all.sort_unstable();
        all
    }

    /// Bytes the clients hold, with the prefixes they use (each once): what the node holds.
    fn clients_total(&self) -> u64 {
        let mut prefixes = BTreeMap::new();
        for c in &self.clients {
            for (key, _, bytes, _) in c.prefix_uses() {
                prefixes.insert(key, bytes);
            }
        }
        self.clients_books().iter().map(|h| h.2).sum::<u64>() + prefixes.values().sum::<u64>()
    }

    /// At any moment: the leases and prefixes the clients hold are in what the broker holds
    /// (theirs, and what it keeps for their claims), which fits the budget; a newcomer gets
    /// the rest and not a byte more. With `exact`, the broker holds nothing else.
    fn check_budget(&self) {
        let mut n = connect(&self.path);
        welcomed(&hello(&mut n, "newcomer"));
        // A request, so that a grace that is over ends first.
        assert!(matches!(acquire(&mut n, 0, 0), Reply::Held { .. }));
        let clients = self.clients_total();
        let held = self.broker().total_held(0);
        assert!(
            clients <= held && held <= BUDGET,
            "{clients} <= {held} <= {BUDGET}: clients {:?} {:?}, broker {:?} {:?} {:?} kept {:?}",
            self.clients_books(),
            self.clients
                .iter()
                .map(BrokerClient::prefix_uses)
                .collect::<Vec<_>>(),
            self.broker().holdings(),
            self.broker().prefixes(),
            self.broker().prefix_uses(),
            self.broker().unclaimed(),
        );
        if self.exact {
            assert_eq!(
                clients, held,
                "the broker keeps exactly what the clients hold"
            );
        }
        let r = acquire(&mut n, 0, BUDGET - held + 1);
        assert!(
            matches!(r, Reply::Refused { .. }),
            "one byte too many: {r:?}"
        );
        if held < BUDGET {
            let r = acquire(&mut n, 0, BUDGET - held);
            assert!(matches!(r, Reply::Held { .. }), "all that is free: {r:?}");
            let r = give_back(&mut n, 0, BUDGET - held);
            assert!(matches!(r, Reply::Held { held: 0, .. }), "{r:?}");
        }
    }

    /// Once every client is back: the broker's books are the clients' books.
    fn check_books(&self) {
        for c in &self.clients {
            assert!(c.wait_connected(GUARD), "a client did not come back");
            c.sync().unwrap();
        }
        let b = self.broker();
        let mut got = b.holdings();
        got.sort_unstable();
        assert_eq!(
            got,
            self.clients_books(),
            "the broker's books are the clients'"
        );
        let mut uses: Vec<(u64, String, u32)> = self
            .clients
            .iter()
            .flat_map(|c| {
                let id = c.welcome().unwrap().client;
                c.prefix_uses()
                    .into_iter()
                    .map(move |(k, _, _, n)| (id, k, n))
            })
            .collect();
        uses.sort();
        let mut broker_uses = b.prefix_uses();
        broker_uses.sort();
        assert_eq!(broker_uses, uses, "and their prefix uses");
        let kept: u64 = b.unclaimed().values().sum();
        assert_eq!(
            b.total_held(0),
            self.clients_total() + kept,
            "nothing else is held"
        );
    }

    /// [`check_books`](Self::check_books), with nothing kept for claims: every byte the
    /// previous broker lent was claimed.
    fn check_books_exactly(&self) {
        self.check_books();
        assert!(
            self.broker().unclaimed().is_empty(),
            "everything kept was claimed"
        );
    }

    /// Kills the broker and starts another on the same socket; the raw client's connection
    /// is gone with it.
    fn restart(&mut self) {
        self.broker.take().unwrap().abandon();
        self.raw = None;
        // Every client notices at once (its connection ended), nothing asked of it (a
        // failure guard, never an outcome).
        let began = std::time::Instant::now();
        while self.clients.iter().any(BrokerClient::connected) {
            assert!(
                began.elapsed() < GUARD,
                "a client did not notice its broker died"
            );
            std::thread::yield_now();
        }
        self.broker = Some(Broker::start(config(&self.path, &self.clock)).unwrap());
    }

    /// Waits (a failure guard, never an outcome) until every client came back by itself and
    /// claimed what it holds, nothing asked of it: what is kept for claims is the raw
    /// client's alone.
    fn clients_come_back(&self) {
        let raw = self.raw_held;
        common::wait_until(self.broker(), "the clients came back by themselves", |b| {
            b.clients() == self.clients.len()
                && b.unclaimed()
                    .into_iter()
                    .all(|((t, _), bytes)| t == "r" && bytes == raw)
        });
    }

    /// Steps the raw client back in: hello, then its claim, checking the budget at each step.
    fn raw_rejoins(&mut self) {
        self.check_budget();
        let mut s = connect(&self.path);
        self.raw_id = welcomed(&hello(&mut s, "r"));
        self.check_budget();
        let lie = Request::Claim {
            id: 5,
            device: 0,
            bytes: BUDGET,
        };
        assert_eq!(
            code(&send(&mut s, &lie)),
            Some(ErrorCode::NotHeld),
            "more than r had"
        );
        let claim = Request::Claim {
            id: 6,
            device: 0,
            bytes: self.raw_held,
        };
        let r = send(&mut s, &claim);
        assert!(matches!(r, Reply::Held { .. }), "{r:?}");
        self.raw = Some(s);
        self.check_budget();
    }
}

impl Drop for World {
    fn drop(&mut self) {
        self.clients.clear();
        self.raw = None;
        if let Some(b) = self.broker.take() {
            let books = b.config().books_path();
            drop(b);
            let _ = std::fs::remove_file(books);
        }
    }
}

/// One step of the script.
fn step(w: &mut World, i: usize) {
    let [a, a2, b] = [&w.clients[0], &w.clients[1], &w.clients[2]];
    match i {
        0 => drop(a.acquire_bytes(0, 300, 300)),
        1 => drop(b.acquire_bytes(0, 200, 200)),
        2 => a.return_bytes(0, 100),
        3 => {
            let fd = memfd(100);
            let _ = a.publish_prefix(0, "p", &[(fd.as_fd(), 100)], "meta");
        }
        4 => drop(a2.open_prefix("p")),
        5 => drop(a.close_prefix("p")),
        6 => drop(b.acquire_bytes(0, 300, 400)),
        7 => drop(a2.acquire_bytes(0, 100, 100)),
        8 => {
            let s = w.raw.as_mut().unwrap();
            if matches!(give_back(s, 0, 20), Reply::Held { .. }) {
                w.raw_held -= 20;
            }
        }
        9 => drop(a2.close_prefix("p")),
        10 => b.return_bytes(0, 200),
        _ => drop(a.acquire_bytes(0, 1, 1000)),
    }
}

const STEPS: usize = 12;

#[test]
fn a_broker_killed_at_every_step_never_lends_a_byte_twice_and_its_books_come_back() {
    for kill_at in 0..=STEPS {
        let mut w = World::new(&format!("restart-{kill_at}"));
        for i in 0..STEPS {
            if i == kill_at {
                w.restart();
                w.clients_come_back();
                w.raw_rejoins();
                w.check_books_exactly();
                // Twice more, back to back: the second kill may find clients half way
                // through their claims.
                w.restart();
                w.check_budget();
                w.restart();
                w.raw_rejoins();
                w.check_books_exactly();
            }
            step(&mut w, i);
            w.check_books_exactly();
            w.check_budget();
        }
    }
}

#[test]
fn a_broker_killed_while_a_request_is_in_flight_never_lends_a_byte_twice() {
    for at in 0..STEPS {
        let mut w = World::new(&format!("in-flight-{at}"));
        for i in 0..at {
            step(&mut w, i);
        }
        w.check_books();
        w.exact = false;
        // The step's request and the kill race: whichever wins, the books agree after.
        let path = w.path.clone();
        let clock = w.clock.clone();
        let broker = w.broker.take().unwrap();
        let killer = std::thread::spawn(move || {
            broker.abandon();
            Broker::start(config(&path, &clock)).unwrap()
        });
        // The raw client's step needs the broker it had: it is not played here (its
        // connection ends with the killed broker below, not before: that would be its death).
        if at != 8 {
            step(&mut w, at);
        }
        w.broker = Some(killer.join().unwrap());
        w.raw = None;
        w.raw_rejoins();
        w.check_books();
        w.check_budget();
        // A grant whose answer was lost, or a return never read, was lent by the killed
        // broker and is claimed by nobody: kept until the grace ends, then let go.
        w.clock.advance(w.broker().config().restart_grace);
        w.exact = true;
        w.check_budget();
        w.check_books_exactly();
    }
}

#[test]
fn what_a_client_that_never_comes_back_held_is_lent_again_when_the_grace_ends() {
    let mut w = World::new("never-back");
    step(&mut w, 0);
    w.check_books();
    w.restart();
    // The raw client died with the old broker's connection and never comes back.
    w.raw_held = 0;
    for c in &w.clients {
        assert!(c.wait_connected(GUARD));
    }
    let held = w.clients_total();
    let mut n = connect(&w.path);
    welcomed(&hello(&mut n, "newcomer"));
    let r = acquire(&mut n, 0, BUDGET - held);
    assert!(matches!(r, Reply::Refused { .. }), "r's 50 are kept: {r:?}");
    assert_eq!(w.broker().unclaimed().values().sum::<u64>(), 50);
    w.clock.advance(w.broker().config().restart_grace);
    let r = acquire(&mut n, 0, BUDGET - held);
    assert!(matches!(r, Reply::Held { .. }), "the grace is over: {r:?}");
    assert!(w.broker().unclaimed().is_empty());
}
