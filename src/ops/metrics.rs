//! Prometheus metrics and the small amount of state `/status` reports.
//!
//! One [`Metrics`] is created per process ([`super::Ops::new`]) and shared as
//! `Arc<Metrics>` by the proxy, the replicator, the reconciler and the
//! importer. Every recording method is cheap (an atomic add, or a read-locked
//! map lookup plus an atomic add) and never blocks on I/O, so it can be called
//! on hot paths. Nothing here allocates per DATA frame.
//!
//! Which metrics there are, with their type, labels and help, is written
//! once, in [`table::METRICS`] (docs/operations.md's list is generated from it).
//! Recorded by: the proxy ([`CallObserver`]), the replicator
//! ([`ReplicationObserver`]), the reconciler ([`PassObserver`]), the
//! importer ([`ImportObserver`]) and the write breaker ([`BreakObserver`]).

mod table;

use std::collections::HashMap;
use std::fmt::{self, Display};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock};
use std::time::{Duration, SystemTime};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Metric, Registry};
use serde::Serialize;

use crate::containerd::breaker::{BreakObserver, Broken};
use crate::import::{Count, ImportObserver};
use crate::lock::{lock, read, write};
use crate::proxy::observe::CallObserver;
use crate::reconcile::{PassObserver, Report};
use crate::replicate::observe::{Attempt, PendingBlob, ReplicationObserver};
pub use table::{readme_list, MetricDef, METRICS};

/// Most distinct `(method, grpc_status)` series kept; further new methods are
/// counted as `method="other"` so a misbehaving client cannot blow up the
/// scrape size.
pub const MAX_CALL_SERIES: usize = 512;

/// Most entries kept in each "last errors" map (images, files); the oldest
/// entry is evicted first.
pub const MAX_LAST_ERRORS: usize = 256;

/// The result of one unit of work, as a bounded label value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Done, and the result is visible (`outcome="ok"`).
    Ok,
    /// Gave up with an error (`outcome="failed"`).
    Failed,
    /// Nothing to do: unchanged, filtered out, not applicable (`outcome="skipped"`).
    Skipped,
    /// Accepted, but finishes later, e.g. a replica written while some blobs
    /// are still missing in the source (`outcome="deferred"`).
    Deferred,
    /// Refused: the name is protected in the target (`outcome="protected"`).
    Protected,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Failed => "failed",
            Outcome::Skipped => "skipped",
            Outcome::Deferred => "deferred",
            Outcome::Protected => "protected",
        }
    }

    /// `Ok` for `Ok(_)`, `Failed` for `Err(_)`.
    pub fn of<T, E>(r: &Result<T, E>) -> Outcome {
        if r.is_ok() {
            Outcome::Ok
        } else {
            Outcome::Failed
        }
    }
}

impl Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How many pending blobs `/status` lists (oldest first): enough to see
/// what is stuck, bounded however many an index's other platforms leave.
pub const PENDING_LISTED: usize = 100;

/// Work not finished yet, as `/status` shows it. Set as a whole with
/// [`Metrics::set_pending`] by whoever owns the queue.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Pending {
    /// Blobs a replica is still waiting for (not yet present in the source)
    /// that a pod on this node could need.
    pub blobs: u64,
    /// Blobs waited for only under other platforms' entries of an index
    /// (a pull for this node's platform never fetches them): linked if
    /// they appear, not a problem for pods here, not in the gauge.
    pub other_platform_blobs: u64,
    /// Images whose replication is not complete (waiting for blobs or retrying).
    pub images: u64,
    /// Files in watched directories waiting to be imported (or retried).
    pub files: u64,
}

