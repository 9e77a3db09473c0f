//! Runs a one-shot CRI pod the way kubelet would (ImageStatus, then
//! RunPodSandbox, CreateContainer, StartContainer) and prints its log.
//! Used by scripts/try.sh; Debian ships no crictl.
//!
//! usage: try_pod SOCKET IMAGE EXPECTED_OUTPUT

use std::time::{Duration, Instant};

use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::*;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, sock, image, expect] = &args[..] else {
        return Err("usage: try_pod SOCKET IMAGE EXPECTED_OUTPUT".into());
    };
    let channel = imgbridge::containerd::Containerd::new(sock).channel();
    let mut images = ImageServiceClient::new(channel.clone());
    let mut rt = RuntimeServiceClient::new(channel);
    let spec = ImageSpec {
        image: image.clone(),
        ..Default::default()
    };
    let st = images
        .image_status(ImageStatusRequest {
            image: Some(spec.clone()),
            verbose: false,
        })
        .await?
        .into_inner();
    let id = st
        .image
        .ok_or("CRI ImageStatus: image not found (kubelet would try to pull it)")?
        .id;
    println!("CRI ImageStatus {image} -> {id}");
    let logs = std::env::temp_dir().join(format!("imgbridge-try-{}", std::process::id()));
    std::fs::create_dir_all(&logs)?;
    let ns = NamespaceOption {
        network: NamespaceMode::Node as i32,
        pid: NamespaceMode::Node as i32,
        ipc: NamespaceMode::Node as i32,
        ..Default::default()
    };
    let config = PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: "imgbridge-try".into(),
            uid: format!("uid-{}", std::process::id()),
            namespace: "default".into(),
            attempt: 0,
        }),
        log_directory: logs.display().to_string(),
        linux: Some(LinuxPodSandboxConfig {
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: Some(ns.clone()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let pod = rt
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(config.clone()),
            ..Default::default()
        })
        .await?
        .into_inner()
        .pod_sandbox_id;
    let ctr = rt
        .create_container(CreateContainerRequest {
            pod_sandbox_id: pod.clone(),
            config: Some(ContainerConfig {
                metadata: Some(ContainerMetadata {
                    name: "app".into(),
                    attempt: 0,
                }),
                image: Some(spec),
                log_path: "app.log".into(),
                linux: Some(LinuxContainerConfig {
                    security_context: Some(LinuxContainerSecurityContext {
                        namespace_options: Some(ns),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            sandbox_config: Some(config),
        })
        .await?
        .into_inner()
        .container_id;
    rt.start_container(StartContainerRequest {
        container_id: ctr.clone(),
    })
    .await?;
    let log = logs.join("app.log");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = String::new();
    while Instant::now() < deadline {
        seen = std::fs::read_to_string(&log).unwrap_or_default();
        if seen.contains(expect.as_str()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = rt
        .stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await;
    let _ = rt
        .remove_pod_sandbox(RemovePodSandboxRequest {
            pod_sandbox_id: pod,
        })
        .await;
    let _ = std::fs::remove_dir_all(&logs);
    if !seen.contains(expect.as_str()) {
        return Err(format!("pod log did not show {expect:?}; got: {seen}").into());
    }
    println!(
        "pod ran; its log: {}",
        seen.lines().last().unwrap_or_default()
    );
    Ok(())
}
