//! Read-your-writes down to the last layer: buildkit's image exporter names
//! the image (Update → NotFound → Create) *before* it writes the layers it
//! had never fetched (lazy), and only then returns to the user. These tests
//! replay that sequence with `containerd-client` through imgbridge against a
//! real containerd, and create the container through CRI on containerd's
//! own socket the moment the last write returns — no wait, no retry.

use std::path::Path;
use std::time::Duration;

use containerd_client::services::v1 as api;
use containerd_client::types::Descriptor;
use imgbridge_test_support::cri::cri_runtime_client;
use imgbridge_test_support::grpc::content_client;
use imgbridge_test_support::prelude::*;
use imgbridge_test_support::util::POD_TIMEOUT;
use k8s_cri::v1 as cri;
use serde_json::json;
use tokio_stream::wrappers::ReceiverStream;

const SRC: &str = "buildkit";

const LAYER: &str = "application/vnd.oci.image.layer.v1.tar";
const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const CONFIG: &str = "application/vnd.oci.image.config.v1+json";

fn opts(isolated: bool) -> ContainerdOpts {
    ContainerdOpts {
        cri: true,
        isolated,
        ..Default::default()
    }
}

/// An uncompressed layer with the given files (mode 0755).
fn layer(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o755);
        h.set_cksum();
        b.append_data(&mut h, path, *data).unwrap();
    }
    b.into_inner().unwrap()
}

fn desc(media_type: &str, data: &[u8]) -> Descriptor {
    Descriptor {
        media_type: media_type.into(),
        digest: sha256_digest(data),
        size: data.len() as i64,
        ..Default::default()
    }
}

/// One build's blobs: config and manifest (written before the record, as
/// buildkit does) and the layers (written after it).
struct Build {
    manifest: Vec<u8>,
    config: Vec<u8>,
    layers: Vec<Vec<u8>>,
}

impl Build {
    /// busybox plus a layer of its own holding `/lazy` = `text`.
    fn new(busybox: &[u8], text: &str) -> Build {
        let layers = vec![
            layer(&[("bin/busybox", busybox)]),
            layer(&[("lazy", text.as_bytes())]),
        ];
        let config = json!({
            "architecture": "amd64", "os": "linux",
            "config": {"Cmd": ["/bin/busybox", "cat", "/lazy"]},
            "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|l| sha256_digest(l)).collect::<Vec<_>>()},
        })
        .to_string()
        .into_bytes();
        let manifest = json!({
            "schemaVersion": 2, "mediaType": MANIFEST,
            "config": {"mediaType": CONFIG, "digest": sha256_digest(&config), "size": config.len()},
            "layers": layers.iter().map(|l| json!({"mediaType": LAYER, "digest": sha256_digest(l), "size": l.len()})).collect::<Vec<_>>(),
        })
        .to_string()
        .into_bytes();
        Build {
            manifest,
            config,
            layers,
        }
    }

    fn target(&self) -> Descriptor {
        desc(MANIFEST, &self.manifest)
    }

    /// What buildkit's exporter does before the layers: config and manifest
    /// through `sock`, then the image named (the layers are absent).
    async fn export_record(&self, sock: &Path, name: &str) {
        write(sock, &self.config, &[]).await.unwrap();
        write(sock, &self.manifest, &self.manifest_labels())
            .await
            .unwrap();
        name_image(sock, name, &self.target()).await;
    }

    /// The gc.ref labels buildkit puts on the manifest it writes.
    fn manifest_labels(&self) -> Vec<(String, String)> {
        let mut l = vec![(
            "containerd.io/gc.ref.content.config".to_string(),
            sha256_digest(&self.config),
        )];
        for (i, layer) in self.layers.iter().enumerate() {
            l.push((
                format!("containerd.io/gc.ref.content.l.{i}"),
                sha256_digest(layer),
            ));
        }
        l
    }
}

