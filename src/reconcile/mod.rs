//! Catch-up for images that did not come through the proxy's Images calls:
//! a full pass at start and after every reconnect, and an events
//! subscription as a backstop. Both reuse the one replication path.

use std::sync::Arc;
use std::time::Duration;

use containerd_client::services::v1::{
    ImageCreate, ImageDelete, ImageUpdate, PublishRequest, SubscribeRequest,
};
use futures_util::stream::{self, StreamExt};
use prost::Message;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::containerd::request;
use crate::replicate::Replicator;

/// Images replicated at once during a pass.
const PASS_PARALLEL: usize = 8;

/// Published (in the first source namespace) until the subscription hears
/// something: only then has containerd registered it.
const BARRIER_TOPIC: &str = "/imgbridge/subscribed";

/// How long a pass waits for the subscription to be live before it runs
/// anyway (then writes in between wait for the next pass).
const BARRIER_WAIT: Duration = Duration::from_secs(5);

/// Receives the end of every pass: `ops::Metrics` counts it, the readiness
/// gate `ops` registered for the first pass opens on it. The reconciler only
/// reports, as the replicator, the proxy and the importer do.
pub trait PassObserver: Send + Sync + 'static {
    /// A full pass ended (`report.failed` is empty when every image was fine).
    fn pass_done(&self, report: &Report);
}

/// Result of one pass.
#[derive(Debug, Default)]
pub struct Report {
    pub images: usize,
    pub writes: usize,
    pub failed: Vec<(String, String)>,
}

/// Lists every source namespace and repairs every target. Idempotent: a pass
/// over images already in sync performs zero writes.
pub async fn pass(r: &Replicator) -> Report {
    let mut report = Report::default();
    // containerd may have come back with another config.
    r.refresh_sandbox().await;
    for ns in &r.settings().sources {
        let images = match r.containerd().list_images(ns, Vec::new()).await {
            Ok(i) => i,
            Err(e) => {
                report.failed.push((format!("{ns}/*"), e.to_string()));
                continue;
            }
        };
        let results: Vec<_> = stream::iter(images)
            .map(|img| async move {
                let res = r.replicate(ns, &img.name, false).await;
                (img.name, res)
            })
            .buffer_unordered(PASS_PARALLEL)
            .collect()
            .await;
        for (name, res) in results {
            report.images += 1;
            match res {
                Ok(o) => report.writes += o.writes,
                // Refused as the operator configured: logged, not a failure.
                Err(e) if e.is_protected() => {}
                Err(e) => report.failed.push((format!("{ns}/{name}"), e.to_string())),
            }
        }
        // Labels converge too: replicas whose source went away while the
        // delete could not be followed (down, or the write failed).
        match r.converge_deletes(ns).await {
            Ok(n) => report.writes += n,
            Err(e) => report
                .failed
                .push((format!("{ns}/* (delete_policy)"), e.to_string())),
        }
    }
    report
}

/// Keeps targets in sync until `shutdown`: pass, subscribe, follow events;
/// on any break (containerd restart) wait for it, pass again, resubscribe.
/// Every pass is reported to `observers`, in order.
pub async fn run(
    r: Arc<Replicator>,
    events: bool,
    observers: Vec<Arc<dyn PassObserver>>,
    shutdown: CancellationToken,
) {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    loop {
        if shutdown.is_cancelled() {
            return;
        }
        if r.containerd().version().await.is_err() {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff.next_delay()) => {}
            }
            continue;
        }
        backoff.reset();
        // Subscribe before the pass so nothing written in between is missed:
        // a write the pass's listing does not see comes later, and its event
        // reaches a subscription that containerd has registered.
        let sub = match events {
            true => Some(subscribe_live(&r, &shutdown).await),
            false => None,
        };
        let sub = sub.map(|task| (task.abort_handle(), task));
        let report = pass(&r).await;
        log_report(&report);
        for o in &observers {
            o.pass_done(&report);
        }
        match sub {
            Some((abort, task)) => {
                let followed = async {
                    match task.await {
                        Ok(Some(stream)) => follow(&r, stream).await,
                        _ => tokio::time::sleep(Duration::from_secs(1)).await,
                    }
                };
                tokio::select! {
                    _ = shutdown.cancelled() => {
                        abort.abort();
                        return;
                    }
                    _ = followed => {
                        tracing::warn!("event subscription ended (containerd restarted?); reconnecting and running a catch-up pass");
                    }
                }
            }
            None => {
                // No events: watch for restarts by polling, re-pass on return.
                wait_for_restart(&r, &shutdown).await;
            }
        }
    }
}

