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
//!
//! What is reported: only blobs a pod on this node could need
//! ([`Need::Node`]) are WARNed about after `pending_warn_after`, listed in
//! `/status` and counted in the gauge. Blobs only under other platforms'
//! index entries (a pull for this node's platform never fetches them) are
//! linked all the same if they appear, but only counted apart and logged
//! at DEBUG. And a blob waits only as long as an image naming it does: each
//! check that finds it still missing first reads the records of the images
//! that named it, and an entry none of whose images still points at the
//! root it had is dropped without a warning, however it was deleted or
//! moved (through imgbridge or straight on containerd's socket).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

use super::tree::{Child, Need};
use super::Replicator;
use crate::backoff::Backoff;
use crate::lock::lock;

/// First backstop check after a blob was found missing; doubles per miss.
/// Short, because the blob usually arrives within the build that named it.
const FIRST_CHECK: Duration = Duration::from_millis(50);
/// Backstop cap: a blob that never comes (another platform's manifest) costs
/// one `Content.Info`, and one `Images.Get` per image naming it, per this
/// interval until `pending_give_up`; one that arrives behind imgbridge's
/// back is linked at most this late, and one whose images are deleted is
/// forgotten at most this late.
const MAX_CHECK: Duration = Duration::from_secs(1);
/// The backstop's checks of one blob: from [`FIRST_CHECK`] doubling to [`MAX_CHECK`].
const CHECKS: Backoff = Backoff::new(FIRST_CHECK, MAX_CHECK);

/// An image that named a missing blob. It waits for the blob as long as
/// its record in the source still points at `root`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Owner {
    pub image: String,
    pub root: String,
    /// Whether a pod on this node could need the blob through this image.
    pub need: Need,
}

/// What the replicator found missing: one blob of one image for one target.
#[derive(Clone, Debug)]
pub struct Item {
    pub source: String,
    pub target: String,
    pub owner: Owner,
    pub child: Child,
}

pub use super::observe::PendingBlob as Blob;

type Key = (String, String);

/// One missing blob of one source namespace, whatever images and targets
/// wait for it.
struct Entry {
    child: Child,
    owners: Vec<Owner>,
    targets: Vec<String>,
    since: Instant,
    /// Since an image a pod here could run first named it: what
    /// `pending_warn_after` counts from.
    needed_since: Option<Instant>,
    told: Told,
    state: State,
}

/// What the operator was told about a blob still missing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Told {
    Nothing,
    /// Overdue, but only other platforms need it: a DEBUG line.
    Noted,
    /// Overdue and a pod here could need it: the WARN.
    Warned,
}

/// Who is acting on a pending blob.
enum State {
    /// Nobody: the backstop looks again at `next`.
    Waiting { next: Instant, backoff: Backoff },
    /// A link is running; the receiver sees its sender dropped when it ends.
    Linking(watch::Receiver<()>),
}

impl State {
    fn waiting(backoff: Backoff) -> State {
        State::Waiting {
            next: Instant::now() + backoff.current(),
            backoff,
        }
    }
}

/// What a check that found a blob still missing decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Waited for still; nothing (new) to say.
    Waiting,
    /// Past `pending_warn_after` for the first time (WARN if a pod here
    /// could need it, DEBUG otherwise).
    Overdue(Need),
    /// No image that named it still points at the tree that did: dropped
    /// without a warning.
    Forgotten,
    /// Past `pending_give_up`: dropped (WARN if a pod here could need it).
    GaveUp(Need),
}

/// When a pending blob is overdue or given up.
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
    pub warn_after: Duration,
    pub give_up: Duration,
}

impl Entry {
    fn new(child: Child) -> Entry {
        Entry {
            child,
            owners: Vec::new(),
            targets: Vec::new(),
            since: Instant::now(),
            needed_since: None,
            told: Told::Nothing,
            state: State::waiting(CHECKS),
        }
    }

    /// Whether a pod on this node could need it through any image.
    fn need(&self) -> Need {
        self.owners
            .iter()
            .map(|o| o.need)
            .max()
            .unwrap_or(Need::OtherPlatform)
    }

    /// The images waiting for it, first seen first, each once.
    fn images(&self) -> Vec<String> {
        let mut v: Vec<String> = Vec::new();
        for o in &self.owners {
            if !v.contains(&o.image) {
                v.push(o.image.clone());
            }
        }
        v
    }

