//! Transport: a transparent HTTP/2 (h2c) gRPC proxy over Unix sockets.
//!
//! Every call is relayed to containerd untouched and streamed both ways with
//! end-to-end flow control. Only calls an [`Interceptor`] selects are held
//! (they are unary and small); this module never decides which ones.
//!
//! Each client connection gets its own containerd connection. While
//! containerd answers, the two are spliced frame by frame ([`splice`]). A
//! client that connects while containerd is down is served by hyper's
//! HTTP/2 server instead ([`Connection`]): it answers UNAVAILABLE naming the
//! socket, and forwards calls again once containerd is back.

pub mod body;
pub mod frames;
pub mod grpc;
pub mod hpack;
pub mod intercept;
pub mod io;
pub mod listener;
pub mod observe;
pub mod raw;
pub mod shards;
mod sock;
pub mod splice;
pub mod tuning;
pub mod upstream;

use std::convert::Infallible;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body_util::{BodyExt, Either, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use body::{replay, ProxyBody};
pub use intercept::{CallInfo, Hook, Interceptor, NoIntercept};
pub use observe::CallObserver;
use observe::{CallGuard, Observed};
pub use tuning::Tuning;
use upstream::Upstream;

/// Transport settings.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// containerd's gRPC socket.
    pub upstream: PathBuf,
    /// How long in-flight calls may run after shutdown was requested.
    pub drain_timeout: Duration,
    pub tuning: Tuning,
    /// Receives per-call metrics (method, grpc-status, bytes); `None` = off.
    pub observer: Option<Arc<dyn CallObserver>>,
}

impl ProxyConfig {
    pub fn new(upstream: impl Into<PathBuf>) -> Self {
        ProxyConfig {
            upstream: upstream.into(),
            drain_timeout: Duration::from_secs(10),
            tuning: Tuning::default(),
            observer: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("accept on the proxy socket failed: {0}")]
    Accept(std::io::Error),
    #[error("cannot start the connection threads: {0}")]
    Threads(std::io::Error),
}

/// Serves gRPC on `listener` until `shutdown` resolves, then stops accepting
/// and lets in-flight calls finish for up to `drain_timeout`.
pub async fn serve(
    listener: UnixListener,
    config: ProxyConfig,
    interceptor: Arc<dyn Interceptor>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ProxyError> {
    let upstream_path = Arc::new(config.upstream.clone());
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder.timer(TokioTimer::new());
    config.tuning.server(&mut builder);
    let builder = Arc::new(builder);
    let mut shards =
        shards::Shards::start(config.tuning.shard_count()).map_err(ProxyError::Threads)?;
    let splice_ctx = Arc::new(splice::Ctx {
        interceptor: interceptor.clone(),
        observer: config.observer.clone(),
        upstream: config.upstream.clone(),
    });
    let drain = CancellationToken::new();
    let tracker = TaskTracker::new();
    tokio::pin!(shutdown);
    let mut accept_errors = 0u32;
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((s, _)) => { accept_errors = 0; s }
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning, keep serving.
                    accept_errors += 1;
                    tracing::warn!(error = %e, "accept failed");
                    if accept_errors > 1000 {
                        return Err(ProxyError::Accept(e));
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let peer = peer_label(&stream);
        // Move the socket to a connection thread (its own I/O driver).
        let stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(peer = %peer, error = %e, "cannot hand over connection");
                continue;
            }
        };
        let (builder, tuning) = (builder.clone(), config.tuning);
        let (ctx, drain, up_path) = (splice_ctx.clone(), drain.clone(), upstream_path.clone());
        shards.spawn(tracker.track_future(async move {
            let stream = match UnixStream::from_std(stream) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(peer = %peer, error = %e, "cannot register connection");
                    return;
                }
            };
            // containerd answers: splice the two connections frame by frame.
            if let Ok(up) = UnixStream::connect(&*up_path).await {
                match splice::run(stream, up, ctx, drain.clone()).await {
                    Err(e) if e.is_hangup() => {
                        tracing::debug!(peer = %peer, error = %e, "connection ended")
                    }
                    Err(e) => tracing::warn!(peer = %peer, error = %e, "connection closed"),
                    Ok(()) => {}
                }
                return;
            }
            // containerd is down: an HTTP/2 server answers UNAVAILABLE
            // naming the socket, and forwards again once it is back. Then
            // GOAWAY moves the client to a new connection, which is spliced
            // (kubelet, say, would otherwise keep this slower one for days).
            let conn = Arc::new(Connection {
                upstream: Upstream::new(up_path, tuning),
                interceptor: ctx.interceptor.clone(),
                observer: ctx.observer.clone(),
                upstream_back: tokio::sync::Notify::new(),
            });
            let back = conn.clone();
            let svc = service_fn(move |req| conn.clone().handle(req));
            let io = TokioIo::new(tuning.server_io(stream));
            let served = builder.serve_connection(io, svc);
            tokio::pin!(served);
            let why = tokio::select! {
                r = served.as_mut() => {
                    if let Err(e) = r {
                        // Clients routinely reset when they exit; not worth more than debug.
                        tracing::debug!(peer = %peer, error = %e, "client connection ended");
                    }
                    return;
                }
                _ = back.upstream_back.notified() => "containerd is back; moving the client to a spliced connection",
                _ = drain.cancelled() => "draining",
            };
            tracing::debug!(peer = %peer, "{why}");
            served.as_mut().graceful_shutdown();
            if let Err(e) = served.await {
                tracing::debug!(peer = %peer, error = %e, "client connection ended");
            }
        }));
    }
    drop(listener);
    tracing::info!("shutting down: draining in-flight calls");
    drain.cancel();
    tracker.close();
    if tokio::time::timeout(config.drain_timeout, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!(timeout = ?config.drain_timeout, "in-flight calls still running at drain timeout; closing them");
    }
    shards.stop().await;
    Ok(())
}

