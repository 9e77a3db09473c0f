//! CRI as kubelet sees it: image status (through crictl when the peers are
//! there) and pods whose container must print what the test expects.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use tempfile::TempDir;
use tonic::transport::Channel;

use crate::grpc::{containerd_channel, try_containerd_channel, MAX_MSG};
use crate::images::hello_text;
use crate::util::{logs_near, tempdir, unique_name, POD_TIMEOUT};

/// CRI RuntimeService client (16 MiB max message).
pub async fn cri_runtime_client(sock: &Path) -> RuntimeServiceClient<Channel> {
    RuntimeServiceClient::new(containerd_channel(sock).await)
        .max_decoding_message_size(MAX_MSG)
        .max_encoding_message_size(MAX_MSG)
}

/// CRI ImageService client (16 MiB max message).
pub async fn cri_image_client(sock: &Path) -> ImageServiceClient<Channel> {
    ImageServiceClient::new(containerd_channel(sock).await)
        .max_decoding_message_size(MAX_MSG)
        .max_encoding_message_size(MAX_MSG)
}

/// CRI's `ImageStatus` of `image_ref` on containerd's socket `sock`: what
/// kubelet would see, asked with crictl (over gRPC only when the peers are
/// skipped). `Err` carries the connection or RPC error.
pub async fn try_cri_image_status(
    sock: &Path,
    image_ref: &str,
) -> Result<Option<k8s_cri::v1::Image>, String> {
    if let Some(crictl) = crate::peers::Crictl::quiet(sock) {
        let name = image_ref.to_string();
        let status = tokio::task::spawn_blocking(move || crictl.inspecti(&name))
            .await
            .map_err(|e| e.to_string())??;
        return Ok(status.map(|s| image_from_json(&s)));
    }
    let ch = try_containerd_channel(sock)
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    let mut c = ImageServiceClient::new(ch).max_decoding_message_size(MAX_MSG);
    let resp = c
        .image_status(k8s_cri::v1::ImageStatusRequest {
            image: Some(k8s_cri::v1::ImageSpec {
                image: image_ref.to_string(),
                ..Default::default()
            }),
            verbose: false,
        })
        .await
        .map_err(|s| format!("ImageStatus: {s:?}"))?;
    Ok(resp.into_inner().image)
}

/// crictl's JSON image status as CRI's `Image`.
pub(crate) fn image_from_json(s: &serde_json::Value) -> k8s_cri::v1::Image {
    let strings = |k: &str| -> Vec<String> {
        s[k].as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    k8s_cri::v1::Image {
        id: s["id"].as_str().unwrap_or_default().to_string(),
        repo_tags: strings("repoTags"),
        repo_digests: strings("repoDigests"),
        size: s["size"]
            .as_str()
            .and_then(|v| v.parse().ok())
            .or_else(|| s["size"].as_u64())
            .unwrap_or_default(),
        pinned: s["pinned"].as_bool().unwrap_or_default(),
        ..Default::default()
    }
}

/// CRI `ImageStatus` for `image_ref`, `None` when CRI does not know it.
/// Panics on connection/RPC errors.
pub async fn cri_image_status(sock: &Path, image_ref: &str) -> Option<k8s_cri::v1::Image> {
    try_cri_image_status(sock, image_ref)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "CRI ImageStatus({image_ref}) on {}: {e}{}",
                sock.display(),
                logs_near(sock)
            )
        })
}

/// A pod sandbox with one started container (see [`run_pod`]).
pub struct PodRun {
    pub sock: PathBuf,
    pub name: String,
    pub pod_id: String,
    pub container_id: String,
    /// The container's log file.
    pub log_path: PathBuf,
    /// The log dir, removed when the pod run is dropped.
    _logs: TempDir,
}

impl PodRun {
    /// Current content of the container log (CRI format lines).
    pub fn log(&self) -> String {
        fs::read(&self.log_path)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// StopPodSandbox + RemovePodSandbox, retried for up to 30 s as kubelet
    /// does: containerd 1.6 can fail a stop with "ttrpc: closed" when the
    /// container's shim is exiting at that moment.
    pub async fn cleanup(self) {
        let mut rt = cri_runtime_client(&self.sock).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let Err(e) = self.try_cleanup(&mut rt).await else {
                return;
            };
            if Instant::now() >= deadline {
                panic!(
                    "pod {} cleanup failed for 30 s: {e}{}",
                    self.name,
                    logs_near(&self.sock)
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await; // retry interval
        }
    }

    async fn try_cleanup(
        &self,
        rt: &mut RuntimeServiceClient<Channel>,
    ) -> Result<(), tonic::Status> {
        use k8s_cri::v1::{RemovePodSandboxRequest, StopPodSandboxRequest};
        if self.pod_id.is_empty() {
            return Ok(());
        }
        rt.stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: self.pod_id.clone(),
        })
        .await?;
        rt.remove_pod_sandbox(RemovePodSandboxRequest {
            pod_sandbox_id: self.pod_id.clone(),
        })
        .await?;
        Ok(())
    }

    /// Best-effort removal of the pod, then panic with `msg` and logs.
    async fn fail(&self, rt: &mut RuntimeServiceClient<Channel>, msg: String) {
        let _ = self.try_cleanup(rt).await;
        panic!(
            "pod {} (image run failed): {msg}\n--- container log ---\n{}{}",
            self.name,
            self.log(),
            logs_near(&self.sock)
        );
    }
}

