//! Engine processes under one broker: real child processes (this binary re-run), each with a
//! governor leased from a broker that this process runs; after every step the broker's books
//! are checked against what every child reports holding.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{books_agree, socket, wait_until, Proc};
use kvvm_broker::{Broker, BrokerConfig, TenantPolicy};

/// The children's entry point (a no-op in the parent).
#[test]
fn child() {
    common::child_main();
}

fn start(path: &std::path::Path, budget: u64) -> Broker {
    Broker::start(BrokerConfig::new(path, budget)).unwrap()
}

#[test]
fn processes_share_one_budget_and_the_books_agree_after_every_step() {
    let path = socket("share");
    let broker = start(&path, 1000);
    let mut a = Proc::spawn("child", &path, "a");
    let mut b = Proc::spawn("child", &path, "b");
    let mut c = Proc::spawn("child", &path, "c");
    for p in [&mut a, &mut b, &mut c] {
        assert!(p.cmd("grant 300").starts_with("granted"));
        assert_eq!(p.held, 300);
    }
    books_agree(&broker, &[&a, &b, &c]);
    assert!(a.cmd("grant 50").starts_with("granted"), "a batch of 100");
    assert_eq!(a.held, 400);
    books_agree(&broker, &[&a, &b, &c]);
    let refused = b.cmd("grant 50");
    assert!(refused.starts_with("backpressure"), "{refused}");
    // The refusal asked a (over its floor of 0) for the 50 bytes; it had 50 unused.
    let id = a.client;
    wait_until(&broker, "a gave its unused 50 back", |br| {
        br.holdings().contains(&(id, 0, 350))
    });
    assert!(a.cmd("sync").starts_with("synced"));
    assert_eq!(a.held, 350);
    books_agree(&broker, &[&a, &b, &c]);
    assert!(c.cmd("free 300").starts_with("freed"));
    assert_eq!(c.held, 200, "unused above two batches goes back");
    books_agree(&broker, &[&a, &b, &c]);
    assert!(b.cmd("grant 50").starts_with("granted"));
    assert_eq!(b.held, 400, "a batch");
    books_agree(&broker, &[&a, &b, &c]);
    assert!(a.cmd("grant 5000").starts_with("never_fits"));
    books_agree(&broker, &[&a, &b, &c]);
    for p in [a, b, c] {
        p.exit();
    }
    wait_until(&broker, "every exited client's grants are back", |b| {
        b.total_held(0) == 0 && b.clients() == 0
    });
}

#[test]
fn a_sigkilled_client_loses_its_grants() {
    let path = socket("kill");
    let broker = start(&path, 1000);
    let mut a = Proc::spawn("child", &path, "a");
    let mut b = Proc::spawn("child", &path, "b");
    assert!(a.cmd("grant 700").starts_with("granted"));
    assert!(b.cmd("grant 400").starts_with("backpressure"));
    books_agree(&broker, &[&a, &b]);
    a.kill();
    wait_until(&broker, "the killed client's grants are back", |br| {
        br.total_held(0) == 0 && br.clients() == 1
    });
    books_agree(&broker, &[&b]);
    assert!(b.cmd("grant 1000").starts_with("granted"));
    books_agree(&broker, &[&b]);
    b.exit();
}

#[test]
fn a_restarted_broker_is_rejoined_with_what_clients_hold() {
    let path = socket("restart");
    let mut first = start(&path, 1000);
    let mut a = Proc::spawn("child", &path, "a");
    assert!(a.cmd("grant 400").starts_with("granted"));
    books_agree(&first, &[&a]);
    first.stop();
    assert_eq!(first.clients(), 0, "every client was told and let go");
    let second = start(&path, 1000);
    assert!(a.cmd("sync").starts_with("synced"));
    assert_eq!(second.clients(), 1, "registered again");
    assert_eq!(a.held, 400, "kept what it held");
    books_agree(&second, &[&a]);
    assert!(a.cmd("grant 100").starts_with("granted"), "leases again");
    assert_eq!(a.held, 500);
    books_agree(&second, &[&a]);
    a.exit();
}

#[test]
fn tenants_over_their_floor_are_asked_to_give_back() {
    let path = socket("floor");
    let small = TenantPolicy {
        floor: 400,
        ..TenantPolicy::default()
    };
    let broker = Broker::start(BrokerConfig::new(&path, 1000).tenant("small", small)).unwrap();
    let mut big = Proc::spawn("child", &path, "big");
    let mut small = Proc::spawn("child", &path, "small");
    assert!(
        big.cmd("grant 1000").starts_with("backpressure"),
        "400 kept"
    );
    assert!(big.cmd("grant 600").starts_with("granted"));
    assert!(small.cmd("grant 300").starts_with("granted"));
    assert!(big.cmd("free 200").starts_with("freed"));
    assert_eq!(big.held, 600, "two batches kept unused");
    assert!(small.cmd("grant 100").starts_with("granted"));
    books_agree(&broker, &[&big, &small]);
    let refused = small.cmd("grant 100");
    assert!(refused.starts_with("backpressure"), "{refused}");
    let id = big.client;
    wait_until(&broker, "big gave back what small needs", |b| {
        b.holdings().contains(&(id, 0, 500))
    });
    assert!(big.cmd("sync").starts_with("synced"));
    assert_eq!(big.held, 500, "only unused bytes were given back");
    assert!(small.cmd("grant 100").starts_with("granted"));
    books_agree(&broker, &[&big, &small]);
    big.exit();
    small.exit();
}
