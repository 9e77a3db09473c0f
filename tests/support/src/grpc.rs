//! containerd gRPC clients: channels on Unix sockets, namespaced requests,
//! image and content look-ups that never mistake an error for "absent".

use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

use crate::util::logs_near;

/// Max gRPC message size for clients built here (16 MiB).
pub const MAX_MSG: usize = 16 << 20;

/// Connects a tonic channel to a unix socket (as `containerd_client::connect`).
pub async fn try_containerd_channel(sock: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = sock.to_path_buf();
    Endpoint::try_from("http://[::]")?
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await
}

/// A bare HTTP/2 client connection to `sock`: no gRPC layer and no timers
/// of its own, for exact wire behaviour.
pub async fn h2_connect<B>(sock: &Path) -> hyper::client::conn::http2::SendRequest<B>
where
    B: hyper::body::Body + Unpin + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let s = tokio::net::UnixStream::connect(sock).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(s),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    send
}

/// [`try_containerd_channel`], panicking with the nearby daemon logs on error.
pub async fn containerd_channel(sock: &Path) -> Channel {
    try_containerd_channel(sock).await.unwrap_or_else(|e| {
        panic!(
            "cannot connect to {}: {e:?}{}",
            sock.display(),
            logs_near(sock)
        )
    })
}

/// Wraps `req` in a `tonic::Request` with `containerd-namespace: <ns>`.
pub fn with_ns<T>(req: T, ns: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(req);
    r.metadata_mut().insert(
        "containerd-namespace",
        ns.parse().expect("namespace is valid metadata"),
    );
    r
}

/// Images client on a containerd (or proxy) socket.
pub async fn images_client(
    sock: &Path,
) -> containerd_client::services::v1::images_client::ImagesClient<Channel> {
    containerd_client::services::v1::images_client::ImagesClient::new(
        containerd_channel(sock).await,
    )
}

/// Content client on a containerd (or proxy) socket.
pub async fn content_client(
    sock: &Path,
) -> containerd_client::services::v1::content_client::ContentClient<Channel> {
    containerd_client::services::v1::content_client::ContentClient::new(
        containerd_channel(sock).await,
    )
}

/// The image record `name` in `ns`, or `None` when containerd says it is
/// absent. Other errors are retried for a while (containerd may be
/// restarting under the test), then fail the test: "absent" is never
/// inferred from a failed call.
pub async fn get_image(
    sock: &Path,
    ns: &str,
    name: &str,
) -> Option<containerd_client::services::v1::Image> {
    let c = imgbridge::containerd::Containerd::new(sock);
    definite(&format!("image {name} in {ns}"), || c.get_image(ns, name)).await
}

