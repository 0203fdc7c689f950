//! [`MappedGrowthGrant`]: permission to commit bytes, settled exactly once per byte.

use std::fmt;
use std::sync::Arc;

use kvvm_hal::DeviceId;

use crate::books::Ledger;
use crate::bucket::Bucket;
use crate::error::GovernorError;

/// Permission to commit `bytes` more physical memory on one device.
///
/// The granted bytes are deducted from the budget (as *pending*) until the grant is settled:
/// [`commit`](Self::commit) or [`settle`](Self::settle) turn them into a bucket,
/// [`rollback`](Self::rollback) or dropping the grant return them.
#[must_use = "a grant that is dropped is rolled back"]
pub struct MappedGrowthGrant {
    ledger: Arc<Ledger>,
    device: DeviceId,
    bytes: u64,
}

impl fmt::Debug for MappedGrowthGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MappedGrowthGrant")
            .field("device", &self.device)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl MappedGrowthGrant {
    /// A grant of `bytes` on `device`, already added to the ledger's pending bytes.
    pub(crate) fn new(ledger: Arc<Ledger>, device: DeviceId, bytes: u64) -> Self {
        MappedGrowthGrant {
            ledger,
            device,
            bytes,
        }
    }

    /// The books the grant settles into.
    pub(crate) fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    /// The device the grant is for.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// The bytes still held by the grant.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Turns `bytes` of the grant into `bucket` (physical memory now exists for them).
    /// Fails, changing nothing, if the grant holds fewer bytes.
    pub fn settle(&mut self, bytes: u64, bucket: Bucket) -> Result<(), GovernorError> {
        self.take(bytes, Some(bucket))
    }

    /// Takes `bytes` out of the grant into `bucket` (`None`: back to the budget); fails,
    /// changing nothing, if the grant holds fewer bytes.
    fn take(&mut self, bytes: u64, bucket: Option<Bucket>) -> Result<(), GovernorError> {
        let rest = self
            .bytes
            .checked_sub(bytes)
            .ok_or(GovernorError::Underflow {
                device: self.device,
                bucket: "grant",
                bytes,
                held: self.bytes,
            })?;
        self.ledger.settle_pending(self.device, bytes, bucket);
        self.bytes = rest;
        Ok(())
    }

    /// Returns `bytes` of the grant to the budget (they were not needed). Fails, changing
    /// nothing, if the grant holds fewer bytes.
    pub fn give_back(&mut self, bytes: u64) -> Result<(), GovernorError> {
        self.take(bytes, None)
    }

    /// A successful commit: every byte still held becomes [`Bucket::Committed`].
    pub fn commit(mut self) {
        let bytes = std::mem::take(&mut self.bytes);
        self.ledger
            .settle_pending(self.device, bytes, Some(Bucket::Committed));
    }

    /// A failed commit: every byte still held returns to the budget.
    pub fn rollback(mut self) {
        let bytes = std::mem::take(&mut self.bytes);
        self.ledger.settle_pending(self.device, bytes, None);
    }
}

impl Drop for MappedGrowthGrant {
    fn drop(&mut self) {
        let bytes = std::mem::take(&mut self.bytes);
        self.ledger.settle_pending(self.device, bytes, None);
    }
}
