//! What replication reports as it works: the end of each attempt, CRI
//! confirmations and the blobs still pending. The replicator only reports;
//! counting and `/status` live in whoever implements
//! [`ReplicationObserver`] (`ops::Metrics`), as for the proxy's
//! `CallObserver` and the importer's `ImportObserver`.

use std::fmt::Display;
use std::time::Duration;

/// How one replication of one image into one target ended.
#[derive(Clone, Copy)]
pub enum Attempt<'a> {
    /// Something was written (or is pending): the replica changed.
    Changed,
    /// Already in sync, or not replicable (name is not a reference).
    Unchanged,
    /// Failed or timed out; the error as the operator should read it.
    Failed(&'a dyn Display),
    /// Refused: the name is protected in the target, nothing was written
    /// there ([`super::protect`]); the refusal as the operator should read it.
    Protected(&'a super::protect::Protection, &'a dyn Display),
}

/// A blob replicas wait for, as `/status` lists it: referenced by
/// `images` in `source`, not there yet (buildkit names images before it
/// fetches lazy base layers), and needed by pods on this node (not only
/// under other platforms' entries of an index).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PendingBlob {
    pub source: String,
    pub digest: String,
    /// The images waiting for it, first seen first.
    pub images: Vec<String>,
    pub targets: Vec<String>,
    /// Since it was first found missing.
    pub age_seconds: u64,
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
    /// Every blob pending right now that a pod on this node could need,
    /// oldest first (the whole set, whenever the backstop looked), so an
    /// observer can show counts, ages or a list; and how many more wait
    /// that only other platforms' pods need (linked if they appear, not a
    /// problem here).
    fn blobs_pending(&self, blobs: &[PendingBlob], other_platforms: usize);
}
