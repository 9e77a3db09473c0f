//! The operations endpoint (`metrics.listen` / `--metrics-listen`): a tiny
//! HTTP/1.1 server, on TCP `host:port` or on a Unix socket path.
//!
//! - `GET /metrics`: Prometheus/OpenMetrics text;
//! - `GET /healthz`: 200 while the process runs;
//! - `GET /readyz`: 200 when containerd answers and every readiness gate is
//!   open (e.g. the first reconcile), else 503 with the reasons;
//! - `GET /status`: JSON ([`super::Status`]): configuration, pending work,
//!   last errors per image and per file.

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;

use super::Ops;
use crate::listener::{self, SocketPerms};

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("metrics.listen {addr:?}: cannot listen: {source}")]
    Tcp {
        addr: String,
        source: std::io::Error,
    },
    #[error("metrics.listen {addr:?}: {source}")]
    Unix {
        addr: String,
        source: listener::ListenError,
    },
}

/// A bound operations endpoint.
#[derive(Debug)]
pub enum OpsListener {
    Tcp(TcpListener),
    /// The socket file is removed when the server stops.
    Unix(UnixListener, PathBuf),
}

impl OpsListener {
    /// Where it listens, for logs (`127.0.0.1:9090` or a path).
    pub fn describe(&self) -> String {
        match self {
            OpsListener::Tcp(l) => l
                .local_addr()
                .map_or_else(|_| "tcp".into(), |a| a.to_string()),
            OpsListener::Unix(_, p) => p.display().to_string(),
        }
    }
}

/// Binds `addr`: a Unix socket when it contains `/` (mode 0660, like the
/// proxy socket), else a TCP `host:port`, shared with a handover's other
/// instance when `shared` ([`listener::bind_tcp`]).
pub async fn bind(addr: &str, shared: bool) -> Result<OpsListener, HttpError> {
    if addr.contains('/') {
        let path = PathBuf::from(addr);
        let l =
            listener::bind(&path, SocketPerms::default()).map_err(|source| HttpError::Unix {
                addr: addr.into(),
                source,
            })?;
        Ok(OpsListener::Unix(l, path))
    } else {
        listener::bind_tcp(addr, shared)
            .await
            .map(OpsListener::Tcp)
            .map_err(|source| HttpError::Tcp {
                addr: addr.into(),
                source,
            })
    }
}

/// Serves the endpoint until `stop` is cancelled.
pub async fn serve(listener: OpsListener, ops: Arc<Ops>, stop: CancellationToken) {
    tracing::info!(listen = %listener.describe(), "operations endpoint: /metrics /healthz /readyz /status");
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            a = accept(&listener) => a,
        };
        match accepted {
            Ok(conn) => {
                let ops = ops.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let ops = ops.clone();
                        async move { Ok::<_, Infallible>(route(&ops, req).await) }
                    });
                    let mut b = hyper::server::conn::http1::Builder::new();
                    b.timer(TokioTimer::new())
                        .header_read_timeout(Some(Duration::from_secs(10)));
                    if let Err(e) = b.serve_connection(TokioIo::new(conn), svc).await {
                        tracing::debug!(error = %e, "operations endpoint connection ended");
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "operations endpoint accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    if let OpsListener::Unix(_, p) = &listener {
        let _ = std::fs::remove_file(p);
    }
}

trait Conn: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Conn for T {}

async fn accept(l: &OpsListener) -> std::io::Result<Box<dyn Conn>> {
    Ok(match l {
        OpsListener::Tcp(l) => Box::new(l.accept().await?.0),
        OpsListener::Unix(l, _) => Box::new(l.accept().await?.0),
    })
}

/// Answers one request.
pub async fn route(ops: &Ops, req: Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET and HEAD are supported\n".into(),
        );
    }
    match req.uri().path() {
        "/metrics" => {
            let mut r = text(StatusCode::OK, ops.metrics.encode());
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static(OPENMETRICS),
            );
            r
        }
        "/healthz" => text(StatusCode::OK, "ok\n".into()),
        "/readyz" => match ops.ready().await {
            Ok(()) => text(StatusCode::OK, "ready\n".into()),
            Err(reasons) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready:\n{}\n", reasons.join("\n")),
            ),
        },
        "/status" => {
            let body = serde_json::to_string_pretty(&ops.status().await)
                .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
            let mut r = text(StatusCode::OK, body + "\n");
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("application/json"),
            );
            r
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; try /metrics /healthz /readyz /status\n".into(),
        ),
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(sock: &std::path::Path, path: &str) -> String {
        let mut s = tokio::net::UnixStream::connect(sock).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_on_unix_socket() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            upstream: dir.path().join("nothing.sock"),
            ..Config::default()
        };
        let ops = Ops::new(Arc::new(config));
        let sock = dir.path().join("ops/metrics.sock");
        let l = bind(sock.to_str().unwrap(), false).await.unwrap();
        let stop = CancellationToken::new();
        let task = tokio::spawn(serve(l, ops, stop.clone()));
        let r = get(&sock, "/healthz").await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        let r = get(&sock, "/readyz").await;
        assert!(r.starts_with("HTTP/1.1 503"), "{r}");
        assert!(r.contains("nothing.sock"), "{r}");
        let r = get(&sock, "/metrics").await;
        assert!(r.contains("imgbridge_build_info"), "{r}");
        let r = get(&sock, "/nope").await;
        assert!(r.starts_with("HTTP/1.1 404"), "{r}");
        stop.cancel();
        task.await.unwrap();
        assert!(!sock.exists());
    }

    #[tokio::test]
    async fn bad_tcp_address_names_the_key() {
        let e = bind("not-an-address", false).await.unwrap_err().to_string();
        assert!(e.contains("metrics.listen"), "{e}");
    }
}