    /// A check found the blob still missing and these owners `gone`
    /// (deleted, or pointing elsewhere now): what to do with it.
    fn missed(&mut self, gone: &[Owner], limits: Limits) -> Verdict {
        self.owners.retain(|o| !gone.contains(o));
        if self.owners.is_empty() {
            return Verdict::Forgotten;
        }
        let need = self.need();
        if self.since.elapsed() > limits.give_up {
            return Verdict::GaveUp(need);
        }
        let overdue = match need {
            Need::Node => self
                .needed_since
                .is_some_and(|t| t.elapsed() > limits.warn_after),
            Need::OtherPlatform => self.since.elapsed() > limits.warn_after,
        };
        match (overdue, need, self.told) {
            (true, Need::Node, Told::Nothing | Told::Noted) => {
                self.told = Told::Warned;
                Verdict::Overdue(Need::Node)
            }
            (true, Need::OtherPlatform, Told::Nothing) => {
                self.told = Told::Noted;
                Verdict::Overdue(Need::OtherPlatform)
            }
            _ => Verdict::Waiting,
        }
    }
}

/// The right to link one blob, handed to exactly one task.
pub(super) struct Job {
    key: Key,
    pub child: Child,
    pub owners: Vec<Owner>,
    pub targets: Vec<String>,
    since: Instant,
    backoff: Backoff,
    _done: watch::Sender<()>,
}

impl Job {
    pub fn source(&self) -> &str {
        &self.key.0
    }

    /// `(source, image)` of each owner.
    fn owner_keys(&self) -> impl Iterator<Item = Key> + '_ {
        self.owners
            .iter()
            .map(|o| (self.source().to_string(), o.image.clone()))
    }

    /// The owners whose record, as `known` read it, is gone or points at
    /// another tree. One not read counts as still there.
    fn gone(&self, known: &HashMap<Key, Option<String>>) -> Vec<Owner> {
        self.owners
            .iter()
            .filter(|o| {
                let key = (self.source().to_string(), o.image.clone());
                known
                    .get(&key)
                    .is_some_and(|root| root.as_deref() != Some(o.root.as_str()))
            })
            .cloned()
            .collect()
    }

    /// The images waiting for the blob, each once (for logs).
    pub fn images(&self) -> Vec<&str> {
        let mut v: Vec<&str> = Vec::new();
        for o in &self.owners {
            if !v.contains(&o.image.as_str()) {
                v.push(&o.image);
            }
        }
        v
    }
}

enum Claim {
    Absent,
    Busy(watch::Receiver<()>),
    /// Boxed: a job is several times the size of the other claims.
    Mine(Box<Job>),
}

/// How a [`Job`] ended.
pub(super) enum Linked {
    /// Linked into these targets (the others stay pending).
    Into(Vec<String>),
    /// Still not in the source; these owners no longer name it.
    Missing { gone: Vec<Owner> },
}

#[derive(Default)]
pub struct Pending {
    items: Mutex<HashMap<Key, Entry>>,
    /// Wakes the backstop when a blob is added.
    added: Notify,
}

impl Pending {
    pub fn add(&self, item: Item) {
        let key = (item.source, item.child.digest.to_string());
        let mut m = lock(&self.items);
        let e = m.entry(key).or_insert_with_key(|(source, digest)| {
            match item.owner.need {
                Need::Node => tracing::info!(image = ?item.owner.image, digest = %digest, source = ?source, target = ?item.target,
                    "blob not yet in source; will link it when it appears"),
                Need::OtherPlatform => tracing::debug!(image = ?item.owner.image, digest = %digest, source = ?source, target = ?item.target,
                    "blob of another platform not in source; will link it when it appears, and not report it"),
            }
            Entry::new(item.child)
        });
        if item.owner.need == Need::Node && e.needed_since.is_none() {
            e.needed_since = Some(Instant::now());
        }
        if !e.owners.contains(&item.owner) {
            e.owners.push(item.owner);
        }
        if !e.targets.contains(&item.target) {
            e.targets.push(item.target);
        }
        drop(m);
        self.added.notify_one();
    }

    pub fn count(&self) -> usize {
        lock(&self.items).len()
    }

