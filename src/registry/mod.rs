//! The node-local OCI registry endpoint (`[registry]`, docs/registry.md):
//! OCI distribution-spec v1.1 over HTTP/1.1 on loopback, storing straight
//! into containerd. Blobs stream into the content store (`Content.Write`,
//! digest checked by containerd's commit) under leases; a manifest becomes
//! a content blob with containerd's GC labels plus an image record
//! `<host:port>/<name>:<tag>` in the registry's namespace, a replication
//! source: a tag PUT answers 201 only once the replicator
//! ([`Replicator::on_write`], the hold an intercepted `Images.Create` gets)
//! has made it usable in every target and CRI resolves it.
//!
//! One job per file: [`routes`] (what a path names), [`errors`] (the spec's
//! error bodies), [`session`] (upload sessions, leases), [`upload`] (blob
//! uploads and mounts), [`blobs`] (blob reads), [`manifests`], [`records`]
//! (image records of a repository), [`tags`], [`referrers`].
//!
//! It runs on its own tasks of the runtime; nothing here blocks a thread,
//! and the proxy's splice never waits for it.

mod blobs;
pub mod errors;
mod manifests;
pub mod observe;
mod records;
mod referrers;
pub mod routes;
pub mod session;
mod tags;
mod upload;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config;
use crate::containerd::Containerd;
use crate::replicate::Replicator;
use errors::{Code, Error};
use observe::RegistryObserver;
use routes::Route;

/// Response bodies: small JSON, or a blob streamed out of containerd.
pub type Body = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

pub(crate) fn full(b: Bytes) -> Body {
    Full::new(b).map_err(|e: Infallible| match e {}).boxed()
}

pub(crate) fn empty() -> Body {
    Empty::new().map_err(|e: Infallible| match e {}).boxed()
}

/// Limits and timings, from `[registry]`.
#[derive(Clone, Debug)]
pub struct Settings {
    pub namespace: String,
    pub max_manifest: u64,
    /// 0: no limit.
    pub max_blob: u64,
    pub upload_expiry: Duration,
    pub max_uploads: usize,
    /// Host names besides localhost and loopback IPs a push may address.
    pub hosts: Vec<String>,
}

