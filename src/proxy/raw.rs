//! Byte-for-byte relay for containerd's ttrpc socket (`<socket>.ttrpc`).
//!
//! containerd serves only the Events service there (shims publish on it);
//! relaying it keeps the drop-in socket swap lossless.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Accepts on `listener` and splices each connection to `upstream` until
/// `shutdown` is cancelled. Then the listener is closed and so is every
/// relayed connection, at once: they carry shims' event publishes, which
/// have no end to wait for, and a shim reconnects (to the next instance).
/// Returns once all are closed.
pub async fn relay(
    listener: UnixListener,
    upstream: PathBuf,
    outage: Arc<super::outage::Outage>,
    shutdown: CancellationToken,
) {
    let upstream = Arc::new(upstream);
    let conns = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            a = listener.accept() => a,
        };
        let mut down = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(error = %e, "ttrpc accept failed");
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(10)) => continue,
                }
            }
        };
        let upstream = upstream.clone();
        let shutdown = shutdown.clone();
        let outage = outage.clone();
        conns.spawn(async move {
            let mut up = match UnixStream::connect(&*upstream).await {
                Ok(s) => {
                    outage.up(&upstream);
                    s
                }
                Err(e) => {
                    // The client's connection is closed (it reconnects).
                    outage.down(&upstream, &e);
                    outage.call();
                    return;
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => {}
                r = tokio::io::copy_bidirectional(&mut down, &mut up) => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "ttrpc relay ended");
                    }
                }
            }
        });
    }
    drop(listener);
    conns.close();
    conns.wait().await;
    tracing::debug!("ttrpc relay closed");
}
