//! What a case is ([`Case`]) and the helpers every case uses.

use std::fmt::Display;

use kvvm_hal::{BackendResult, DeviceAddress, ErrorKind};

use crate::ctx::Ctx;
pub(crate) use crate::verdict::{Outcome, Verdict};

/// One named case of the suite.
#[derive(Clone, Copy)]
pub struct Case {
    /// Stable name (used in reports and `--case` filters).
    pub name: &'static str,
    /// What it checks.
    pub description: &'static str,
    pub(crate) run: fn(&Ctx<'_>) -> Outcome,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Case").field("name", &self.name).finish()
    }
}

pub(crate) fn fail(msg: impl Display) -> Verdict {
    Verdict::Fail(msg.to_string())
}

pub(crate) fn ensure(cond: bool, msg: impl Display) -> Outcome {
    if cond {
        Ok(())
    } else {
        Err(fail(msg))
    }
}

pub(crate) fn expect_kind<T>(r: BackendResult<T>, kind: ErrorKind, what: &str) -> Outcome {
    match r {
        Ok(_) => Err(fail(format!("{what}: succeeded, expected {kind}"))),
        Err(e) if e.kind == kind => Ok(()),
        Err(e) => Err(fail(format!("{what}: got {e}, expected {kind}"))),
    }
}

pub(crate) fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
        .collect()
}

/// The wrapping sum of `bytes`: what a load probe over them returns.
pub(crate) fn load_sum(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0u64, |acc, &b| acc.wrapping_add(u64::from(b)))
}

pub(crate) fn read_back(ctx: &Ctx<'_>, at: DeviceAddress, len: usize) -> BackendResult<Vec<u8>> {
    let mut v = vec![0u8; len];
    ctx.backend.copy_from_device(&mut v, at)?;
    Ok(v)
}

pub(crate) fn at(va: DeviceAddress, off: u64) -> Result<DeviceAddress, Verdict> {
    va.checked_add(off)
        .ok_or_else(|| fail("address arithmetic overflowed"))
}

/// Bytes a case writes and reads back when it samples a granule.
pub(crate) const SAMPLE: usize = 4096;