impl Settings {
    pub fn from_config(c: &config::Config) -> Settings {
        let r = &c.registry;
        Settings {
            namespace: r.namespace(&c.replication).to_string(),
            max_manifest: r.max_manifest_bytes,
            max_blob: r.max_blob_bytes,
            upload_expiry: r.upload_expiry,
            max_uploads: r.max_uploads,
            hosts: r.hosts.clone(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("registry.listen {addr:?}: cannot listen: {source}")]
pub struct BindError {
    addr: String,
    source: std::io::Error,
}

impl BindError {
    pub fn new(addr: &str, source: std::io::Error) -> BindError {
        BindError {
            addr: addr.into(),
            source,
        }
    }
}

/// Binds `registry.listen` (validated as loopback by the config), shared
/// with a handover's other instance when `shared`.
pub async fn bind(addr: &str, shared: bool) -> Result<TcpListener, BindError> {
    crate::listener::bind_tcp(addr, shared)
        .await
        .map_err(|source| BindError {
            addr: addr.into(),
            source,
        })
}

/// The endpoint's state; shared by its connections.
pub struct Registry {
    c: Containerd,
    replicator: Arc<Replicator>,
    s: Settings,
    sessions: session::Sessions,
    held: session::Held,
    tombstones: blobs::Tombstones,
    observer: Option<Arc<dyn RegistryObserver>>,
    /// `host:port` records are named with when a request has no usable
    /// `Host` header.
    local: String,
}

impl Registry {
    pub fn new(
        c: Containerd,
        replicator: Arc<Replicator>,
        s: Settings,
        local: SocketAddr,
        observer: Option<Arc<dyn RegistryObserver>>,
    ) -> Arc<Registry> {
        Arc::new(Registry {
            c,
            replicator,
            s,
            sessions: Default::default(),
            held: Default::default(),
            tombstones: Default::default(),
            observer,
            local: local.to_string(),
        })
    }

    fn ns(&self) -> &str {
        &self.s.namespace
    }

    /// Upload sessions open, leases of blobs no manifest names yet.
    pub fn open_counts(&self) -> (usize, usize) {
        (self.sessions.count(), self.held.count())
    }

    /// Answers one request; never fails (errors become the spec's bodies).
    pub async fn handle(self: &Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let method = req.method().clone();
        let kind;
        let mut resp = match Route::parse(req.uri().path()) {
            None => {
                kind = "other";
                Error::new(Code::Unsupported, "not a distribution API path")
                    .with_status(StatusCode::NOT_FOUND)
                    .response()
            }
            Some(Err(e)) => {
                kind = "invalid";
                e.response()
            }
            Some(Ok(route)) => {
                kind = route.kind();
                self.dispatch(route, req)
                    .await
                    .unwrap_or_else(Error::response)
            }
        };
        resp.headers_mut().insert(
            "docker-distribution-api-version",
            HeaderValue::from_static("registry/2.0"),
        );
        if method == Method::HEAD {
            // Headers only (Content-Length stays what a GET would send).
            let (parts, _) = resp.into_parts();
            resp = Response::from_parts(parts, empty());
        }
        if let Some(o) = &self.observer {
            o.request(method.as_str(), kind, resp.status().as_u16());
        }
        resp
    }

    async fn dispatch(
        self: &Arc<Self>,
        route: Route,
        req: Request<Incoming>,
    ) -> errors::Result<Response<Body>> {
        let m = req.method().clone();
        match route {
            Route::Ping => match m {
                Method::GET | Method::HEAD => Ok(json(StatusCode::OK, "{}".into())),
                _ => Err(unsupported(&m)),
            },
            Route::Blob(_, d) => match m {
                Method::GET | Method::HEAD => {
                    let range = req
                        .headers()
                        .get(header::RANGE)
                        .and_then(|v| v.to_str().ok());
                    self.get_blob(&d, range, m == Method::HEAD).await
                }
                Method::DELETE => self.delete_blob(&d).await,
                _ => Err(unsupported(&m)),
            },
            Route::Uploads(name) => match m {
                Method::POST => self.start_upload(&name, req).await,
                _ => Err(unsupported(&m)),
            },
            Route::Upload(name, id) => match m {
                Method::PATCH => self.patch_upload(&name, &id.0, req).await,
                Method::PUT => self.put_upload(&name, &id.0, req).await,
                Method::GET => self.upload_status(&name, &id.0).await,
                Method::DELETE => self.cancel_upload(&name, &id.0).await,
                _ => Err(unsupported(&m)),
            },
            Route::Manifest(name, r) => match m {
                Method::GET | Method::HEAD => {
                    self.get_manifest(&name, &r, &req, m == Method::HEAD).await
                }
                Method::PUT => self.put_manifest(&name, &r, req).await,
                Method::DELETE => self.delete_manifest(&name, &r).await,
                _ => Err(unsupported(&m)),
            },
            Route::Tags(name) => match m {
                Method::GET | Method::HEAD => self.list_tags(&name, req.uri().query()).await,
                _ => Err(unsupported(&m)),
            },
            Route::Referrers(name, d) => match m {
                Method::GET | Method::HEAD => self.referrers(&name, &d, req.uri().query()).await,
                _ => Err(unsupported(&m)),
            },
        }
    }

    /// `host[:port]` the client addressed, as image records are named
    /// (`localhost:5000/app:dev`), if it is one of the endpoint's own
    /// names ([`own_host`]); else `None`.
    fn addressed(&self, req: &Request<Incoming>) -> Option<String> {
        let h = req
            .headers()
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())?
            .to_ascii_lowercase();
        own_host(&h, &self.s.hosts).then_some(h)
    }

    /// The host records are read under: the one addressed, else the
    /// listening address.
    fn host(&self, req: &Request<Incoming>) -> String {
        self.addressed(req).unwrap_or_else(|| self.local.clone())
    }

    /// The host a pushed record is named with. A client can put any
    /// `Host` header on a request: were it taken as it comes, a push could
    /// take the name of an image pods run from another registry and
    /// replace it. Only the endpoint's own names are accepted.
    fn push_host(&self, req: &Request<Incoming>) -> errors::Result<String> {
        self.addressed(req).ok_or_else(|| {
            let h = req
                .headers()
                .get(header::HOST)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            Error::new(
                Code::Denied,
                format!("pushes must address this endpoint as localhost, a loopback address or one of registry.hosts, not {h:?}: the host becomes part of the image name"),
            )
        })
    }

    /// Drops idle upload sessions (aborting their ingests) and releases
    /// leases past their time; with `all`, every one (at shutdown).
    async fn sweep(&self, all: bool) {
        let expiry = if all {
            Duration::ZERO
        } else {
            self.s.upload_expiry
        };
        for s in self.sessions.expired(expiry) {
            tracing::debug!(repo = %s.repo, "registry: upload session expired");
            s.end().await;
        }
        let now = (!all).then(std::time::Instant::now);
        for l in self.held.expired(now) {
            l.release().await;
        }
    }
}

/// Whether `h` (`host[:port]`) names this endpoint: `localhost`, a
/// loopback IP literal, or one of `extra` (`registry.hosts`), with any
/// port.
pub fn own_host(h: &str, extra: &[String]) -> bool {
    if h.is_empty() || h.len() > 255 {
        return false;
    }
    let name = match h.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((ip, port))
                if port.is_empty() || port.strip_prefix(':').is_some_and(valid_port) =>
            {
                ip
            }
            _ => return false,
        },
        None => match h.rsplit_once(':') {
            Some((n, port)) if valid_port(port) => n,
            Some(_) => return false,
            None => h,
        },
    };
    name == "localhost"
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
        || extra.iter().any(|x| x.eq_ignore_ascii_case(name))
}