fn peer_label(s: &UnixStream) -> String {
    match s.peer_cred() {
        Ok(c) => format!("pid={} uid={}", c.pid().unwrap_or(-1), c.uid()),
        Err(_) => "unknown".into(),
    }
}

/// State of one downstream connection served by hyper (containerd was
/// down when it was accepted).
struct Connection {
    upstream: Upstream,
    interceptor: Arc<dyn Interceptor>,
    observer: Option<Arc<dyn CallObserver>>,
    /// Signalled when a call reached containerd again.
    upstream_back: tokio::sync::Notify,
}

impl Connection {
    async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
    ) -> Result<Response<Observed<ProxyBody>>, Infallible> {
        let call = CallInfo {
            method: req.uri().path().into(),
            namespace: req
                .headers()
                .get("containerd-namespace")
                .and_then(|v| v.to_str().ok())
                .map(Arc::from),
        };
        let guard =
            (self.observer.as_ref()).map(|o| CallGuard::new(o.clone(), call.method.clone()));
        let hook = self.interceptor.select(&call);
        let (mut parts, body) = req.into_parts();
        parts.uri = upstream_uri(&parts.uri);
        let resp = match hook {
            None => {
                self.forward(Request::from_parts(parts, Either::Left(body)))
                    .await
            }
            // Boxed: the held path's state is ~4 KiB, and hyper moves this
            // future into a new task for every call, passthrough included.
            Some(hook) => Box::pin(self.held(call, hook, parts, body)).await,
        };
        Ok(observe::response(resp, guard))
    }

    /// Passthrough: both bodies stream untouched.
    async fn forward(&self, req: Request<ProxyBody>) -> Response<ProxyBody> {
        match self.send(req).await {
            Ok(resp) => resp.map(Either::Left),
            Err(resp) => resp,
        }
    }

    async fn send(
        &self,
        req: Request<ProxyBody>,
    ) -> Result<Response<Incoming>, Response<ProxyBody>> {
        let mut sender = self.upstream.sender().await.map_err(|e| {
            tracing::warn!(error = %e, "upstream unavailable");
            unavailable(&e.to_string())
        })?;
        self.upstream_back.notify_one();
        sender.send_request(req).await.map_err(|e| {
            tracing::warn!(upstream = %self.upstream.path().display(), error = %e, "upstream call failed");
            unavailable(&format!(
                "containerd at {} failed the call: {e}",
                self.upstream.path().display()
            ))
        })
    }

    /// A held unary call: buffer, run the hook around upstream, replay.
    async fn held(
        &self,
        call: CallInfo,
        mut hook: Box<dyn Hook>,
        parts: http::request::Parts,
        body: Incoming,
    ) -> Response<ProxyBody> {
        let request = match Limited::new(body, grpc::MAX_HELD_BODY).collect().await {
            Ok(c) => c.to_bytes(),
            Err(e) => {
                tracing::warn!(method = %call.method, error = %e, "could not read held request");
                return grpc::error_response(
                    tonic::Code::Cancelled,
                    &format!("imgbridge: reading the request failed: {e}"),
                );
            }
        };
        let forward = |bytes: Bytes| Request::from_parts(parts.clone(), replay(bytes, None));
        let message = match grpc::unary_message(&request) {
            Ok(m) => m,
            Err(e) => {
                // Compressed or malformed: never guess, let containerd judge it.
                tracing::warn!(method = %call.method, error = %e, "request not interceptable; relaying untouched");
                return self.forward(forward(request)).await;
            }
        };
        if let Err(status) = hook.before(&message).await {
            return status_response(&status);
        }
        let resp = match self.send(forward(request)).await {
            Ok(r) => r,
            Err(r) => return r,
        };
        let (rparts, rbody) = resp.into_parts();
        if hyper::body::Body::is_end_stream(&rbody) {
            // Trailers-Only: an error from containerd, relayed as is.
            return Response::from_parts(rparts, Either::Left(rbody));
        }
        let collected = match Limited::new(rbody, grpc::MAX_HELD_BODY).collect().await {
            Ok(c) => c,
            Err(e) => {
                return unavailable(&format!(
                    "containerd at {} broke off the reply: {e}",
                    self.upstream.path().display()
                ));
            }
        };
        let trailers = collected.trailers().cloned();
        let data = collected.to_bytes();
        let replayed =
            |data, trailers| Response::from_parts(rparts.clone(), replay(data, trailers));
        if grpc::status_code(&rparts.headers, trailers.as_ref()) != Some(0) {
            return replayed(data, trailers);
        }
        match grpc::unary_message(&data) {
            Ok(reply) => match hook.after(message, reply).await {
                Ok(()) => replayed(data, trailers),
                Err(status) => status_response(&status),
            },
            Err(e) => {
                tracing::warn!(method = %call.method, error = %e, "reply not interceptable; relaying untouched");
                replayed(data, trailers)
            }
        }
    }
}

/// h2 requires scheme and authority on client requests; keep the path.
fn upstream_uri(uri: &Uri) -> Uri {
    let pq = uri.path_and_query().map_or("/", |p| p.as_str());
    Uri::builder()
        .scheme("http")
        .authority(uri.authority().map_or("localhost", |a| a.as_str()))
        .path_and_query(pq)
        .build()
        .unwrap_or_else(|_| uri.clone())
}

fn unavailable(msg: &str) -> Response<ProxyBody> {
    grpc::error_response(tonic::Code::Unavailable, &format!("imgbridge: {msg}"))
}

fn status_response(status: &tonic::Status) -> Response<ProxyBody> {
    grpc::error_response(status.code(), status.message())
}