fn log_report(report: &Report) {
    if report.failed.is_empty() {
        tracing::info!(
            images = report.images,
            writes = report.writes,
            "reconcile pass done"
        );
    } else {
        for (img, e) in &report.failed {
            tracing::warn!(image = %img, error = %e, "reconcile could not repair image");
        }
        tracing::warn!(
            images = report.images,
            writes = report.writes,
            failed = report.failed.len(),
            "reconcile pass done with failures"
        );
    }
}

async fn wait_for_restart(r: &Replicator, shutdown: &CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        if r.containerd().version().await.is_err() {
            return;
        }
    }
}

type Events = tonic::Streaming<containerd_client::types::Envelope>;

/// Subscribes, and returns once containerd has registered the subscription
/// (or after [`BARRIER_WAIT`]). containerd answers a subscription only with
/// its first event, and registers it asynchronously, so a barrier event is
/// published until one event, whichever, has come back: the stream is then
/// returned with that event still unread.
async fn subscribe_live(
    r: &Arc<Replicator>,
    shutdown: &CancellationToken,
) -> tokio::task::JoinHandle<Option<Events>> {
    let task = tokio::spawn(subscribe(r.clone()));
    let Some(ns) = r.settings().sources.first().cloned() else {
        return task;
    };
    let deadline = tokio::time::Instant::now() + BARRIER_WAIT;
    while !task.is_finished() && !shutdown.is_cancelled() {
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!("events subscription not confirmed within {BARRIER_WAIT:?}; passing anyway (writes meanwhile wait for the next pass)");
            break;
        }
        let barrier = PublishRequest {
            topic: BARRIER_TOPIC.into(),
            event: Some(prost_types::Any {
                type_url: "types.googleapis.com/google.protobuf.Empty".into(),
                value: Vec::new(),
            }),
        };
        if let Err(e) = r
            .containerd()
            .events()
            .publish(request(&ns, None, barrier))
            .await
        {
            tracing::debug!(error = %e, "publishing the subscription barrier failed");
        }
        tokio::time::sleep(Duration::from_millis(20)).await; // poll interval
    }
    task
}

async fn subscribe(r: Arc<Replicator>) -> Option<Events> {
    let filters = r
        .settings()
        .sources
        .iter()
        .map(|ns| format!("namespace=={ns},topic~=\"^/images/\""))
        .chain([format!("topic==\"{BARRIER_TOPIC}\"")])
        .collect();
    match r
        .containerd()
        .events()
        .subscribe(request("", None, SubscribeRequest { filters }))
        .await
    {
        Ok(s) => Some(s.into_inner()),
        Err(e) => {
            tracing::warn!(error = %e, "cannot subscribe to image events; relying on passes only");
            None
        }
    }
}

async fn follow(r: &Replicator, mut events: Events) {
    loop {
        let env = match events.message().await {
            Ok(Some(e)) => e,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(error = %e, "event stream error");
                return;
            }
        };
        let Some(any) = env.event else { continue };
        if !r.is_source(&env.namespace) {
            continue;
        }
        let ns = env.namespace.as_str();
        let res = match env.topic.as_str() {
            "/images/create" => match ImageCreate::decode(any.value.as_slice()) {
                Ok(e) => r.replicate(ns, &e.name, false).await.map(|_| ()),
                Err(_) => continue,
            },
            "/images/update" => match ImageUpdate::decode(any.value.as_slice()) {
                Ok(e) => r.replicate(ns, &e.name, false).await.map(|_| ()),
                Err(_) => continue,
            },
            "/images/delete" => match ImageDelete::decode(any.value.as_slice()) {
                Ok(e) => r.on_delete(ns, &e.name).await,
                Err(_) => continue,
            },
            _ => continue,
        };
        match &res {
            // A refusal was logged by the replication: nothing to retry.
            Err(e) if e.is_protected() => {}
            Err(e) => {
                tracing::warn!(namespace = ns, topic = %env.topic, error = %e, "event-driven replication failed; the next pass retries")
            }
            Ok(()) => {}
        }
    }
}
