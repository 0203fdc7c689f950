//! Property test: forks behave like independent copies of `Vec<Vec<u8>>`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvvm_host_kv::{HostKvError, HostPageStore, PagedKvCache};
use kvvm_layout::KvGeometry;
use proptest::prelude::*;

const MAX_TOKENS: u64 = 40;
const FORKS: usize = 6;

fn geometry() -> KvGeometry {
    // 2 layers x 1 KV head x head_dim 2, fp16: 16 bytes per token.
    KvGeometry::new(2, 1, 2, 2, MAX_TOKENS).unwrap()
}

fn token(seed: u8) -> Vec<u8> {
    (0..16u8).map(|i| seed.wrapping_mul(17) ^ i).collect()
}

#[derive(Debug, Clone)]
enum Op {
    Append { fork: usize, seed: u8 },
    Fork { fork: usize },
    Write { fork: usize, token: usize, seed: u8 },
    WriteWithoutEnsure { fork: usize, token: usize, seed: u8 },
    Truncate { fork: usize, len: usize },
    Drop { fork: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..FORKS, any::<u8>()).prop_map(|(fork, seed)| Op::Append { fork, seed }),
        2 => (0..FORKS).prop_map(|fork| Op::Fork { fork }),
        3 => (0..FORKS, 0..MAX_TOKENS as usize, any::<u8>())
            .prop_map(|(fork, token, seed)| Op::Write { fork, token, seed }),
        2 => (0..FORKS, 0..MAX_TOKENS as usize, any::<u8>())
            .prop_map(|(fork, token, seed)| Op::WriteWithoutEnsure { fork, token, seed }),
        1 => (0..FORKS, 0..MAX_TOKENS as usize).prop_map(|(fork, len)| Op::Truncate { fork, len }),
        1 => (0..FORKS).prop_map(|fork| Op::Drop { fork }),
    ]
}

/// Runs `ops` on real forks and on plain copied vectors, comparing after every step.
fn run(ops: &[Op], tokens_per_page: u32) -> Result<(), TestCaseError> {
    let store = HostPageStore::new(geometry(), tokens_per_page).unwrap();
    let mut real: Vec<Option<PagedKvCache>> = (0..FORKS).map(|_| None).collect();
    let mut model: Vec<Option<Vec<Vec<u8>>>> = vec![None; FORKS];
    real[0] = Some(PagedKvCache::new(&store, geometry()).unwrap());
    model[0] = Some(Vec::new());
    for op in ops {
        match *op {
            Op::Append { fork, seed } => {
                if let (Some(c), Some(m)) = (&mut real[fork], &mut model[fork]) {
                    let r = c.append_token(&token(seed));
                    if m.len() as u64 == MAX_TOKENS {
                        let is_full = matches!(r, Err(HostKvError::CapacityExceeded { .. }));
                        prop_assert!(is_full);
                    } else {
                        prop_assert_eq!(r.unwrap(), m.len() as u64);
                        m.push(token(seed));
                    }
                }
            }
            Op::Fork { fork } => {
                if let Some(src) = real[fork].as_ref().map(|c| c.fork()) {
                    let m = model[fork].clone();
                    let live = store.live_pages();
                    // the first empty slot gets the fork
                    if let Some(slot) = real.iter().position(Option::is_none) {
                        real[slot] = Some(src);
                        model[slot] = m;
                    }
                    prop_assert_eq!(store.live_pages(), live, "a fork allocates nothing");
                }
            }
            Op::Write {
                fork,
                token: t,
                seed,
            } => {
                if let (Some(c), Some(m)) = (&mut real[fork], &mut model[fork]) {
                    if t < m.len() {
                        c.ensure_token_for_write(t as u64).unwrap();
                        c.write_token(t as u64, &token(seed)).unwrap();
                        m[t] = token(seed);
                    } else {
                        let is_range_error = matches!(
                            c.write_token(t as u64, &token(seed)),
                            Err(HostKvError::TokenOutOfRange { .. })
                        );
                        prop_assert!(is_range_error);
                    }
                }
            }
            Op::WriteWithoutEnsure {
                fork,
                token: t,
                seed,
            } => {
                if let (Some(c), Some(m)) = (&mut real[fork], &mut model[fork]) {
                    if t < m.len() {
                        let page = t / tokens_per_page as usize;
                        let shared = c.page_table().ref_count(page).unwrap() > 1;
                        let r = c.write_token(t as u64, &token(seed));
                        if shared {
                            let is_shared_error = matches!(r, Err(HostKvError::PageShared { .. }));
                            prop_assert!(is_shared_error);
                        } else {
                            prop_assert!(r.is_ok());
                            m[t] = token(seed);
                        }
                    }
                }
            }
            Op::Truncate { fork, len } => {
                if let (Some(c), Some(m)) = (&mut real[fork], &mut model[fork]) {
                    c.truncate(len as u64);
                    m.truncate(len);
                }
            }
            Op::Drop { fork } => {
                real[fork] = None;
                model[fork] = None;
            }
        }
        // every live fork reads exactly its model
        for (c, m) in real.iter().zip(&model) {
            if let (Some(c), Some(m)) = (c, m) {
                prop_assert_eq!(c.len(), m.len() as u64);
                for (i, expect) in m.iter().enumerate() {
                    prop_assert_eq!(&c.token_to_vec(i as u64).unwrap(), expect);
                }
                let from_pages: usize = c.pages().map(|p| p.token_count()).sum();
                prop_assert_eq!(from_pages, m.len());
            }
        }
        // live pages = distinct physical pages mapped by live forks
        let mut ids: Vec<_> = real
            .iter()
            .flatten()
            .flat_map(|c| {
                c.page_table()
                    .entries()
                    .map(|(id, _)| id)
                    .collect::<Vec<_>>()
            })
            .collect();
        ids.sort();
        ids.dedup();
        prop_assert_eq!(store.live_pages(), ids.len());
    }
    drop(real);
    prop_assert_eq!(
        store.live_pages(),
        0,
        "all pages back when the last fork drops"
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn a_write_after_a_fork_never_shows_in_a_sibling(
        ops in proptest::collection::vec(op(), 1..80),
        tokens_per_page in 1u32..6,
    ) {
        run(&ops, tokens_per_page)?;
    }
}
