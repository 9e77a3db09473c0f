//! Self-tests of the integration harness (`tests/support`), without the proxy.
//!
//! Every test starts the daemons it needs (a private containerd boots in well
//! under a second) and stops them on drop, so tests are independent and can
//! run in parallel. Only the offline-built test images are shared, through the
//! process-wide caches in the harness (`pause_image()`, `TestImage::hello`).

use std::time::{Duration, Instant};

use containerd_client::services::v1::introspection_client::IntrospectionClient;
use containerd_client::services::v1::PluginsRequest;
use imgbridge_test_support::grpc::MAX_MSG;
use imgbridge_test_support::images::PAUSE_IMAGE;
use imgbridge_test_support::prelude::*;

/// (a) containerd + CRI: import a docker-archive into k8s.io, CRI ImageStatus
/// resolves the normalised name, and a CRI pod runs the image.
#[tokio::test]
async fn cri_import_status_and_pod() {
    let t0 = Instant::now();
    let cd = Containerd::start(ContainerdOpts {
        cri: true,
        isolated: false,
        ..Default::default()
    });
    let started = t0.elapsed();
    let version = cd.ctr_ok("default", ["version"]);
    let (major, minor, _) = flavor().semver;
    assert!(
        version.contains(&format!("{major}.{minor}.")),
        "unexpected ctr version:\n{version}"
    );

    let img = TestImage::hello("harness-a:v1");
    let archive = img.docker_archive();
    cd.ctr_ok(
        "k8s.io",
        ["images", "import", archive.to_str().expect("utf-8 path")],
    );
    // (ctr 2.x imports through Transfer and prints a progress table.)
    let listed = cd.ctr_ok("k8s.io", ["images", "ls", "-q"]);
    assert!(
        listed
            .lines()
            .any(|l| l == "docker.io/library/harness-a:v1"),
        "{listed}"
    );

    // CRI learns about the image from the ImageCreate event: poll.
    let name = img.normalized();
    assert_eq!(name, "docker.io/library/harness-a:v1");
    let sock = cd.socket().to_path_buf();
    let image = poll_async(Duration::from_secs(10), || cri_image_status(&sock, &name))
        .await
        .unwrap_or_else(|| {
            panic!(
                "CRI ImageStatus never found {name}; log:\n{}",
                cd.log_tail()
            )
        });
    assert!(image.repo_tags.contains(&name), "{image:?}");
    // The CRI image id is the config digest, and CRI created that record.
    let cfg = format!("sha256:{}", config_of(&cd, &name));
    assert_eq!(image.id, cfg);
    let ids = cd.ctr_ok("k8s.io", ["images", "ls", "-q"]);
    assert!(ids.lines().any(|l| l == cfg), "no {cfg} record in:\n{ids}");

    let t1 = Instant::now();
    let pod = run_pod(cd.socket(), &name, &[], &hello_text("harness-a:v1")).await;
    assert!(
        pod.log().contains("stdout"),
        "CRI log format: {}",
        pod.log()
    );
    let pod_time = t1.elapsed();
    pod.cleanup().await;
    eprintln!("containerd+CRI start {started:?}, pod run {pod_time:?}");
}

/// Config digest (hex) of an image in k8s.io, read via `ctr content get`.
fn config_of(cd: &Containerd, name: &str) -> String {
    let ls = cd.ctr_ok("k8s.io", ["images", "ls"]);
    let digest = ls
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.split_whitespace().nth(2))
        .unwrap_or_else(|| panic!("{name} not in:\n{ls}"))
        .to_string();
    let manifest = cd.ctr_ok("k8s.io", ["content", "get", &digest]);
    let v: serde_json::Value = serde_json::from_str(&manifest).expect("manifest json");
    v["config"]["digest"]
        .as_str()
        .and_then(|d| d.strip_prefix("sha256:"))
        .expect("config digest")
        .to_string()
}

/// (b) registry: push with skopeo, pull with `ctr --plain-http` into buildkit.
#[test]
fn registry_push_and_ctr_pull() {
    let reg = Registry::start();
    let img = TestImage::build("harness-b:v2", 2, &["/bin/sh", "-c", "echo b"], 0);
    let pushed = img.push(&reg.addr());
    assert_eq!(pushed, format!("{}/harness-b:v2", reg.addr()));

    let cd = Containerd::start(ContainerdOpts::default());
    cd.ctr_ok("buildkit", ["images", "pull", "--plain-http", &pushed]);
    let ls = cd.ctr_ok("buildkit", ["images", "ls", "-q"]);
    assert!(ls.lines().any(|l| l == pushed), "{pushed} not in:\n{ls}");
    // The pushed manifest is the OCI layout's manifest, unchanged.
    let full = cd.ctr_ok("buildkit", ["images", "ls"]);
    assert!(full.contains(&img.manifest_digest()), "{full}");
    // 1 busybox layer + 2 extra layers.
    let manifest = cd.ctr_ok("buildkit", ["content", "get", &img.manifest_digest()]);
    let v: serde_json::Value = serde_json::from_str(&manifest).expect("manifest json");
    assert_eq!(v["layers"].as_array().map(Vec::len), Some(3), "{manifest}");
}

