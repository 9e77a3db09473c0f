//! Operability: metrics, health/readiness/status over HTTP, `doctor`,
//! logging, systemd socket activation.
//!
//! One [`Ops`] per process, created by `app::serve`, hands out what the other
//! parts need:
//! - `ops.metrics` (`Arc<Metrics>`): record replications, imports, reconcile
//!   passes, pins, pending work and last errors (see [`metrics::Metrics`]);
//! - `ops.readiness` ([`Readiness`]): register a [`Gate`] that keeps
//!   `/readyz` at 503 until the work it stands for is done (the reconciler's
//!   first pass; a [`Gate`] is a `reconcile::PassObserver` that opens on
//!   the first pass).
//!
//! The other modules never call into `ops`: they report through observer
//! traits they own (`proxy::observe::CallObserver`,
//! `replicate::observe::ReplicationObserver`, `reconcile::PassObserver`,
//! `import::ImportObserver`, `containerd::breaker::BreakObserver`), which
//! [`Metrics`] (and [`Gate`]) implement.

pub mod activation;
pub mod doctor;
pub mod http;
pub mod logging;
pub mod metrics;
pub mod swap;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::config::Config;
use crate::containerd::Containerd;
use crate::lock::lock;

pub use metrics::{LastError, Metrics, Outcome, Pending};

/// How long `/readyz` and `/status` wait for containerd's `Version`.
const UPSTREAM_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Shared operability state of one running imgbridge.
#[derive(Debug)]
pub struct Ops {
    /// The process's metrics; pass clones of this `Arc` around.
    pub metrics: Arc<Metrics>,
    /// What `/readyz` waits for besides a reachable containerd.
    pub readiness: Readiness,
    config: Arc<Config>,
    upstream: Containerd,
    started: Instant,
}

impl Ops {
    /// Creates the metrics and readiness state for `config`. Must run inside
    /// a tokio runtime (it creates a lazy containerd client for probes).
    pub fn new(config: Arc<Config>) -> Arc<Ops> {
        Arc::new(Ops {
            metrics: Arc::new(Metrics::new()),
            readiness: Readiness::default(),
            upstream: Containerd::new(&config.upstream),
            config,
            started: Instant::now(),
        })
    }

    /// The effective configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// containerd's version, or why it could not be asked.
    pub async fn probe_upstream(&self) -> Result<String, String> {
        match tokio::time::timeout(UPSTREAM_PROBE_TIMEOUT, self.upstream.version()).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(format!(
                "containerd at {} is not reachable: {e}",
                self.config.upstream.display()
            )),
            Err(_) => Err(format!(
                "containerd at {} did not answer within {UPSTREAM_PROBE_TIMEOUT:?}",
                self.config.upstream.display()
            )),
        }
    }

    /// `Ok` when containerd answers and every readiness gate is open;
    /// otherwise the reasons, one per line of `/readyz`.
    pub async fn ready(&self) -> Result<(), Vec<String>> {
        let mut reasons: Vec<String> = self
            .readiness
            .waiting_for()
            .into_iter()
            .map(|g| format!("waiting for {g}"))
            .collect();
        if let Err(e) = self.probe_upstream().await {
            reasons.insert(0, e);
        }
        if reasons.is_empty() {
            Ok(())
        } else {
            Err(reasons)
        }
    }

    /// The `/status` document.
    pub async fn status(&self) -> Status {
        let upstream = self.probe_upstream().await;
        let waiting_for = self.readiness.waiting_for();
        Status {
            version: crate::VERSION,
            commit: env!("IMGBRIDGE_GIT_COMMIT"),
            uptime_seconds: self.started.elapsed().as_secs(),
            ready: upstream.is_ok() && waiting_for.is_empty(),
            waiting_for,
            upstream: UpstreamStatus {
                socket: self.config.upstream.display().to_string(),
                version: upstream.as_ref().ok().cloned(),
                error: upstream.err(),
            },
            config: (*self.config).clone(),
            pending: self.metrics.pending(),
            pending_blobs: self.metrics.pending_blobs(),
            stopped_calls: self.metrics.stopped_calls(),
            protected: self.metrics.image_refusals().into_iter().collect(),
            last_errors: LastErrors {
                images: self.metrics.image_errors().into_iter().collect(),
                files: self.metrics.file_errors().into_iter().collect(),
            },
        }
    }
}

