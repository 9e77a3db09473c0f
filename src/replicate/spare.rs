//! One lease per target made ready before a replication needs it.
//!
//! The first link of a new tree had to wait for `Leases.Create`, a bolt
//! transaction with an fsync on containerd's one writer, about 1 ms of the
//! held `Images.Create` of every dev-loop build (debug "replication phases":
//! lease, then each link, one at a time). The spare is made after a
//! replication is done with its own lease, when nothing waits for it, and
//! only for targets that needed one: an idle imgbridge holds at most one
//! empty lease per target, which expires on its own if imgbridge dies.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::containerd::{self as ctrd, Containerd};

pub struct Spares {
    c: Containerd,
    ttl: Duration,
    /// target → (lease id, when it was made).
    ready: Mutex<HashMap<String, (String, Instant)>>,
    /// Set at shutdown: a refill that finishes later deletes what it made.
    closed: AtomicBool,
}

impl Spares {
    pub fn new(c: Containerd, ttl: Duration) -> Self {
        Spares {
            c,
            ttl,
            ready: Mutex::default(),
            closed: AtomicBool::new(false),
        }
    }

    fn ready(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, Instant)>> {
        self.ready
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A lease for `target`, all its own: the spare if one is ready and has
    /// most of its life left, else a new one.
    pub async fn take(&self, target: &str) -> Result<String, ctrd::Error> {
        let spare = self.ready().remove(target);
        if let Some((id, made)) = spare {
            if made.elapsed() < self.ttl / 2 {
                return Ok(id);
            }
            self.delete(target, &id).await;
        }
        self.c.create_lease(target, self.ttl).await
    }

    /// Makes a spare ready for `target` if none is. Called once a
    /// replication has released its lease, off any client's path.
    pub async fn refill(&self, target: &str) {
        if self.closed.load(Ordering::SeqCst) || self.ready().contains_key(target) {
            return;
        }
        match self.c.create_lease(target, self.ttl).await {
            Ok(id) => {
                let extra = {
                    let mut ready = self.ready();
                    if self.closed.load(Ordering::SeqCst) {
                        Some(id)
                    } else {
                        // Two refills raced: keep one.
                        ready
                            .insert(target.into(), (id, Instant::now()))
                            .map(|o| o.0)
                    }
                };
                if let Some(extra) = extra {
                    self.delete(target, &extra).await;
                }
            }
            Err(e) => {
                tracing::debug!(target, error = %e, "no spare lease made; the next replication makes its own")
            }
        }
    }

    /// Deletes every spare (at shutdown): they hold nothing, and need not
    /// wait for their expiry.
    pub async fn release_all(&self) {
        let all: Vec<_> = {
            let mut ready = self.ready();
            self.closed.store(true, Ordering::SeqCst);
            ready.drain().collect()
        };
        for (target, (id, _)) in all {
            self.delete(&target, &id).await;
        }
    }

    pub async fn delete(&self, target: &str, id: &str) {
        if let Err(e) = self.c.delete_lease(target, id).await {
            tracing::debug!(lease = %id, target, error = %e, "could not delete a spare lease; it expires on its own");
        }
    }
}
