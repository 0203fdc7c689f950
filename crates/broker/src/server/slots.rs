//! [`Conns`]: the connections served and the slots they take: at most
//! [`BrokerConfig::max_clients`](crate::BrokerConfig::max_clients) in all and
//! [`max_clients_per_user`](crate::BrokerConfig::max_clients_per_user) of one user (the
//! peer's uid), so that one user cannot take every slot. A connection whose peer has gone
//! gives its slot back at once: when the slots are full, the ones whose peer hung up are let
//! go before a newcomer is refused (their threads may not have noticed yet).

use std::collections::BTreeMap;
use std::os::fd::RawFd;
use std::sync::Arc;

use super::Conn;

/// How many connections there are, in all and per user.
#[derive(Debug, Default)]
pub(super) struct Slots {
    total: usize,
    per_user: BTreeMap<u32, usize>,
}

/// Why a connection gets no slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NoSlot {
    /// Every slot is taken.
    Full(usize),
    /// Every slot its user may take is taken.
    User(usize),
}

impl std::fmt::Display for NoSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoSlot::Full(n) => write!(f, "at most {n} clients"),
            NoSlot::User(n) => write!(f, "at most {n} clients of one user"),
        }
    }
}

impl Slots {
    /// Takes a slot for `user` if one is free (`max` in all, `per_user` for one user).
    pub(super) fn take(&mut self, user: u32, max: usize, per_user: usize) -> Result<(), NoSlot> {
        let mine = self.per_user.get(&user).copied().unwrap_or(0);
        if self.total >= max {
            return Err(NoSlot::Full(max));
        }
        if mine >= per_user.min(max) {
            return Err(NoSlot::User(per_user.min(max)));
        }
        self.total += 1;
        self.per_user.insert(user, mine + 1);
        Ok(())
    }

    /// Gives `user`'s slot back.
    pub(super) fn give(&mut self, user: u32) {
        if let Some(n) = self.per_user.get_mut(&user) {
            *n -= 1;
            self.total -= 1;
            if *n == 0 {
                self.per_user.remove(&user);
            }
        }
    }

    /// Slots taken.
    pub(super) fn taken(&self) -> usize {
        self.total
    }
}

/// Whether the peer of the connection on `fd` has closed (or shut down its side of) it.
fn hung_up(fd: RawFd) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: `pfd` is one valid pollfd (its descriptor is kept open by the connection the
    // caller holds); a timeout of 0 only looks.
    let rc = unsafe { libc::poll(&mut pfd, 1, 0) };
    rc > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// The connections served, by number, and their slots.
#[derive(Default)]
pub(super) struct Conns {
    map: BTreeMap<u64, Arc<Conn>>,
    slots: Slots,
}

impl Conns {
    /// Enters connection `id` if a slot is free for its user, first letting go of
    /// connections whose peer hung up when none is.
    pub(super) fn admit(
        &mut self,
        id: u64,
        conn: &Arc<Conn>,
        max: usize,
        per_user: usize,
    ) -> Result<(), NoSlot> {
        if self.slots.take(conn.user, max, per_user).is_err() {
            let dead: Vec<u64> = self
                .map
                .iter()
                .filter(|(_, c)| hung_up(c.raw))
                .map(|(id, _)| *id)
                .collect();
            for d in dead {
                self.remove(d);
            }
            self.slots.take(conn.user, max, per_user)?;
        }
        self.map.insert(id, Arc::clone(conn));
        Ok(())
    }

    /// Lets connection `id` go (nothing if it went already).
    pub(super) fn remove(&mut self, id: u64) {
        if let Some(c) = self.map.remove(&id) {
            self.slots.give(c.user);
        }
    }

    /// Every connection.
    pub(super) fn all(&self) -> Vec<Arc<Conn>> {
        self.map.values().cloned().collect()
    }

    /// The connection of broker client `client`.
    pub(super) fn of_client(&self, client: u64) -> Option<Arc<Conn>> {
        self.map
            .values()
            .find(|c| *super::lock(&c.client) == Some(client))
            .cloned()
    }

    /// Connections served.
    pub(super) fn len(&self) -> usize {
        self.slots.taken()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn a_connection_is_dead_once_its_peer_hung_up_and_not_for_unread_bytes() {
        let (mut a, b) = UnixStream::pair().unwrap();
        assert!(!hung_up(b.as_raw_fd()), "quiet");
        a.write_all(b"unread").unwrap();
        assert!(!hung_up(b.as_raw_fd()), "bytes waiting to be read");
        a.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(hung_up(b.as_raw_fd()), "its peer writes no more");
        drop(a);
        assert!(hung_up(b.as_raw_fd()), "its peer is gone");
    }

    #[test]
    fn one_user_cannot_take_every_slot_and_a_slot_given_back_is_free_again() {
        let mut s = Slots::default();
        for _ in 0..2 {
            s.take(1000, 4, 2).unwrap();
        }
        assert_eq!(
            s.take(1000, 4, 2),
            Err(NoSlot::User(2)),
            "user 1000 is at its cap"
        );
        s.take(1001, 4, 2).unwrap();
        s.take(0, 4, 2).unwrap();
        assert_eq!(s.take(1002, 4, 2), Err(NoSlot::Full(4)), "every slot taken");
        assert_eq!(s.taken(), 4);
        s.give(1000);
        assert_eq!(s.take(1000, 4, 2), Ok(()), "its slot is free again");
        s.give(7);
        assert_eq!(s.taken(), 4, "a user without a slot gives nothing back");
        assert_eq!(s.take(5, 4, 9), Err(NoSlot::Full(4)));
        let mut one = Slots::default();
        assert_eq!(one.take(1, 1, 9), Ok(()));
        assert_eq!(
            one.take(1, 1, 9),
            Err(NoSlot::Full(1)),
            "the cap is at most max"
        );
        one.give(1);
        assert_eq!(
            (one.taken(), one.per_user.len()),
            (0, 0),
            "nothing left behind"
        );
    }
}
