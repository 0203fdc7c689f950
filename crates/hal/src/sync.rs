//! Locks that survive poisoning, decided once for the whole project.
//!
//! A lock is poisoned when a thread panicked while holding it. Library code never panics
//! on bad input or a driver failure, so such a panic is a bug reported where it happened;
//! every critical section in kvvm leaves its data consistent at each step (an entry pushed
//! or removed, a counter moved), so the data is taken as it is rather than the panic
//! carried into every other thread that touches the lock.

use std::sync::{LockResult, Mutex, MutexGuard, PoisonError};

/// A lock's result taken whether or not the lock is poisoned: [`Mutex::lock`],
/// [`std::sync::RwLock::read`] and `write`, [`Mutex::get_mut`], and [`std::sync::Condvar`]'s
/// waits (their guard, and the timeout result with it).
pub trait Unpoison<G> {
    /// The guard (or the wait's result), poisoned or not.
    fn unpoisoned(self) -> G;
}

impl<G> Unpoison<G> for LockResult<G> {
    fn unpoisoned(self) -> G {
        self.unwrap_or_else(PoisonError::into_inner)
    }
}

/// Locks `m`, poisoned or not (see the module).
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unpoisoned()
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Condvar, RwLock};
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_poisoned_lock_gives_its_data_as_it_was_left() {
        let m = Arc::new(Mutex::new(vec![1]));
        let l = Arc::new(RwLock::new(2));
        let (m2, l2) = (Arc::clone(&m), Arc::clone(&l));
        let panicked = std::thread::spawn(move || {
            let mut g = m2.lock().unpoisoned();
            let _w = l2.write().unpoisoned();
            g.push(2);
            panic!("poisons both locks");
        })
        .join();
        assert!(panicked.is_err() && m.is_poisoned() && l.is_poisoned());
        assert_eq!(*lock(&m), vec![1, 2]);
        assert_eq!(*l.read().unpoisoned(), 2);
        *l.write().unpoisoned() += 1;
        assert_eq!(*l.read().unpoisoned(), 3);
        let c = Condvar::new();
        let (g, timeout) = c
            .wait_timeout(lock(&m), Duration::from_millis(1))
            .unpoisoned();
        assert!(timeout.timed_out() && g.len() == 2);
    }
}
