//! Byte-for-byte relay for containerd's ttrpc socket (`<socket>.ttrpc`).
//!
//! containerd serves only the Events service there (shims publish on it);
//! relaying it keeps the drop-in socket swap lossless.

use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

/// Accepts on `listener` and splices each connection to `upstream` until
/// `shutdown` is cancelled.
pub async fn relay(listener: UnixListener, upstream: PathBuf, shutdown: CancellationToken) {
    let upstream = Arc::new(upstream);
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return,
            a = listener.accept() => a,
        };
        let mut down = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "ttrpc accept failed");
                continue;
            }
        };
        let upstream = upstream.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut up = match UnixStream::connect(&*upstream).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(upstream = %upstream.display(), error = %e, "ttrpc upstream unreachable; closing client connection");
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
}