/// `Content.Write` as containerd's Go client does it: each message is sent
/// and its reply awaited; the write is done when the COMMIT reply arrives.
/// `Ok(false)`: the blob was already there (ALREADY_EXISTS).
async fn write(
    sock: &Path,
    data: &[u8],
    labels: &[(String, String)],
) -> Result<bool, tonic::Status> {
    let digest = sha256_digest(data);
    let mut content = content_client(sock).await;
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let reference = format!("test/{}", &digest[7..23]);
    tx.send(api::WriteContentRequest {
        action: api::WriteAction::Stat as i32,
        r#ref: reference.clone(),
        total: data.len() as i64,
        expected: digest.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    let mut replies = match content.write(with_ns(ReceiverStream::new(rx), SRC)).await {
        Ok(r) => r.into_inner(),
        Err(e) if e.code() == tonic::Code::AlreadyExists => return Ok(false),
        Err(e) => return Err(e),
    };
    match replies.message().await {
        Ok(_) => {}
        Err(e) if e.code() == tonic::Code::AlreadyExists => return Ok(false),
        Err(e) => return Err(e),
    }
    let mut offset = 0;
    for chunk in data.chunks(1 << 20) {
        tx.send(api::WriteContentRequest {
            action: api::WriteAction::Write as i32,
            r#ref: reference.clone(),
            offset,
            data: chunk.to_vec(),
            ..Default::default()
        })
        .await
        .unwrap();
        offset += chunk.len() as i64;
        replies.message().await?;
    }
    tx.send(api::WriteContentRequest {
        action: api::WriteAction::Commit as i32,
        r#ref: reference,
        total: data.len() as i64,
        offset,
        expected: digest.clone(),
        labels: labels.iter().cloned().collect(),
        ..Default::default()
    })
    .await
    .unwrap();
    let reply = replies.message().await?.expect("a COMMIT reply");
    assert_eq!(reply.digest, digest);
    Ok(true)
}

/// Images.Update, and on NotFound Images.Create: buildkit's exporter.
async fn name_image(sock: &Path, name: &str, target: &Descriptor) {
    let mut images = images_client(sock).await;
    let image = api::Image {
        name: name.into(),
        target: Some(target.clone()),
        ..Default::default()
    };
    let update = images
        .update(with_ns(
            api::UpdateImageRequest {
                image: Some(image.clone()),
                ..Default::default()
            },
            SRC,
        ))
        .await;
    match update {
        Ok(_) => {}
        Err(e) if e.code() == tonic::Code::NotFound => {
            images
                .create(with_ns(
                    api::CreateImageRequest {
                        image: Some(image),
                        ..Default::default()
                    },
                    SRC,
                ))
                .await
                .expect("Images.Create");
        }
        Err(e) => panic!("Images.Update: {e:?}"),
    }
}

/// One CRI pod sandbox, in which each build's container is created.
struct Sandbox {
    rt: cri::runtime_service_client::RuntimeServiceClient<tonic::transport::Channel>,
    id: String,
    config: cri::PodSandboxConfig,
    logs: tempfile::TempDir,
}

fn host_namespaces() -> cri::NamespaceOption {
    cri::NamespaceOption {
        network: cri::NamespaceMode::Node as i32,
        pid: cri::NamespaceMode::Node as i32,
        ipc: cri::NamespaceMode::Node as i32,
        ..Default::default()
    }
}

impl Sandbox {
    async fn start(containerd: &Path) -> Sandbox {
        let logs = tempdir("lazy-pod-");
        let config = cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: unique_name("lazy"),
                uid: unique_name("uid"),
                namespace: "imgbridge-test".into(),
                attempt: 0,
            }),
            log_directory: logs.path().display().to_string(),
            linux: Some(cri::LinuxPodSandboxConfig {
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(host_namespaces()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut rt = cri_runtime_client(containerd).await;
        let id = rt
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: String::new(),
            })
            .await
            .expect("RunPodSandbox")
            .into_inner()
            .pod_sandbox_id;
        Sandbox {
            rt,
            id,
            config,
            logs,
        }
    }

    /// CreateContainer of `image` (what fails when a layer is missing).
    async fn create(&mut self, image: &str, n: usize) -> Result<String, tonic::Status> {
        let config = cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata {
                name: format!("c{n}"),
                attempt: 0,
            }),
            image: Some(cri::ImageSpec {
                image: image.into(),
                ..Default::default()
            }),
            log_path: format!("c{n}.log"),
            linux: Some(cri::LinuxContainerConfig {
                security_context: Some(cri::LinuxContainerSecurityContext {
                    namespace_options: Some(host_namespaces()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        self.rt
            .create_container(cri::CreateContainerRequest {
                pod_sandbox_id: self.id.clone(),
                config: Some(config),
                sandbox_config: Some(self.config.clone()),
            })
            .await
            .map(|r| r.into_inner().container_id)
    }

    /// Starts container `id` (`n` as created) and waits for `expect` in its log.
    async fn run(&mut self, id: &str, n: usize, expect: &str) {
        self.rt
            .start_container(cri::StartContainerRequest {
                container_id: id.into(),
            })
            .await
            .expect("StartContainer");
        let log = self.logs.path().join(format!("c{n}.log"));
        let seen = poll(POD_TIMEOUT, || {
            std::fs::read_to_string(&log)
                .ok()
                .filter(|l| l.contains(expect))
        });
        assert!(seen.is_some(), "container {n} never printed {expect:?}");
    }

    /// StopContainer then RemoveContainer, retried for up to 30 s as
    /// kubelet does: a container that just exited may still be settling
    /// (containerd 2.x refuses to remove it while running; its shim may be
    /// closing: "ttrpc: closed").
    async fn remove(&mut self, id: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let _ = self
                .rt
                .stop_container(cri::StopContainerRequest {
                    container_id: id.into(),
                    timeout: 0,
                })
                .await;
            let r = self
                .rt
                .remove_container(cri::RemoveContainerRequest {
                    container_id: id.into(),
                })
                .await;
            match r {
                Ok(_) => return,
                Err(e) if std::time::Instant::now() > deadline => {
                    panic!("RemoveContainer: {e:?}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await, // retry interval
            }
        }
    }

    async fn stop(mut self) {
        let id = self.id.clone();
        let _ = self
            .rt
            .stop_pod_sandbox(cri::StopPodSandboxRequest {
                pod_sandbox_id: id.clone(),
            })
            .await;
        let _ = self
            .rt
            .remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: id })
            .await;
    }
}

/// `rounds` rebuilds of one tag, each exactly as buildkit exports an image
/// whose layers are lazy; a container is created from the tag the moment
/// the last layer write returns. Every `run_every`th one is also run.
async fn exporter_rounds(isolated: bool, rounds: usize, run_every: usize) {
    let c = Containerd::start(opts(isolated));
    let p = Imgbridge::start(c.socket(), &[]);
    let busybox = std::fs::read("/bin/busybox").expect("/bin/busybox (busybox-static)");
    let name = "docker.io/library/lazy:dev";
    let mut sandbox = Sandbox::start(c.socket()).await;
    let mut failures = Vec::new();
    for n in 0..rounds {
        let text = format!("lazy-{n}-{}", unique_name("x"));
        let b = Build::new(&busybox, &text);
        // Config and manifest first, then the record: the layers are absent.
        b.export_record(p.socket(), name).await;
        // Unlazy: the layers, concurrently (buildkit's errgroup).
        let writes = b.layers.iter().map(|l| write(p.socket(), l, &[]));
        for r in futures_util::future::join_all(writes).await {
            r.expect("layer write");
        }
        // Done, as buildctl would say: the container now, no wait.
        match sandbox.create(name, n).await {
            Ok(id) => {
                if n % run_every == 0 {
                    sandbox.run(&id, n, &text).await;
                }
                sandbox.remove(&id).await;
            }
            Err(e) => failures.push(format!("round {n}: {} {}", e.code(), e.message())),
        }
    }
    sandbox.stop().await;
    assert!(
        failures.is_empty(),
        "{} of {rounds} containers failed right after the export returned:\n{}\n{}",
        failures.len(),
        failures.join("\n"),
        p.log_tail()
    );
}

#[tokio::test]
async fn buildkit_exporter_sequence_100_rounds_every_container_starts() {
    exporter_rounds(false, 100, 10).await;
}

/// `content_sharing_policy = "isolated"`: the layers are copied, not linked,
/// and the commit still waits for the copy.
#[tokio::test]
async fn buildkit_exporter_sequence_isolated_content_copies_before_the_commit_returns() {
    exporter_rounds(true, 20, 5).await;
}

/// A layer someone committed straight into containerd (not through
/// imgbridge) after the record was named: buildkit's next Write of it gets
/// ALREADY_EXISTS, which it takes as done — so by then it is in k8s.io too.
#[tokio::test]
async fn already_existing_layer_is_in_the_target_when_the_write_says_so() {
    let c = Containerd::start(opts(false));
    let p = Imgbridge::start(c.socket(), &[]);
    let busybox = std::fs::read("/bin/busybox").expect("/bin/busybox");
    let name = "docker.io/library/lazy-exists:dev";
    let mut sandbox = Sandbox::start(c.socket()).await;
    for n in 0..10 {
        let text = format!("exists-{n}-{}", unique_name("x"));
        let b = Build::new(&busybox, &text);
        b.export_record(p.socket(), name).await;
        // Behind imgbridge's back, then through it.
        for l in &b.layers {
            write(c.socket(), l, &[]).await.unwrap();
        }
        for l in &b.layers {
            assert!(!write(p.socket(), l, &[]).await.unwrap(), "already there");
        }
        let id = sandbox
            .create(name, n)
            .await
            .unwrap_or_else(|e| panic!("round {n}: {e:?}\n{}", p.log_tail()));
        sandbox.run(&id, n, &text).await;
        sandbox.remove(&id).await;
    }
    sandbox.stop().await;
}

/// A write aborted half-way and resumed on another connection commits the
/// blob there: that commit waits for the link too.
#[tokio::test]
async fn write_resumed_on_another_connection_links_before_its_commit_returns() {
    let c = Containerd::start(opts(false));
    let p = Imgbridge::start(c.socket(), &[]);
    let busybox = std::fs::read("/bin/busybox").expect("/bin/busybox");
    let name = "docker.io/library/lazy-resume:dev";
    let mut sandbox = Sandbox::start(c.socket()).await;
    let text = format!("resumed-{}", unique_name("x"));
    let b = Build::new(&busybox, &text);
    b.export_record(p.socket(), name).await;
    for l in &b.layers {
        resume_write(p.socket(), l).await;
    }
    let id = sandbox
        .create(name, 0)
        .await
        .unwrap_or_else(|e| panic!("{e:?}\n{}", p.log_tail()));
    sandbox.run(&id, 0, &text).await;
    sandbox.remove(&id).await;
    sandbox.stop().await;
}

/// Writes the first half of `data` on one connection, drops it, and
/// finishes (STAT for the offset, the rest, COMMIT) on a new one.
async fn resume_write(sock: &Path, data: &[u8]) {
    let digest = sha256_digest(data);
    let reference = format!("resume/{}", &digest[7..23]);
    let half = write_first_half(sock, data, &reference).await;
    let resumed = poll_async(Duration::from_secs(10), || async {
        let mut content = content_client(sock).await;
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tx.send(api::WriteContentRequest {
            action: api::WriteAction::Stat as i32,
            r#ref: reference.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        let mut replies = content
            .write(with_ns(ReceiverStream::new(rx), SRC))
            .await
            .ok()?
            .into_inner();
        let offset = replies.message().await.ok()??.offset;
        Some((tx, replies, offset))
    })
    .await;
    let (tx, mut replies, offset) = resumed.expect("the ingest unlocks once its writer is gone");
    assert_eq!(
        offset as usize, half,
        "resumes where the first writer stopped"
    );
    tx.send(api::WriteContentRequest {
        action: api::WriteAction::Write as i32,
        r#ref: reference.clone(),
        offset,
        data: data[half..].to_vec(),
        ..Default::default()
    })
    .await
    .unwrap();
    replies.message().await.unwrap();
    tx.send(api::WriteContentRequest {
        action: api::WriteAction::Commit as i32,
        r#ref: reference,
        total: data.len() as i64,
        offset: data.len() as i64,
        expected: digest.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    let reply = replies.message().await.unwrap().expect("COMMIT reply");
    assert_eq!(reply.digest, digest);
}

/// Writes the first half of `data` under `reference` and drops the call
/// without COMMIT: the ingest stays, unlocked once containerd sees the
/// writer gone. Returns where the rest starts.
async fn write_first_half(sock: &Path, data: &[u8], reference: &str) -> usize {
    let half = data.len() / 2;
    let mut content = content_client(sock).await;
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(api::WriteContentRequest {
        action: api::WriteAction::Write as i32,
        r#ref: reference.into(),
        total: data.len() as i64,
        expected: sha256_digest(data),
        data: data[..half].to_vec(),
        ..Default::default()
    })
    .await
    .unwrap();
    let mut replies = content
        .write(with_ns(ReceiverStream::new(rx), SRC))
        .await
        .unwrap()
        .into_inner();
    replies.message().await.unwrap();
    half
}

/// How a client that pipelines lays out one blob's `Content.Write`
/// messages. Each holds a COMMIT after another message, so the first reply
/// after the COMMIT went out is not the COMMIT's.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// WRITE with all the data, then COMMIT.
    Pair,
    /// STAT, the data in four WRITEs, COMMIT.
    Chunked,
    /// STAT, then one message with all the data that COMMITs.
    OneMessage,
    /// The second half of a write resumed (the first half is in the
    /// ingest, see [`write_first_half`]): STAT, WRITE at that offset,
    /// COMMIT.
    Resumed,
}

impl Layout {
    /// Every message for `data`, built before the call starts.
    fn requests(self, data: &[u8], reference: &str) -> Vec<api::WriteContentRequest> {
        let digest = sha256_digest(data);
        let total = data.len() as i64;
        let msg = |action: api::WriteAction| api::WriteContentRequest {
            action: action as i32,
            r#ref: reference.into(),
            total,
            expected: digest.clone(),
            ..Default::default()
        };
        let commit = api::WriteContentRequest {
            offset: total,
            ..msg(api::WriteAction::Commit)
        };
        let write = |offset: usize, chunk: &[u8]| api::WriteContentRequest {
            offset: offset as i64,
            data: chunk.to_vec(),
            ..msg(api::WriteAction::Write)
        };
        match self {
            Layout::Pair => vec![write(0, data), commit],
            Layout::Chunked => {
                let mut m = vec![msg(api::WriteAction::Stat)];
                let size = data.len().div_ceil(4).max(1);
                for (i, chunk) in data.chunks(size).enumerate() {
                    m.push(write(i * size, chunk));
                }
                m.push(commit);
                m
            }
            Layout::Resumed => {
                let half = data.len() / 2;
                vec![
                    msg(api::WriteAction::Stat),
                    write(half, &data[half..]),
                    commit,
                ]
            }
            Layout::OneMessage => vec![
                msg(api::WriteAction::Stat),
                api::WriteContentRequest {
                    offset: 0,
                    data: data.to_vec(),
                    ..msg(api::WriteAction::Commit)
                },
            ],
        }
    }
}

type Replies = tonic::Streaming<api::WriteContentResponse>;

/// `Content.Write` as a streaming client (containerd-client/tonic, Python)
/// may do it: every message goes before any reply is read. Returns at the
/// COMMIT reply — where the client's write is done — with the rest of the
/// replies, or `None` when the blob was already there (ALREADY_EXISTS).
async fn write_pipelined(
    sock: &Path,
    data: &[u8],
    layout: Layout,
) -> Result<Option<Replies>, tonic::Status> {
    let digest = sha256_digest(data);
    let requests = layout.requests(data, &pipelined_ref(&digest));
    let mut content = content_client(sock).await;
    let stream = tokio_stream::iter(requests);
    let mut replies = match content.write(with_ns(stream, SRC)).await {
        Ok(r) => r.into_inner(),
        Err(e) if e.code() == tonic::Code::AlreadyExists => return Ok(None),
        Err(e) => return Err(e),
    };
    loop {
        match replies.message().await {
            Ok(Some(r)) if r.action == api::WriteAction::Commit as i32 => {
                assert_eq!(r.digest, digest);
                return Ok(Some(replies));
            }
            Ok(Some(_)) => {}
            Ok(None) => panic!("{layout:?}: the write ended without a COMMIT reply"),
            Err(e) if e.code() == tonic::Code::AlreadyExists => return Ok(None),
            Err(e) => return Err(e),
        }
    }
}

/// The ingest a pipelined write of `digest` uses.
fn pipelined_ref(digest: &str) -> String {
    format!("pipelined/{}", &digest[7..23])
}

/// Whether `digest` is in `k8s.io`, asked of containerd itself.
async fn in_k8s(k8s: &mut ContentClient, digest: &str) -> bool {
    let info = api::InfoRequest {
        digest: digest.into(),
    };
    match k8s.info(with_ns(info, "k8s.io")).await {
        Ok(_) => true,
        Err(e) if e.code() == tonic::Code::NotFound => false,
        Err(e) => panic!("Content.Info {digest} in k8s.io: {e:?}"),
    }
}

type ContentClient =
    containerd_client::services::v1::content_client::ContentClient<tonic::transport::Channel>;

/// Writes `data` pipelined through `sock`; `Some` with how long the blob
/// took to show up in `k8s.io` (a miss) when it was not there at the
/// COMMIT reply (or at ALREADY_EXISTS).
async fn pipelined_miss(
    sock: &Path,
    k8s: &ContentClient,
    data: &[u8],
    layout: Layout,
) -> Option<Duration> {
    let mut k8s = k8s.clone();
    let digest = sha256_digest(data);
    let rest = write_pipelined(sock, data, layout)
        .await
        .unwrap_or_else(|e| panic!("{layout:?} write: {e:?}"));
    let done = std::time::Instant::now();
    let there = in_k8s(&mut k8s, &digest).await;
    if let Some(mut rest) = rest {
        while rest
            .message()
            .await
            .expect("the rest of the replies")
            .is_some()
        {}
    }
    match there {
        true => None,
        false => Some(late(&k8s, &digest, done).await),
    }
}

/// How long after `done` the blob `digest` showed up in `k8s.io` (for a
/// miss's report; `Duration::MAX`: not within 10 s).
async fn late(k8s: &ContentClient, digest: &str, done: std::time::Instant) -> Duration {
    let arrived = poll_async(Duration::from_secs(10), || {
        let mut k8s = k8s.clone();
        async move { in_k8s(&mut k8s, digest).await.then(|| done.elapsed()) }
    })
    .await;
    arrived.unwrap_or(Duration::MAX)
}

/// `None` when `digest` is in `k8s.io` now, else how late it came.
async fn lateness(k8s: &ContentClient, digest: &str, done: std::time::Instant) -> Option<Duration> {
    match in_k8s(&mut k8s.clone(), digest).await {
        true => None,
        false => Some(late(k8s, digest, done).await),
    }
}

/// Fails with every miss of `rounds` and imgbridge's log tail, if any.
fn assert_no_misses(misses: &[String], what: &str, rounds: usize, p: &Imgbridge) {
    assert!(
        misses.is_empty(),
        "{what}: {} misses in {rounds} rounds:\n{}\n{}",
        misses.len(),
        misses.join("\n"),
        p.log_tail()
    );
}

/// `rounds` exports in buildkit's order (config, manifest, the image
/// named, then the lazy layers) whose layers a pipelining client writes:
/// each layer must be in `k8s.io` the moment its COMMIT reply arrives.
/// With `cri`, a container is also created from the tag at once.
async fn pipelined_rounds(isolated: bool, layout: Layout, rounds: usize, cri: bool) {
    let c = Containerd::start(opts(isolated));
    let p = Imgbridge::start(c.socket(), &[]);
    let k8s = content_client(c.socket()).await;
    let busybox = std::fs::read("/bin/busybox").expect("/bin/busybox (busybox-static)");
    let name = "docker.io/library/pipelined:dev";
    let mut sandbox = match cri {
        true => Some(Sandbox::start(c.socket()).await),
        false => None,
    };
    let mut misses = Vec::new();
    for n in 0..rounds {
        let text = format!("pipelined-{n}-{}", unique_name("x"));
        let b = Build::new(&busybox, &text);
        b.export_record(p.socket(), name).await;
        let writes = (b.layers.iter()).map(|l| pipelined_miss(p.socket(), &k8s, l, layout));
        for (l, miss) in b
            .layers
            .iter()
            .zip(futures_util::future::join_all(writes).await)
        {
            if let Some(late) = miss {
                misses.push(format!(
                    "round {n}: {} in k8s.io {late:?} after its COMMIT reply",
                    sha256_digest(l)
                ));
            }
        }
        if let Some(sandbox) = sandbox.as_mut() {
            match sandbox.create(name, n).await {
                Ok(id) => sandbox.remove(&id).await,
                Err(e) => misses.push(format!(
                    "round {n}: CreateContainer {} {}",
                    e.code(),
                    e.message()
                )),
            }
        }
    }
    if let Some(sandbox) = sandbox {
        sandbox.stop().await;
    }
    let what = format!("{layout:?} (isolated: {isolated})");
    assert_no_misses(&misses, &what, rounds, &p);
}

/// The race the commit hold closes: WRITE and COMMIT sent together, in
/// buildkit's exporter order, with a container created the moment the
/// layers return.
#[tokio::test]
async fn pipelined_write_commit_100_rounds_every_layer_is_in_k8s_io_at_its_commit_reply() {
    pipelined_rounds(false, Layout::Pair, 100, true).await;
}

#[tokio::test]
async fn pipelined_write_commit_isolated_100_rounds_every_layer_is_in_k8s_io_at_its_commit_reply() {
    pipelined_rounds(true, Layout::Pair, 100, true).await;
}

#[tokio::test]
async fn pipelined_stat_writes_commit_100_rounds_every_layer_is_in_k8s_io_at_its_commit_reply() {
    pipelined_rounds(false, Layout::Chunked, 100, false).await;
}

#[tokio::test]
async fn pipelined_stat_writes_commit_isolated_100_rounds_every_layer_is_in_k8s_io_at_its_commit_reply(
) {
    pipelined_rounds(true, Layout::Chunked, 100, false).await;
}

#[tokio::test]
async fn pipelined_stat_and_one_write_commit_message_100_rounds_every_layer_is_in_k8s_io() {
    pipelined_rounds(false, Layout::OneMessage, 100, false).await;
}

#[tokio::test]
async fn pipelined_stat_and_one_write_commit_message_isolated_100_rounds_every_layer_is_in_k8s_io()
{
    pipelined_rounds(true, Layout::OneMessage, 100, false).await;
}

/// A client that names the image and writes its lazy layers at once: the
/// Update/Create and the layer writes on the wire together, none waiting
/// for another's reply. Once every call has returned, every layer is in
/// `k8s.io` — also a layer committed after the replication looked for it
/// and before it noted that the image waits for it (that COMMIT reply
/// found nothing to hold). The writes start staggered by up to 5 ms so
/// that over the rounds their commits fall all along the replication.
#[tokio::test]
async fn create_and_layer_writes_sent_together_100_rounds_every_layer_is_in_k8s_io() {
    let c = Containerd::start(opts(false));
    let p = Imgbridge::start(c.socket(), &[]);
    let k8s = content_client(c.socket()).await;
    let busybox = std::fs::read("/bin/busybox").expect("/bin/busybox (busybox-static)");
    let name = "docker.io/library/together:dev";
    let mut misses = Vec::new();
    for n in 0..100u64 {
        let b = Build::new(&busybox, &format!("together-{n}-{}", unique_name("x")));
        write(p.socket(), &b.config, &[]).await.unwrap();
        let labels = b.manifest_labels();
        write(p.socket(), &b.manifest, &labels).await.unwrap();
        let stagger = Duration::from_micros(n % 26 * 200);
        let sock = p.socket();
        let layers = futures_util::future::join_all(b.layers.iter().map(|l| async move {
            tokio::time::sleep(stagger).await; // the stagger, not a wait for anything
            write(sock, l, &[]).await.expect("layer write");
        }));
        let target = b.target();
        tokio::join!(name_image(sock, name, &target), layers);
        let done = std::time::Instant::now();
        for l in &b.layers {
            let digest = sha256_digest(l);
            if let Some(late) = lateness(&k8s, &digest, done).await {
                misses.push(format!(
                    "round {n}: {digest} in k8s.io {late:?} after the calls returned"
                ));
            }
        }
    }
    assert_no_misses(&misses, "Create sent with its layer writes", 100, &p);
}

/// A write aborted half-way and resumed on another connection by a
/// pipelining client: STAT, the rest (offset > 0) and the COMMIT sent
/// together. The layer is in `k8s.io` at that COMMIT's reply.
#[tokio::test]
async fn pipelined_resumed_write_20_rounds_every_layer_is_in_k8s_io_at_its_commit_reply() {
    let c = Containerd::start(opts(false));
    let p = Imgbridge::start(c.socket(), &[]);
    let k8s = content_client(c.socket()).await;
    let busybox = std::fs::read("/bin/busybox").expect("/bin/busybox (busybox-static)");
    let name = "docker.io/library/pipelined-resume:dev";
    let mut misses = Vec::new();
    for n in 0..20 {
        let b = Build::new(&busybox, &format!("resumed-{n}-{}", unique_name("x")));
        b.export_record(p.socket(), name).await;
        write(p.socket(), &b.layers[0], &[]).await.unwrap();
        let lazy = &b.layers[1];
        let digest = sha256_digest(lazy);
        write_first_half(p.socket(), lazy, &pipelined_ref(&digest)).await;
        // Until containerd has seen the first writer go, the ingest is locked.
        let rest = poll_async(Duration::from_secs(10), || async {
            write_pipelined(p.socket(), lazy, Layout::Resumed)
                .await
                .ok()
        })
        .await
        .expect("the resumed write commits once the ingest unlocks")
        .expect("the rest written and committed, not ALREADY_EXISTS");
        let done = std::time::Instant::now();
        let miss = lateness(&k8s, &digest, done).await;
        drop(rest);
        if let Some(late) = miss {
            misses.push(format!(
                "round {n}: {digest} in k8s.io {late:?} after its COMMIT reply"
            ));
        }
    }
    assert_no_misses(&misses, "resumed pipelined write", 20, &p);
}
