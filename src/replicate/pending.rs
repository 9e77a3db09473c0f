//! Blobs that were missing in the source when their image was replicated
//! (buildkit names an image before it fetches the lazy base layers it never
//! needed; an index pulled for one platform). They never hold the image's
//! own reply: buildkit fetches them only after that reply, so holding it
//! would deadlock. Instead each is linked into its targets
//!
//! - **when a write through imgbridge commits it** ([`Replicator::committed`]):
//!   the client's commit reply waits for that link, so when buildkit's export
//!   returns, every blob of the image is in the target;
//! - otherwise by a backstop that checks it with a capped backoff
//!   (containerd publishes no content events), for blobs that appear behind
//!   imgbridge's back (a write straight to containerd's socket).
//!
//! A blob is linked by one task at a time: a commit that finds the backstop
//! (or another commit) linking it waits for that link instead of returning
//! early, so "the write returned" always means "the blob is in the target".

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

use super::tree::Child;
use super::Replicator;

/// First backstop check after a blob was found missing; doubles per miss.
/// Short, because the blob usually arrives within the build that named it.
const FIRST_CHECK: Duration = Duration::from_millis(50);
/// Backstop cap: a blob that never comes (another platform's manifest) costs
/// one `Content.Info` per this interval until `pending_give_up`, and one that
/// arrives behind imgbridge's back is linked at most this late.
const MAX_CHECK: Duration = Duration::from_secs(1);

/// What the replicator found missing: one blob of one image for one target.
#[derive(Clone, Debug)]
pub struct Item {
    pub source: String,
    pub target: String,
    pub image: String,
    pub child: Child,
}

pub use super::observe::PendingBlob as Blob;

type Key = (String, String);

/// One missing blob of one source namespace, whatever images and targets
/// wait for it.
struct Entry {
    child: Child,
    images: Vec<String>,
    targets: Vec<String>,
    since: Instant,
    warned: bool,
    state: State,
}

/// Who is acting on a pending blob.
enum State {
    /// Nobody: the backstop looks again at `next`.
    Waiting { next: Instant, backoff: Duration },
    /// A link is running; the receiver sees its sender dropped when it ends.
    Linking(watch::Receiver<()>),
}

impl State {
    fn waiting(backoff: Duration) -> State {
        State::Waiting {
            next: Instant::now() + backoff,
            backoff,
        }
    }
}

/// The right to link one blob, handed to exactly one task.
pub(super) struct Job {
    key: Key,
    pub child: Child,
    pub images: Vec<String>,
    pub targets: Vec<String>,
    since: Instant,
    backoff: Duration,
    _done: watch::Sender<()>,
}

impl Job {
    pub fn source(&self) -> &str {
        &self.key.0
    }
}

enum Claim {
    Absent,
    Busy(watch::Receiver<()>),
    Mine(Job),
}

/// How a [`Job`] ended.
pub(super) enum Linked {
    /// Linked into these targets (the others stay pending).
    Into(Vec<String>),
    /// Still not in the source.
    Missing,
}

#[derive(Default)]
pub struct Pending {
    items: Mutex<HashMap<Key, Entry>>,
    /// Wakes the backstop when a blob is added.
    added: Notify,
}

impl Pending {
    pub fn add(&self, item: Item) {
        let key = (item.source, item.child.digest.clone());
        let mut m = self.items.lock().unwrap();
        let e = m.entry(key).or_insert_with_key(|(source, digest)| {
            tracing::info!(image = ?item.image, digest = %digest, source = ?source, target = ?item.target,
                "blob not yet in source; will link it when it appears");
            Entry {
                child: item.child,
                images: Vec::new(),
                targets: Vec::new(),
                since: Instant::now(),
                warned: false,
                state: State::waiting(FIRST_CHECK),
            }
        });
        if !e.images.contains(&item.image) {
            e.images.push(item.image);
        }
        if !e.targets.contains(&item.target) {
            e.targets.push(item.target);
        }
        drop(m);
        self.added.notify_one();
    }

    pub fn count(&self) -> usize {
        self.items.lock().unwrap().len()
    }

