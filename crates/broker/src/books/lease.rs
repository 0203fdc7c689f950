//! Leases: acquire (floors, ceilings, the shared rest, asks to give back), give back, and the
//! claims of clients that held bytes under a previous broker, with the bytes kept for them
//! after a restart.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvvm_governor::{RetryPolicy, TenantBounds, TenantId};

use super::{BooksError, NodeBooks, ReclaimAsk};
use crate::proto::WireRefusal;

/// What an acquire answers: the bytes granted, or a refusal with the asks to send.
pub type AcquireOutcome = Result<u64, (WireRefusal, Vec<ReclaimAsk>)>;

impl NodeBooks {
    /// Keeps `lent` (per tenant and device: what a previous broker had lent when it stopped)
    /// for the claims of its clients until `until`: those bytes count as their tenant's
    /// until claimed, so nothing new is granted out of them; what is not claimed by then
    /// is let go. Devices this broker does not budget are skipped.
    pub fn keep_for_claims(&mut self, lent: BTreeMap<(String, u32), u64>, until: Instant) {
        for ((name, device), bytes) in lent {
            if bytes == 0 || self.check_device(device).is_err() {
                continue;
            }
            let tenant = self.names.enter(&name);
            self.lend(tenant, None, device, bytes);
            let kept = self.grace.unclaimed.entry((tenant, device)).or_default();
            *kept = kept.saturating_add(bytes);
        }
        if !self.grace.unclaimed.is_empty() {
            self.grace.until = Some(until);
        }
    }

    /// Bytes kept for claims now, per (tenant, device).
    pub fn unclaimed(&self) -> BTreeMap<(String, u32), u64> {
        self.by_name(&self.grace.unclaimed)
    }

    /// Lets the bytes kept for claims go once the grace is over.
    pub(super) fn expire(&mut self, now: Instant) {
        if self.grace.until.is_none_or(|until| now < until) {
            return;
        }
        self.grace.until = None;
        for ((tenant, device), bytes) in std::mem::take(&mut self.grace.unclaimed) {
            self.take_back(tenant, None, device, bytes);
        }
    }

    /// Records bytes a client already held under a previous broker: accepted once per device
    /// where it holds nothing, from what is kept for its tenant's claims and, for the rest,
    /// only if it fits the tenant's ceiling and the budget (the node is never over it).
    pub fn claim(
        &mut self,
        client: u64,
        device: u32,
        bytes: u64,
        now: Instant,
    ) -> Result<u64, BooksError> {
        let tenant = self.claimant(client, device, now)?;
        if self.client_held(client, device) > 0 {
            return Err(BooksError::Claim(device));
        }
        self.bill_claim(tenant, Some(client), device, bytes)?;
        Ok(bytes)
    }

    /// The tenant of `client`, claiming on `device` at `now`, once what is kept for claims
    /// is let go if the grace is over.
    pub(super) fn claimant(
        &mut self,
        client: u64,
        device: u32,
        now: Instant,
    ) -> Result<TenantId, BooksError> {
        self.expire(now);
        let tenant = self.tenant_of(client)?;
        self.check_device(device)?;
        Ok(tenant)
    }

    /// Bills a claim of `bytes` on `device` to `tenant` (and its `client`, if any): out of
    /// what is kept for the tenant's claims; outside a grace (no books file was left, or the
    /// grace is over) the rest if it fits; all or nothing. During a grace a claim of more
    /// than is kept for its tenant is refused: what the previous broker lent is all kept,
    /// so more is no client's.
    pub(super) fn bill_claim(
        &mut self,
        tenant: TenantId,
        client: Option<u64>,
        device: u32,
        bytes: u64,
    ) -> Result<(), BooksError> {
        let key = (tenant, device);
        let kept = self.grace.unclaimed.get(&key).copied().unwrap_or(0);
        let from_kept = bytes.min(kept);
        let extra = bytes - from_kept;
        let ceiling = self.tenants.get(&tenant).map_or(0, |t| t.limits.ceiling);
        let fits = self.held_by(tenant, device).saturating_add(extra) <= ceiling
            && self.total.get(device).saturating_add(extra) <= self.budget
            && (extra == 0 || self.grace.until.is_none());
        if !fits {
            return Err(BooksError::Claim(device));
        }
        if from_kept == kept {
            self.grace.unclaimed.remove(&key);
        } else {
            self.grace.unclaimed.insert(key, kept - from_kept);
        }
        if self.grace.unclaimed.is_empty() {
            self.grace.until = None;
        }
        // What was kept counts already as the tenant's and the node's.
        if let Some(c) = client.and_then(|c| self.clients.get_mut(&c)) {
            c.held.add(device, from_kept);
        }
        self.lend(tenant, client, device, extra);
        Ok(())
    }

