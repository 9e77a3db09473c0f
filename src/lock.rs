//! One way to take a standard lock, with one poisoning policy: recover.
//!
//! A poisoned lock means a thread panicked while holding it. Every
//! critical section here is short and leaves its data whole at each step
//! (a map insert, a counter, a cache entry), so what the panicking thread
//! left is still usable; propagating the panic would take down every later
//! call that touches the lock (the whole proxy, for the data path's buffer
//! pool) for one bug already logged by the panic itself.

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Locks `m`, recovering it if poisoned (see the module doc).
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Read-locks `l`, recovering it if poisoned.
pub fn read<T: ?Sized>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

/// Write-locks `l`, recovering it if poisoned.
pub fn write<T: ?Sized>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}