/// JSON body of `GET /status`.
#[derive(Debug, Serialize)]
pub struct Status {
    pub version: &'static str,
    pub commit: &'static str,
    pub uptime_seconds: u64,
    /// Same verdict as `/readyz`.
    pub ready: bool,
    /// Readiness gates still closed.
    pub waiting_for: Vec<String>,
    pub upstream: UpstreamStatus,
    /// The effective configuration (file + flags).
    pub config: Config,
    pub pending: Pending,
    /// Blobs replicas wait for, oldest first, with their age.
    pub pending_blobs: Vec<crate::replicate::observe::PendingBlob>,
    /// Writes that broke containerd's connection twice: not sent again
    /// until imgbridge restarts (see `containerd::breaker`).
    pub stopped_calls: Vec<crate::containerd::breaker::Broken>,
    /// Last refusal per source image (`namespace/name`) of a name protected
    /// in a target: the message the client got, the target and protection.
    pub protected: BTreeMap<String, LastError>,
    pub last_errors: LastErrors,
}

#[derive(Debug, Serialize)]
pub struct UpstreamStatus {
    pub socket: String,
    pub version: Option<String>,
    pub error: Option<String>,
}

/// Latest error per image and per watched file (bounded, newest kept).
#[derive(Debug, Serialize)]
pub struct LastErrors {
    pub images: BTreeMap<String, LastError>,
    pub files: BTreeMap<String, LastError>,
}

/// Conditions `/readyz` waits for, besides containerd answering.
///
/// Cheap to clone; all clones share the same gates.
#[derive(Clone, Debug, Default)]
pub struct Readiness {
    gates: Arc<Mutex<BTreeMap<String, bool>>>,
}

impl Readiness {
    /// Registers a closed gate named `name` (e.g. `"first reconcile"`):
    /// `/readyz` answers 503 until [`Gate::open`] is called. Register it
    /// before the work starts, i.e. while wiring in `app::serve`.
    pub fn gate(&self, name: &str) -> Gate {
        self.lock().insert(name.to_owned(), false);
        Gate {
            readiness: self.clone(),
            name: name.to_owned(),
        }
    }

    /// Names of the gates still closed.
    pub fn waiting_for(&self) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|(_, open)| !**open)
            .map(|(n, _)| n.clone())
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, bool>> {
        lock(&self.gates)
    }
}

/// One readiness condition; see [`Readiness::gate`].
#[derive(Clone, Debug)]
pub struct Gate {
    readiness: Readiness,
    name: String,
}

impl Gate {
    /// Marks the condition met (idempotent; gates never close again).
    pub fn open(&self) {
        self.readiness.lock().insert(self.name.clone(), true);
    }
}

/// The "first reconcile" gate: open once any pass ended, failed images or
/// not (they are in `/status`; readiness means "caught up once").
impl crate::reconcile::PassObserver for Gate {
    fn pass_done(&self, _: &crate::reconcile::Report) {
        self.open();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gates_close_until_opened() {
        let r = Readiness::default();
        assert!(r.waiting_for().is_empty());
        let g = r.gate("first reconcile");
        let _h = r.clone().gate("initial import");
        assert_eq!(r.waiting_for(), ["first reconcile", "initial import"]);
        g.open();
        g.open();
        assert_eq!(r.waiting_for(), ["initial import"]);
    }

    #[tokio::test]
    async fn not_ready_without_upstream() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            upstream: dir.path().join("missing.sock"),
            ..Config::default()
        };
        let ops = Ops::new(Arc::new(config));
        let reasons = ops.ready().await.unwrap_err();
        assert!(reasons[0].contains("missing.sock"), "{reasons:?}");
        let s = ops.status().await;
        assert!(!s.ready);
        assert!(s.upstream.error.is_some());
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(
            json["config"]["replication"]["target_namespaces"][0],
            "k8s.io"
        );
    }
}
