//! Typed helpers over `containerd-client`: the calls imgbridge itself makes
//! to containerd (content, leases, images, CRI). No policy lives here.

pub mod breaker;
pub mod content;
pub mod cri;
pub mod images;
pub mod introspect;
pub mod leases;
pub mod node_config;
pub mod orphans;
pub mod sandbox;

use std::path::{Path, PathBuf};

use containerd_client::services::v1 as api;
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

pub use api::Image;
pub use containerd_client::types::Descriptor;

/// containerd's default message limit; our clients accept as much.
pub const MAX_MESSAGE: usize = 16 << 20;
/// HTTP/2 receive windows of the bulk read connection.
const BULK_STREAM_WINDOW: u32 = 2 << 20;
const BULK_CONNECTION_WINDOW: u32 = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{op}: {status}")]
    Status {
        op: String,
        #[source]
        status: tonic::Status,
    },
    #[error("{0}")]
    Protocol(String),
    /// Not sent: an earlier `op` on the same item broke the connection.
    #[error("{op}: not sent: {}", match .refusal {
        breaker::Refusal::HeldBack { remaining } => format!(
            "it broke containerd's connection before; held back for another {remaining:?}"),
        breaker::Refusal::Stopped => "it broke containerd's connection twice; not sent again until imgbridge restarts".to_string(),
    })]
    Refused {
        op: String,
        refusal: breaker::Refusal,
    },
}

impl Error {
    pub fn status(op: impl Into<String>) -> impl FnOnce(tonic::Status) -> Error {
        let op = op.into();
        move |status| Error::Status { op, status }
    }

    /// The gRPC code behind this error, if it came from containerd.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            Error::Status { status, .. } => Some(status.code()),
            Error::Protocol(_) | Error::Refused { .. } => None,
        }
    }

    pub fn is(&self, code: tonic::Code) -> bool {
        self.code() == Some(code)
    }

    /// Did the call fail because containerd was not there to answer (not
    /// listening, or its connection broke under the call)? Such a call may
    /// be sent again once it is back; any other answer is containerd's word.
    pub fn unreachable(&self) -> bool {
        match self {
            Error::Status { status, .. } => {
                status.code() == tonic::Code::Unavailable
                    || breaker::broke_connection(status)
                    // The connection closed before the call went out:
                    // tonic says CANCELLED with the transport's error as
                    // its source (containerd's own CANCELLED has none).
                    || (status.code() == tonic::Code::Cancelled
                        && std::error::Error::source(status).is_some())
            }
            Error::Protocol(_) | Error::Refused { .. } => false,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A lazily connected, self-reconnecting client for one containerd socket.
#[derive(Clone, Debug)]
pub struct Containerd {
    channel: Channel,
    /// A second connection only for bulk `Content.Read` streams. Read data a
    /// copy has not consumed yet holds the connection's flow-control window;
    /// on a shared connection that can starve the WRITE acks the copy is
    /// waiting for (a deadlock with several concurrent copies).
    bulk: Channel,
    socket: PathBuf,
    /// Shared by every clone: writes that broke the connection (see
    /// [`breaker`]).
    breaker: std::sync::Arc<breaker::Breaker>,
}

fn connect(socket: &Path, windows: Option<(u32, u32)>) -> Channel {
    let path = socket.to_path_buf();
    let mut e = Endpoint::from_static("http://localhost");
    if let Some((stream, conn)) = windows {
        e = e
            .initial_stream_window_size(stream)
            .initial_connection_window_size(conn);
    }
    e.connect_with_connector_lazy(tower::service_fn(move |_| {
        let path = path.clone();
        async move {
            Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?))
        }
    }))
}