async fn bolt_policy(sock: &std::path::Path) -> String {
    let mut c =
        IntrospectionClient::new(containerd_channel(sock).await).max_decoding_message_size(MAX_MSG);
    let resp = c
        .plugins(PluginsRequest {
            filters: vec!["type==io.containerd.metadata.v1,id==bolt".into()],
        })
        .await
        .expect("Introspection.Plugins")
        .into_inner();
    let bolt = resp
        .plugins
        .iter()
        .find(|p| p.id == "bolt")
        .unwrap_or_else(|| panic!("no bolt plugin in {:?}", resp.plugins));
    bolt.exports
        .get("policy")
        .cloned()
        .unwrap_or_else(|| panic!("bolt exports without policy: {:?}", bolt.exports))
}

/// (c) isolated content sharing mode is visible through Introspection.
#[tokio::test]
async fn isolated_mode_is_reported() {
    let iso = Containerd::start(ContainerdOpts {
        cri: false,
        isolated: true,
        ..Default::default()
    });
    assert_eq!(bolt_policy(iso.socket()).await, "isolated");
    let shared = Containerd::start(ContainerdOpts::default());
    assert_eq!(bolt_policy(shared.socket()).await, "shared");
}

/// (d) kill -9 then restart: containerd serves again with its old state, CRI
/// included.
#[tokio::test]
async fn kill9_and_restart() {
    let mut cd = Containerd::start(ContainerdOpts {
        cri: true,
        isolated: false,
        ..Default::default()
    });
    let img = TestImage::hello("harness-d:v1");
    let archive = img.docker_archive();
    cd.ctr_ok(
        "buildkit",
        ["images", "import", archive.to_str().expect("utf-8 path")],
    );
    let old_pid = cd.pid();
    cd.kill9();
    assert!(
        !pid_alive(old_pid),
        "containerd {old_pid} still alive after kill9"
    );
    assert!(!cd.ctr("default", ["version"]).status.success());

    let t = Instant::now();
    cd.restart();
    let restart_time = t.elapsed();
    assert_ne!(cd.pid(), old_pid);
    cd.ctr_ok("default", ["version"]);
    let ls = cd.ctr_ok("buildkit", ["images", "ls", "-q"]);
    assert!(
        ls.contains(&img.normalized()),
        "image lost on restart:\n{ls}"
    );
    // CRI came back too (restart waits for it) and still knows the pause image.
    assert!(cri_image_status(cd.socket(), PAUSE_IMAGE).await.is_some());
    // A graceful stop/restart cycle works as well.
    cd.stop();
    cd.restart();
    cd.ctr_ok("default", ["version"]);
    eprintln!("restart after kill9 took {restart_time:?}");
}

fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Process hygiene: dropping a daemon struct kills and reaps it; a dropped
/// containerd leaves no shims, container processes, cgroups or temp dir
/// behind, both when it is alive at drop time (tasks are deleted through it)
/// and when it was SIGKILLed before (shims are killed directly).
#[tokio::test]
async fn drop_kills_daemons_and_shims() {
    for crash_first in [false, true] {
        let mut cd = Containerd::start(ContainerdOpts {
            cri: true,
            isolated: false,
            ..Default::default()
        });
        let cd_pid = cd.pid();
        let dir = cd.dir().to_path_buf();
        let sock = cd.socket().to_path_buf();
        // Leave a running pod behind (no cleanup) so a shim exists at drop.
        let pod = run_pod(
            &sock,
            PAUSE_IMAGE,
            &["/bin/sh", "-c", "echo started-pause; exec sleep 3600"],
            "started-pause",
        )
        .await;
        let ids = [pod.pod_id.clone(), pod.container_id.clone()];
        assert!(count_shims_for(&sock) > 0, "expected a shim for {sock:?}");
        assert!(
            ids.iter().all(|id| !cgroup_dirs_named(id).is_empty()),
            "expected container cgroups for {ids:?}"
        );
        if crash_first {
            cd.kill9();
            assert!(count_shims_for(&sock) > 0, "shims die with containerd?");
        }
        drop(cd);
        assert!(!pid_alive(cd_pid), "containerd survived drop");
        let clean = poll(Duration::from_secs(5), || {
            (count_shims_for(&sock) == 0).then_some(())
        });
        assert!(clean.is_some(), "shims survived containerd drop");
        for id in &ids {
            let left = cgroup_dirs_named(id);
            assert!(left.is_empty(), "cgroups left behind: {left:?}");
        }
        assert!(!dir.exists(), "{} not removed", dir.display());
    }
    let reg = Registry::start();
    let reg_pid = reg.pid();
    drop(reg);
    assert!(!pid_alive(reg_pid), "registry survived drop");
}