/// One remembered error, as `/status` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LastError {
    /// The error text (the `Display` of the error chain's head).
    pub error: String,
    /// Target namespace, pull-list line or other context; empty when none.
    pub context: String,
    /// Unix time in seconds when it happened.
    pub at_unix: u64,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    method: String,
    grpc_status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReplicationLabels {
    outcome: &'static str,
    target: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RegistryLabels {
    method: String,
    route: &'static str,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    commit: &'static str,
}

/// All metrics of the process, plus the pending summary and last errors
/// `/status` reports. Share it as `Arc<Metrics>`.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    calls: Family<CallLabels, Counter>,
    /// The counters of `calls` by request path and status slot, found
    /// without building (allocating, SipHashing) a label set: what every
    /// call pays. Holds only paths with a series of their own, so it is
    /// bounded like `calls`.
    quick_calls:
        RwLock<HashMap<Box<str>, [Option<Counter>; STATUS_SLOTS], foldhash::fast::RandomState>>,
    call_series: AtomicUsize,
    in_flight: Gauge,
    /// Set from the runtime at each scrape ([`Metrics::encode`]).
    tasks_alive: Gauge,
    relayed_bytes: Counter<u64, AtomicU64>,
    hpack_desyncs: Counter,
    pings_answered: Counter,
    replications: Family<ReplicationLabels, Counter>,
    replication_seconds: Histogram,
    cri_wait_seconds: Histogram,
    pending_blobs: Gauge,
    reconcile_passes: Family<OutcomeLabels, Counter>,
    imported_files: Family<OutcomeLabels, Counter>,
    pins: Counter,
    unpins: Counter,
    pending: Mutex<Pending>,
    /// The oldest pending blobs, for `/status`.
    pending_list: Mutex<Vec<PendingBlob>>,
    image_errors: Mutex<HashMap<String, LastError>>,
    /// Last refusal per image of a protected name (context: the target and
    /// the protection), as `/status` shows them.
    image_refusals: Mutex<HashMap<String, LastError>>,
    file_errors: Mutex<HashMap<String, LastError>>,
    broken_calls: Family<OutcomeLabels, Counter>,
    registry_requests: Family<RegistryLabels, Counter>,
    registry_received: Counter<u64, AtomicU64>,
    /// Calls that broke containerd's connection twice and are no longer
    /// sent (bounded like the last errors: one entry per item).
    stopped_calls: Mutex<HashMap<String, Broken>>,
}