impl Containerd {
    /// Creates the client without connecting: calls fail with UNAVAILABLE
    /// while containerd is down and succeed again once it is back.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        let socket = socket.into();
        Containerd {
            channel: connect(&socket, None),
            // h2's 64 KiB default windows cap a Content.Read at one window
            // per round trip; larger ones let containerd keep streaming.
            bulk: connect(&socket, Some((BULK_STREAM_WINDOW, BULK_CONNECTION_WINDOW))),
            socket,
            breaker: Default::default(),
        }
    }

    /// A client on connections of its own (bulk writes of one part do not
    /// share HTTP/2 windows with another's) that shares this one's breaker.
    pub fn new_connection(&self) -> Self {
        Containerd {
            breaker: self.breaker.clone(),
            ..Containerd::new(self.socket.clone())
        }
    }

    pub fn breaker(&self) -> &breaker::Breaker {
        &self.breaker
    }

    /// Sends a write of imgbridge's own on `item` (image name or blob
    /// digest) in `ns` and records the outcome (see [`breaker`]). After a
    /// write of the item broke the connection once, this one waits out the
    /// back-off first (a containerd that merely restarted meanwhile gets the
    /// write a moment later, not never); after two, it is refused.
    pub(crate) async fn guarded<T>(
        &self,
        op: &str,
        ns: &str,
        item: &str,
        call: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        loop {
            match self.breaker.admit(ns, item) {
                Ok(()) => break,
                Err(breaker::Refusal::HeldBack { remaining }) => {
                    tokio::time::sleep(remaining).await;
                }
                Err(refusal) => {
                    let op = op.to_string();
                    return Err(Error::Refused { op, refusal });
                }
            }
        }
        let r = call.await;
        match &r {
            Ok(_) => self.breaker.succeeded(ns, item),
            Err(Error::Status { op, status }) if breaker::broke_connection(status) => {
                self.breaker.broke(op, ns, item)
            }
            Err(_) => {}
        }
        r
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    pub fn images(&self) -> api::images_client::ImagesClient<Channel> {
        api::images_client::ImagesClient::new(self.channel())
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE)
    }

    pub fn content(&self) -> api::content_client::ContentClient<Channel> {
        api::content_client::ContentClient::new(self.channel())
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE)
    }

    /// Content client on the bulk connection, for large `Read` streams.
    pub fn bulk_content(&self) -> api::content_client::ContentClient<Channel> {
        api::content_client::ContentClient::new(self.bulk.clone())
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE)
    }

    pub fn leases(&self) -> api::leases_client::LeasesClient<Channel> {
        api::leases_client::LeasesClient::new(self.channel())
    }

    pub fn events(&self) -> api::events_client::EventsClient<Channel> {
        api::events_client::EventsClient::new(self.channel()).max_decoding_message_size(MAX_MESSAGE)
    }

    pub fn namespaces(&self) -> api::namespaces_client::NamespacesClient<Channel> {
        api::namespaces_client::NamespacesClient::new(self.channel())
    }

    pub fn introspection(&self) -> api::introspection_client::IntrospectionClient<Channel> {
        api::introspection_client::IntrospectionClient::new(self.channel())
            .max_decoding_message_size(MAX_MESSAGE)
    }

    pub fn version_client(&self) -> api::version_client::VersionClient<Channel> {
        api::version_client::VersionClient::new(self.channel())
    }

    /// containerd's version string; also a cheap liveness probe.
    pub async fn version(&self) -> Result<String> {
        let v = self
            .version_client()
            .version(())
            .await
            .map_err(Error::status("Version"))?;
        let v = v.into_inner().version;
        self.breaker.saw_version(&v);
        Ok(v)
    }

    /// The metadata store's content sharing policy (`shared` or `isolated`).
    pub async fn sharing_policy(&self) -> Result<String> {
        let ps = self.plugins("type==io.containerd.metadata.v1").await?;
        Ok(ps
            .iter()
            .find_map(|p| p.exports.get("policy").cloned())
            .unwrap_or_else(|| "shared".into()))
    }

    /// Whether the CRI plugin is loaded (so `ImageStatus` can confirm replicas).
    pub async fn has_cri(&self) -> Result<bool> {
        let ps = self.plugins("type==io.containerd.grpc.v1,id==cri").await?;
        Ok(ps.iter().any(|p| p.init_err.is_none()))
    }
}

/// Builds a request carrying `containerd-namespace` (and optionally a lease).
pub fn request<T>(ns: &str, lease: Option<&str>, msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Ok(v) = ns.parse() {
        r.metadata_mut().insert("containerd-namespace", v);
    }
    if let Some(l) = lease.and_then(|l| l.parse().ok()) {
        r.metadata_mut().insert("containerd-lease", l);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::Error;

    fn status_error(code: tonic::Code, source: Option<std::io::ErrorKind>) -> Error {
        let mut status = tonic::Status::new(code, "x");
        if let Some(kind) = source {
            status.set_source(std::sync::Arc::new(std::io::Error::from(kind)));
        }
        Error::Status {
            op: "Images.Get a in k8s.io".into(),
            status,
        }
    }

    /// What a restart mid-import showed: a call the closing connection
    /// never sent comes back CANCELLED with hyper's error as its source.
    #[test]
    fn a_call_the_transport_gave_up_is_unreachable_and_containerds_answer_is_not() {
        use std::io::ErrorKind::{BrokenPipe, NotFound};
        use tonic::Code::{Cancelled, NotFound as Missing, Unavailable, Unknown};
        assert!(status_error(Cancelled, Some(BrokenPipe)).unreachable());
        assert!(status_error(Unknown, Some(BrokenPipe)).unreachable());
        assert!(status_error(Unavailable, Some(NotFound)).unreachable());
        assert!(
            !status_error(Cancelled, None).unreachable(),
            "containerd's own CANCELLED"
        );
        assert!(!status_error(Unknown, None).unreachable());
        assert!(!status_error(Missing, None).unreachable());
    }
}
