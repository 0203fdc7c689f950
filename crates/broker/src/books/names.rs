//! [`TenantNames`]: the tenants' names, what users write in the configuration, the hello and
//! the metrics, and the governor's [`TenantId`] the books know them by. A name is resolved
//! once, when a client registers or a restart keeps bytes for its tenant's claims; the books
//! are keyed by the id from then on and give the name back only in what they report.
//!
//! The tenants named in the configuration have their ids for the broker's life (their floors
//! are kept whether they are connected or not); any other name is forgotten with its tenant's
//! books, so the table holds no more names than the configuration and the tenants known now.

use std::collections::BTreeMap;

use kvvm_governor::TenantId;

/// Every tenant name the books know, and its id.
#[derive(Debug, Default)]
pub(crate) struct TenantNames {
    ids: BTreeMap<String, TenantId>,
    names: BTreeMap<TenantId, String>,
    /// Ids below this are the configuration's: never forgotten.
    named: u64,
    /// The next id given (ids are never given twice).
    next: u64,
}

impl TenantNames {
    /// A table of the names `named` (the configuration's), numbered from 0 in their order.
    pub(crate) fn new<'a>(named: impl IntoIterator<Item = &'a String>) -> Self {
        let mut table = TenantNames::default();
        for name in named {
            table.enter(name);
        }
        table.named = table.next;
        table
    }

    /// The id of `name`, if the books know it.
    pub(crate) fn id(&self, name: &str) -> Option<TenantId> {
        self.ids.get(name).copied()
    }

    /// The name of `id` (empty for an id the books do not know: none is ever reported).
    pub(crate) fn name(&self, id: TenantId) -> &str {
        self.names.get(&id).map_or("", String::as_str)
    }

    /// Whether `id` is a tenant named in the configuration.
    pub(crate) fn is_named(&self, id: TenantId) -> bool {
        id.0 < self.named
    }

    /// The id of `name`, entered with a new id if the books did not know it.
    pub(crate) fn enter(&mut self, name: &str) -> TenantId {
        if let Some(id) = self.id(name) {
            return id;
        }
        // 2^64 names are never entered: the counter saturates rather than wraps.
        let id = TenantId(self.next);
        self.next = self.next.saturating_add(1);
        self.ids.insert(name.to_owned(), id);
        self.names.insert(id, name.to_owned());
        id
    }

    /// Forgets `id` (its tenant's books are gone), unless it is named in the configuration.
    pub(crate) fn forget(&mut self, id: TenantId) {
        if self.is_named(id) {
            return;
        }
        if let Some(name) = self.names.remove(&id) {
            self.ids.remove(&name);
        }
    }

    /// How many names the table holds.
    pub(crate) fn len(&self) -> usize {
        self.names.len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use kvvm_governor::RetryPolicy;

    use super::*;
    use crate::books::NodeBooks;
    use crate::config::{BrokerConfig, TenantPolicy};

    fn floor(floor: u64) -> TenantPolicy {
        TenantPolicy {
            floor,
            ..TenantPolicy::default()
        }
    }

    #[test]
    fn the_books_forget_a_name_with_its_tenant_and_keep_the_configuration_s() {
        let config = BrokerConfig::new("/nonexistent", 100).tenant("named", floor(30));
        let mut b = NodeBooks::new(&config);
        let honest = b.register("honest", &floor(0), 100);
        let before = b.entries();
        assert_eq!((before.names, before.tenants), (2, 1), "{before:?}");
        let now = Instant::now();
        let retry = RetryPolicy::default();
        for i in 0..5_000u32 {
            let name = format!("t{i}");
            if i % 2 == 0 {
                // Bytes kept for the claims of a tenant that never comes back.
                b.keep_for_claims([((name.clone(), 0), 1)].into(), now);
            }
            // Nothing kept for zero bytes or a device not budgeted: no name entered.
            b.keep_for_claims(
                [((format!("u{i}"), 0), 0), ((name.clone(), 9_999), 5)].into(),
                now,
            );
            let c = b.register(&name, &floor(0), 100);
            let granted = b.acquire(c, 0, 1, 1, &retry, now).unwrap();
            assert_eq!(granted, Ok(1), "the grace is over, what was kept let go");
            assert_eq!(b.give_back(c, 0, 1, now), Ok(0));
            b.drop_client(c, now);
        }
        let after = b.entries();
        assert_eq!(
            (after.names, after.tenants, after.clients),
            (before.names, before.tenants, before.clients),
            "{before:?} then {after:?}"
        );
        // The named tenant, never connected, keeps its name and its floor.
        assert_eq!(b.acquire(honest, 0, 70, 100, &retry, now).unwrap(), Ok(70));
        let kept = b.register("named", &floor(30), 100);
        assert_eq!(b.acquire(kept, 0, 30, 30, &retry, now).unwrap(), Ok(30));
        assert_eq!(b.tenant_held("named", 0), 30);
        assert_eq!(b.metrics().held.get(&("named".to_owned(), 0)), Some(&30));
        let late = now + Duration::from_secs(1);
        b.drop_client(kept, late);
        assert_eq!(b.entries().names, 2, "a named tenant's name stays");
    }

    #[test]
    fn named_tenants_keep_their_ids_and_others_are_forgotten_with_their_books() {
        let config = ["a".to_owned(), "b".to_owned()];
        let mut t = TenantNames::new(&config);
        assert_eq!(
            (t.id("a"), t.id("b")),
            (Some(TenantId(0)), Some(TenantId(1)))
        );
        let x = t.enter("x");
        assert_eq!((x, t.enter("x"), t.name(x)), (TenantId(2), x, "x"));
        assert!(t.is_named(TenantId(1)) && !t.is_named(x));
        t.forget(TenantId(0));
        t.forget(x);
        assert_eq!(
            (t.id("a"), t.id("x"), t.name(x)),
            (Some(TenantId(0)), None, "")
        );
        assert_eq!(t.len(), 2);
        assert_eq!(t.enter("x"), TenantId(3), "an id is never given twice");
    }
}