/// Kubelet-style run on the CRI at `sock`: RunPodSandbox (host network, pid
/// and ipc namespaces; log dir in a temp dir; unique name/uid),
/// CreateContainer (`image_ref`, `cmd`; empty `cmd` = the image's CMD),
/// StartContainer, then polls the container log for up to [`POD_TIMEOUT`]
/// until it contains `expect`. Panics (after removing the pod) otherwise.
/// Call [`PodRun::cleanup`] when done.
pub async fn run_pod(sock: &Path, image_ref: &str, cmd: &[&str], expect: &str) -> PodRun {
    use k8s_cri::v1::*;

    let name = unique_name("pod");
    let logs = tempdir("pod-logs-");
    let log_dir = logs.path().join(&name);
    fs::create_dir_all(&log_dir).expect("mkdir pod log dir");
    let ns_opts = NamespaceOption {
        network: NamespaceMode::Node as i32,
        pid: NamespaceMode::Node as i32,
        ipc: NamespaceMode::Node as i32,
        ..Default::default()
    };
    let pod_config = PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: name.clone(),
            uid: unique_name("uid"),
            namespace: "imgbridge-test".into(),
            attempt: 0,
        }),
        log_directory: log_dir.display().to_string(),
        linux: Some(LinuxPodSandboxConfig {
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: Some(ns_opts.clone()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut rt = cri_runtime_client(sock).await;
    let crictl = crate::peers::Crictl::quiet(sock);
    let mut pod = PodRun {
        sock: sock.to_path_buf(),
        name: name.clone(),
        pod_id: String::new(),
        container_id: String::new(),
        log_path: log_dir.join("main.log"),
        _logs: logs,
    };
    if let Some(crictl) = crictl {
        // As kubelet would: crictl runp, create, start.
        let (name, image, dir) = (name.clone(), image_ref.to_string(), log_dir.clone());
        let cmd: Vec<String> = cmd.iter().map(|s| s.to_string()).collect();
        let (pod_id, started) = tokio::task::spawn_blocking(move || {
            let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();
            crictl.start_pod(&name, &image, &cmd, &dir)
        })
        .await
        .expect("crictl task");
        pod.pod_id = pod_id.unwrap_or_default();
        match started {
            Ok(cid) => pod.container_id = cid,
            Err(e) => pod.fail(&mut rt, e).await,
        }
        return pod.wait_for(&mut rt, expect).await;
    }
    match rt
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(pod_config.clone()),
            runtime_handler: String::new(),
        })
        .await
    {
        Ok(r) => pod.pod_id = r.into_inner().pod_sandbox_id,
        Err(e) => pod.fail(&mut rt, format!("RunPodSandbox: {e:?}")).await,
    }
    let container_config = ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: "main".into(),
            attempt: 0,
        }),
        image: Some(ImageSpec {
            image: image_ref.to_string(),
            ..Default::default()
        }),
        command: cmd.iter().map(|s| s.to_string()).collect(),
        log_path: "main.log".into(),
        linux: Some(LinuxContainerConfig {
            security_context: Some(LinuxContainerSecurityContext {
                namespace_options: Some(ns_opts),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    match rt
        .create_container(CreateContainerRequest {
            pod_sandbox_id: pod.pod_id.clone(),
            config: Some(container_config),
            sandbox_config: Some(pod_config),
        })
        .await
    {
        Ok(r) => pod.container_id = r.into_inner().container_id,
        Err(e) => {
            pod.fail(&mut rt, format!("CreateContainer({image_ref}): {e:?}"))
                .await
        }
    }
    if let Err(e) = rt
        .start_container(StartContainerRequest {
            container_id: pod.container_id.clone(),
        })
        .await
    {
        pod.fail(&mut rt, format!("StartContainer: {e:?}")).await;
    }

    pod.wait_for(&mut rt, expect).await
}

impl PodRun {
    /// Polls the log until it shows `expect`; fails fast if the container
    /// exited without it (allowing 2 s for the log to be flushed).
    async fn wait_for(mut self, rt: &mut RuntimeServiceClient<Channel>, expect: &str) -> PodRun {
        use k8s_cri::v1::*;
        let pod = &mut self;
        let deadline = Instant::now() + POD_TIMEOUT;
        let mut exited_at: Option<(Instant, ContainerStatus)> = None;
        loop {
            if pod.log().contains(expect) {
                return self;
            }
            if exited_at.is_none() {
                if let Ok(r) = rt
                    .container_status(ContainerStatusRequest {
                        container_id: pod.container_id.clone(),
                        verbose: false,
                    })
                    .await
                {
                    if let Some(st) = r.into_inner().status {
                        if st.state == ContainerState::ContainerExited as i32 {
                            exited_at = Some((Instant::now(), st));
                        }
                    }
                }
            }
            if let Some((t, st)) = &exited_at {
                if t.elapsed() > Duration::from_secs(2) {
                    let msg = format!(
                    "container exited (code {}, reason {:?}, message {:?}) without printing {expect:?}",
                    st.exit_code, st.reason, st.message
                );
                    pod.fail(rt, msg).await;
                }
            }
            if Instant::now() >= deadline {
                pod.fail(
                    rt,
                    format!("{expect:?} not in container log within {POD_TIMEOUT:?}"),
                )
                .await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Runs `image_ref` (built with [`crate::images::TestImage::hello`]`(name_tag)`) as a pod
/// until it prints [`hello_text`]`(name_tag)`, then removes the pod.
pub async fn run_hello_pod(sock: &Path, image_ref: &str, name_tag: &str) {
    run_pod(sock, image_ref, &[], &hello_text(name_tag))
        .await
        .cleanup()
        .await;
}
