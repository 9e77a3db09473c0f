//! Wiring: builds the interceptor and background tasks from a [`Config`] and
//! runs the proxy until shutdown.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::proxy::{self, NoIntercept, ProxyConfig};

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Proxy(#[from] proxy::ProxyError),
}

/// Optional extra listeners the caller already bound.
#[derive(Default)]
pub struct Listeners {
    /// Relayed byte for byte to `<upstream>.ttrpc`.
    pub ttrpc: Option<UnixListener>,
}

/// Serves `listener` with the behaviour `config` describes until `shutdown`.
pub async fn serve(
    listener: UnixListener,
    extra: Listeners,
    config: Arc<Config>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    config.validate()?;
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    if let Some(l) = extra.ttrpc {
        let up = ttrpc_path(&config.upstream);
        tasks.push(tokio::spawn(proxy::raw::relay(l, up, stop.clone())));
    }
    if !config.import.dirs.is_empty() {
        let c = crate::containerd::Containerd::new(&config.upstream);
        tasks.push(tokio::spawn(crate::import::run(
            c,
            config.import.clone(),
            stop.clone(),
        )));
    }
    let mut pc = ProxyConfig::new(&config.upstream);
    pc.drain_timeout = config.drain_timeout;
    let result = proxy::serve(listener, pc, Arc::new(NoIntercept), shutdown).await;
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    Ok(result?)
}

/// containerd's ttrpc socket sits next to the gRPC one.
pub fn ttrpc_path(grpc: &std::path::Path) -> PathBuf {
    let mut s = grpc.as_os_str().to_owned();
    s.push(".ttrpc");
    s.into()
}