/// Registers `metric` under `name` with the help and unit [`METRICS`] gives
/// it.
fn register(registry: &mut Registry, name: &str, metric: impl Metric) {
    let d = table::find(name);
    match d.unit() {
        Some(unit) => registry.register_with_unit(d.name, d.help, unit, metric),
        None => registry.register(d.name, d.help, metric),
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric (all start at zero).
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("imgbridge");
        let m = Metrics {
            registry: Registry::default(),
            calls: Family::default(),
            quick_calls: RwLock::default(),
            call_series: AtomicUsize::new(0),
            in_flight: Gauge::default(),
            tasks_alive: Gauge::default(),
            relayed_bytes: Counter::default(),
            hpack_desyncs: Counter::default(),
            pings_answered: Counter::default(),
            replications: Family::default(),
            replication_seconds: Histogram::new(exponential_buckets(0.001, 2.5, 14)),
            cri_wait_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            pending_blobs: Gauge::default(),
            reconcile_passes: Family::default(),
            imported_files: Family::default(),
            pins: Counter::default(),
            unpins: Counter::default(),
            pending: Mutex::new(Pending::default()),
            pending_list: Mutex::new(Vec::new()),
            image_errors: Mutex::new(HashMap::new()),
            image_refusals: Mutex::new(HashMap::new()),
            file_errors: Mutex::new(HashMap::new()),
            broken_calls: Family::default(),
            registry_requests: Family::default(),
            registry_received: Counter::default(),
            stopped_calls: Mutex::new(HashMap::new()),
        };
        let r = &mut registry;
        register(r, "registry_requests", m.registry_requests.clone());
        register(r, "registry_blob_received", m.registry_received.clone());
        register(r, "broken_calls", m.broken_calls.clone());
        register(r, "proxy_calls", m.calls.clone());
        register(r, "hpack_desync", m.hpack_desyncs.clone());
        register(r, "pings_answered", m.pings_answered.clone());
        register(r, "proxy_streams_in_flight", m.in_flight.clone());
        register(r, "tasks_alive", m.tasks_alive.clone());
        register(r, "proxy_relayed", m.relayed_bytes.clone());
        register(r, "replications", m.replications.clone());
        register(r, "replication_duration", m.replication_seconds.clone());
        register(r, "cri_wait_duration", m.cri_wait_seconds.clone());
        register(r, "pending_blobs", m.pending_blobs.clone());
        register(r, "reconcile_passes", m.reconcile_passes.clone());
        register(r, "imported_files", m.imported_files.clone());
        register(r, "pins", m.pins.clone());
        register(r, "unpins", m.unpins.clone());
        let build = BuildLabels {
            version: crate::VERSION,
            commit: env!("IMGBRIDGE_GIT_COMMIT"),
        };
        register(r, "build", Info::new(build));
        Metrics { registry, ..m }
    }

    /// The OpenMetrics text exposition of every metric.
    pub fn encode(&self) -> String {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let alive = rt.metrics().num_alive_tasks();
            self.tasks_alive
                .set(i64::try_from(alive).unwrap_or(i64::MAX));
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    // ---- replication (src/replicate) -------------------------------------

    /// Records one replication of one image into `target` (a target
    /// namespace) and how long it took, whatever the outcome. Call it once per
    /// image and target, when the attempt ends (`Outcome::Deferred` when the
    /// record is written but blobs are still pending). On `Failed`, also call
    /// [`Metrics::image_error`]; on `Ok`, [`Metrics::clear_image_error`].
    pub fn replication(&self, target: &str, outcome: Outcome, elapsed: Duration) {
        self.replications
            .get_or_create(&ReplicationLabels {
                outcome: outcome.as_str(),
                target: target.to_owned(),
            })
            .inc();
        self.replication_seconds.observe(elapsed.as_secs_f64());
    }

    /// Records how long CRI `ImageStatus` took to resolve a new replica
    /// (only for waits that ended with the image visible).
    pub fn cri_wait(&self, elapsed: Duration) {
        self.cri_wait_seconds.observe(elapsed.as_secs_f64());
    }

    /// Replaces the pending-work summary shown in `/status`; also sets the
    /// `pending_blobs` gauge to `pending.blobs`. Call it whenever the owner's
    /// queue changes (it takes a short mutex, no I/O).
    pub fn set_pending(&self, pending: Pending) {
        self.pending_blobs
            .set(i64::try_from(pending.blobs).unwrap_or(i64::MAX));
        *lock(&self.pending) = pending;
    }

    /// The oldest pending blobs (at most [`PENDING_LISTED`]), with ages.
    pub fn pending_blobs(&self) -> Vec<PendingBlob> {
        lock(&self.pending_list).clone()
    }

    /// The current pending-work summary.
    pub fn pending(&self) -> Pending {
        lock(&self.pending).clone()
    }

    // ---- reconcile (src/reconcile) ----------------------------------------

    /// Records one full reconcile pass (`Ok`, or `Failed` if it was cut short).
    pub fn reconcile_pass(&self, outcome: Outcome) {
        self.reconcile_passes
            .get_or_create(&OutcomeLabels {
                outcome: outcome.as_str(),
            })
            .inc();
    }

    // ---- import (src/import, through ImportObserver below) ----------------

    fn imported_files(&self, outcome: Outcome, n: u64) {
        self.imported_files
            .get_or_create(&OutcomeLabels {
                outcome: outcome.as_str(),
            })
            .inc_by(n);
    }

    // ---- last errors (shown in /status) ------------------------------------

    /// Remembers the latest error for `image` (a full image name), with
    /// `context` such as the target namespace. Keeps at most
    /// [`MAX_LAST_ERRORS`] images, evicting the oldest.
    pub fn image_error(&self, image: &str, context: &str, error: &dyn Display) {
        remember(&self.image_errors, image, context, error);
    }

    /// Forgets the error of `image` (call after it replicated fine).
    pub fn clear_image_error(&self, image: &str) {
        lock(&self.image_errors).remove(image);
    }

    /// Last errors per image, as `/status` shows them.
    pub fn image_errors(&self) -> HashMap<String, LastError> {
        lock(&self.image_errors).clone()
    }

    /// Last refusal per image of a protected name, as `/status` shows them.
    pub fn image_refusals(&self) -> HashMap<String, LastError> {
        lock(&self.image_refusals).clone()
    }

    /// Last errors per file, as `/status` shows them.
    pub fn file_errors(&self) -> HashMap<String, LastError> {
        lock(&self.file_errors).clone()
    }
}

/// The replicator's side: one call per image and target attempted, per CRI
/// confirmation, and the pending set about every 200 ms.
impl ReplicationObserver for Metrics {
    fn replicated(
        &self,
        source: &str,
        name: &str,
        target: &str,
        attempt: Attempt<'_>,
        elapsed: Duration,
    ) {
        let outcome = match attempt {
            Attempt::Changed => Outcome::Ok,
            Attempt::Unchanged => Outcome::Skipped,
            Attempt::Failed(_) => Outcome::Failed,
            Attempt::Protected(..) => Outcome::Protected,
        };
        self.replication(target, outcome, elapsed);
        let key = format!("{source}/{name}");
        match attempt {
            Attempt::Failed(e) => self.image_error(&key, target, e),
            Attempt::Protected(p, e) => {
                let context = format!("{target} ({})", p.kind());
                remember(&self.image_refusals, &key, &context, e);
            }
            Attempt::Changed | Attempt::Unchanged => self.clear_image_error(&key),
        }
    }

    fn cri_confirmed(&self, elapsed: Duration) {
        self.cri_wait(elapsed);
    }

    fn blobs_pending(&self, blobs: &[PendingBlob], other_platforms: usize) {
        let images: std::collections::HashSet<_> = blobs
            .iter()
            .flat_map(|b| b.images.iter().map(move |i| (&b.source, i)))
            .collect();
        self.set_pending(Pending {
            blobs: blobs.len() as u64,
            other_platform_blobs: other_platforms as u64,
            images: images.len() as u64,
            ..self.pending()
        });
        *lock(&self.pending_list) = blobs.iter().take(PENDING_LISTED).cloned().collect();
    }
}

/// The reconciler's side: one call per full pass.
impl PassObserver for Metrics {
    fn pass_done(&self, report: &Report) {
        self.reconcile_pass(if report.failed.is_empty() {
            Outcome::Ok
        } else {
            Outcome::Failed
        });
    }
}

/// The containerd client's side: writes that broke the connection.
impl BreakObserver for Metrics {
    fn call_broke(&self, call: &Broken, stopped: bool) {
        let outcome = if stopped { "stopped" } else { "held_back" };
        self.broken_calls
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
        if stopped {
            let mut calls = lock(&self.stopped_calls);
            if calls.len() < MAX_LAST_ERRORS {
                calls.insert(format!("{}/{}", call.namespace, call.item), call.clone());
            }
        }
    }
}

impl Metrics {
    /// Calls no longer sent, as `/status` shows them.
    pub fn stopped_calls(&self) -> Vec<Broken> {
        lock(&self.stopped_calls).values().cloned().collect()
    }
}

/// The importer's side: files processed from watched directories (archives
/// imported, pull-list references pulled, each one `ok`; unchanged files
/// `skipped`; failed files, images and list lines `failed`), pins, and the
/// last error of each file for `/status`.
impl ImportObserver for Metrics {
    fn counted(&self, what: Count, n: u64) {
        match what {
            Count::Imported | Count::Pulled => self.imported_files(Outcome::Ok, n),
            Count::Failed | Count::PullFailed => self.imported_files(Outcome::Failed, n),
            Count::Skipped => self.imported_files(Outcome::Skipped, n),
            Count::Pinned => {
                self.pins.inc_by(n);
            }
            Count::Unpinned => {
                self.unpins.inc_by(n);
            }
            Count::Images | Count::Scans => {}
        }
    }

    /// Same bound as [`Metrics::image_error`].
    fn file_failed(&self, path: &Path, context: &str, error: &dyn Display) {
        remember(
            &self.file_errors,
            &path.display().to_string(),
            context,
            error,
        );
    }

    fn file_ok(&self, path: &Path, context: &str) {
        let mut errors = lock(&self.file_errors);
        let key = path.display().to_string();
        if errors
            .get(&key)
            .is_some_and(|e| context.is_empty() || e.context == context)
        {
            errors.remove(&key);
        }
    }
}

/// The proxy's side: called per call and per DATA frame.
impl crate::registry::observe::RegistryObserver for Metrics {
    fn request(&self, method: &str, route: &'static str, status: u16) {
        // Bounded: the methods HTTP/1 parsers accept are few, and an
        // unknown one is folded.
        let method = match method {
            "GET" | "HEAD" | "PUT" | "POST" | "PATCH" | "DELETE" => method,
            _ => "other",
        };
        self.registry_requests
            .get_or_create(&RegistryLabels {
                method: method.to_string(),
                route,
                status,
            })
            .inc();
    }

    fn blob_bytes(&self, n: u64) {
        self.registry_received.inc_by(n);
    }
}

impl CallObserver for Metrics {
    fn call_started(&self) {
        self.in_flight.inc();
    }

    fn bytes_relayed(&self, n: u64) {
        self.relayed_bytes.inc_by(n);
    }

    fn hpack_desync(&self) {
        self.hpack_desyncs.inc();
    }

    fn ping_answered(&self) {
        self.pings_answered.inc();
    }

    fn call_finished(&self, method: &str, grpc_status: Option<i32>) {
        self.in_flight.dec();
        let slot = status_slot(grpc_status);
        let quick = read(&self.quick_calls);
        if let Some(c) = quick.get(method).and_then(|s| s[slot].as_ref()) {
            c.inc();
            return;
        }
        drop(quick);
        let mut labels = CallLabels {
            method: method_label(method).to_owned(),
            grpc_status: status_label(grpc_status),
        };
        let counter = match self.calls.get(&labels) {
            Some(c) => c.clone(),
            None => {
                // A new series: count it, and fold it into "other" past the cap.
                if self.call_series.fetch_add(1, Ordering::Relaxed) >= MAX_CALL_SERIES {
                    labels.method = "other".into();
                }
                self.calls.get_or_create(&labels).clone()
            }
        };
        counter.inc();
        if labels.method == method {
            let mut quick = write(&self.quick_calls);
            quick.entry(method.into()).or_default()[slot] = Some(counter);
        }
    }
}

/// `grpc_status` label values, one slot each: the 17 codes, none, invalid.
const STATUS_SLOTS: usize = 19;

/// The slot of [`status_label`]'s value.
fn status_slot(code: Option<i32>) -> usize {
    match code {
        Some(c @ 0..=16) => c as usize,
        None => 17,
        Some(_) => 18,
    }
}

/// The `method` label for a request path: containerd services, CRI and gRPC
/// infrastructure (health, reflection) verbatim, anything else `"other"`.
pub fn method_label(path: &str) -> &str {
    let known = ["/containerd.services.", "/runtime.v1", "/grpc."]
        .iter()
        .any(|p| path.starts_with(p));
    let sane = path.len() <= 160
        && path
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._/-".contains(&b));
    if known && sane {
        path
    } else {
        "other"
    }
}

/// The `grpc_status` label: the numeric code, `"none"` when the stream ended
/// without a status, `"invalid"` for a value outside gRPC's codes.
pub fn status_label(code: Option<i32>) -> &'static str {
    const CODES: [&str; 17] = [
        "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "16",
    ];
    match code {
        None => "none",
        Some(c) => usize::try_from(c)
            .ok()
            .and_then(|c| CODES.get(c))
            .copied()
            .unwrap_or("invalid"),
    }
}

