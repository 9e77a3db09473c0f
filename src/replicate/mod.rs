//! The replication contract (DESIGN.md): make an image written in a source
//! namespace usable in every target namespace, record last, CRI-confirmed.
//!
//! One replication path serves every trigger (proxy hook, reconcile pass,
//! events, Transfer). It reads the *current* source record under a per
//! (target, name) lock, so concurrent writers converge on the final state,
//! and it plans read-only first, so a pass over images already in sync
//! writes nothing.

mod announce;
pub mod commit;
mod cri_id;
pub mod cri_view;
mod delete;
pub(crate) mod distribution;
pub mod hooks;
mod locks;
pub mod observe;
mod pending;
mod platform;
pub mod protect;
pub mod span;
mod spare;
pub mod tree;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

use crate::config::{self, DeletePolicy, OnFailure};
use crate::containerd::content::{BlobRef, Linked};
use crate::containerd::{self as ctrd, Containerd, Descriptor, Image};
use crate::reference::Reference;
use observe::{Attempt, ReplicationObserver};
use tree::{Child, Need};

use crate::labels::{
    pin_owner, PinOwner, CRI_MANAGED, CRI_MANAGED_VALUE, CRI_NAMESPACE, CRI_PREFIX,
    DISTRIBUTION_SOURCE, EXPIRE, GC_REF_CONTENT, IMPORT, PINNED, PINNED_VALUE, REPLICATE,
    REPLICATE_NO, SOURCE,
};
/// Blobs linked or checked in parallel per image.
const PARALLEL: usize = 16;
/// The labels of `want` that `have` lacks or holds with another value; a
/// distribution-source label `have` has for the registry is kept as it is.
fn missing_labels(
    want: HashMap<String, String>,
    have: &containerd_client::services::v1::Info,
) -> HashMap<String, String> {
    want.into_iter()
        .filter(|(k, v)| match have.labels.get(k) {
            Some(_) if k.starts_with(DISTRIBUTION_SOURCE) => false,
            h => h != Some(v),
        })
        .collect()
}

/// CRI poll interval: 1 ms while CRI usually catches up, then backing off
/// so a slow (or failing) CRI is not hammered until `cri_wait` runs out.
/// With `waiters` replications polling at once, each polls that much less
/// often: all together stay near 1000 ImageStatus calls a second (a burst of
/// 200 Creates polling every millisecond each kept containerd, and with it
/// CRI's own event handling, which they wait for, busy answering them). From
/// [`cri_view::SHARED_FROM`] waiters on they share one `ListImages` instead
/// ([`cri_view::CriView::shared`]).
fn cri_poll_delay(waited: Duration, waiters: usize) -> Duration {
    let alone = match waited.as_millis() {
        0..=50 => Duration::from_millis(1),
        51..=500 => Duration::from_millis(5),
        _ => Duration::from_millis(25),
    };
    alone.max(Duration::from_millis(waiters as u64).min(Duration::from_millis(250)))
}

/// Reset writes followed at once: each costs one Images.Get per 250 ms
/// for up to 3 s.
const ABANDONED_FOLLOWED: usize = 256;

/// Leases outlive any replication; containerd's GC drops them if we crash.
const LEASE_TTL: Duration = Duration::from_secs(3600);

/// Replication settings, from `[replication]`.
#[derive(Clone, Debug)]
pub struct Settings {
    pub sources: Vec<String>,
    pub targets: Vec<String>,
    pub pin: bool,
    pub digest_refs: bool,
    pub confirm_direct: bool,
    pub delete_policy: DeletePolicy,
    pub on_failure: OnFailure,
    pub timeout: Duration,
    pub cri_wait: Duration,
    pub pending_give_up: Duration,
    pub pending_warn_after: Duration,
    /// `replication.protect` and `replication.overwrite` ([`protect`]).
    pub protect: Vec<String>,
    pub overwrite: Vec<String>,
}

impl From<&config::Replication> for Settings {
    fn from(r: &config::Replication) -> Self {
        Settings {
            sources: r.source_namespaces.clone(),
            targets: r.target_namespaces.clone(),
            pin: r.pin,
            digest_refs: r.digest_refs,
            confirm_direct: r.confirm_direct_writes,
            delete_policy: r.delete_policy,
            on_failure: r.on_failure,
            timeout: r.timeout,
            cri_wait: r.cri_wait,
            pending_give_up: r.pending_give_up,
            pending_warn_after: r.pending_warn_after,
            protect: r.protect.clone(),
            overwrite: r.overwrite.clone(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("replicating {image} from {source_ns} into {target}: {cause}")]
    Containerd {
        image: String,
        source_ns: String,
        target: String,
        #[source]
        cause: ctrd::Error,
    },
    #[error("replicating {image} into {target} timed out after {after:?}")]
    Timeout {
        image: String,
        target: String,
        after: Duration,
    },
    #[error(
        "{name} was written into {target} but CRI ImageStatus did not resolve it to {expected:?} within {after:?}"
    )]
    CriWait {
        name: String,
        target: String,
        expected: Vec<String>,
        after: Duration,
    },
    #[error("image {image} in {source_ns} has no target descriptor")]
    NoTarget { image: String, source_ns: String },
    /// The target holds `replica` under a protection ([`protect`]): nothing
    /// was written there.
    #[error("{replica} is protected in {target} ({protection}), so the image was not replicated there; to let builds replace it, add it to replication.overwrite (for example overwrite = [\"{replica}\"])")]
    Protected {
        image: String,
        source_ns: String,
        target: String,
        replica: String,
        protection: protect::Protection,
    },
}

impl Error {
    /// A refusal ([`Error::Protected`]): nothing went wrong, and trying
    /// again changes nothing until the operator does.
    pub fn is_protected(&self) -> bool {
        matches!(self, Error::Protected { .. })
    }
}

