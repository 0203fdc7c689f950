//! Two of the policies that do not use the virtual-memory API (static-max, realloc-copy; the
//! paged ones are `paged_policy.rs`), accounted by formula with the driver costs of
//! `driver.rs`: one allocation (one handle, one mapping) per buffer.

use std::collections::HashMap;
use std::time::Duration;

use kvvm_num::{add, mul};

use crate::driver::classic;
use crate::error::WorkloadResult;
use crate::policy::{seq_of, take_seq, Costs, Outcome, Policy, PolicyKind, Shape};
use crate::trace::Request;

#[derive(Debug, Clone, Copy)]
struct ClassicSeq {
    tokens: u64,
    capacity_tokens: u64,
}

/// `static-max` and `realloc-copy`, accounted by formula.
#[derive(Debug)]
pub(crate) struct ClassicPolicy {
    kind: PolicyKind,
    shape: Shape,
    seqs: HashMap<usize, ClassicSeq>,
    committed: u64,
    live: u64,
    transient_peak: u64,
    calls: u64,
    time: Duration,
    copy_bytes: u64,
    /// Allocations made (one handle and one mapping each), live now, most live at once.
    allocations: u64,
    live_allocations: u64,
    peak_allocations: u64,
}

impl ClassicPolicy {
    pub fn new(kind: PolicyKind, shape: Shape) -> Self {
        ClassicPolicy {
            kind,
            shape,
            seqs: HashMap::new(),
            committed: 0,
            live: 0,
            transient_peak: 0,
            calls: 0,
            time: Duration::ZERO,
            copy_bytes: 0,
            allocations: 0,
            live_allocations: 0,
            peak_allocations: 0,
        }
    }

    /// One allocation more (live until [`freed`](Self::freed)).
    fn allocated(&mut self) {
        self.allocations = self.allocations.saturating_add(1);
        self.live_allocations = self.live_allocations.saturating_add(1);
        self.peak_allocations = self.peak_allocations.max(self.live_allocations);
    }

    fn freed(&mut self) {
        self.live_allocations = self.live_allocations.saturating_sub(1);
    }

    fn capacity_for(&self, tokens: u64, current: u64) -> u64 {
        let max = self.shape.max_context;
        match self.kind {
            PolicyKind::StaticMax => max,
            _ => {
                if current == 0 {
                    tokens
                        .max(16)
                        .checked_next_power_of_two()
                        .unwrap_or(max)
                        .min(max)
                } else {
                    current.saturating_mul(2).max(tokens).min(max)
                }
            }
        }
    }

    fn limit(&self) -> u64 {
        self.shape.budget
    }

    fn set_tokens(&mut self, id: usize, old: u64, tokens: u64) -> WorkloadResult<()> {
        let bpt = self.shape.bytes_per_token;
        self.live = add(
            self.live.saturating_sub(mul(old, bpt, "live bytes")?),
            mul(tokens, bpt, "live bytes")?,
            "live bytes",
        )?;
        if let Some(s) = self.seqs.get_mut(&id) {
            s.tokens = tokens;
        }
        Ok(())
    }
}

impl Policy for ClassicPolicy {
    fn admit(&mut self, id: usize, _req: &Request, tokens: u64) -> WorkloadResult<Outcome> {
        let cap = self.capacity_for(tokens, 0);
        let bytes = mul(cap, self.shape.bytes_per_token, "allocation bytes")?;
        if add(self.committed, bytes, "committed bytes")? > self.limit() {
            return Ok(Outcome::Refused(None));
        }
        self.committed = add(self.committed, bytes, "committed bytes")?;
        self.calls = self.calls.saturating_add(1);
        self.time = self.time.saturating_add(classic::alloc(bytes));
        self.allocated();
        self.seqs.insert(
            id,
            ClassicSeq {
                tokens: 0,
                capacity_tokens: cap,
            },
        );
        self.set_tokens(id, 0, tokens)?;
        Ok(Outcome::Done)
    }

    fn grow(&mut self, id: usize, tokens: u64) -> WorkloadResult<Outcome> {
        let seq = seq_of(&self.seqs, "grow", id)?;
        if tokens > seq.capacity_tokens {
            let bpt = self.shape.bytes_per_token;
            let cap = self.capacity_for(tokens, seq.capacity_tokens);
            let old_bytes = mul(seq.capacity_tokens, bpt, "allocation bytes")?;
            let new_bytes = mul(cap, bpt, "allocation bytes")?;
            match self.kind {
                PolicyKind::ReallocCopy => {
                    // Allocate the new buffer while the old one is still held, copy, free.
                    let during = add(self.committed, new_bytes, "committed bytes")?;
                    if during > self.limit() {
                        return Ok(Outcome::Refused(None));
                    }
                    self.transient_peak = self.transient_peak.max(during);
                    self.calls = self.calls.saturating_add(3);
                    self.time = self.time.saturating_add(classic::growth(new_bytes));
                    // The new buffer is allocated while the old one is held.
                    self.allocated();
                    self.freed();
                    self.copy_bytes = add(
                        self.copy_bytes,
                        mul(seq.tokens, bpt, "copy bytes")?,
                        "copy bytes",
                    )?;
                }
                _ => {
                    // static-max holds the maximum context: never reached.
                    let extra = new_bytes.saturating_sub(old_bytes);
                    if add(self.committed, extra, "committed bytes")? > self.limit() {
                        return Ok(Outcome::Refused(None));
                    }
                }
            }
            self.committed = add(
                self.committed.saturating_sub(old_bytes),
                new_bytes,
                "committed",
            )?;
            if let Some(s) = self.seqs.get_mut(&id) {
                s.capacity_tokens = cap;
            }
        }
        self.set_tokens(id, seq.tokens, tokens)?;
        Ok(Outcome::Done)
    }

    fn finish(&mut self, id: usize) -> WorkloadResult<()> {
        let seq = take_seq(&mut self.seqs, "finish", id)?;
        let bpt = self.shape.bytes_per_token;
        let bytes = mul(seq.capacity_tokens, bpt, "allocation bytes")?;
        self.committed = self.committed.saturating_sub(bytes);
        self.live = self
            .live
            .saturating_sub(mul(seq.tokens, bpt, "live bytes")?);
        self.calls = self.calls.saturating_add(1);
        self.time = self.time.saturating_add(classic::free(bytes));
        self.freed();
        Ok(())
    }

    fn committed_bytes(&self) -> u64 {
        self.committed
    }

    fn held_bytes(&self) -> u64 {
        self.committed
    }

    fn live_bytes(&self) -> u64 {
        self.live
    }

    fn transient_peak(&self) -> u64 {
        self.transient_peak
    }

    fn close(&mut self) -> WorkloadResult<Costs> {
        Ok(Costs {
            driver_calls: self.calls,
            mappings: self.allocations,
            handles: self.allocations,
            peak_mappings: self.peak_allocations,
            driver_time: self.time,
            measured: false,
            copy_bytes: self.copy_bytes,
            ..Costs::default()
        })
    }
}