    /// Whether `digest` is awaited in `source`: asked for every commit that
    /// passes through the proxy, and almost always with nothing pending, so
    /// that case costs no allocation; otherwise one hash lookup.
    pub fn awaits(&self, source: &str, digest: &str) -> bool {
        let m = self.items.lock().unwrap();
        !m.is_empty() && m.contains_key(&(source.to_string(), digest.to_string()))
    }

    /// The pending blobs of `source`.
    pub fn digests(&self, source: &str) -> Vec<String> {
        let m = self.items.lock().unwrap();
        m.keys()
            .filter(|(s, _)| s == source)
            .map(|(_, d)| d.clone())
            .collect()
    }

    /// Every pending blob, oldest first.
    pub fn list(&self) -> Vec<Blob> {
        let m = self.items.lock().unwrap();
        let mut v: Vec<_> = m
            .iter()
            .map(|((source, digest), e)| {
                (
                    e.since,
                    Blob {
                        source: source.clone(),
                        digest: digest.clone(),
                        images: e.images.clone(),
                        targets: e.targets.clone(),
                        age_seconds: e.since.elapsed().as_secs(),
                    },
                )
            })
            .collect();
        v.sort_by_key(|(since, _)| *since);
        v.into_iter().map(|(_, b)| b).collect()
    }

    fn claim(&self, source: &str, digest: &str) -> Claim {
        let key = (source.to_string(), digest.to_string());
        let mut m = self.items.lock().unwrap();
        let Some(e) = m.get_mut(&key) else {
            return Claim::Absent;
        };
        match &e.state {
            State::Linking(rx) => Claim::Busy(rx.clone()),
            State::Waiting { backoff, .. } => {
                let backoff = *backoff;
                Claim::Mine(Self::start(key, e, backoff))
            }
        }
    }

    fn start(key: Key, e: &mut Entry, backoff: Duration) -> Job {
        let (tx, rx) = watch::channel(());
        e.state = State::Linking(rx);
        Job {
            key,
            child: e.child.clone(),
            images: e.images.clone(),
            targets: e.targets.clone(),
            since: e.since,
            backoff,
            _done: tx,
        }
    }

    /// The blobs due for a backstop check, claimed; drops (with a WARN)
    /// those waited for longer than `give_up`, and warns once about those
    /// older than `warn_after`.
    fn due(&self, warn_after: Duration, give_up: Duration) -> Vec<Job> {
        let now = Instant::now();
        let mut jobs = Vec::new();
        let mut m = self.items.lock().unwrap();
        m.retain(|(source, digest), e| {
            let age = e.since.elapsed();
            if age > give_up && matches!(e.state, State::Waiting { .. }) {
                tracing::warn!(images = ?e.images, digest = %digest, source = ?source, targets = ?e.targets,
                    waited_s = age.as_secs(),
                    "gave up waiting for a blob to appear in the source; pull or rebuild the image, then run `imgbridge sync`");
                return false;
            }
            if age > warn_after && !e.warned {
                e.warned = true;
                tracing::warn!(images = ?e.images, digest = %digest, source = ?source, targets = ?e.targets,
                    waited_s = age.as_secs(),
                    "a blob these images reference is still not in the source; pods of them fail to start until it is written (kubelet retries)");
            }
            true
        });
        for (key, e) in m.iter_mut() {
            if let State::Waiting { next: at, backoff } = e.state {
                if at <= now {
                    jobs.push(Self::start(key.clone(), e, backoff));
                }
            }
        }
        jobs
    }

    /// When the backstop should look next.
    fn next_due(&self) -> Option<Instant> {
        let m = self.items.lock().unwrap();
        m.values()
            .filter_map(|e| match e.state {
                State::Waiting { next, .. } => Some(next),
                State::Linking(_) => None,
            })
            .min()
    }

    /// Ends a job: removes what was linked, schedules the rest.
    fn finish(&self, job: Job, linked: &Linked, by_commit: bool) {
        let mut m = self.items.lock().unwrap();
        let Some(e) = m.get_mut(&job.key) else {
            return;
        };
        match linked {
            Linked::Into(targets) => {
                e.targets.retain(|t| !targets.contains(t));
                tracing::info!(images = ?job.images, digest = %job.key.1, source = ?job.key.0, targets = ?targets,
                    late_ms = job.since.elapsed().as_millis() as u64,
                    by = if by_commit { "commit" } else { "backstop" },
                    "linked a blob that arrived after its image");
                if e.targets.is_empty() {
                    m.remove(&job.key);
                } else {
                    e.state = State::waiting(FIRST_CHECK);
                }
            }
            Linked::Missing => {
                e.state = State::waiting((job.backoff * 2).min(MAX_CHECK));
            }
        }
        // `job` (and with it the sender) drops here: waiters wake.
    }
}

