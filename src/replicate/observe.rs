//! What replication reports as it works: the end of each attempt, CRI
//! confirmations and the blobs still pending. The replicator only reports;
//! counting and `/status` live in whoever implements
//! [`ReplicationObserver`] (`ops::Metrics`), as for the proxy's
//! `CallObserver` and the importer's `ImportObserver`.

use std::fmt::Display;
use std::time::{Duration, Instant};

use super::tree::Child;

/// How one replication of one image into one target ended.
#[derive(Clone, Copy)]
pub enum Attempt<'a> {
    /// Something was written (or is pending): the replica changed.
    Changed,
    /// Already in sync, or not replicable (name is not a reference).
    Unchanged,
    /// Failed or timed out; the error as the operator should read it.
    Failed(&'a dyn Display),
}

/// A blob a replica waits for: referenced by `image` in `source`, not yet
/// there (buildkit names images before fetching lazy base layers).
#[derive(Clone, Debug)]
pub struct PendingBlob {
    pub source: String,
    pub target: String,
    pub image: String,
    pub child: Child,
    /// When it was first found missing.
    pub since: Instant,
}

/// Receives replication events. Called from replication tasks, never per
/// byte: keep implementations to short, uncontended locks.
pub trait ReplicationObserver: Send + Sync + 'static {
    /// One replication of `source/name` into `target` ended after `elapsed`.
    fn replicated(
        &self,
        source: &str,
        name: &str,
        target: &str,
        attempt: Attempt<'_>,
        elapsed: Duration,
    );
    /// CRI resolved a new replica `elapsed` after the record was written.
    fn cri_confirmed(&self, elapsed: Duration);
    /// Every blob pending right now (the whole set, each time it is checked,
    /// about every 200 ms), so an observer can show counts, ages or a list.
    fn blobs_pending(&self, blobs: &[PendingBlob]);
}
