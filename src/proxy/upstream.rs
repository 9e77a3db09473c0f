//! The upstream side of one downstream connection: a lazily (re)connected
//! HTTP/2 client connection to containerd's socket.
//!
//! One upstream connection per downstream connection (not a shared pool), so
//! flow control, stream limits and teardown behave as if the client talked to
//! containerd directly. When containerd restarts, the next call reconnects.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::UnixStream;
use tokio::sync::Mutex;

use super::body::ProxyBody;
use super::tuning::Tuning;

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("cannot connect to containerd at {path}: {source}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("HTTP/2 handshake with containerd at {path} failed: {source}")]
    Handshake { path: PathBuf, source: hyper::Error },
}

/// Reconnecting handle to containerd for one downstream connection.
pub struct Upstream {
    path: Arc<PathBuf>,
    tuning: Tuning,
    sender: Mutex<Option<SendRequest<ProxyBody>>>,
}

impl Upstream {
    pub fn new(path: Arc<PathBuf>, tuning: Tuning) -> Self {
        Upstream {
            path,
            tuning,
            sender: Mutex::new(None),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A sender on a live connection, connecting first if there is none or
    /// the previous one was closed (containerd restarted).
    pub async fn sender(&self) -> Result<SendRequest<ProxyBody>, UpstreamError> {
        let mut slot = self.sender.lock().await;
        if let Some(s) = slot.as_ref() {
            if !s.is_closed() {
                return Ok(s.clone());
            }
        }
        // Boxed: rare, and its state would otherwise inflate every call's future.
        let s = Box::pin(self.connect()).await?;
        *slot = Some(s.clone());
        Ok(s)
    }

    async fn connect(&self) -> Result<SendRequest<ProxyBody>, UpstreamError> {
        let stream =
            UnixStream::connect(&*self.path)
                .await
                .map_err(|source| UpstreamError::Connect {
                    path: (*self.path).clone(),
                    source,
                })?;
        let mut b = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
        b.timer(TokioTimer::new());
        self.tuning.client(&mut b);
        let (sender, conn) = b
            .handshake::<_, ProxyBody>(TokioIo::new(self.tuning.client_io(stream)))
            .await
            .map_err(|source| UpstreamError::Handshake {
                path: (*self.path).clone(),
                source,
            })?;
        let path = self.path.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(upstream = %path.display(), error = %e, "upstream connection ended");
            }
        });
        Ok(sender)
    }
}
