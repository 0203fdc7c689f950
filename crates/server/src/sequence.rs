//! One live sequence's KV cache: a reservation sized for its `max_tokens`, with the granule
//! windows that hold live bytes of its first `tokens` tokens committed.
//!
//! This is the only module that touches reservations and layout plans directly; the
//! [`KvService`](crate::KvService) owns the table of these.

use kvvm_kv::{KvGeometry, KvLayout, LayoutPlan};
use kvvm_vmm::{Reservation, VirtualMemory, VmmError};

use crate::error::ServiceError;

/// A live sequence.
#[derive(Debug)]
pub(crate) struct LiveSequence {
    plan: LayoutPlan,
    reservation: Reservation,
    tokens: u64,
}

impl LiveSequence {
    /// Reserves the address space of `geometry` (whose `max_tokens` is the sequence's) under
    /// `layout` and commits the windows of its first `tokens` tokens, as one transaction: on
    /// error nothing is left (the reservation is dropped, which frees it).
    pub(crate) fn open(
        vm: &VirtualMemory,
        geometry: KvGeometry,
        layout: KvLayout,
        tokens: u64,
    ) -> Result<Self, ServiceError> {
        let plan = LayoutPlan::new(geometry, layout, vm.granule())?;
        // Validate the token count before any driver call.
        let needed = plan.committed_bytes_for_tokens(tokens)?;
        let reservation = vm
            .reserve(plan.reservation_bytes())
            .map_err(|e| vmm_error(vm, e, needed))?;
        let mut seq = LiveSequence {
            plan,
            reservation,
            tokens: 0,
        };
        seq.grow_to(vm, tokens)?;
        Ok(seq)
    }

    /// Live tokens.
    pub(crate) fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The most tokens this sequence may hold.
    pub(crate) fn max_tokens(&self) -> u64 {
        self.plan.geometry().max_tokens()
    }

    /// Committed bytes (granule x mapped windows).
    pub(crate) fn committed_bytes(&self) -> u64 {
        self.reservation.committed_bytes()
    }

    /// Reserved bytes of address space.
    pub(crate) fn reserved_bytes(&self) -> u64 {
        self.reservation.size()
    }

    /// The base device address (never changes while the sequence lives).
    pub(crate) fn address(&self) -> u64 {
        self.reservation.address().0
    }

    /// Grows to `tokens` live tokens, committing the windows that now hold live bytes, as one
    /// transaction: on error the sequence is unchanged.
    pub(crate) fn grow_to(&mut self, vm: &VirtualMemory, tokens: u64) -> Result<(), ServiceError> {
        let windows = self.plan.windows_for_tokens(tokens)?;
        let g = self.plan.granule();
        let mut ranges = Vec::with_capacity(windows.len());
        for w in windows {
            let start = w.start.checked_mul(g);
            let len = (w.end - w.start).checked_mul(g);
            match (start, len) {
                (Some(s), Some(l)) => ranges.push((s, l)),
                _ => return Err(ServiceError::Internal("window offset overflow".into())),
            }
        }
        let target = self.plan.committed_bytes_for_tokens(tokens)?;
        let needed = target.saturating_sub(self.committed_bytes());
        self.reservation
            .commit_ranges(&ranges)
            .map_err(|e| vmm_error(vm, e, needed))?;
        self.tokens = tokens;
        Ok(())
    }

    /// Releases every committed window and the address range; returns the bytes that were
    /// committed.
    pub(crate) fn close(mut self) -> Result<u64, ServiceError> {
        let committed = self.committed_bytes();
        let released = self.reservation.release();
        // Dropping the reservation frees the range (or quarantines what cannot be proven
        // idle): the manager never forgets memory.
        drop(self);
        released
            .map(|_| committed)
            .map_err(|e| ServiceError::Internal(format!("release: {e}")))
    }
}

/// Maps a manager error with what this operation needed.
fn vmm_error(vm: &VirtualMemory, e: VmmError, needed: u64) -> ServiceError {
    let device = vm.device();
    let available = vm.governor().snapshot().device(device).free();
    crate::error::from_vmm(e, needed, available, |shortfall| {
        vm.governor().estimate_retry_after(device, shortfall)
    })
}