    /// Whether `digest` is awaited in `source`: asked for every commit that
    /// passes through the proxy, and almost always with nothing pending, so
    /// that case costs no allocation; otherwise one hash lookup.
    pub fn awaits(&self, source: &str, digest: &str) -> bool {
        let m = lock(&self.items);
        !m.is_empty() && m.contains_key(&(source.to_string(), digest.to_string()))
    }

    /// The pending blobs of `source`.
    pub fn digests(&self, source: &str) -> Vec<String> {
        let m = lock(&self.items);
        m.keys()
            .filter(|(s, _)| s == source)
            .map(|(_, d)| d.clone())
            .collect()
    }

    /// The pending blobs a pod on this node could need, oldest first, and
    /// how many others (only other platforms need them) wait besides.
    pub fn list(&self) -> (Vec<Blob>, usize) {
        let m = lock(&self.items);
        let mut others = 0;
        let mut v = Vec::new();
        for ((source, digest), e) in m.iter() {
            if e.need() == Need::OtherPlatform {
                others += 1;
                continue;
            }
            let since = e.needed_since.unwrap_or(e.since);
            v.push((
                since,
                Blob {
                    source: source.clone(),
                    digest: digest.clone(),
                    images: e.images(),
                    targets: e.targets.clone(),
                    age_seconds: since.elapsed().as_secs(),
                },
            ));
        }
        v.sort_by_key(|(since, _)| *since);
        (v.into_iter().map(|(_, b)| b).collect(), others)
    }

    fn claim(&self, source: &str, digest: &str) -> Claim {
        let key = (source.to_string(), digest.to_string());
        let mut m = lock(&self.items);
        let Some(e) = m.get_mut(&key) else {
            return Claim::Absent;
        };
        match &e.state {
            State::Linking(rx) => Claim::Busy(rx.clone()),
            State::Waiting { backoff, .. } => {
                let backoff = *backoff;
                Claim::Mine(Box::new(Self::start(key, e, backoff)))
            }
        }
    }

    fn start(key: Key, e: &mut Entry, backoff: Backoff) -> Job {
        let (tx, rx) = watch::channel(());
        e.state = State::Linking(rx);
        Job {
            key,
            child: e.child.clone(),
            owners: e.owners.clone(),
            targets: e.targets.clone(),
            since: e.since,
            backoff,
            _done: tx,
        }
    }

    /// The blobs due for a backstop check, claimed.
    fn due(&self) -> Vec<Job> {
        let now = Instant::now();
        let mut m = lock(&self.items);
        let mut jobs = Vec::new();
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
        let m = lock(&self.items);
        m.values()
            .filter_map(|e| match e.state {
                State::Waiting { next, .. } => Some(next),
                State::Linking(_) => None,
            })
            .min()
    }

    /// Ends a job: removes what was linked, forgets what no image names
    /// any more, says what is overdue or given up, schedules the rest.
    /// Returns what became of a blob still missing.
    fn finish(&self, job: Job, linked: &Linked, limits: Limits, by_commit: bool) -> Verdict {
        let mut m = lock(&self.items);
        let Some(e) = m.get_mut(&job.key) else {
            return Verdict::Waiting;
        };
        let (source, digest) = (&job.key.0, &job.key.1);
        let gone = match linked {
            Linked::Into(targets) => {
                e.targets.retain(|t| !targets.contains(t));
                tracing::info!(images = ?job.images(), digest = %digest, source = ?source, targets = ?targets,
                    late_ms = job.since.elapsed().as_millis() as u64,
                    by = if by_commit { "commit" } else { "backstop" },
                    "linked a blob that arrived after its image");
                if e.targets.is_empty() {
                    m.remove(&job.key);
                } else {
                    e.state = State::waiting(CHECKS);
                }
                return Verdict::Waiting;
            }
            Linked::Missing { gone } => gone,
        };
        let verdict = e.missed(gone, limits);
        let (images, targets, waited_s) = (e.images(), &e.targets, e.since.elapsed().as_secs());
        match verdict {
            Verdict::Forgotten => {
                tracing::info!(images = ?job.images(), digest = %digest, source = ?source,
                    "stopped waiting for a blob: no image in the source names it any more (deleted, or now pointing at another tree)");
            }
            Verdict::GaveUp(Need::Node) => {
                tracing::warn!(images = ?images, digest = %digest, source = ?source, targets = ?targets, waited_s,
                    "gave up waiting for a blob to appear in the source; pull or rebuild the image, then run `imgbridge sync`");
            }
            Verdict::GaveUp(Need::OtherPlatform) => {
                tracing::debug!(images = ?images, digest = %digest, source = ?source, waited_s,
                    "stopped waiting for a blob only other platforms' pods need");
            }
            Verdict::Overdue(Need::Node) => {
                tracing::warn!(images = ?images, digest = %digest, source = ?source, targets = ?targets, waited_s,
                    "a blob these images reference is still not in the source; pods of them fail to start until it is written (kubelet retries)");
            }
            Verdict::Overdue(Need::OtherPlatform) => {
                tracing::debug!(images = ?images, digest = %digest, source = ?source, waited_s,
                    "a blob only other platforms' pods need is still not in the source; not reported (no pod on this node runs it)");
            }
            Verdict::Waiting => {}
        }
        match verdict {
            Verdict::Forgotten | Verdict::GaveUp(_) => {
                m.remove(&job.key);
            }
            Verdict::Overdue(_) | Verdict::Waiting => {
                let mut backoff = job.backoff;
                backoff.next_delay();
                e.state = State::waiting(backoff);
            }
        }
        // `job` (and with it the sender) drops here: waiters wake.
        verdict
    }
}