    /// Bytes kept free on `device` for tenants other than `tenant` that are under their floor
    /// (the named tenants, whether connected or not, and the others known now).
    fn reserved_for_others(&self, tenant: TenantId, device: u32) -> u64 {
        let named = self
            .named
            .iter()
            .filter(|(id, l)| l.floor > 0 && **id != tenant)
            .map(|(id, l)| (*l, self.held_by(*id, device)));
        let others = self
            .tenants
            .iter()
            .filter(|(id, t)| t.limits.floor > 0 && **id != tenant && !self.names.is_named(**id))
            .map(|(_, t)| (t.limits, t.held.get(device)));
        TenantBounds::kept_free_for(named.chain(others))
    }

    /// Grants `client` at least `need` and at most `want` bytes on `device`, or refuses with
    /// the asks to send to tenants over their floor. Returns the bytes granted. A device the
    /// broker does not budget never fits.
    pub fn acquire(
        &mut self,
        client: u64,
        device: u32,
        need: u64,
        want: u64,
        retry: &RetryPolicy,
        now: Instant,
    ) -> Result<AcquireOutcome, BooksError> {
        self.expire(now);
        let tenant = self.tenant_of(client)?;
        let bounds = self
            .tenants
            .get(&tenant)
            .map(|t| t.limits)
            .unwrap_or_default();
        let ceiling = bounds.ceiling;
        let mine = self.client_held(client, device);
        let (limit, limit_bytes) = if self.check_device(device).is_err() {
            ("device_not_budgeted", 0)
        } else if ceiling < self.budget {
            ("tenant_ceiling", ceiling)
        } else {
            ("node_budget", self.budget)
        };
        let needed = mine.saturating_add(need);
        if needed > limit_bytes || limit_bytes == 0 {
            let refusal = WireRefusal::NeverFits {
                needed,
                limit: limit.to_owned(),
                limit_bytes,
            };
            self.counters.never_fits += 1;
            return Ok(Err((refusal, Vec::new())));
        }
        let room = bounds.room_in(
            self.held_by(tenant, device),
            (self.total.get(device), self.budget),
            self.reserved_for_others(tenant, device),
        );
        let available = room.available();
        if room.refusing(need).is_none() {
            let granted = want.max(need).min(available);
            self.lend(tenant, Some(client), device, granted);
            self.counters.grants += 1;
            self.counters.granted_bytes = self.counters.granted_bytes.saturating_add(granted);
            return Ok(Ok(granted));
        }
        let shortfall = need.saturating_sub(available);
        // Others are asked only when the node binds, not the tenant's own ceiling.
        let asks = if room.shared < room.tenant {
            self.asks(tenant, device, shortfall)
        } else {
            Vec::new()
        };
        let freed = self.given_back_in(device, now, retry.window);
        let retry_after = retry.estimate(shortfall, freed);
        let refusal = WireRefusal::Backpressure {
            needed: need,
            available,
            retry_after_ms: u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX),
        };
        self.counters.backpressure += 1;
        self.counters.reclaim_asks += asks.len() as u64;
        let asked = asks.iter().fold(0u64, |a, k| a.saturating_add(k.bytes));
        self.counters.reclaim_asked_bytes = self.counters.reclaim_asked_bytes.saturating_add(asked);
        Ok(Err((refusal, asks)))
    }

    /// Asks for `shortfall` bytes on `device` from clients of tenants (other than `tenant`)
    /// over their floor, each for at most its tenant's excess and its own holding.
    fn asks(&self, tenant: TenantId, device: u32, shortfall: u64) -> Vec<ReclaimAsk> {
        let mut left = shortfall;
        let mut asks = Vec::new();
        for (id, t) in &self.tenants {
            if *id == tenant || left == 0 {
                continue;
            }
            let mut excess = t.limits.excess(t.held.get(device));
            for id in &t.clients {
                let bytes = self.client_held(*id, device).min(excess).min(left);
                if bytes > 0 {
                    asks.push(ReclaimAsk {
                        client: *id,
                        device,
                        bytes,
                    });
                    excess -= bytes;
                    left -= bytes;
                }
            }
        }
        asks
    }

    /// Takes `bytes` on `device` back from `client`; more than it holds changes nothing.
    /// Returns what it holds now.
    pub fn give_back(
        &mut self,
        client: u64,
        device: u32,
        bytes: u64,
        now: Instant,
    ) -> Result<u64, BooksError> {
        let tenant = self.tenant_of(client)?;
        let rest = self.held_after(client, device, bytes)?;
        self.take_back(tenant, Some(client), device, bytes);
        self.note_given_back(device, bytes, now);
        Ok(rest)
    }

    /// Bytes given back on `device` during the `window` before `now`.
    fn given_back_in(&mut self, device: u32, now: Instant, window: Duration) -> u64 {
        self.given_back.get_mut(&device).map_or(0, |w| {
            w.prune(now, window);
            w.total(now, window)
        })
    }
}