/// What one replication did, for logs, tests and idempotence checks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Writes sent to containerd (blob links/copies, label fixes, records).
    pub writes: usize,
    /// Blobs not yet in the source, linked later in the background.
    pub pending: usize,
    /// Skipped because the name is not a valid reference.
    pub skipped: bool,
}

impl Outcome {
    fn absorb(&mut self, o: Outcome) {
        self.writes += o.writes;
        self.pending += o.pending;
        self.skipped |= o.skipped;
    }
}

/// A replication's lease in its target, taken by the first write (a spare
/// made ready before, see [`spare`]). It is released explicitly once the
/// blobs are referenced, and from `Drop` when the replication is cancelled
/// (timeout, caller gone) so the content is not held until the lease
/// expires. Either way the next spare is made after it is gone.
struct Lease {
    spares: Arc<spare::Spares>,
    target: String,
    id: OnceCell<String>,
    released: std::sync::atomic::AtomicBool,
}

impl Lease {
    fn new(spares: &Arc<spare::Spares>, target: &str) -> Lease {
        Lease {
            spares: spares.clone(),
            target: target.into(),
            id: OnceCell::new(),
            released: Default::default(),
        }
    }

    /// The lease's id; the first caller takes it.
    async fn id(&self) -> Result<&String, ctrd::Error> {
        self.id
            .get_or_try_init(|| self.spares.take(&self.target))
            .await
    }

    async fn release(&self) {
        let Some(id) = self.id.get() else { return };
        if self
            .released
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        self.spares.delete(&self.target, id).await;
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
                spares.delete(&target, &id).await;
                spares.refill(&target).await;
            });
        }
    }
}

/// A tree made visible in a target, shared by the replications that need
/// it at once; dropping the last one releases the lease.
struct Walked {
    _lease: Lease,
    outcome: Outcome,
    configs: Vec<String>,
    /// Blobs the source lacks, queued ([`pending`]) by each replication
    /// that uses the walk, once it knows the tree is its image's.
    missing: Vec<(Child, Need)>,
    /// The image id CRI will report, when certain; the names are then
    /// written already marked and its id record next to them ([`cri_id`]).
    cri_id: Option<String>,
    /// The id record's writes, made once for every name of the tree.
    id_record: OnceCell<usize>,
}

