//! The replication contract
//! ([docs/design.md](../../docs/design.md#replication)): make an image
//! written in a source namespace usable in every target namespace, record
//! last, CRI-confirmed.
//!
//! One replication path serves every trigger (`trigger.rs`: proxy hook,
//! reconcile pass, events, Transfer). It reads the *current* source record
//! under a per (target, name) lock, so concurrent writers converge on the
//! final state, and it inspects each blob read-only before writing, so a
//! pass over images already in sync writes nothing. Into each target it
//! goes by phase, each with one home (`replicate_into`):
//! plan (`record.rs`: the records read, the protections checked), apply
//! (`walk.rs`: the blobs made visible, the missing ones left to
//! `pending.rs`), record (`record.rs`) and confirm (`confirm.rs`).

mod announce;
mod apply;
pub mod commit;
mod confirm;
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
mod record;
pub mod span;
mod spare;
pub mod tree;
mod trigger;
mod walk;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

use crate::config::{self, DeletePolicy, OnFailure};
use crate::containerd::{self as ctrd, Containerd, Descriptor};
use crate::labels::CRI_NAMESPACE;
use observe::{Attempt, ReplicationObserver};
use record::{Planned, Replica, Skip};

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

/// The replication engine; cheap to share (`Arc`).
pub struct Replicator {
    c: Containerd,
    s: Settings,
    locks: Arc<locks::KeyedLocks>,
    /// One walk per (source, target, tree) at a time, and its result.
    walk_locks: locks::KeyedLocks,
    walked: std::sync::Mutex<HashMap<String, std::sync::Weak<walk::Walked>>>,
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
        let replica = record::replica(name);
        let mut total = Outcome::default();
        let mut first_err = None;
        for target in &self.s.targets {
            let started = Instant::now();
            let r = tokio::time::timeout(
                self.s.timeout,
                self.replicate_into(source, target, &replica, wait_cri, hint),
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

    /// Replicates into one target by phase: plan (the records read, the
    /// protections checked: [`record`]), apply (every blob the source holds
    /// made visible: [`walk`]), record (the tag first, so that CRI handles
    /// its event first) and confirm (CRI resolves the tag while the digest
    /// ref is written; the id record after the names, off a client's path;
    /// then the digest ref: [`confirm`]). `replica`: the name, parsed once
    /// for every target.
    async fn replicate_into(
        &self,
        source: &str,
        target: &str,
        replica: &Result<Replica, Skip>,
        wait_cri: bool,
        hint: Option<&Descriptor>,
    ) -> Result<Outcome, Error> {
        let replica = match replica {
            Ok(r) => r,
            Err(skip) => return Ok(skip.outcome(source)),
        };
        let _guard = self.locks.lock(format!("{target}\0{}", replica.name)).await;
        let err = replica.err(source, target);
        let mut clock = Clock::start();
        let mut plan = match self.plan(source, target, replica, hint).await? {
            Planned::Write(plan) => plan,
            Planned::Done(outcome) => return Ok(outcome),
        };
        let (tree, mut outcome) = self.apply(source, target, &mut plan).await.map_err(&err)?;
        clock.walked();
        // The root the tag pointed at before, if this write moves it.
        let moved_from = plan
            .existing
            .as_ref()
            .and_then(|e| e.target.as_ref())
            .map(|t| t.digest.clone())
            .filter(|d| *d != plan.root.digest);
        outcome.writes += self
            .record_tag(source, target, &mut plan, &tree)
            .await
            .map_err(&err)?;
        clock.recorded();
        let confirm = confirm::needed(target, wait_cri, outcome.writes);
        let configs = tree.found.configs.clone();
        let (digest_ref, (mut polls, resolved)) = tokio::join!(
            self.record_digest_ref(source, target, &plan, tree.cri_id.is_some()),
            self.confirm(target, &replica.name, &configs, confirm)
        );
        outcome.writes += digest_ref.map_err(&err)?;
        let root = &plan.root;
        outcome.writes += self
            .record_id(target, tree, root, wait_cri)
            .await
            .map_err(&err)?;
        // Not when the tag timed out: CRI is behind, and that was logged.
        if resolved {
            polls += self.confirm_digest_ref(target, &plan, &configs).await;
        }
        if let Some(old) = moved_from {
            if let Err(e) = self
                .on_moved(source, target, &replica.reference, &old)
                .await
            {
                tracing::warn!(image = %replica.name, source, target, error = %e,
                    "could not apply delete_policy to the digest record the tag left; the next catch-up pass does");
            }
        }
        clock.report(replica, source, target, &outcome, polls);
        Ok(outcome)
    }

    /// The protections in force ([`protect`]).
    pub fn protections(&self) -> &protect::Protections {
        &self.protect
    }
}

/// When a replication's phases ended, for its debug line.
struct Clock {
    started: Instant,
    walked: Duration,
    recorded: Duration,
}

impl Clock {
    fn start() -> Clock {
        Clock {
            started: Instant::now(),
            walked: Duration::ZERO,
            recorded: Duration::ZERO,
        }
    }

    fn walked(&mut self) {
        self.walked = self.started.elapsed();
    }

    fn recorded(&mut self) {
        self.recorded = self.started.elapsed();
    }

    /// Logs the phases' times (DEBUG) and, if it changed anything, the
    /// replication (INFO).
    fn report(&self, r: &Replica, source: &str, target: &str, outcome: &Outcome, polls: usize) {
        tracing::debug!(
            image = r.image.as_str(),
            target,
            writes = outcome.writes,
            walk_ms = self.walked.as_secs_f64() * 1e3,
            record_ms = (self.recorded - self.walked).as_secs_f64() * 1e3,
            cri_ms = (self.started.elapsed() - self.recorded).as_secs_f64() * 1e3,
            cri_polls = polls,
            "replication phases"
        );
        if outcome.writes > 0 || outcome.pending > 0 {
            tracing::info!(image = r.image.as_str(), source, target, replica = %r.name, writes = outcome.writes, pending = outcome.pending, "replicated");
        }
    }
}