impl Replicator {
    fn limits(&self) -> Limits {
        Limits {
            warn_after: self.s.pending_warn_after,
            give_up: self.s.pending_give_up,
        }
    }

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
                    let mut linked = self.link_job(&job).await;
                    if let Linked::Missing { gone } = &mut linked {
                        let known = self.current_roots(job.owner_keys().collect()).await;
                        *gone = job.gone(&known);
                    }
                    self.pending.finish(*job, &linked, self.limits(), true);
                    if matches!(linked, Linked::Into(_)) {
                        return;
                    }
                }
            }
        }
    }

    /// Blobs a pod here could need, just noted as missing, that are in
    /// `source` by now, linked (a client that writes them without waiting
    /// for the image's reply may have committed one since the walk looked:
    /// that COMMIT reply was not held, as nothing waited for the blob yet).
    /// Costs one `Content.Info` per such blob, at once; other platforms'
    /// blobs are left to the backstop, as nobody here waits for them.
    pub async fn arrived_meanwhile(&self, source: &str, missing: &[(Child, Need)]) {
        let needed = missing.iter().filter(|(_, n)| *n == Need::Node);
        let links = needed.map(|(c, _)| async move {
            if let Ok(Some(_)) = self.c.content_info(source, &c.digest).await {
                self.committed(source, &c.digest).await;
            }
        });
        futures_util::future::join_all(links).await;
    }

    /// Links a claimed blob into each of its targets if it is in the source.
    async fn link_job(&self, job: &Job) -> Linked {
        let missing = Linked::Missing { gone: Vec::new() };
        match self.c.content_info(job.source(), &job.child.digest).await {
            Ok(Some(_)) => {}
            Ok(None) => return missing,
            Err(e) => {
                tracing::debug!(error = %e, digest = %job.child.digest, "pending check failed; retrying");
                return missing;
            }
        }
        let root = crate::containerd::Descriptor {
            media_type: job.child.media_type.clone(),
            digest: job.child.digest.to_string(),
            size: job.child.size,
            ..Default::default()
        };
        let registry = job
            .images()
            .first()
            .and_then(|i| super::distribution::source(i));
        let mut done = Vec::new();
        for target in &job.targets {
            // The parent in the target already carries a gc.ref label for
            // this blob, so the link is GC-safe by itself; the walk's lease
            // (created only if it writes) covers its children until they
            // are referenced. Children still missing are queued in turn,
            // for the same images, needed where both are.
            let lease = super::spare::Lease::new(&self.spares, target);
            let open = super::protect::Gate::open();
            match self
                .walk(
                    job.source(),
                    target,
                    registry.as_ref(),
                    &root,
                    &lease,
                    &open,
                )
                .await
            {
                Ok(found) => {
                    for (child, need) in found.missing {
                        for o in &job.owners {
                            self.pending.add(Item {
                                source: job.source().to_string(),
                                target: target.clone(),
                                owner: Owner {
                                    need: need.min(o.need),
                                    ..o.clone()
                                },
                                child: child.clone(),
                            });
                        }
                    }
                    done.push(target.clone())
                }
                Err(e) => {
                    tracing::warn!(images = ?job.images(), digest = %job.child.digest, target = ?target, error = %e,
                        "linking a blob that arrived late failed; retrying")
                }
            }
            lease.release().await;
        }
        if done.is_empty() {
            missing
        } else {
            Linked::Into(done)
        }
    }

    /// The root each `(source, image)` points at now (`None`: the image
    /// is gone); each read once. One containerd cannot read is left out:
    /// its image counts as still there.
    async fn current_roots(&self, wanted: HashSet<Key>) -> HashMap<Key, Option<String>> {
        let reads = wanted.into_iter().map(|(source, image)| async move {
            let r = self.c.get_image(&source, &image).await;
            ((source, image), r)
        });
        let mut known = HashMap::new();
        for (key, r) in futures_util::future::join_all(reads).await {
            match r {
                Ok(img) => {
                    known.insert(key, img.and_then(|i| i.target).map(|t| t.digest));
                }
                Err(e) => {
                    tracing::debug!(image = %key.1, source = %key.0, error = %e,
                        "could not read the record of an image waiting for a blob; keeping the blob pending");
                }
            }
        }
        known
    }

    /// Pending blobs a pod on this node could need, oldest first (for
    /// `/status`).
    pub fn pending_blobs(&self) -> Vec<Blob> {
        self.pending.list().0
    }
}