impl Replicator {
    /// A write through imgbridge committed `digest` in `source` (or found it
    /// already there). Returns once every target waiting for it has it, so
    /// the caller can let the client see its write finish. Returns at once
    /// when nothing waits for the blob.
    pub async fn committed(&self, source: &str, digest: &str) {
        // Claims race with the backstop: after waiting for another task's
        // link, look again (new targets may have been added meanwhile).
        for _ in 0..3 {
            match self.pending.claim(source, digest) {
                Claim::Absent => return,
                Claim::Busy(mut rx) => {
                    let _ = rx.changed().await;
                }
                Claim::Mine(job) => {
                    let linked = self.link_job(&job).await;
                    self.pending.finish(job, &linked, true);
                    if matches!(linked, Linked::Into(_)) {
                        return;
                    }
                }
            }
        }
    }

    /// Blobs just noted as missing that are in `source` by now, linked
    /// (a client that writes them without waiting for the image's reply
    /// may have committed one since the walk looked: that COMMIT reply was
    /// not held, as nothing waited for the blob yet). Costs one
    /// `Content.Info` per missing blob, at once.
    pub async fn arrived_meanwhile(&self, source: &str, missing: &[Child]) {
        let links = missing.iter().map(|c| async move {
            if let Ok(Some(_)) = self.c.content_info(source, &c.digest).await {
                self.committed(source, &c.digest).await;
            }
        });
        futures_util::future::join_all(links).await;
    }

    /// Links a claimed blob into each of its targets if it is in the source.
    async fn link_job(&self, job: &Job) -> Linked {
        match self.c.content_info(job.source(), &job.child.digest).await {
            Ok(Some(_)) => {}
            Ok(None) => return Linked::Missing,
            Err(e) => {
                tracing::debug!(error = %e, digest = %job.child.digest, "pending check failed; retrying");
                return Linked::Missing;
            }
        }
        let root = crate::containerd::Descriptor {
            media_type: job.child.media_type.clone(),
            digest: job.child.digest.clone(),
            size: job.child.size,
            ..Default::default()
        };
        let image = job.images.first().cloned().unwrap_or_default();
        let mut done = Vec::new();
        for target in &job.targets {
            // The parent in the target already carries a gc.ref label for
            // this blob, so the link is GC-safe by itself; the walk's lease
            // (created only if it writes) covers its children until they
            // are referenced. Children still missing are queued in turn.
            let lease = super::Lease::new(&self.spares, target);
            match self.walk(job.source(), target, &image, &root, &lease).await {
                Ok(_) => done.push(target.clone()),
                Err(e) => {
                    tracing::warn!(images = ?job.images, digest = %job.child.digest, target = ?target, error = %e,
                        "linking a blob that arrived late failed; retrying")
                }
            }
            lease.release().await;
        }
        if done.is_empty() {
            Linked::Missing
        } else {
            Linked::Into(done)
        }
    }

    /// Pending blobs, oldest first (for `/status`).
    pub fn pending_blobs(&self) -> Vec<Blob> {
        self.pending.list()
    }
}

/// The backstop: checks each pending blob when it is due.
pub async fn run(r: Arc<Replicator>, shutdown: CancellationToken) {
    loop {
        let jobs = r.pending.due(r.s.pending_warn_after, r.s.pending_give_up);
        let checks = jobs.into_iter().map(|job| {
            let r = &r;
            async move {
                let linked = r.link_job(&job).await;
                r.pending.finish(job, &linked, false);
            }
        });
        futures_util::future::join_all(checks).await;
        report(&r);
        let sleep = r
            .pending
            .next_due()
            .map_or(MAX_CHECK, |n| n.saturating_duration_since(Instant::now()));
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = r.pending.added.notified() => {}
            _ = tokio::time::sleep(sleep) => {}
        }
    }
}

fn report(r: &Replicator) {
    if let Some(o) = r.observer() {
        o.blobs_pending(&r.pending.list());
    }
}
