//! Wiring: builds the interceptor and background tasks from a [`Config`] and
//! runs the proxy until shutdown.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::containerd::{orphans, Containerd};
use crate::ops::{self, Ops};
use crate::proxy::{self, ProxyConfig};
use crate::replicate::{hooks::ImageHooks, Replicator, Settings};

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Proxy(#[from] proxy::ProxyError),
    #[error(transparent)]
    Ops(#[from] ops::http::HttpError),
    #[error(transparent)]
    Registry(#[from] crate::registry::BindError),
}

/// Optional extra listeners the caller already bound.
#[derive(Default)]
pub struct Listeners {
    /// Each relayed byte for byte to `<upstream>.ttrpc`.
    pub ttrpc: Vec<UnixListener>,
}

/// Serves `listeners` (every one alike) with the behaviour `config` describes until `shutdown`.
///
/// Shutdown order: when `shutdown` resolves, both listeners stop accepting
/// at once and the ttrpc relay closes its connections (shims reconnect);
/// the gRPC calls in flight drain (see [`proxy::serve`]) with replication
/// still running for the calls it holds; then the background tasks stop.
pub async fn serve(
    listeners: Vec<UnixListener>,
    extra: Listeners,
    config: Arc<Config>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    config.validate()?;
    // Fired the moment shutdown starts; `stop` only once the drain is over.
    let closing = CancellationToken::new();
    let shutdown = {
        let closing = closing.clone();
        async move {
            shutdown.await;
            closing.cancel();
        }
    };
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    // Metrics, readiness and /status; hand `ops.metrics` / `ops.readiness` to
    // the parts wired below.
    let ops = Ops::new(config.clone());
    if !config.metrics.listen.is_empty() {
        let l = ops::http::bind(&config.metrics.listen, config.socket_handover).await?;
        tasks.push(tokio::spawn(ops::http::serve(l, ops.clone(), stop.clone())));
    }

    // One client for everything imgbridge writes itself, so a write that
    // broke containerd's connection is held back whoever retries it.
    let containerd = Containerd::new(&config.upstream);
    containerd.breaker().observe(ops.metrics.clone());
    // A killed imgbridge's leases and ingests: released as soon as it is
    // known dead, not at their expiry (docs/design.md, "Leases").
    let _presence = match orphans::Presence::claim(&config.owners_dir()) {
        Ok(p) => {
            tasks.push(tokio::spawn(orphans::sweep_forever(
                containerd.new_connection(),
                config.owners_dir(),
                stop.clone(),
            )));
            Some(p)
        }
        Err(e) => {
            tracing::warn!(dir = %config.owners_dir().display(), error = %e, "cannot mark this imgbridge as alive there; the leases of a killed imgbridge will only expire on their own (make the directory of `listen` writable)");
            None
        }
    };
    if !config.import.dirs.is_empty() {
        tasks.push(tokio::spawn(crate::import::run(
            containerd.new_connection(),
            config.import.clone(),
            stop.clone(),
            vec![ops.metrics.clone()],
        )));
    }
    let mut pc = ProxyConfig::new(&config.upstream);
    pc.drain_timeout = config.drain_timeout;
    for l in extra.ttrpc {
        let up = ttrpc_path(&config.upstream);
        let relay = proxy::raw::relay(l, up, pc.outage.clone(), closing.clone());
        tasks.push(tokio::spawn(relay));
    }
    let replicator = Replicator::new(containerd.clone(), Settings::from(&config.replication))
        .with_observer(ops.metrics.clone());
    tasks.push(replicator.start(stop.clone()));
    if config.reconcile.enabled {
        // Counted first, then /readyz opens (the gate stays open after).
        let first_pass = Arc::new(ops.readiness.gate("first reconcile"));
        tasks.push(tokio::spawn(crate::reconcile::run(
            replicator.clone(),
            config.reconcile.events,
            vec![ops.metrics.clone(), first_pass],
            stop.clone(),
        )));
    }
    tasks.extend(start_registry(&config, &containerd, &replicator, &ops, &stop).await?);
    pc.observer = Some(ops.metrics.clone());
    let hooks = Arc::new(ImageHooks::new(replicator.clone()));
    let result = proxy::serve(listeners, pc, hooks, shutdown).await;
    closing.cancel(); // if serve failed instead
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    Ok(result?)
}

/// Starts the registry endpoint if `registry.listen` is set.
async fn start_registry(
    config: &Config,
    containerd: &Containerd,
    replicator: &Arc<Replicator>,
    ops: &Ops,
    stop: &CancellationToken,
) -> Result<Option<JoinHandle<()>>, ServeError> {
    if config.registry.listen.is_empty() {
        return Ok(None);
    }
    // Bound before the proxy serves: a port in use fails the start.
    let l = crate::registry::bind(&config.registry.listen, config.socket_handover).await?;
    let local = l
        .local_addr()
        .map_err(|source| crate::registry::BindError::new(&config.registry.listen, source))?;
    let reg = crate::registry::Registry::new(
        containerd.new_connection(),
        replicator.clone(),
        crate::registry::Settings::from_config(config),
        local,
        Some(ops.metrics.clone()),
    );
    Ok(Some(tokio::spawn(crate::registry::serve(
        l,
        reg,
        stop.clone(),
    ))))
}

/// containerd's ttrpc socket sits next to the gRPC one.
pub fn ttrpc_path(grpc: &std::path::Path) -> PathBuf {
    let mut s = grpc.as_os_str().to_owned();
    s.push(".ttrpc");
    s.into()
}