fn remember(
    map: &Mutex<HashMap<String, LastError>>,
    key: &str,
    context: &str,
    error: &dyn Display,
) {
    let entry = LastError {
        error: error.to_string(),
        context: context.to_owned(),
        at_unix: SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    };
    let mut map = lock(map);
    if map.len() >= MAX_LAST_ERRORS && !map.contains_key(key) {
        if let Some(oldest) = map
            .iter()
            .min_by_key(|(_, e)| e.at_unix)
            .map(|(k, _)| k.clone())
        {
            map.remove(&oldest);
        }
    }
    map.insert(key.to_owned(), entry);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_label_is_bounded() {
        let v = "/containerd.services.version.v1.Version/Version";
        assert_eq!(method_label(v), v);
        assert_eq!(
            method_label("/runtime.v1.ImageService/ImageStatus"),
            "/runtime.v1.ImageService/ImageStatus"
        );
        assert_eq!(
            method_label("/grpc.health.v1.Health/Check"),
            "/grpc.health.v1.Health/Check"
        );
        assert_eq!(method_label("/evil.Service/X"), "other");
        assert_eq!(method_label("/containerd.services.x/\"}\n"), "other");
        assert_eq!(method_label(&format!("/grpc.{}", "a".repeat(500))), "other");
    }

    #[test]
    fn status_labels() {
        assert_eq!(status_label(Some(0)), "0");
        assert_eq!(status_label(Some(16)), "16");
        assert_eq!(status_label(Some(17)), "invalid");
        assert_eq!(status_label(Some(-1)), "invalid");
        assert_eq!(status_label(None), "none");
    }

    #[test]
    fn records_and_encodes() {
        let m = Metrics::new();
        m.call_started();
        m.bytes_relayed(10);
        assert!(m.encode().contains("imgbridge_proxy_streams_in_flight 1\n"));
        m.call_finished("/containerd.services.version.v1.Version/Version", Some(0));
        m.replication("k8s.io", Outcome::Ok, Duration::from_millis(12));
        m.cri_wait(Duration::from_millis(3));
        m.reconcile_pass(Outcome::Ok);
        m.counted(Count::Failed, 1);
        m.counted(Count::Pinned, 1);
        m.counted(Count::Unpinned, 1);
        m.set_pending(Pending {
            blobs: 3,
            images: 1,
            ..Pending::default()
        });
        let text = m.encode();
        for line in [
            "imgbridge_proxy_calls_total{method=\"/containerd.services.version.v1.Version/Version\",grpc_status=\"0\"} 1",
            "imgbridge_proxy_streams_in_flight 0",
            "imgbridge_proxy_relayed_bytes_total 10",
            "imgbridge_replications_total{outcome=\"ok\",target=\"k8s.io\"} 1",
            "imgbridge_replication_duration_seconds_count 1",
            "imgbridge_cri_wait_duration_seconds_count 1",
            "imgbridge_pending_blobs 3",
            "imgbridge_reconcile_passes_total{outcome=\"ok\"} 1",
            "imgbridge_imported_files_total{outcome=\"failed\"} 1",
            "imgbridge_pins_total 1",
            "imgbridge_unpins_total 1",
            "imgbridge_build_info{",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        assert_eq!(m.pending().images, 1);
    }

    /// What the replicator and reconciler report lands in the same series
    /// and `/status` fields they used to set directly.
    #[test]
    fn replication_and_pass_reports_map_to_outcomes_and_status() {
        let m = Metrics::new();
        let d = Duration::from_millis(1);
        m.replicated("buildkit", "a:1", "k8s.io", Attempt::Failed(&"boom"), d);
        assert_eq!(m.image_errors()["buildkit/a:1"].context, "k8s.io");
        m.replicated("buildkit", "a:1", "k8s.io", Attempt::Unchanged, d);
        assert!(m.image_errors().is_empty());
        m.replicated("buildkit", "b:1", "k8s.io", Attempt::Changed, d);
        m.cri_confirmed(d);
        let blob = |image: &str, digest: &str| PendingBlob {
            source: "buildkit".into(),
            digest: digest.into(),
            images: vec![image.into()],
            targets: vec!["k8s.io".into()],
            age_seconds: 3,
        };
        m.set_pending(Pending {
            files: 4,
            ..Pending::default()
        });
        m.blobs_pending(
            &[
                blob("a:1", "sha256:1"),
                blob("a:1", "sha256:2"),
                blob("b:1", "sha256:1"),
            ],
            5,
        );
        assert_eq!(
            m.pending(),
            Pending {
                blobs: 3,
                other_platform_blobs: 5,
                images: 2,
                files: 4
            }
        );
        assert_eq!(m.pending_blobs().len(), 3);
        assert_eq!(m.pending_blobs()[0].age_seconds, 3);
        m.pass_done(&Report::default());
        m.pass_done(&Report {
            failed: vec![("buildkit/x".into(), "e".into())],
            ..Report::default()
        });
        let text = m.encode();
        for line in [
            "imgbridge_replications_total{outcome=\"failed\",target=\"k8s.io\"} 1",
            "imgbridge_replications_total{outcome=\"skipped\",target=\"k8s.io\"} 1",
            "imgbridge_replications_total{outcome=\"ok\",target=\"k8s.io\"} 1",
            "imgbridge_replication_duration_seconds_count 3",
            "imgbridge_cri_wait_duration_seconds_count 1",
            "imgbridge_pending_blobs 3",
            "imgbridge_reconcile_passes_total{outcome=\"ok\"} 1",
            "imgbridge_reconcile_passes_total{outcome=\"failed\"} 1",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }

    #[test]
    fn repeated_calls_count_through_the_quick_path() {
        let m = Metrics::new();
        let version = "/containerd.services.version.v1.Version/Version";
        for status in [Some(0), Some(0), Some(5), None, Some(0)] {
            m.call_started();
            m.call_finished(version, status);
        }
        for _ in 0..2 {
            m.call_started();
            m.call_finished("/x.Y/Z", Some(0)); // folded into "other", never cached
        }
        let text = m.encode();
        for line in [
            format!("imgbridge_proxy_calls_total{{method=\"{version}\",grpc_status=\"0\"}} 3"),
            format!("imgbridge_proxy_calls_total{{method=\"{version}\",grpc_status=\"5\"}} 1"),
            format!("imgbridge_proxy_calls_total{{method=\"{version}\",grpc_status=\"none\"}} 1"),
            "imgbridge_proxy_calls_total{method=\"other\",grpc_status=\"0\"} 2".to_string(),
        ] {
            assert!(text.contains(&line), "missing {line} in\n{text}");
        }
        assert!(!m.quick_calls.read().unwrap().contains_key("/x.Y/Z"));
    }

    #[test]
    fn status_slots_match_status_labels() {
        let codes: Vec<Option<i32>> = std::iter::once(None).chain((-2..=18).map(Some)).collect();
        for a in &codes {
            for b in &codes {
                assert_eq!(
                    status_slot(*a) == status_slot(*b),
                    status_label(*a) == status_label(*b),
                    "{a:?} {b:?}"
                );
            }
            assert!(status_slot(*a) < STATUS_SLOTS);
        }
    }

    #[test]
    fn call_series_are_capped() {
        let m = Metrics::new();
        for i in 0..MAX_CALL_SERIES + 10 {
            m.call_started();
            m.call_finished(&format!("/containerd.services.x.v1.X/M{i}"), Some(0));
        }
        let series = m.encode().matches("imgbridge_proxy_calls_total{").count();
        assert_eq!(series, MAX_CALL_SERIES + 1);
        assert!(m
            .encode()
            .contains("imgbridge_proxy_calls_total{method=\"other\",grpc_status=\"0\"} 10"));
    }

    #[test]
    fn last_errors_are_bounded_and_clearable() {
        let m = Metrics::new();
        for i in 0..MAX_LAST_ERRORS + 5 {
            m.image_error(&format!("docker.io/library/a{i}:dev"), "k8s.io", &"boom");
        }
        assert_eq!(m.image_errors().len(), MAX_LAST_ERRORS);
        m.image_error("docker.io/library/x:dev", "k8s.io", &"late");
        assert_eq!(m.image_errors()["docker.io/library/x:dev"].error, "late");
        m.clear_image_error("docker.io/library/x:dev");
        assert!(!m.image_errors().contains_key("docker.io/library/x:dev"));
        m.file_failed(Path::new("/d/a.tar"), "", &"bad archive");
        assert_eq!(m.file_errors()["/d/a.tar"].error, "bad archive");
        m.file_ok(Path::new("/d/a.tar"), "");
        assert!(m.file_errors().is_empty());
        // A pull list's error is about one reference: only that one clears it.
        let list = Path::new("/d/list.txt");
        m.file_failed(list, "registry.local/b:1", &"not found");
        m.file_ok(list, "registry.local/a:1");
        assert_eq!(m.file_errors()["/d/list.txt"].context, "registry.local/b:1");
        m.file_ok(list, "registry.local/b:1");
        assert!(m.file_errors().is_empty());
    }

    #[test]
    fn broken_calls_are_counted_and_stopped_ones_listed() {
        use crate::containerd::breaker::Breaker;
        let m = std::sync::Arc::new(Metrics::new());
        let b = Breaker::default();
        b.observe(m.clone());
        b.saw_version("v2.4.2");
        b.broke(
            "Images.Update docker.io/library/a:1 in k8s.io",
            "k8s.io",
            "docker.io/library/a:1",
        );
        assert!(m.stopped_calls().is_empty(), "one break only holds it back");
        b.broke(
            "Images.Update docker.io/library/a:1 in k8s.io",
            "k8s.io",
            "docker.io/library/a:1",
        );
        let stopped = m.stopped_calls();
        assert_eq!(stopped.len(), 1);
        assert_eq!(stopped[0].containerd, "v2.4.2");
        let text = m.encode();
        assert!(
            text.contains("imgbridge_broken_calls_total{outcome=\"held_back\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("imgbridge_broken_calls_total{outcome=\"stopped\"} 1"),
            "{text}"
        );
    }
}