/// The backstop: checks each pending blob when it is due.
pub async fn run(r: Arc<Replicator>, shutdown: CancellationToken) {
    loop {
        let jobs = r.pending.due();
        let checks = jobs.into_iter().map(|job| {
            let r = &r;
            async move {
                let linked = r.link_job(&job).await;
                (job, linked)
            }
        });
        let mut results = futures_util::future::join_all(checks).await;
        // Blobs still missing: are their images still there? Each image
        // read once per round, however many blobs it waits for.
        let wanted: HashSet<Key> = results
            .iter()
            .filter(|(_, l)| matches!(l, Linked::Missing { .. }))
            .flat_map(|(j, _)| j.owner_keys())
            .collect();
        let known = r.current_roots(wanted).await;
        for (job, linked) in &mut results {
            if let Linked::Missing { gone } = linked {
                *gone = job.gone(&known);
            }
        }
        for (job, linked) in results {
            r.pending.finish(job, &linked, r.limits(), false);
        }
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
        let (blobs, others) = r.pending.list();
        o.blobs_pending(&blobs, others);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L1: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
    const L2: &str = "sha256:2222222222222222222222222222222222222222222222222222222222222222";
    const M_ARM64: &str = "sha256:3333333333333333333333333333333333333333333333333333333333333333";

    const LIMITS: Limits = Limits {
        warn_after: Duration::from_secs(60),
        give_up: Duration::from_secs(1800),
    };
    /// Everything is overdue at once.
    const OVERDUE: Limits = Limits {
        warn_after: Duration::ZERO,
        give_up: Duration::from_secs(1800),
    };

    fn owner(image: &str, root: char, need: Need) -> Owner {
        Owner {
            image: image.into(),
            root: format!("sha256:{}", root.to_string().repeat(64)),
            need,
        }
    }

    fn add(p: &Pending, digest: &str, target: &str, o: &Owner) {
        p.add(Item {
            source: "buildkit".into(),
            target: target.into(),
            owner: o.clone(),
            child: Child::new(
                "application/vnd.oci.image.layer.v1.tar+gzip",
                crate::oci::Digest::parse(digest).unwrap(),
                1,
            ),
        });
    }

    /// The one claimed job for `digest`.
    fn job(p: &Pending, digest: &str) -> Job {
        match p.claim("buildkit", digest) {
            Claim::Mine(j) => *j,
            _ => panic!("{digest} not claimable"),
        }
    }

    fn missed(p: &Pending, digest: &str, gone: &[&Owner], limits: Limits) -> Verdict {
        let gone = gone.iter().map(|o| (*o).clone()).collect();
        p.finish(job(p, digest), &Linked::Missing { gone }, limits, false)
    }

    /// An image deleted (or moved) while its blob is pending: the entry
    /// goes at the next check, without a warning, even long overdue; it
    /// stays while another image still names it.
    #[test]
    fn an_entry_goes_silently_with_the_last_image_naming_it() {
        let p = Pending::default();
        let (a, b) = (owner("a:1", 'a', Need::Node), owner("b:1", 'b', Need::Node));
        add(&p, L1, "k8s.io", &a);
        add(&p, L1, "k8s.io", &b);
        add(&p, L2, "k8s.io", &a);
        assert_eq!(p.list().0.len(), 2);
        assert_eq!(missed(&p, L1, &[&a], LIMITS), Verdict::Waiting);
        assert_eq!(p.list().0[0].images, vec!["b:1".to_string()]);
        assert_eq!(missed(&p, L1, &[&b], OVERDUE), Verdict::Forgotten);
        assert_eq!(missed(&p, L2, &[&a], OVERDUE), Verdict::Forgotten);
        assert_eq!(p.count(), 0, "nothing outlives its images");
        assert!(!p.awaits("buildkit", L1));
    }

    /// The same image pointing at a new tree that still names the blob is
    /// another owner: dropping the old one keeps the entry.
    #[test]
    fn a_moved_record_that_still_names_the_blob_keeps_it() {
        let p = Pending::default();
        let (old, new) = (owner("a:1", 'a', Need::Node), owner("a:1", 'c', Need::Node));
        add(&p, L1, "k8s.io", &old);
        add(&p, L1, "k8s.io", &new);
        assert_eq!(missed(&p, L1, &[&old], LIMITS), Verdict::Waiting);
        assert_eq!(p.count(), 1);
    }

    /// Blobs only other platforms need are neither listed nor warned
    /// about; one an image here also needs is.
    #[test]
    fn other_platforms_are_counted_apart_and_never_warned() {
        let p = Pending::default();
        let foreign = owner("idx:1", 'a', Need::OtherPlatform);
        add(&p, M_ARM64, "k8s.io", &foreign);
        assert_eq!(p.list(), (vec![], 1));
        assert_eq!(
            missed(&p, M_ARM64, &[], OVERDUE),
            Verdict::Overdue(Need::OtherPlatform)
        );
        assert_eq!(missed(&p, M_ARM64, &[], OVERDUE), Verdict::Waiting);
        let here = owner("arm64-only:1", 'b', Need::Node);
        add(&p, M_ARM64, "k8s.io", &here);
        let (listed, others) = p.list();
        assert_eq!((listed.len(), others), (1, 0));
        assert_eq!(listed[0].images, vec!["idx:1", "arm64-only:1"]);
        assert_eq!(
            missed(&p, M_ARM64, &[], OVERDUE),
            Verdict::Overdue(Need::Node)
        );
        assert_eq!(missed(&p, M_ARM64, &[], OVERDUE), Verdict::Waiting);
        let give_up = Limits {
            warn_after: Duration::ZERO,
            give_up: Duration::ZERO,
        };
        assert_eq!(
            missed(&p, M_ARM64, &[&here], give_up),
            Verdict::GaveUp(Need::OtherPlatform)
        );
        assert_eq!(p.count(), 0);
    }

    /// A warning is said once, and only past `warn_after`.
    #[test]
    fn warns_once_when_overdue() {
        let p = Pending::default();
        let a = owner("a:1", 'a', Need::Node);
        add(&p, L1, "k8s.io", &a);
        assert_eq!(missed(&p, L1, &[], LIMITS), Verdict::Waiting);
        assert_eq!(missed(&p, L1, &[], OVERDUE), Verdict::Overdue(Need::Node));
        assert_eq!(missed(&p, L1, &[], OVERDUE), Verdict::Waiting);
        assert_eq!(p.count(), 1);
    }

    /// Which owners a job drops, from the records read: deleted or moved
    /// ones; unread ones stay.
    #[test]
    fn gone_owners_are_the_deleted_and_the_moved() {
        let p = Pending::default();
        let (a, b, c) = (
            owner("a:1", 'a', Need::Node),
            owner("b:1", 'b', Need::Node),
            owner("c:1", 'c', Need::Node),
        );
        for o in [&a, &b, &c] {
            add(&p, L1, "k8s.io", o);
        }
        let j = job(&p, L1);
        let key = |o: &Owner| ("buildkit".to_string(), o.image.clone());
        let known = HashMap::from([
            (key(&a), None),
            (key(&b), Some(format!("sha256:{}", "d".repeat(64)))),
        ]);
        assert_eq!(j.gone(&known), vec![a.clone(), b.clone()]);
        let known = HashMap::from([(key(&c), Some(c.root.clone()))]);
        assert_eq!(j.gone(&known), vec![]);
    }
}
