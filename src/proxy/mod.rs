//! Transport: a transparent HTTP/2 (h2c) gRPC proxy over Unix sockets.
//!
//! Every call is relayed to containerd untouched and streamed both ways with
//! end-to-end flow control. Only calls an [`Interceptor`] selects are held
//! (they are unary and small); this module never decides which ones.
//!
//! Each client connection gets its own containerd connection, and the two
//! are spliced frame by frame ([`h2`]). A client that connects while
//! containerd is down is served by hyper's HTTP/2 server instead, which
//! answers every call UNAVAILABLE naming the socket; once containerd answers
//! again, GOAWAY sends the client to a new connection, which is spliced.

pub mod grpc;
pub mod h2;
pub mod intercept;
pub mod observe;
pub mod outage;
pub mod raw;
pub mod shards;
mod sock;

/// The socket listener moved to [`crate::listener`] (ops binds with it
/// too); still named here because `tests/` use this path.
#[doc(hidden)]
pub use crate::listener;

use std::convert::Infallible;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use intercept::{CallInfo, Hook, Interceptor, NoIntercept};
use observe::CallGuard;
pub use observe::CallObserver;

/// How often a connection served while containerd is down checks whether it
/// is back.
const PROBE_INTERVAL: Duration = Duration::from_millis(100);

/// Transport settings.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// containerd's gRPC socket.
    pub upstream: PathBuf,
    /// How long in-flight calls may run after shutdown was requested.
    pub drain_timeout: Duration,
    /// Threads serving connections, each a single-threaded runtime that owns
    /// its connections outright; 0 = one per CPU.
    pub threads: usize,
    /// Receives per-call metrics (method, grpc-status, bytes); `None` = off.
    pub observer: Option<Arc<dyn CallObserver>>,
    /// containerd's outages, logged once each; shared with the ttrpc
    /// relays ([`raw::relay`]), which reach the same containerd.
    pub outage: Arc<outage::Outage>,
}

