//! A request-level gRPC front on a Unix socket: every call goes to a
//! handler, which relays it to the real containerd ([`relay`]) or answers
//! it itself. Only for what no real peer here can produce; each use says
//! which (a Transfer service in front of 1.6, a containerd that dies on a
//! request).

use std::convert::Infallible;
use std::future::Future;
use std::path::Path;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use tokio::sync::broadcast;

pub type Body = BoxBody<Bytes, hyper::Error>;
pub type Request = http::Request<Incoming>;
pub type Response = http::Response<Body>;

/// Drops every connection of its front, as a crashing containerd does.
#[derive(Clone)]
pub struct Killer(broadcast::Sender<()>);

impl Killer {
    pub fn drop_connections(&self) {
        let _ = self.0.send(());
    }
}

pub struct Front {
    killer: Killer,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Default for Front {
    fn default() -> Self {
        Front {
            killer: Killer(broadcast::channel(16).0),
            task: None,
        }
    }
}

impl Front {
    pub fn killer(&self) -> Killer {
        self.killer.clone()
    }

    /// Serves `listen` until dropped; each request goes to `handle`.
    pub fn serve<H, F>(&mut self, listen: &Path, handle: H)
    where
        H: Fn(Request) -> F + Clone + Send + Sync + 'static,
        F: Future<Output = Response> + Send + 'static,
    {
        let listener = tokio::net::UnixListener::bind(listen).unwrap();
        let kill = self.killer.0.clone();
        self.task = Some(tokio::spawn(async move {
            loop {
                let Ok((s, _)) = listener.accept().await else {
                    return;
                };
                let mut killed = kill.subscribe();
                let handle = handle.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request| {
                        let handle = handle.clone();
                        async move { Ok::<_, Infallible>(handle(req).await) }
                    });
                    let conn = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(s), svc);
                    tokio::select! {
                        _ = conn => {}
                        _ = killed.recv() => {}
                    }
                });
            }
        }));
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// The request's `containerd-namespace`.
pub fn namespace(req: &Request) -> String {
    req.headers()
        .get("containerd-namespace")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

/// Relays `req` to the containerd at `real` (a connection per call).
pub async fn relay(real: &Path, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let mut send = crate::grpc::h2_connect(real).await;
    let (mut parts, body) = req.into_parts();
    parts.uri = format!("http://localhost{path}").parse().unwrap();
    let resp = send
        .send_request(http::Request::from_parts(parts, body))
        .await
        .unwrap();
    resp.map(|b| b.boxed())
}

/// A gRPC reply: `msg` (when `status` is 0) and trailers.
pub fn grpc_reply(msg: &[u8], status: i32, message: &str) -> Response {
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    framed.extend_from_slice(msg);
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", status.into());
    if !message.is_empty() {
        trailers.insert("grpc-message", message.parse().unwrap());
    }
    let body = Full::new(Bytes::from(if status == 0 { framed } else { Vec::new() }))
        .map_err(|never| match never {})
        .with_trailers(async move { Some(Ok(trailers)) })
        .boxed();
    http::Response::builder()
        .header("content-type", "application/grpc")
        .body(body)
        .unwrap()
}
