//! CRI's view of images, shared by every replication waiting for it at once.
//!
//! Each replication used to poll CRI `ImageStatus` for its own name, the
//! polls of all of them spread to about 1000 a second so they did not keep
//! containerd (and CRI's event handling, which they wait for) busy. In a
//! burst of 200 that is one poll per name every 200 ms: a name CRI resolved
//! was seen up to 200 ms later, and the burst's replies came in steps of
//! that (debug "replication phases", containerd 2.4.2: none for 400 ms
//! after the first, then clusters 100-200 ms apart). One `ListImages`
//! answers for every waiter, so with many waiting one task asks it again
//! as soon as the last answer is in (never more often than [`MIN_GAP`],
//! twice the call's own time apart), and each waiter checks its name in
//! the newest answer asked after its record was written.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::containerd::Containerd;

/// Waiters from which one shared `ListImages` replaces their own polls.
pub const SHARED_FROM: usize = 8;
/// The least time between two `ListImages`.
const MIN_GAP: Duration = Duration::from_millis(2);
/// The most: a slow answer (a node with thousands of images) is not asked
/// for back to back.
const MAX_GAP: Duration = Duration::from_millis(50);

/// One answer of `ListImages`.
pub struct Snapshot {
    /// When the call was sent: names written before it are in it if CRI
    /// had handled them.
    pub asked: Instant,
    /// name (repo tag or repo digest) → image id.
    pub ids: HashMap<String, String>,
}

pub struct CriView {
    c: Containerd,
    /// Replications waiting for CRI now.
    waiters: Arc<AtomicUsize>,
    latest: watch::Sender<Arc<Snapshot>>,
    refreshing: Arc<AtomicBool>,
}

impl CriView {
    pub fn new(c: Containerd) -> Self {
        let (latest, _) = watch::channel(Arc::new(Snapshot {
            asked: Instant::now(),
            ids: HashMap::new(),
        }));
        CriView {
            c,
            waiters: Default::default(),
            latest,
            refreshing: Default::default(),
        }
    }

    /// Counts a waiter while the guard lives.
    pub fn enter(&self) -> Waiting {
        self.waiters.fetch_add(1, Ordering::Relaxed);
        Waiting(self.waiters.clone())
    }

    pub fn waiters(&self) -> usize {
        self.waiters.load(Ordering::Relaxed)
    }

    /// Whether a waiter should take the shared answers: enough wait, or the
    /// refresher already runs (it runs until the last waiter is gone, so
    /// the tail of a burst polling on its own would only ask CRI twice).
    pub fn shared(&self) -> bool {
        self.waiters() >= SHARED_FROM || self.refreshing.load(Ordering::Acquire)
    }

    /// The first answer asked at or after `after` (the record's write, or
    /// the previous answer's), and the image id CRI gave `name` in it, if
    /// any. Starts the shared refresher if it is not running.
    pub async fn id_after(&self, name: &str, after: Instant) -> (Instant, Option<String>) {
        let mut rx = self.latest.subscribe();
        self.refresh();
        let snap = match rx.wait_for(|s| s.asked >= after).await {
            Ok(s) => s.clone(),
            // The sender lives as long as `self`.
            Err(_) => return (Instant::now(), None),
        };
        (snap.asked, snap.ids.get(name).cloned())
    }

    /// Runs the refresher unless it runs: `ListImages` back to back while
    /// enough replications wait.
    fn refresh(&self) {
        if self.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        let (c, waiters, latest, refreshing) = (
            self.c.clone(),
            self.waiters.clone(),
            self.latest.clone(),
            self.refreshing.clone(),
        );
        tokio::spawn(async move {
            loop {
                while waiters.load(Ordering::Relaxed) > 0 {
                    let asked = Instant::now();
                    let ids = match c.cri_list_images().await {
                        Ok(images) => images
                            .into_iter()
                            .flat_map(|(id, names)| names.into_iter().map(move |n| (n, id.clone())))
                            .collect(),
                        Err(e) => {
                            tracing::debug!(error = %e, "CRI ListImages failed; asking again");
                            HashMap::new()
                        }
                    };
                    let took = asked.elapsed();
                    latest.send_replace(Arc::new(Snapshot { asked, ids }));
                    tokio::time::sleep((took * 2).clamp(MIN_GAP, MAX_GAP)).await;
                }
                refreshing.store(false, Ordering::Release);
                // A waiter that came after the check and saw it still
                // running would wait forever: look again.
                if waiters.load(Ordering::Relaxed) == 0 || refreshing.swap(true, Ordering::AcqRel) {
                    return;
                }
            }
        });
    }
}

/// A waiter, counted while it lives.
pub struct Waiting(Arc<AtomicUsize>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