fn valid_port(p: &str) -> bool {
    !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit())
}

fn unsupported(m: &Method) -> Error {
    Error::new(Code::Unsupported, format!("{m} is not supported here"))
}

pub(crate) fn json(status: StatusCode, body: String) -> Response<Body> {
    let mut r = Response::new(full(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// A response with `status`, no body, and `headers`.
pub(crate) fn answer(status: StatusCode, headers: &[(&str, String)]) -> Response<Body> {
    let mut r = Response::new(empty());
    *r.status_mut() = status;
    for (k, v) in headers {
        if let (Ok(k), Ok(v)) = (
            header::HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            r.headers_mut().insert(k, v);
        }
    }
    if !r.headers().contains_key(header::CONTENT_LENGTH) {
        r.headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
    }
    r
}

/// Serves `listener` until `stop`; the janitor runs alongside.
pub async fn serve(listener: TcpListener, reg: Arc<Registry>, stop: CancellationToken) {
    let addr = listener
        .local_addr()
        .map_or_else(|_| "?".into(), |a| a.to_string());
    tracing::info!(listen = %addr, namespace = %reg.s.namespace, "registry endpoint: OCI distribution v1.1");
    let janitor = {
        let (reg, stop) = (reg.clone(), stop.clone());
        let every =
            (reg.s.upload_expiry / 4).clamp(Duration::from_millis(250), Duration::from_secs(30));
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(every) => reg.sweep(false).await,
                }
            }
        })
    };
    let conns = tokio_util::task::TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            a = listener.accept() => a,
        };
        let conn = match accepted {
            Ok((conn, _)) => conn,
            Err(e) => {
                tracing::warn!(error = %e, "registry endpoint accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = conn.set_nodelay(true);
        let (reg, stop) = (reg.clone(), stop.clone());
        conns.spawn(async move {
            let svc = service_fn(move |req| {
                let reg = reg.clone();
                async move { Ok::<_, Infallible>(reg.handle(req).await) }
            });
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(TokioTimer::new())
                .header_read_timeout(Some(Duration::from_secs(30)));
            let c = b.serve_connection(TokioIo::new(conn), svc);
            tokio::pin!(c);
            tokio::select! {
                r = c.as_mut() => if let Err(e) = r {
                    tracing::debug!(error = %e, "registry connection ended");
                },
                _ = stop.cancelled() => {
                    c.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(Duration::from_secs(5), c).await;
                }
            }
        });
    }
    conns.close();
    let _ = tokio::time::timeout(Duration::from_secs(10), conns.wait()).await;
    janitor.abort();
    // Release what is still open; containerd would expire it anyway.
    reg.sweep(true).await;
}

#[cfg(test)]
mod tests {
    use super::own_host;

    #[test]
    fn own_hosts() {
        let extra = vec!["registry.local".to_string()];
        for ok in [
            "localhost",
            "localhost:5000",
            "127.0.0.1:5000",
            "127.1.2.3",
            "[::1]:5000",
            "[::1]",
            "registry.local:5000",
        ] {
            assert!(own_host(ok, &extra), "{ok}");
        }
        for bad in [
            "registry.example.invalid",
            "registry.example.invalid:443",
            "10.0.0.1:5000",
            "[::2]:5000",
            "localhost:x",
            "",
            "registry.local.evil:5000",
        ] {
            assert!(!own_host(bad, &extra), "{bad}");
        }
    }
}