/// Retries `call` until containerd gives a definite answer (value or
/// NotFound, which the library maps to `None`), for up to 10 s.
pub(crate) async fn definite<T, F, Fut>(what: &str, call: F) -> Option<T>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, imgbridge::containerd::Error>>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match call().await {
            Ok(v) => return v,
            Err(e) if Instant::now() > deadline => panic!("asking containerd for {what}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// The target descriptor of image `name` in `ns`, panicking when it is absent.
pub async fn image_target(
    sock: &Path,
    ns: &str,
    name: &str,
) -> containerd_client::types::Descriptor {
    get_image(sock, ns, name)
        .await
        .unwrap_or_else(|| panic!("image {name} not found in {ns}"))
        .target
        .unwrap_or_else(|| panic!("image {name} in {ns} has no target"))
}

/// Content info of `digest` in `ns`, or `None` when containerd says it is
/// absent (errors as in [`get_image`]).
pub async fn content_info(
    sock: &Path,
    ns: &str,
    digest: &str,
) -> Option<containerd_client::services::v1::Info> {
    let c = imgbridge::containerd::Containerd::new(sock);
    definite(&format!("blob {digest} in {ns}"), || {
        c.content_info(ns, digest)
    })
    .await
}

/// An `Images/Create` request for `name` -> `target` in `ns`.
pub fn create_image_req(
    ns: &str,
    name: &str,
    target: &containerd_client::types::Descriptor,
) -> tonic::Request<containerd_client::services::v1::CreateImageRequest> {
    with_ns(
        containerd_client::services::v1::CreateImageRequest {
            image: Some(containerd_client::services::v1::Image {
                name: name.into(),
                target: Some(target.clone()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ns,
    )
}

/// Lower-case hex SHA-256 of `data`.
fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(data))
}

/// `sha256:<hex>` digest of `data`.
pub fn sha256_digest(data: &[u8]) -> String {
    format!("sha256:{}", sha256_hex(data))
}

/// A manifest descriptor (size 1) whose digest is `digit` 64 times: the
/// target of a record that containerd stores without reading its content.
pub fn placeholder_manifest(digit: char) -> containerd_client::types::Descriptor {
    containerd_client::types::Descriptor {
        media_type: "application/vnd.oci.image.manifest.v1+json".into(),
        digest: format!("sha256:{}", digit.to_string().repeat(64)),
        size: 1,
        ..Default::default()
    }
}

/// `Images/Create` of `name` -> `target` in `ns` on `sock` (containerd's
/// socket, or imgbridge's), panicking unless it succeeds.
pub async fn create_image(
    sock: &Path,
    ns: &str,
    name: &str,
    target: &containerd_client::types::Descriptor,
) {
    images_client(sock)
        .await
        .create(create_image_req(ns, name, target))
        .await
        .unwrap_or_else(|e| panic!("create {name} in {ns}: {e:?}"));
}

/// `Images/Update` of the whole record `image` in `ns` on `sock`,
/// panicking unless it succeeds.
pub async fn update_image(sock: &Path, ns: &str, image: containerd_client::services::v1::Image) {
    let name = image.name.clone();
    images_client(sock)
        .await
        .update(with_ns(
            containerd_client::services::v1::UpdateImageRequest {
                image: Some(image),
                ..Default::default()
            },
            ns,
        ))
        .await
        .unwrap_or_else(|e| panic!("update {name} in {ns}: {e:?}"));
}

/// Asserts every record carries CRI's management mark, as CRI's own pull
/// writes it (`io.cri-containerd.image=managed`).
pub fn assert_cri_managed(records: &[&containerd_client::services::v1::Image]) {
    for r in records {
        assert_eq!(
            r.labels.get("io.cri-containerd.image").map(String::as_str),
            Some("managed"),
            "{}: {:?}",
            r.name,
            r.labels
        );
    }
}

/// Leases as `(namespace, id, owner label)`, ingests as `(namespace, ref)`.
pub type LeasesAndIngests = (Vec<(String, String, Option<String>)>, Vec<(String, String)>);

/// Every lease in every namespace as `(namespace, id, owner label)`, and
/// every active ingest as `(namespace, ref)`, read straight from
/// containerd: what a killed imgbridge can leave behind.
pub async fn leases_and_ingests(sock: &std::path::Path) -> LeasesAndIngests {
    try_leases_and_ingests(sock)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// [`leases_and_ingests`], or what failed (containerd down).
pub async fn try_leases_and_ingests(sock: &std::path::Path) -> Result<LeasesAndIngests, String> {
    use containerd_client::services::v1::{
        leases_client::LeasesClient, namespaces_client::NamespacesClient, ListNamespacesRequest,
        ListRequest, ListStatusesRequest,
    };
    let ch = try_containerd_channel(sock)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let namespaces = NamespacesClient::new(ch.clone())
        .list(ListNamespacesRequest::default())
        .await
        .map_err(|e| format!("Namespaces.List: {e}"))?
        .into_inner()
        .namespaces;
    let (mut leases, mut ingests) = (Vec::new(), Vec::new());
    for ns in namespaces.into_iter().map(|n| n.name) {
        let ls = LeasesClient::new(ch.clone())
            .list(with_ns(ListRequest::default(), &ns))
            .await
            .map_err(|e| format!("Leases.List: {e}"))?
            .into_inner()
            .leases;
        for l in ls {
            let owner = l.labels.get("io.imgbridge.owner").cloned();
            leases.push((ns.clone(), l.id, owner));
        }
        let st = containerd_client::services::v1::content_client::ContentClient::new(ch.clone())
            .list_statuses(with_ns(ListStatusesRequest::default(), &ns))
            .await
            .map_err(|e| format!("Content.ListStatuses: {e}"))?
            .into_inner()
            .statuses;
        ingests.extend(st.into_iter().map(|s| (ns.clone(), s.r#ref)));
    }
    Ok((leases, ingests))
}