/// Makes sure the id record of a tree whose names are written marked
/// exists ([`cri_id`]), once for all of them; returns the writes this
/// caller made. CRI does not write it for a marked name, and does not need
/// it to resolve one: it keeps the tree alive by its id once the names move
/// on, so it is written after the names, off a client's path.
async fn id_record(
    c: &Containerd,
    locks: &locks::KeyedLocks,
    target: &str,
    tree: &Walked,
    root: &Descriptor,
) -> Result<usize, ctrd::Error> {
    let Some(id) = &tree.cri_id else {
        return Ok(0);
    };
    let mut mine = false;
    let writes = tree
        .id_record
        .get_or_try_init(|| {
            mine = true;
            async {
                let _guard = locks.lock(format!("{target}\0{id}")).await;
                cri_id::ensure(c, target, id, root).await
            }
        })
        .await?;
    Ok(if mine { *writes } else { 0 })
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The replication engine; cheap to share (`Arc`).
pub struct Replicator {
    c: Containerd,
    s: Settings,
    locks: Arc<locks::KeyedLocks>,
    /// One walk per (source, target, tree) at a time, and its result.
    walk_locks: locks::KeyedLocks,
    walked: std::sync::Mutex<HashMap<String, std::sync::Weak<Walked>>>,
    /// Bounds the reset writes followed at once ([`Self::on_abandoned`]).
    abandoned: Arc<tokio::sync::Semaphore>,
    /// Replications waiting for CRI, and the answers they share.
    cri_view: cri_view::CriView,
    pending: pending::Pending,
    protect: protect::Protections,
    /// A lease per target ready for the next replication that links.
    spares: Arc<spare::Spares>,
    nodes: std::sync::Mutex<HashMap<String, Arc<tree::Node>>>,
    cri: OnceCell<bool>,
    shared: OnceCell<bool>,
    content_events: OnceCell<bool>,
    observer: std::sync::OnceLock<Arc<dyn ReplicationObserver>>,
    /// The runtime replications run on: the one that built the replicator,
    /// not the proxy's connection threads that trigger them.
    rt: Option<tokio::runtime::Handle>,
}

/// Result of looking at one blob.
#[derive(Default)]
struct Visit {
    children: Vec<(Child, Need)>,
    config: Option<String>,
    write: Option<Write>,
    pending: bool,
}

/// What a blob needs in the target.
enum Write {
    /// Not there: link (or copy) it with these labels; if another
    /// replication linked it since, they are checked then.
    Link {
        size: i64,
        labels: HashMap<String, String>,
    },
    /// There, but these labels are missing or differ.
    Relabel(HashMap<String, String>),
}

/// A finished unit of [`Replicator::walk`].
enum Step {
    Inspected(Child, Result<Visit, ctrd::Error>),
    Wrote(Result<usize, ctrd::Error>),
}

impl Replicator {
    pub fn new(c: Containerd, s: Settings) -> Arc<Self> {
        Arc::new(Replicator {
            protect: protect::Protections::new(&s.protect, &s.overwrite),
            spares: Arc::new(spare::Spares::new(c.clone(), LEASE_TTL)),
            cri_view: cri_view::CriView::new(c.clone()),
            c,
            s,
            locks: Default::default(),
            walk_locks: locks::KeyedLocks::default(),
            walked: Default::default(),
            abandoned: Arc::new(tokio::sync::Semaphore::new(ABANDONED_FOLLOWED)),
            pending: pending::Pending::default(),
            nodes: Default::default(),
            cri: OnceCell::new(),
            shared: OnceCell::new(),
            content_events: OnceCell::new(),
            observer: std::sync::OnceLock::new(),
            rt: tokio::runtime::Handle::try_current().ok(),
        })
    }

    /// Reports outcomes, latencies and pending work to `o`.
    pub fn with_observer(self: Arc<Self>, o: Arc<dyn ReplicationObserver>) -> Arc<Self> {
        let _ = self.observer.set(o);
        self
    }

    pub(crate) fn observer(&self) -> Option<&dyn ReplicationObserver> {
        self.observer.get().map(|o| &**o)
    }

    pub fn settings(&self) -> &Settings {
        &self.s
    }

    pub fn containerd(&self) -> &Containerd {
        &self.c
    }

    pub fn is_source(&self, ns: &str) -> bool {
        self.s.sources.iter().any(|s| s == ns)
    }

    /// Number of blobs waiting to appear in a source namespace.
    pub fn pending_count(&self) -> usize {
        self.pending.count()
    }

    /// Whether a replica waits for `digest` to appear in `source`.
    pub fn awaits(&self, source: &str, digest: &str) -> bool {
        self.pending.awaits(source, digest)
    }

    /// Something wrote into `source` server-side (a Transfer pull): link
    /// every pending blob of it that is there now, before the call returns.
    pub async fn source_written(&self, source: &str) {
        let digests = self.pending.digests(source);
        futures_util::future::join_all(digests.iter().map(|d| self.committed(source, d))).await;
    }

    /// Starts the background linker for blobs that were missing.
    pub fn start(self: &Arc<Self>, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            pending::run(me.clone(), shutdown).await;
            me.spares.release_all().await;
        })
    }

    /// Replicates the current state of `name` in `source` into every target.
    /// `wait_cri` confirms through CRI even when nothing had to be written.
    pub async fn replicate(
        &self,
        source: &str,
        name: &str,
        wait_cri: bool,
    ) -> Result<Outcome, Error> {
        self.replicate_from(source, name, wait_cri, None).await
    }

    /// [`Self::replicate`], with the root the write's reply named: its tree
    /// is walked while the source record is read again ([`Self::replicate_into`]).
    async fn replicate_from(
        &self,
        source: &str,
        name: &str,
        wait_cri: bool,
        hint: Option<&Descriptor>,
    ) -> Result<Outcome, Error> {
        let mut total = Outcome::default();
        let mut first_err = None;
        for target in &self.s.targets {
            let started = Instant::now();
            let r = tokio::time::timeout(
                self.s.timeout,
                self.replicate_into(source, target, name, wait_cri, hint),
            )
            .await;
            if let Some(obs) = self.observer() {
                let attempt = match &r {
                    Ok(Ok(o)) if o.skipped || (o.writes == 0 && o.pending == 0) => {
                        Attempt::Unchanged
                    }
                    Ok(Ok(_)) => Attempt::Changed,
                    Ok(Err(e @ Error::Protected { protection, .. })) => {
                        Attempt::Protected(protection, e)
                    }
                    Ok(Err(e)) => Attempt::Failed(e),
                    Err(_) => Attempt::Failed(&"timed out"),
                };
                obs.replicated(source, name, target, attempt, started.elapsed());
            }
            match r {
                Ok(Ok(o)) => total.absorb(o),
                Ok(Err(e)) if e.is_protected() => {
                    let root = hint.map_or("", |h| h.digest.as_str());
                    let key = format!("{target}\0{name}\0{root}");
                    if self.protect.first_refusal(key) {
                        tracing::warn!(image = name, source, target = %target, error = %e,
                            "not replicated: the name is protected in the target; the image stays in the source as written");
                    } else {
                        tracing::debug!(image = name, source, target = %target, "not replicated: protected (told before)");
                    }
                    first_err.get_or_insert(e);
                }
                Ok(Err(e)) => {
                    tracing::warn!(image = name, source, target = %target, error = %e, "replication failed");
                    first_err.get_or_insert(e);
                }
                Err(_) => {
                    let e = Error::Timeout {
                        image: name.into(),
                        target: target.clone(),
                        after: self.s.timeout,
                    };
                    tracing::warn!(image = name, error = %e, "replication timed out");
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(total),
        }
    }

    async fn replicate_into(
        &self,
        source: &str,
        target: &str,
        name: &str,
        wait_cri: bool,
        hint: Option<&Descriptor>,
    ) -> Result<Outcome, Error> {
        if name.starts_with("sha256:") {
            return Ok(Outcome {
                skipped: true,
                ..Default::default()
            });
        }
        let parsed = match Reference::parse(name) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(image = name, source, error = %e, "not replicating an image whose name is not a valid reference");
                return Ok(Outcome {
                    skipped: true,
                    ..Default::default()
                });
            }
        };
        let target_name = parsed.to_string();
        let _guard = self.locks.lock(format!("{target}\0{target_name}")).await;
        let err = |cause| Error::Containerd {
            image: name.into(),
            source_ns: source.into(),
            target: target.into(),
            cause,
        };
        let started = Instant::now();
        let by_name = self.protection_by_name(target, &target_name).await;
        // The latest source state, not the reply that triggered us: under the
        // lock this makes racing writers converge on what containerd holds.
        // The tree the reply named is walked meanwhile (almost always the
        // same; if not, that walk is dropped), and the target's record is
        // read: all reads but the links, and the lock keeps our own writers
        // out. The walk writes only once that record is known not to be
        // protected ([`protect::Gate`]); a name protected as such is not
        // walked at all.
        let (verdict, gate) = protect::Gate::pending();
        let hint = hint.filter(|_| by_name.is_none());
        let (image, existing, early) = tokio::join!(
            self.c.get_image(source, name),
            async {
                let existing = self.c.get_image(target, &target_name).await;
                let clear = by_name.is_none()
                    && matches!(&existing, Ok(e) if self.protect.by_record(&target_name, e.as_ref()).is_none());
                let _ = verdict.send(Some(clear));
                existing
            },
            async {
                match hint {
                    Some(h) => Some((h, self.walk_shared(source, target, name, h, &gate).await)),
                    None => None,
                }
            }
        );
        let Some(image) = image.map_err(err)? else {
            tracing::debug!(
                image = name,
                source,
                "source image gone before replication; nothing to do"
            );
            return Ok(Outcome::default());
        };
        if image.labels.get(REPLICATE).map(String::as_str) == Some(REPLICATE_NO) {
            // Not an image for CRI (a registry artefact or digest-only
            // manifest, see crate::registry).
            return Ok(Outcome {
                skipped: true,
                ..Default::default()
            });
        }
        let existing = existing.map_err(err)?;
        let root = image.target.clone().ok_or_else(|| Error::NoTarget {
            image: name.into(),
            source_ns: source.into(),
        })?;
        let protection =
            by_name.or_else(|| self.protect.by_record(&target_name, existing.as_ref()));
        if let Some(protection) = protection {
            let held = existing.as_ref().and_then(|e| e.target.as_ref());
            if held.is_some_and(|t| t.digest == root.digest) {
                // It already is what the source holds: nothing to replace.
                return Ok(Outcome::default());
            }
            return Err(Error::Protected {
                image: name.into(),
                source_ns: source.into(),
                target: target.into(),
                replica: target_name,
                protection,
            });
        }
        let mut names = vec![target_name.clone()];
        if self.s.digest_refs && parsed.digest.is_none() {
            names.push(parsed.with_digest(&root.digest));
        }
        let walk = match early {
            Some((h, w)) if h.digest == root.digest => w,
            _ => {
                let open = protect::Gate::open();
                self.walk_shared(source, target, &image.name, &root, &open)
                    .await
            }
        };
        let (tree, shared) = walk.map_err(err)?;
        for (child, need) in &tree.missing {
            self.pending.add(pending::Item {
                source: source.into(),
                target: target.into(),
                owner: pending::Owner {
                    image: image.name.clone(),
                    root: root.digest.clone(),
                    need: *need,
                },
                child: child.clone(),
            });
        }
        let mut outcome = match shared {
            // Another replication of the same tree wrote (and counted) it.
            true => Outcome::default(),
            false => tree.outcome.clone(),
        };
        let configs = tree.configs.clone();
        let walked = started.elapsed();
        // Every blob is visible: the tag first, so that CRI handles its
        // event first; the digest ref and the lease release overlap the
        // wait, the id record follows.
        let managed = tree.cri_id.is_some();
        let (tag, ()) = tokio::join!(
            self.put_record(source, target, &names[0], &image, existing, managed),
            self.arrived_meanwhile(source, &tree.missing)
        );
        let recorded = started.elapsed();
        outcome.writes += tag.map_err(err)?;
        let confirm = target == CRI_NAMESPACE && (wait_cri || outcome.writes > 0);
        // The digest ref is one record for every name of the tree: a burst
        // of names for one image would otherwise write it once per name
        // (each a bolt transaction with an fsync, one at a time), so its
        // writers take turns and each reads it again under the lock.
        let digest_refs = futures_util::future::join_all(names[1..].iter().map(|n| {
            let image = &image;
            async move {
                let _guard = self.locks.lock(format!("{target}\0{n}")).await;
                let existing = self.c.get_image(target, n).await?;
                self.put_record(source, target, n, image, existing, managed)
                    .await
            }
        }));
        let (rest, (mut polls, resolved)) = tokio::join!(digest_refs, async {
            if confirm {
                self.wait_cri(target, &target_name, &configs).await
            } else {
                (0, false)
            }
        });
        for r in rest {
            outcome.writes += r.map_err(err)?;
        }
        // The id record after the names: CRI does not need it to resolve
        // them (and handles events in order), so a client's write does not
        // wait for it. The tree, and with it the lease (once the last
        // replication sharing it is done), is held until the record is in.
        if wait_cri {
            let (c, locks, target, root) = (
                self.c.clone(),
                self.locks.clone(),
                target.to_string(),
                root.clone(),
            );
            tokio::spawn(async move {
                if let Err(e) = id_record(&c, &locks, &target, &tree, &root).await {
                    tracing::warn!(target, id = ?tree.cri_id, error = %e,
                        "could not write the image id record CRI keeps; the next pass over the image writes it");
                }
            });
        } else {
            outcome.writes += id_record(&self.c, &self.locks, target, &tree, &root)
                .await
                .map_err(err)?;
        }
        // A pod may name the image by digest (`repo:tag@sha256:…`): the
        // digest ref is confirmed too. CRI handles events in order, so it
        // usually is by now (one poll). Not when the tag timed out: CRI is
        // behind, and that was logged.
        if resolved {
            for n in &names[1..] {
                polls += self.wait_cri(target, n, &configs).await.0;
            }
        }
        tracing::debug!(
            image = name,
            target,
            writes = outcome.writes,
            walk_ms = walked.as_secs_f64() * 1e3,
            record_ms = (recorded - walked).as_secs_f64() * 1e3,
            cri_ms = (started.elapsed() - recorded).as_secs_f64() * 1e3,
            cri_polls = polls,
            "replication phases"
        );
        if outcome.writes > 0 || outcome.pending > 0 {
            tracing::info!(image = name, source, target, replica = %target_name, writes = outcome.writes, pending = outcome.pending, "replicated");
        }
        Ok(outcome)
    }

    /// [`Self::walk`] once per tree and target for every replication that
    /// needs it at the same time (a burst of names for one image): the
    /// first walks, the others wait for it and share its result. The
    /// shared [`Walked`] holds the lease, so the tree stays protected until
    /// the last of them has written its record. `true`: shared. Names of
    /// another registry walk on their own: the walk labels every blob with
    /// the name's registry ([`distribution`]).
    async fn walk_shared(
        &self,
        source: &str,
        target: &str,
        image: &str,
        root: &Descriptor,
        gate: &protect::Gate,
    ) -> Result<(Arc<Walked>, bool), ctrd::Error> {
        let registry = distribution::source(image).map(|(k, _)| k);
        let key = format!(
            "{source}\0{target}\0{}\0{}",
            root.digest,
            registry.as_deref().unwrap_or("")
        );
        let _walking = self.walk_locks.lock(key.clone()).await;
        if let Some(w) = lock(&self.walked)
            .get(&key)
            .and_then(std::sync::Weak::upgrade)
        {
            return Ok((w, true));
        }
        let lease = Lease::new(&self.spares, target);
        let (outcome, configs, missing) =
            self.walk(source, target, image, root, &lease, gate).await?;
        let cri_id = match target == CRI_NAMESPACE && self.has_cri().await {
            true => self.cri_id(source, root).await,
            false => None,
        };
        let w = Arc::new(Walked {
            _lease: lease,
            outcome,
            configs,
            missing,
            cri_id,
            id_record: OnceCell::new(),
        });
        let mut walked = lock(&self.walked);
        walked.retain(|_, w| w.strong_count() > 0);
        walked.insert(key, Arc::downgrade(&w));
        Ok((w, false))
    }

    /// Walks the tree from `root`, making every present blob visible in
    /// `target`. Returns the outcome, the config digests seen (the image
    /// ids CRI may report) and the blobs the source lacks, each with
    /// whether this node could need it, given that it could need `root`.
    ///
    /// Inspections (reads) and writes share one bounded set of futures: a
    /// blob's link starts as soon as it is inspected, and its children are
    /// inspected meanwhile, so a cold tree costs about one round trip per
    /// level plus containerd's commit rate.
    async fn walk(
        &self,
        source: &str,
        target: &str,
        image: &str,
        root: &Descriptor,
        lease: &Lease,
        gate: &protect::Gate,
    ) -> Result<(Outcome, Vec<String>, Vec<(Child, Need)>), ctrd::Error> {
        let mut outcome = Outcome::default();
        let mut configs = Vec::new();
        let mut missing = Vec::new();
        // Parent → children of every parent read, to tell afterwards which
        // blobs a pod here could need: a blob reached first under another
        // platform's entry may also sit under this node's.
        let mut edges: HashMap<String, Vec<(String, Need)>> = HashMap::new();
        let root = Child {
            media_type: root.media_type.clone(),
            digest: root.digest.clone(),
            size: root.size,
        };
        let root_digest = root.digest.clone();
        let mut queue = vec![root];
        let mut seen = std::collections::HashSet::new();
        let mut running: FuturesUnordered<BoxFuture<'_, Step>> = FuturesUnordered::new();
        loop {
            while running.len() < PARALLEL {
                let Some(c) = queue.pop() else { break };
                if seen.insert(c.digest.clone()) {
                    running.push(Box::pin(async move {
                        let r = self.inspect(source, target, image, &c).await;
                        Step::Inspected(c, r)
                    }));
                }
            }
            let Some(step) = running.next().await else {
                break;
            };
            match step {
                Step::Inspected(child, r) => {
                    let v = r?;
                    if v.pending {
                        outcome.pending += 1;
                        missing.push(child.clone());
                    }
                    configs.extend(v.config);
                    if !v.children.is_empty() {
                        let e = v.children.iter().map(|(c, n)| (c.digest.clone(), *n));
                        edges.insert(child.digest.clone(), e.collect());
                    }
                    queue.extend(v.children.into_iter().map(|(c, _)| c));
                    if let Some(w) = v.write {
                        running.push(Box::pin(async move {
                            if !gate.passed().await {
                                let shut = "the target's record is protected: nothing written";
                                return Step::Wrote(Err(ctrd::Error::Protocol(shut.into())));
                            }
                            Step::Wrote(self.apply(source, target, &child, w, lease).await)
                        }));
                    }
                }
                Step::Wrote(r) => outcome.writes += r?,
            }
        }
        let here = tree::needed_here(&root_digest, &edges);
        let missing = missing
            .into_iter()
            .map(|c| {
                let n = match here.contains(&c.digest) {
                    true => Need::Node,
                    false => Need::OtherPlatform,
                };
                (c, n)
            })
            .collect();
        Ok((outcome, configs, missing))
    }

    /// One blob, read-only: present in source? its labels and children, and
    /// what (if anything) the target needs. The reads run at once: asking
    /// the target costs no round trip, and a blob found there (the base
    /// layers of a rebuild) needs no write at all, where a link would be a
    /// bolt transaction answering ALREADY_EXISTS. Such a blob is not in our
    /// lease, but its parent is (linked with its `gc.ref` labels at the
    /// same time as this probe), so from then on the lease keeps it; only a
    /// GC finishing in between could take it, and a reconcile pass links
    /// it again.
    async fn inspect(
        &self,
        source: &str,
        target: &str,
        image: &str,
        c: &Child,
    ) -> Result<Visit, ctrd::Error> {
        let parent = tree::is_parent(&c.media_type);
        let (info, in_target, node) = tokio::join!(
            self.c.content_info(source, &c.digest),
            self.c.content_info(target, &c.digest),
            async {
                if parent {
                    Some(self.node(source, &c.digest).await)
                } else {
                    None
                }
            }
        );
        let Some(info) = info? else {
            return Ok(Visit {
                pending: true,
                ..Default::default()
            });
        };
        let node = node.transpose()?;
        let mut labels: HashMap<String, String> = info
            .labels
            .into_iter()
            .filter(|(k, _)| k != EXPIRE)
            .collect();
        if let Some(n) = &node {
            // Children must stay alive in the target even if the source blob
            // was written by a client that did not label it.
            if !labels.keys().any(|k| k.starts_with(GC_REF_CONTENT)) {
                labels.extend(n.gc_labels());
            }
        }
        if let Some((k, repo)) = distribution::source(image) {
            labels.entry(k).or_insert(repo);
        }
        let mut v = Visit::default();
        match in_target? {
            None => {
                v.write = Some(Write::Link {
                    size: info.size,
                    labels,
                })
            }
            Some(t) => {
                let missing = missing_labels(labels, &t);
                if !missing.is_empty() {
                    v.write = Some(Write::Relabel(missing));
                }
            }
        }
        if let Some(n) = node {
            v.config = n.config.as_ref().map(|c| c.digest.clone());
            v.children = n
                .children_needed()
                .map(|(c, need)| (c.clone(), need))
                .collect();
        }
        Ok(v)
    }

    /// Performs what [`Self::inspect`] found missing; returns writes made.
    async fn apply(
        &self,
        source: &str,
        target: &str,
        c: &Child,
        w: Write,
        lease: &Lease,
    ) -> Result<usize, ctrd::Error> {
        let (size, labels) = match w {
            Write::Relabel(missing) => {
                self.c
                    .update_content_labels(target, &c.digest, &missing)
                    .await?;
                if missing.keys().any(|k| k.starts_with(DISTRIBUTION_SOURCE)) {
                    announce::content_created(&self.c, target, &c.digest, c.size).await;
                }
                return Ok(1);
            }
            Write::Link { size, labels } => (size, labels),
        };
        let id = lease.id().await?;
        let blob = BlobRef {
            digest: &c.digest,
            size,
            labels: &labels,
        };
        let shared = if self.shared_content().await {
            self.c.link_shared(target, Some(id), blob.clone()).await?
        } else {
            None
        };
        let linked = match shared {
            Some(l) => l,
            None => self.c.link_or_copy(source, target, Some(id), blob).await?,
        };
        if linked == Linked::Present {
            // Linked unseen (or another replication linked it since the
            // probe, with its own labels): its labels were not checked.
            if let Some(t) = self.c.content_info(target, &c.digest).await? {
                let missing = missing_labels(labels, &t);
                if !missing.is_empty() {
                    self.c
                        .update_content_labels(target, &c.digest, &missing)
                        .await?;
                }
            }
        } else if linked != Linked::Present && !self.content_events().await {
            announce::content_created(&self.c, target, &c.digest, size).await;
        }
        Ok(1)
    }

    /// Whether containerd publishes `/content/create` itself (asked once,
    /// when known; see [`announce`]).
    async fn content_events(&self) -> bool {
        let r = self
            .content_events
            .get_or_try_init(|| async {
                self.c
                    .version()
                    .await
                    .map(|v| announce::publishes_content_events(&v))
            })
            .await;
        // Unknown (containerd restarting): announcing is harmless either way.
        matches!(r, Ok(true))
    }

    /// Whether containerd shares content across namespaces (asked once):
    /// then a blob is linked with a single COMMIT message.
    async fn shared_content(&self) -> bool {
        let r = self
            .shared
            .get_or_try_init(|| async { self.c.sharing_policy().await.map(|p| p == "shared") })
            .await;
        matches!(r, Ok(true))
    }

    /// Parsed index/manifest, cached by digest (content is immutable).
    async fn node(&self, source: &str, digest: &str) -> Result<Arc<tree::Node>, ctrd::Error> {
        if let Some(n) = self.nodes.lock().unwrap().get(digest) {
            return Ok(n.clone());
        }
        let bytes = self
            .c
            .read_small(source, digest, tree::MAX_MANIFEST)
            .await?;
        let node = Arc::new(tree::parse(&bytes).map_err(|e| {
            ctrd::Error::Protocol(format!(
                "blob {digest} is not a valid manifest or index: {e}"
            ))
        })?);
        let mut cache = self.nodes.lock().unwrap();
        if cache.len() > 8192 {
            cache.clear();
        }
        cache.insert(digest.into(), node.clone());
        Ok(node)
    }

    /// The image id CRI will give the tree at `root` on this host, if that
    /// is certain without asking it: the config of the root manifest, or of
    /// the index entry for this platform ([`tree::Node::host`]).
    async fn cri_id(&self, source: &str, root: &Descriptor) -> Option<String> {
        let node = self.node(source, &root.digest).await.ok()?;
        let manifest = match (&node.config, node.host) {
            (Some(_), _) => node,
            (None, Some(i)) => self.node(source, &node.manifests[i].digest).await.ok()?,
            (None, None) => return None,
        };
        manifest.config.as_ref().map(|c| c.digest.clone())
    }

    /// Why `name` may not be replaced in `target`, from the name alone;
    /// CRI's sandbox image is read first if it is not known yet.
    async fn protection_by_name(&self, target: &str, name: &str) -> Option<protect::Protection> {
        let cri_target = target == CRI_NAMESPACE;
        if cri_target && self.protect.sandbox() == protect::Sandbox::Unknown {
            self.refresh_sandbox().await;
        }
        self.protect.by_name(cri_target, name)
    }

    /// Reads CRI's sandbox image from containerd again: at start and after
    /// every reconnect (each catch-up pass), as containerd may have come
    /// back with another config. A read that fails leaves it unknown, to
    /// be asked again by the next replication into `k8s.io`.
    pub async fn refresh_sandbox(&self) {
        if !self.has_cri().await {
            self.protect.set_sandbox(None);
            return;
        }
        let file = ctrd::node_config::locate_for(self.c.socket());
        let read = self.c.cri_sandbox_image(file.as_deref());
        match tokio::time::timeout(Duration::from_secs(5), read).await {
            Ok(Ok(name)) => {
                let before = self.protect.sandbox();
                self.protect.set_sandbox(name.as_deref());
                if self.protect.sandbox() != before {
                    tracing::info!(sandbox_image = ?name, "CRI's sandbox image is protected: replicas never replace it");
                }
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "could not read CRI's sandbox image; asking again on the next replication")
            }
            Err(_) => tracing::debug!(
                "CRI's sandbox image not read within 5 s; asking again on the next replication"
            ),
        }
    }

    /// The protections in force ([`protect`]).
    pub fn protections(&self) -> &protect::Protections {
        &self.protect
    }

    /// Whether containerd runs CRI. Cached only once known: a probe that
    /// failed (containerd restarting) must not turn CRI's part off for the
    /// life of the process.
    async fn has_cri(&self) -> bool {
        match self.cri.get_or_try_init(|| self.c.has_cri()).await {
            Ok(known) => *known,
            Err(_) => true,
        }
    }

    /// Writes the record `name` in `target`, pointing where the source
    /// record `image` points, if it differs; returns writes. `managed`:
    /// written marked as CRI's, its id record written next to it.
    async fn put_record(
        &self,
        source: &str,
        target: &str,
        name: &str,
        image: &Image,
        existing: Option<Image>,
        managed: bool,
    ) -> Result<usize, ctrd::Error> {
        let Some(root) = image.target.as_ref() else {
            return Err(ctrd::Error::Protocol(format!("image {name} has no target")));
        };
        let mut labels: HashMap<String, String> = image
            .labels
            .iter()
            .filter(|(k, _)| k.as_str() != EXPIRE && !k.starts_with(CRI_PREFIX))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        labels.insert(SOURCE.into(), source.into());
        if self.s.pin {
            labels.insert(PINNED.into(), PINNED_VALUE.into());
        }
        if managed {
            labels.insert(CRI_MANAGED.into(), CRI_MANAGED_VALUE.into());
        }
        if let Some(e) = &existing {
            let same_target = e.target.as_ref().map(|t| &t.digest) == Some(&root.digest);
            for (k, v) in &e.labels {
                // Keep what others own: the importer's pin, CRI's management
                // marker (only while the digest is unchanged).
                let keep = k == IMPORT
                    || (k == PINNED
                        && matches!(pin_owner(&e.labels), PinOwner::Import | PinOwner::Other))
                    || (k == CRI_MANAGED && same_target);
                if keep {
                    labels.entry(k.clone()).or_insert_with(|| v.clone());
                }
            }
            if same_target && e.target.as_ref() == Some(root) && e.labels == labels {
                return Ok(0);
            }
        }
        let record = Image {
            name: name.into(),
            labels,
            target: Some(root.clone()),
            ..Default::default()
        };
        match existing {
            Some(_) => match self
                .c
                .update_image(target, record.clone(), Vec::new())
                .await
            {
                Err(e) if e.is(tonic::Code::NotFound) => {
                    self.c.put_image(target, record).await?;
                }
                r => {
                    r?;
                }
            },
            None => {
                self.c.put_image(target, record).await?;
            }
        }
        Ok(1)
    }

    /// Polls CRI until `name` resolves to one of `configs` (any id if the
    /// config is not known yet); returns the number of polls and whether it
    /// resolved (or needs no confirmation) before `cri_wait` ran out. CRI follows
    /// containerd's events a few ms behind the record, so the first poll is
    /// immediate and the next ones come every millisecond before backing off.
    /// With many waiting, they share one `ListImages` ([`cri_view`]).
    async fn wait_cri(&self, target: &str, name: &str, configs: &[String]) -> (usize, bool) {
        if configs.is_empty() || !self.has_cri().await {
            return (0, true);
        }
        let _waiting = self.cri_view.enter();
        let started = Instant::now();
        let deadline = started + self.s.cri_wait;
        // The record was written before: any answer asked from now on
        // has it if CRI has handled it.
        let mut after = started;
        let mut polls = 0;
        loop {
            polls += 1;
            let shared = self.cri_view.shared();
            let id = if shared {
                let answer = self.cri_view.id_after(name, after);
                match tokio::time::timeout_at(deadline.into(), answer).await {
                    Ok((asked, id)) => {
                        after = asked + Duration::from_nanos(1);
                        id
                    }
                    Err(_) => None,
                }
            } else {
                self.c
                    .cri_image_id(name)
                    .await
                    .inspect_err(
                        |e| tracing::debug!(name, error = %e, "CRI ImageStatus failed; retrying"),
                    )
                    .ok()
                    .flatten()
            };
            if id.is_some_and(|id| configs.contains(&id)) {
                if let Some(o) = self.observer() {
                    o.cri_confirmed(started.elapsed());
                }
                return (polls, true);
            }
            if Instant::now() >= deadline {
                // The replica is written: failing the client's write now
                // would report a change containerd made as not made.
                tracing::warn!(image = name, target, expected = ?configs, waited = ?self.s.cri_wait,
                    "the image is written into k8s.io but CRI ImageStatus did not resolve it in time; kubelet sees it once CRI catches up (is containerd overloaded, or a blob of it still missing?)");
                return (polls, false);
            }
            if !shared {
                let waiters = self.cri_view.waiters();
                tokio::time::sleep(cri_poll_delay(started.elapsed(), waiters)).await;
            }
        }
    }

    /// The proxy path: replicate, then apply `on_failure`. An error here is
    /// what the caller receives. `root`: the tree the write's reply named.
    pub async fn on_write(
        self: &Arc<Self>,
        method: &str,
        source: &str,
        name: &str,
        root: Option<Descriptor>,
    ) -> Result<(), tonic::Status> {
        use tracing::Instrument;
        let me = self.clone();
        let (src, n) = (source.to_string(), name.to_string());
        let span = span::InterceptSpan::new(method, source, name);
        let task = async move { me.replicate_from(&src, &n, true, root.as_ref()).await }
            .instrument(span.span().clone());
        let res = self.detached(task).await.unwrap_or_else(|e| {
            Err(Error::Containerd {
                image: name.into(),
                source_ns: source.into(),
                target: "*".into(),
                cause: ctrd::Error::Protocol(format!("replication task failed: {e}")),
            })
        });
        span.finish(&res);
        match res {
            Ok(_) => Ok(()),
            Err(e) if e.is_protected() => match self.s.on_failure {
                OnFailure::Fail => Err(tonic::Status::failed_precondition(format!(
                    "imgbridge: image {name} was stored in namespace {source} (left there as written), but {e}"
                ))),
                // Logged by the replication; retrying changes nothing.
                OnFailure::Warn => Ok(()),
            },
            Err(e) => match self.s.on_failure {
                OnFailure::Fail => Err(tonic::Status::internal(format!(
                    "imgbridge: image {name} was stored in namespace {source} (kept), but {e}"
                ))),
                OnFailure::Warn => {
                    tracing::warn!(image = name, source, error = %e, "replication failed; replying OK (on_failure = warn) and retrying in the background");
                    self.retry_later(source, name);
                    Ok(())
                }
            },
        }
    }

    /// Runs a held write's work on the replicator's runtime, not the
    /// connection's, detached: a caller that gives up (any caller, not only
    /// the splice, which runs hooks as tasks too) never leaves it half done.
    fn detached<T: Send + 'static>(
        &self,
        task: impl std::future::Future<Output = T> + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        match &self.rt {
            Some(rt) => rt.spawn(task),
            None => tokio::spawn(task),
        }
    }

    /// A write straight into `k8s.io` (`confirm_direct_writes`): nothing
    /// to replicate, only CRI's view to wait for, as for a replica. It
    /// never fails the call: containerd has carried it out.
    pub async fn on_direct_write(
        self: &Arc<Self>,
        method: &str,
        name: &str,
        root: Option<Descriptor>,
    ) {
        use tracing::Instrument;
        let Some(root) = root else { return };
        // CRI resolves a record by its full name only (kubelet asks for
        // `docker.io/library/app:1`, never `app:1`): a record named
        // otherwise (`sha256:…`, `app:1`) is never resolved, so not waited
        // for.
        if Reference::parse(name)
            .map(|r| r.to_string())
            .ok()
            .as_deref()
            != Some(name)
        {
            return;
        }
        let me = self.clone();
        let n = name.to_string();
        let span = span::InterceptSpan::new(method, CRI_NAMESPACE, name);
        let task = async move {
            if !me.has_cri().await {
                return;
            }
            let Some(id) = me.cri_id(CRI_NAMESPACE, &root).await else {
                return;
            };
            let (polls, resolved) = me.wait_cri(CRI_NAMESPACE, &n, &[id]).await;
            tracing::debug!(cri_polls = polls, resolved, "direct write waited for CRI");
        }
        .instrument(span.span().clone());
        let _ = self.detached(task).await;
        span.finish(&Ok::<(), std::convert::Infallible>(()));
    }

    /// A client reset its write of `name` after containerd got it
    /// (containerd may or may not carry it out): replicate it once it is
    /// there, looking for up to 3 s. Later writes are the events backstop's.
    pub fn on_abandoned(self: &Arc<Self>, source: &str, name: &str) {
        // Bounded: a hooked Rapid Reset must not turn into as many pollers;
        // past the bound the events backstop catches what was carried out.
        let Ok(permit) = self.abandoned.clone().try_acquire_owned() else {
            tracing::debug!(image = ?name, source, "too many reset writes being followed; leaving this one to the events backstop");
            return;
        };
        let (me, source, name) = (self.clone(), source.to_string(), name.to_string());
        let task = async move {
            let _permit = permit;
            // containerd may commit a reset call late when it is busy:
            // look for up to 3 s, every 250 ms at most.
            let deadline = Instant::now() + Duration::from_secs(3);
            let mut delay = Duration::from_millis(20);
            while Instant::now() < deadline {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_millis(250));
                if !matches!(me.c.get_image(&source, &name).await, Ok(Some(_))) {
                    continue;
                }
                match me.replicate(&source, &name, false).await {
                    Ok(_) => {
                        tracing::info!(image = ?name, source, "replicated a write its client reset after containerd got it")
                    }
                    Err(e) => {
                        tracing::warn!(image = ?name, source, error = %e, "replicating a write its client reset failed; the events backstop retries")
                    }
                }
                return;
            }
        };
        match &self.rt {
            Some(rt) => rt.spawn(task),
            None => tokio::spawn(task),
        };
    }

    fn retry_later(self: &Arc<Self>, source: &str, name: &str) {
        let (me, src, n) = (self.clone(), source.to_string(), name.to_string());
        tokio::spawn(async move {
            let start = Instant::now();
            let mut delay = Duration::from_secs(1);
            while start.elapsed() < me.s.pending_give_up {
                tokio::time::sleep(delay).await;
                match me.replicate(&src, &n, false).await {
                    Ok(_) => {
                        tracing::info!(image = %n, source = %src, "background retry replicated the image");
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(image = %n, source = %src, error = %e, "background retry failed")
                    }
                }
                delay = (delay * 2).min(Duration::from_secs(60));
            }
            tracing::error!(image = %n, source = %src, "gave up retrying replication; run `imgbridge sync` once the cause is fixed");
        });
    }
}