/// `/sys/fs/cgroup/<hierarchy>/<ns>/<id>` directories that exist.
fn cgroup_dirs_named(id: &str) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for h in std::fs::read_dir("/sys/fs/cgroup")
        .expect("/sys/fs/cgroup")
        .flatten()
    {
        if let Ok(rd) = std::fs::read_dir(h.path()) {
            for ns in rd.flatten() {
                let d = ns.path().join(id);
                if d.is_dir() {
                    out.push(d);
                }
            }
        }
    }
    out
}

/// Live (non-zombie) shim processes whose command line names `sock`.
fn count_shims_for(sock: &std::path::Path) -> usize {
    let want = sock.to_str().expect("utf-8 path");
    std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|e| {
            let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let state = stat[stat.rfind(')')? + 1..]
                .split_whitespace()
                .next()?
                .to_string();
            (cmd.contains("containerd-shim") && cmd.contains(want) && state != "Z").then_some(())
        })
        .count()
}

/// Image builder: extra layers with distinct files, random payload, the three
/// export formats, and digests that match what containerd stores.
#[test]
fn image_builder_variants() {
    let img = TestImage::build(
        "example.com/team/harness-e:v3",
        2,
        &["/bin/busybox", "true"],
        1 << 20,
    );
    assert_eq!(img.normalized(), "example.com/team/harness-e:v3");
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            img.layout()
                .join("blobs/sha256")
                .join(img.manifest_digest().trim_start_matches("sha256:")),
        )
        .expect("manifest blob"),
    )
    .expect("manifest json");
    let layers = manifest["layers"].as_array().expect("layers");
    assert_eq!(layers.len(), 3, "{manifest}");
    let digests: std::collections::HashSet<&str> =
        layers.iter().filter_map(|l| l["digest"].as_str()).collect();
    assert_eq!(digests.len(), 3, "layer digests must differ: {manifest}");
    for l in &layers[1..] {
        // 1 MiB of random data does not compress.
        assert!(l["size"].as_u64().unwrap_or(0) > 1 << 20, "{l}");
    }

    let cd = Containerd::start(ContainerdOpts::default());
    let sock = cd.socket();
    // docker-archive: named by the archive's repo tag.
    let docker = img.docker_archive();
    cd.ctr_ok("t1", ["images", "import", docker.to_str().expect("utf-8")]);
    let ls = cd.ctr_ok("t1", ["images", "ls", "-q"]);
    assert!(ls.lines().any(|l| l == img.normalized()), "{ls}");
    // oci-archive: ref.name is the normalised name; keep it via --base-name.
    let oci = img.oci_archive();
    cd.ctr_ok(
        "t2",
        [
            "images",
            "import",
            "--base-name",
            "example.com/team/harness-e",
            oci.to_str().expect("utf-8"),
        ],
    );
    let ls = cd.ctr_ok("t2", ["images", "ls"]);
    let line = ls
        .lines()
        .find(|l| l.starts_with(&img.normalized()))
        .unwrap_or_else(|| panic!("{} not imported:\n{ls}", img.normalized()));
    assert!(line.contains(&img.manifest_digest()), "{line}");
    // The config blob is the layout's config, byte for byte.
    let cfg = ctr_ok(sock, "t2", ["content", "get", &img.config_digest()]);
    assert!(cfg.contains("\"/bin/busybox\",\"true\""), "{cfg}");
    // Files of the extra layers are in the unpacked rootfs.
    let mnt = tempdir("mnt-");
    let target = mnt.path().to_str().expect("utf-8");
    cd.ctr_ok("t2", ["images", "mount", &img.normalized(), target]);
    let txt = std::fs::read_to_string(mnt.path().join("layer2.txt"));
    let bin = std::fs::metadata(mnt.path().join("layer1.bin")).map(|m| m.len());
    cd.ctr_ok("t2", ["images", "unmount", target]);
    assert_eq!(
        txt.expect("layer2.txt"),
        "layer 2 of example.com/team/harness-e:v3\n"
    );
    assert_eq!(bin.expect("layer1.bin"), 1 << 20);
}
