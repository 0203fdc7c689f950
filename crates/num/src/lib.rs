//! # kvvm-num: checked arithmetic, conversions, byte sizes and the seeded random generator
//!
//! Arithmetic on sizes is checked across kvvm: an overflow is an error that names what was
//! being computed, never a wrap. [`mul`], [`add`] and [`to_usize`] are that rule written once;
//! each crate turns [`Overflow`] into its own error with a `From` impl, so `mul(a, b, "what")?`
//! reads the same everywhere. [`parse_size`] and [`format_size`] are the one way sizes are read
//! from flags (`8GiB`, `512MiB`, raw bytes) and written for people. [`SplitMix64`] is the one seeded generator (a seed names a
//! synthetic trace, a fault plan or a benchmark's data forever).
//!
//! No dependency on any other kvvm crate: everything may use it.

#![forbid(unsafe_code)]

mod checked;
mod rng;
mod size;

pub use checked::{add, mul, to_u64, to_usize, CheckedInt, Overflow};
pub use rng::{mix64, SplitMix64};
pub use size::{format_size, format_size_fixed, parse_size, SizeError};
