//! # kvvm-bench: the benchmarks and demo loops
//!
//! Every measurement `kvvm bench` prints lives here, over the library crates' public APIs
//! (the libraries themselves expose no benchmark code):
//!
//! | module | `kvvm bench` | what |
//! |---|---|---|
//! | [`vmm`] | `vmm` | the manager's commit against the raw driver sequence, pool and parked windows against fresh commits, a request's give warm against cold against one handle, growth by one granule (with [`realloc`] on CUDA) |
//! | [`call_clock`] | `vmm` | a backend wrapper timing each driver call of a commit |
//! | [`realloc`] | `vmm` | the realloc-and-copy baseline (CUDA's plain allocation and device copy) |
//! | [`decode`] | `kv` | the synthetic decode loop: sequences sharing a prompt prefix, every byte verified; committed bytes with and without sharing, attach against copy |
//! | [`host`] | `host` | the host backend against plain memory: commit + first touch vs mmap, prefix attach vs memcpy |
//! | [`precommit`] | `decode` | `ensure_tokens` latency on the decode path, inline against the background pre-committer |
//!
//! The criterion benchmarks of the manager's CPU cost stay with their crate
//! (`cargo bench -p kvvm-vmm`, `cargo bench -p kvvm-host-kv`).

#![forbid(unsafe_code)]

pub mod call_clock;
pub mod decode;
mod decode_report;
pub mod host;
pub mod precommit;
mod raw;
pub mod realloc;
mod stats;
pub mod timing;
pub mod tp;
mod units;
pub mod vmm;
mod vmm_give;
mod vmm_report;
mod vmm_runs;
