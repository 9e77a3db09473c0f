//! Leases: one per target made ready before a replication needs it, and
//! the [`Lease`] a replication takes from it for its writes.
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
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::OnceCell;

use crate::containerd::{self as ctrd, Containerd};
use crate::lock::lock;

/// A target's spare.
enum Slot {
    /// Being made: a burst of replications released at once makes one.
    Making,
    /// Ready since the instant.
    Ready(String, Instant),
}

pub struct Spares {
    c: Containerd,
    ttl: Duration,
    slots: Mutex<HashMap<String, Slot>>,
    /// Set at shutdown: a spare made later is deleted at once.
    closed: AtomicBool,
}

impl Spares {
    pub fn new(c: Containerd, ttl: Duration) -> Self {
        Spares {
            c,
            ttl,
            slots: Mutex::default(),
            closed: AtomicBool::new(false),
        }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        lock(&self.slots)
    }

    /// A lease for `target`, all its own: the spare if one is ready and has
    /// most of its life left, else a new one.
    pub async fn take(&self, target: &str) -> Result<String, ctrd::Error> {
        let stale = {
            let mut slots = self.slots();
            match slots.remove(target) {
                Some(Slot::Ready(id, made)) if made.elapsed() < self.ttl / 2 => return Ok(id),
                Some(Slot::Ready(id, _)) => Some(id),
                Some(Slot::Making) => {
                    slots.insert(target.into(), Slot::Making);
                    None
                }
                None => None,
            }
        };
        if let Some(id) = stale {
            self.c.release_lease(target, &id).await;
        }
        self.c.create_lease(target, self.ttl).await
    }

    /// Makes a spare ready for `target` unless one is (or is being made).
    /// Called once a replication has released its lease, off any client's
    /// path.
    pub async fn refill(&self, target: &str) {
        {
            let mut slots = self.slots();
            if self.closed.load(Ordering::SeqCst) || slots.contains_key(target) {
                return;
            }
            slots.insert(target.into(), Slot::Making);
        }
        let made = self.c.create_lease(target, self.ttl).await;
        let extra = {
            let mut slots = self.slots();
            match made {
                Ok(id) if self.closed.load(Ordering::SeqCst) => Some(id),
                Ok(id) => {
                    slots.insert(target.into(), Slot::Ready(id, Instant::now()));
                    None
                }
                Err(e) => {
                    slots.remove(target);
                    tracing::debug!(target, error = %e, "no spare lease made; the next replication makes its own");
                    None
                }
            }
        };
        if let Some(id) = extra {
            self.c.release_lease(target, &id).await;
        }
    }

    /// Deletes every spare (at shutdown): they hold nothing, and need not
    /// wait for their expiry.
    pub async fn release_all(&self) {
        let ready: Vec<_> = {
            let mut slots = self.slots();
            self.closed.store(true, Ordering::SeqCst);
            slots
                .drain()
                .filter_map(|(t, s)| match s {
                    Slot::Ready(id, _) => Some((t, id)),
                    Slot::Making => None,
                })
                .collect()
        };
        for (target, id) in ready {
            self.c.release_lease(&target, &id).await;
        }
    }
}

/// A replication's lease in its target, taken by the first write (a spare
/// made ready before, see [`Spares`]). It is released explicitly once the
/// blobs are referenced, and from `Drop` when the replication is cancelled
/// (timeout, caller gone) so the content is not held until the lease
/// expires. Either way the next spare is made after it is gone.
pub struct Lease {
    spares: Arc<Spares>,
    target: String,
    id: OnceCell<String>,
    released: AtomicBool,
}

impl Lease {
    pub fn new(spares: &Arc<Spares>, target: &str) -> Lease {
        Lease {
            spares: spares.clone(),
            target: target.into(),
            id: OnceCell::new(),
            released: Default::default(),
        }
    }

    /// The lease's id; the first caller takes it.
    pub async fn id(&self) -> Result<&String, ctrd::Error> {
        self.id
            .get_or_try_init(|| self.spares.take(&self.target))
            .await
    }

    pub async fn release(&self) {
        let Some(id) = self.id.get() else { return };
        if self.released.swap(true, Ordering::SeqCst) {
            return;
        }
        self.spares.c.release_lease(&self.target, id).await;
        let (spares, target) = (self.spares.clone(), self.target.clone());
        tokio::spawn(async move { spares.refill(&target).await });
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let (Some(id), Ok(rt)) = (self.id.take(), tokio::runtime::Handle::try_current()) else {
            return;
        };
        if !*self.released.get_mut() {
            let (spares, target) = (self.spares.clone(), std::mem::take(&mut self.target));
            rt.spawn(async move {
                spares.c.release_lease(&target, &id).await;
                spares.refill(&target).await;
            });
        }
    }
}