impl ProxyConfig {
    pub fn new(upstream: impl Into<PathBuf>) -> Self {
        ProxyConfig {
            upstream: upstream.into(),
            drain_timeout: Duration::from_secs(10),
            threads: 0,
            observer: None,
            outage: Arc::default(),
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

/// Serves gRPC on every one of `listeners` until `shutdown` resolves, then stops accepting
/// (the listener is closed at once) and drains: every client is sent GOAWAY,
/// open-ended calls (event subscriptions) are ended with UNAVAILABLE right
/// away, and the other calls in flight, held ones included, may finish for
/// up to `drain_timeout` (the rule: [`h2::OPEN_ENDED`]).
pub async fn serve(
    listeners: Vec<UnixListener>,
    config: ProxyConfig,
    interceptor: Arc<dyn Interceptor>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ProxyError> {
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(None);
    let builder = Arc::new(builder);
    let threads = match config.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let mut shards = shards::Shards::start(threads).map_err(ProxyError::Threads)?;
    let splice_ctx = Arc::new(h2::Ctx {
        interceptor: interceptor.clone(),
        observer: config.observer.clone(),
        upstream: config.upstream.clone(),
    });
    let outage = config.outage.clone();
    let drain = CancellationToken::new();
    let tracker = TaskTracker::new();
    tokio::pin!(shutdown);
    let mut accept_errors = 0u32;
    let mut next = 0;
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            accepted = accept_any(&listeners, &mut next) => match accepted {
                Ok(s) => { accept_errors = 0; s }
                Err(e) if out_of_fds(&e) => {
                    // Our own limit, not a broken socket: pause accepting
                    // (connections already open keep being served) and say
                    // so once per pause, never fail for it.
                    tracing::warn!(error = %e, "imgbridge is out of file descriptors: not accepting for 100 ms (open connections are served); raise LimitNOFILE or find who holds so many connections");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                Err(e) => {
                    // Anything else: back off instead of spinning, keep serving.
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
        let builder = builder.clone();
        let (ctx, drain, outage) = (splice_ctx.clone(), drain.clone(), outage.clone());
        shards.spawn(tracker.track_future(connection(stream, peer, builder, ctx, outage, drain)));
    }
    drop(listeners);
    tracing::info!("shutting down: stopped accepting; draining in-flight calls");
    let started = tokio::time::Instant::now();
    drain.cancel();
    tracker.close();
    match tokio::time::timeout(config.drain_timeout, tracker.wait()).await {
        Ok(()) => tracing::info!(took = ?started.elapsed(), "drained"),
        Err(_) => {
            tracing::warn!(timeout = ?config.drain_timeout, "in-flight calls still running at drain timeout; closing them")
        }
    }
    shards.stop().await;
    Ok(())
}

/// One accepted client, on its connection thread: spliced to containerd,
/// or answered UNAVAILABLE while containerd is down.
async fn connection(
    stream: std::os::unix::net::UnixStream,
    peer: String,
    builder: Arc<hyper::server::conn::http2::Builder<TokioExecutor>>,
    ctx: Arc<h2::Ctx>,
    outage: Arc<outage::Outage>,
    drain: CancellationToken,
) {
    let stream = match UnixStream::from_std(stream) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(peer = %peer, error = %e, "cannot register connection");
            return;
        }
    };
    // containerd answers: splice the two connections frame by frame.
    let error = match UnixStream::connect(&ctx.upstream).await {
        Ok(up) => {
            outage.up(&ctx.upstream);
            match h2::run(stream, up, ctx.clone(), drain).await {
                Err(e) if e.is_hangup() => {
                    tracing::debug!(peer = %peer, error = %e, "connection ended")
                }
                Err(e) if e.is_desync() => {
                    tracing::error!(peer = %peer, error = %e, "connection closed: its calls can no longer be told apart, so none may pass unseen; the client was sent GOAWAY and reconnects")
                }
                Err(e) => tracing::warn!(peer = %peer, error = %e, "connection closed"),
                Ok(()) => {}
            }
            return;
        }
        Err(e) if out_of_fds(&e) => {
            // Our limit, not containerd's fault: the client is
            // dropped (it retries), containerd is not blamed.
            tracing::warn!(peer = %peer, error = %e, "imgbridge is out of file descriptors: closing this connection without reaching containerd; raise LimitNOFILE");
            return;
        }
        Err(e) => e,
    };
    outage.down(&ctx.upstream, &error);
    unavailable(stream, &builder, &ctx, &error, &outage, &drain, &peer).await;
}

/// The next connection on any of `listeners`, which take turns being asked
/// first so that a busy socket cannot starve another.
async fn accept_any(listeners: &[UnixListener], next: &mut usize) -> std::io::Result<UnixStream> {
    std::future::poll_fn(|cx| {
        let n = listeners.len();
        for i in 0..n {
            let k = (*next + i) % n;
            if let std::task::Poll::Ready(r) = listeners[k].poll_accept(cx) {
                *next = (k + 1) % n;
                return std::task::Poll::Ready(r.map(|(s, _)| s));
            }
        }
        std::task::Poll::Pending
    })
    .await
}

/// EMFILE / ENFILE: this process (or the system) has no descriptor left.
fn out_of_fds(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// Serves a client while containerd is down: every call is answered
/// UNAVAILABLE naming the socket (and counted), and once containerd accepts
/// connections again GOAWAY sends the client to a new, spliced connection.
async fn unavailable(
    stream: UnixStream,
    builder: &hyper::server::conn::http2::Builder<TokioExecutor>,
    ctx: &h2::Ctx,
    error: &std::io::Error,
    outage: &Arc<outage::Outage>,
    drain: &CancellationToken,
    peer: &str,
) {
    let upstream = &ctx.upstream;
    let message = format!(
        "imgbridge: containerd at {} is unavailable: {error}",
        upstream.display()
    );
    let observer = ctx.observer.clone();
    let counted = outage.clone();
    let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
        counted.call();
        if let Some(o) = &observer {
            let mut call = CallGuard::new(o.clone(), req.uri().path().into());
            call.set_status(Some(tonic::Code::Unavailable as i32));
        }
        let resp = grpc::error_response(tonic::Code::Unavailable, &message);
        std::future::ready(Ok::<_, Infallible>(resp))
    });
    let served = builder.serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(served);
    let why = tokio::select! {
        r = served.as_mut() => {
            if let Err(e) = r {
                // Clients routinely reset when they exit; not worth more than debug.
                tracing::debug!(peer = %peer, error = %e, "client connection ended");
            }
            return;
        }
        () = back(upstream) => {
            outage.up(upstream);
            "containerd is back; moving the client to a spliced connection"
        }
        () = drain.cancelled() => "draining",
    };
    tracing::debug!(peer = %peer, "{why}");
    served.as_mut().graceful_shutdown();
    if let Err(e) = served.await {
        tracing::debug!(peer = %peer, error = %e, "client connection ended");
    }
}

/// Resolves once containerd accepts connections on `upstream` again.
async fn back(upstream: &Path) {
    loop {
        tokio::time::sleep(PROBE_INTERVAL).await;
        if UnixStream::connect(upstream).await.is_ok() {
            return;
        }
    }
}

fn peer_label(s: &UnixStream) -> String {
    match s.peer_cred() {
        Ok(c) => format!("pid={} uid={}", c.pid().unwrap_or(-1), c.uid()),
        Err(_) => "unknown".into(),
    }
}
