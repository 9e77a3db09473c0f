//! The node-local registry endpoint (`[registry]`, docs/registry.md)
//! against a real containerd with CRI: the OCI conformance suite, real
//! clients (skopeo, crane, ko, buildctl) each followed at once by a pod
//! that runs what was pushed (no retry: a push returns once CRI resolves
//! the image), and hostile input.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use imgbridge_test_support::cri::{cri_image_client, run_hello_pod};
use imgbridge_test_support::grpc::{content_client, content_info, leases_and_ingests, with_ns};
use imgbridge_test_support::images::host_arch;
use imgbridge_test_support::peers::{go_command, peer, Buildkitd};
use imgbridge_test_support::prelude::*;
use imgbridge_test_support::scenario::config_file;
use imgbridge_test_support::util::{http_status, output_with_timeout, READY_TIMEOUT, TOOL_TIMEOUT};

const SRC: &str = "buildkit";
const K8S: &str = "k8s.io";

/// Rounds of each real client (3 keeps the suite short;
/// `IMGBRIDGE_REGISTRY_ROUNDS=10` for a longer run); each round is a push
/// then a pod, and every round's pod must start.
fn rounds() -> usize {
    std::env::var("IMGBRIDGE_REGISTRY_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
}

/// containerd with CRI, imgbridge in front of it with the endpoint on a
/// free loopback port (plus `extra` in `[registry]`), and its metrics.
/// Reconcile is off: only the endpoint's own hold can replicate, so a pod
/// that starts right after a push proves that hold, not the events
/// backstop's catch-up.
struct Setup {
    c: Containerd,
    p: Imgbridge,
    /// `127.0.0.1:PORT` of the endpoint.
    addr: String,
    /// `127.0.0.1:PORT` of /metrics.
    metrics: String,
}

fn start(extra: &str) -> Setup {
    let c = Scenario::cri().containerd();
    let cfg = config_file(&format!(
        "[reconcile]\nenabled = false\n[metrics]\nlisten = \"127.0.0.1:0\"\n[registry]\nlisten = \"127.0.0.1:0\"\n{extra}\n"
    ));
    let (p, addr, metrics) = serve(&c, None, &cfg);
    Setup {
        c,
        p,
        addr,
        metrics,
    }
}

/// imgbridge with config file `cfg` in front of `c` (listening on `at`,
/// else a socket of its own), once its endpoint answers; with the
/// endpoint's and the metrics' addresses. Port 0 for both: a port picked
/// beforehand can be taken by another process before imgbridge binds it;
/// the log says which ones it got.
fn serve(
    c: &Containerd,
    at: Option<&std::path::Path>,
    cfg: &std::path::Path,
) -> (Imgbridge, String, String) {
    let cfg = cfg.display().to_string();
    let args = ["--config", cfg.as_str()];
    let p = match at {
        Some(sock) => Imgbridge::start_at(sock, c.socket(), &args),
        None => Imgbridge::start(c.socket(), &args),
    };
    let bound = |what: &str| {
        poll(READY_TIMEOUT, || {
            let log = p.log();
            let line = log.lines().find(|l| l.contains(what))?;
            let addr = line.split("listen=").nth(1)?.split_whitespace().next()?;
            Some(addr.to_string())
        })
        .unwrap_or_else(|| panic!("imgbridge never logged {what:?}:\n{}", p.log_tail()))
    };
    let addr = bound("registry endpoint:");
    let metrics = bound("operations endpoint:");
    let up = poll(READY_TIMEOUT, || {
        (http_status(&addr, "/v2/") == Some(200)).then_some(())
    });
    assert!(
        up.is_some(),
        "registry endpoint not up on {addr}:\n{}",
        p.log_tail()
    );
    (p, addr, metrics)
}

impl Setup {
    /// The sum of the samples of metric `name` whose labels include every
    /// one of `labels` (`route="manifest"`), 0 if none.
    fn metric_with(&self, name: &str, labels: &[&str]) -> f64 {
        let text = http_get(&self.metrics, "/metrics").unwrap_or_default();
        text.lines()
            .filter(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// The value of metric `name` (a counter's `_total` line), 0 if absent.
    fn metric(&self, name: &str) -> f64 {
        let text = http_get(&self.metrics, "/metrics").unwrap_or_default();
        text.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    fn received(&self) -> f64 {
        self.metric("imgbridge_registry_blob_received_bytes_total")
    }
}

fn peer_bin(name: &str, bin: &str) -> Option<Command> {
    peer(name).map(|p| p.command(bin))
}

fn run(mut cmd: Command, what: &str) -> String {
    let out = output_with_timeout(
        {
            cmd.stdin(std::process::Stdio::null());
            cmd
        },
        TOOL_TIMEOUT,
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{text}",
        out.status
    );
    text
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[test]
fn conformance_suite_passes() {
    let Some(mut cmd) = peer_bin("conformance", "conformance") else {
        return;
    };
    let s = start("");
    let sha512 = flavor().semver >= (2, 3, 0);
    if !sha512 {
        // Refused with a reason, and nothing is stored.
        let data = b"sha512 blob";
        let d = {
            use sha2::Digest as _;
            format!("sha512:{}", hex::encode(sha2::Sha512::digest(data)))
        };
        let r = http(
            &s.addr,
            "POST",
            &format!("/v2/c/blobs/uploads/?digest={d}"),
            &[],
            data,
        );
        assert_eq!(
            (r.status, r.code().as_str()),
            (400, "DIGEST_INVALID"),
            "{}",
            r.text()
        );
        assert!(
            String::from_utf8_lossy(&r.body).contains("sha512 needs containerd 2.3"),
            "{}",
            r.text()
        );
    }
    let results = tempdir("conformance-");
    cmd.current_dir(results.path())
        .env("OCI_REGISTRY", &s.addr)
        .env("OCI_TLS", "disabled")
        .env("OCI_VERSION", "1.1")
        .env("OCI_RESULTS_DIR", results.path())
        .env("OCI_REPO1", "conformance/repo1")
        .env("OCI_REPO2", "conformance/repo2")
        .env("OCI_API_PULL", "true")
        .env("OCI_API_PUSH", "true")
        .env("OCI_API_BLOBS_UPLOAD_CANCEL", "true")
        .env("OCI_API_BLOBS_DIGEST_HEADER", "true")
        .env("OCI_API_MANIFESTS_DIGEST_HEADER", "true")
        .env("OCI_API_REFERRER", "true")
        // containerd before 2.3 hashes every ingest with sha256 only, so it
        // can store nothing under a sha512 digest (docs/registry.md).
        .env("OCI_DATA_SHA512", sha512.to_string())
        .env("OCI_LOG", "warn");
    let out = output_with_timeout(cmd, Duration::from_secs(600));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The summary block: "OCI Conformance Result: Pass", then the counts.
    let summary = text
        .split_once("OCI Conformance Result:")
        .map(|(_, r)| r.lines().take(7).collect::<Vec<_>>().join("\n"))
        .unwrap_or_default();
    let count = |what: &str| -> Option<u64> {
        summary
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{what}..")))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    };
    let failed: Vec<&str> = text.lines().filter(|l| l.contains(": FAIL")).collect();
    assert!(
        out.status.success()
            && summary.trim_start().starts_with("Pass")
            && count("FAIL") == Some(0)
            && count("Error") == Some(0)
            && count("Skip") == Some(0)
            && count("Pass").is_some_and(|n| n > 500),
        "conformance suite did not pass ({}):\n{}\nfailed:\n{}\n--- tail ---\n{}\n--- imgbridge ---\n{}",
        out.status,
        summary,
        failed.join("\n"),
        tail(&text, 60),
        s.p.log_tail()
    );
    println!("conformance: {summary}");
}

/// One HTTP/1.1 exchange on a fresh connection: status, headers
/// (lower-case names) and body. A plain socket, so a test can send what no
/// client library would (a body larger than it says, a bad range).
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The first error code of an error body.
    fn code(&self) -> String {
        let v: serde_json::Value = serde_json::from_slice(&self.body).unwrap_or_default();
        v["errors"][0]["code"].as_str().unwrap_or("").to_string()
    }

    fn text(&self) -> String {
        format!(
            "{} {:?} {}",
            self.status,
            self.headers,
            String::from_utf8_lossy(&self.body)
        )
    }
}

fn http(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let mut s = TcpStream::connect(addr).expect("connect to the registry endpoint");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: {addr}\r\n"));
    }
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-length"))
    {
        req.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    // The server may answer (and close) before reading a refused body.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP reply to {method} {path}: {raw:?}"));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Reply {
        status,
        headers,
        body: raw[split + 4..].to_vec(),
    }
}

fn sha256(data: &[u8]) -> String {
    sha256_digest(data)
}

/// Uploads `data` as one monolithic POST; returns its digest.
fn push_blob(addr: &str, repo: &str, data: &[u8]) -> String {
    let d = sha256(data);
    let r = http(
        addr,
        "POST",
        &format!("/v2/{repo}/blobs/uploads/?digest={d}"),
        &[("Content-Type", "application/octet-stream")],
        data,
    );
    assert_eq!(r.status, 201, "blob upload: {}", r.text());
    d
}

fn put_manifest(addr: &str, repo: &str, reference: &str, media_type: &str, body: &[u8]) -> Reply {
    http(
        addr,
        "PUT",
        &format!("/v2/{repo}/manifests/{reference}"),
        &[("Content-Type", media_type)],
        body,
    )
}

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

/// skopeo copies an image into the endpoint; the pod runs it at once, in
/// every round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skopeo_push_runs_at_once() {
    let s = start("");
    for n in 0..rounds() {
        let name_tag = format!("reg-skopeo:{n}");
        let img = TestImage::hello(&name_tag);
        let pushed = img.push(&s.addr);
        assert_eq!(pushed, format!("{}/reg-skopeo:{n}", s.addr));
        // No retry: the push returned, so CRI resolves the name now.
        run_hello_pod(s.c.socket(), &pushed, &name_tag).await;
    }
    // Read-your-writes came from the registry path: the record is in the
    // registry's namespace and the replica in k8s.io.
    let last = format!("{}/reg-skopeo:{}", s.addr, rounds() - 1);
    assert!(get_image(s.c.socket(), SRC, &last).await.is_some());
    let replica = get_image(s.c.socket(), K8S, &last).await.expect("replica");
    // imagePullPolicy: Always makes kubelet call PullImage: containerd
    // pulls the name from the endpoint itself (plain http on loopback, as
    // containerd treats localhost) and gets the same image.
    let before = s.metric_with(
        "imgbridge_registry_requests_total",
        &["route=\"manifest\"", "status=\"200\""],
    );
    let pulled = cri_image_client(s.c.socket())
        .await
        .pull_image(k8s_cri::v1::PullImageRequest {
            image: Some(k8s_cri::v1::ImageSpec {
                image: last.clone(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| {
            panic!(
                "CRI PullImage of {last} from the endpoint: {e}\n{}",
                s.p.log_tail()
            )
        })
        .into_inner()
        .image_ref;
    let status = cri_image_status(s.c.socket(), &last)
        .await
        .expect("pulled image");
    assert_eq!(pulled, status.id);
    assert_eq!(
        get_image(s.c.socket(), K8S, &last)
            .await
            .and_then(|i| i.target),
        replica.target,
        "the pull resolved the same manifest"
    );
    assert!(
        s.metric_with(
            "imgbridge_registry_requests_total",
            &["route=\"manifest\"", "status=\"200\""]
        ) > before,
        "containerd's pull did not come to the endpoint"
    );
}

/// A rebuilt image with one changed layer uploads only that layer (and
/// the new config): counted by the endpoint's received-bytes metric.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuild_with_one_changed_layer_uploads_only_that_layer() {
    let s = start("");
    // Three layers of 2 MiB random data each.
    let first = TestImage::build(
        "reg-delta:1",
        3,
        &["/bin/busybox", "cat", "/layer3.txt"],
        2 << 20,
    );
    let before = s.received();
    let a = first.push(&s.addr);
    let sent_first = s.received() - before;
    assert!(
        sent_first > (6 << 20) as f64,
        "first push sent {sent_first} bytes"
    );
    run_pod(s.c.socket(), &a, &[], "layer 3 of reg-delta:1")
        .await
        .cleanup()
        .await;

    // The rebuild: the same layout with its top layer replaced.
    let dir = tempdir("rebuild-");
    let layout = dir.path().join("oci");
    let mut cp = Command::new("cp");
    cp.arg("-a").arg(first.layout()).arg(&layout);
    run(cp, "cp");
    let image = format!("{}:1", layout.display());
    let mut rm = Command::new("umoci");
    rm.args([
        "config",
        "--image",
        &image,
        "--config.cmd",
        "/bin/busybox",
        "--config.cmd",
        "cat",
        "--config.cmd",
        "/changed.txt",
    ]);
    run(rm, "umoci config");
    let stage = dir.path().join("stage");
    std::fs::create_dir(&stage).unwrap();
    std::fs::write(stage.join("changed.txt"), "the changed layer\n").unwrap();
    let mut ins = Command::new("umoci");
    ins.args(["insert", "--image", &image]).arg(&stage).arg("/");
    run(ins, "umoci insert");
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
    let mdigest = index["manifests"][0]["digest"]
        .as_str()
        .unwrap()
        .to_string();
    let blob = |d: &str| {
        std::fs::read(
            layout
                .join("blobs/sha256")
                .join(d.trim_start_matches("sha256:")),
        )
        .unwrap()
    };
    let manifest: serde_json::Value = serde_json::from_slice(&blob(&mdigest)).unwrap();
    let layers = manifest["layers"].as_array().unwrap();
    let new_layer = layers.last().unwrap()["size"].as_u64().unwrap();
    let config = manifest["config"]["size"].as_u64().unwrap();

    let before = s.received();
    let dest = format!("{}/reg-delta:2", s.addr);
    let mut copy = Command::new("skopeo");
    copy.args(["copy", "--quiet", "--dest-tls-verify=false"])
        .arg(format!("oci:{}:1", layout.display()))
        .arg(format!("docker://{dest}"));
    run(copy, "skopeo copy of the rebuild");
    let sent = s.received() - before;
    assert_eq!(
        sent,
        (new_layer + config) as f64,
        "the rebuild should upload its new layer ({new_layer} bytes) and config ({config} bytes) only; the first push sent {sent_first}"
    );
    run_pod(s.c.socket(), &dest, &[], "the changed layer")
        .await
        .cleanup()
        .await;
}

/// crane pushes a tarball and copies it to another repository (a
/// cross-repository mount: no byte moves); both run at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crane_push_and_copy_run_at_once() {
    let Some(_) = peer("crane") else { return };
    let s = start("");
    for n in 0..rounds() {
        let name_tag = format!("reg-crane:{n}");
        let img = TestImage::hello(&name_tag);
        let pushed = format!("{}/reg-crane:{n}", s.addr);
        let mut push = peer_bin("crane", "crane").unwrap();
        push.args(["push", "--insecure"])
            .arg(img.docker_archive())
            .arg(&pushed);
        run(push, "crane push");
        run_hello_pod(s.c.socket(), &pushed, &name_tag).await;

        let copied = format!("{}/reg-crane-copy/x:{n}", s.addr);
        let before = s.received();
        let mut copy = peer_bin("crane", "crane").unwrap();
        copy.args(["copy", "--insecure", &pushed, &copied]);
        run(copy, "crane copy");
        assert_eq!(
            s.received() - before,
            0.0,
            "a copy inside the endpoint mounts, never uploads"
        );
        run_hello_pod(s.c.socket(), &copied, &name_tag).await;
    }
}

/// `ko build` of a Go main package into the endpoint, its base image pushed
/// there first so ko reaches no other registry: the moment ko returns, CRI
/// resolves the tag ko pushed, at the manifest ko reports (asked once, no
/// retry: the read-your-writes claim), and a pod runs it with no pull.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ko_build_runs_at_once() {
    let Some(_) = peer("ko") else { return };
    let Some(go) = go_command() else { return };
    let s = start("");
    let base = TestImage::build("ko-base:1", 0, &[], 0).push(&s.addr);

    // A main package with no dependencies whose output names this run.
    let work = tempdir("ko-");
    let app = work.path().join("app");
    std::fs::create_dir(&app).unwrap();
    let line = unique_name("built-by-ko");
    std::fs::write(
        app.join("go.mod"),
        "module imgbridge.test/koapp\n\ngo 1.21\n",
    )
    .unwrap();
    std::fs::write(
        app.join("main.go"),
        format!(
            "package main\n\nimport (\n\t\"fmt\"\n\t\"time\"\n)\n\nfunc main() {{\n\tfmt.Println({line:?})\n\ttime.Sleep(time.Hour)\n}}\n"
        ),
    )
    .unwrap();

    // The caller's Go build cache (a cold one would rebuild the standard
    // library), everything else private: HOME (no docker credentials nor
    // go env file of the machine's), GOPATH, GOFLAGS (none of the caller's;
    // -mod=mod: the package has no go.sum and needs none), and no module
    // proxy nor toolchain download, so nothing leaves the machine.
    let mut env = Command::new(&go);
    env.args(["env", "GOCACHE"]);
    let gocache = run(env, "go env GOCACHE").trim().to_string();
    let mut path = go.parent().unwrap().as_os_str().to_owned();
    path.push(":");
    path.push(flavor().path_env());
    let tag = unique_name("t");
    let mut ko = peer_bin("ko", "ko").unwrap();
    ko.current_dir(&app)
        .args(["build", "--bare", "-t", &tag, "--sbom=none"])
        .arg(format!("--platform=linux/{}", host_arch()))
        .arg(".")
        .env("PATH", path)
        .env("HOME", work.path().join("home"))
        .env("GOPATH", work.path().join("gopath"))
        .env("GOCACHE", gocache)
        .env("GOFLAGS", "-mod=mod")
        .env("GOPROXY", "off")
        .env("GOTOOLCHAIN", "local")
        .env("GOWORK", "off")
        .env("KO_DOCKER_REPO", format!("{}/koapp", s.addr))
        .env("KO_DEFAULTBASEIMAGE", &base)
        .env_remove("DOCKER_CONFIG")
        .env_remove("KOCACHE")
        .stdin(std::process::Stdio::null());
    let out = output_with_timeout(ko, TOOL_TIMEOUT);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "ko build failed ({}):\n{stderr}",
        out.status
    );
    // ko prints what it published, by digest: <repo>[:<tag>]@<digest>.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let digest = stdout
        .lines()
        .last()
        .and_then(|l| l.trim().split_once('@'))
        .map(|(_, d)| d.to_string())
        .unwrap_or_else(|| panic!("ko printed no digest: {stdout:?}\n{stderr}"));

    // No retry: ko has returned, so CRI resolves the tag now.
    let name = format!("{}/koapp:{tag}", s.addr);
    assert!(
        cri_image_status(s.c.socket(), &name).await.is_some(),
        "CRI does not resolve {name} when ko build returns:\n{stderr}\n{}",
        s.p.log_tail()
    );
    assert_eq!(
        image_target(s.c.socket(), K8S, &name).await.digest,
        digest,
        "the replica in {K8S} is not the manifest ko pushed"
    );
    run_pod(s.c.socket(), &name, &[], &line)
        .await
        .cleanup()
        .await;
}

/// A delete through the endpoint applies `delete_policy` to the replicas
/// before the reply, as an `Images.Delete` through the proxy does (events
/// are off here, so nothing else could): with `delete`, CRI no longer
/// resolves a deleted tag when the client returns, and a tag of the same
/// manifest that was not deleted keeps its replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_applies_delete_policy_to_replicas() {
    let Some(_) = peer("crane") else { return };
    let s = start("[replication]\npin = true\ndelete_policy = \"delete\"");
    let img = TestImage::hello("reg-del:a");
    let a = format!("{}/reg-del:a", s.addr);
    let b = format!("{}/reg-del:b", s.addr);
    let mut push = peer_bin("crane", "crane").unwrap();
    push.args(["push", "--insecure"])
        .arg(img.docker_archive())
        .arg(&a);
    run(push, "crane push");
    let mut tag = peer_bin("crane", "crane").unwrap();
    tag.args(["tag", "--insecure", &a, "b"]);
    run(tag, "crane tag");
    for n in [&a, &b] {
        assert!(
            cri_image_status(s.c.socket(), n).await.is_some(),
            "{n} not resolved after its push"
        );
    }

    // By tag: that tag's replica goes, the other stays.
    let r = http(&s.addr, "DELETE", "/v2/reg-del/manifests/a", &[], b"");
    assert_eq!(r.status, 202, "{}", r.text());
    assert!(
        get_image(s.c.socket(), K8S, &a).await.is_none(),
        "the replica of a deleted tag is still in {K8S}"
    );
    assert!(
        cri_image_status(s.c.socket(), &a).await.is_none(),
        "CRI still resolves a deleted tag"
    );
    assert!(
        cri_image_status(s.c.socket(), &b).await.is_some(),
        "deleting tag a took tag b's replica"
    );

    // By digest (what `crane delete` sends): every tag of that manifest.
    let mut del = peer_bin("crane", "crane").unwrap();
    del.args(["delete", "--insecure", &b]);
    run(del, "crane delete");
    assert!(
        get_image(s.c.socket(), SRC, &b).await.is_none(),
        "the record is still there"
    );
    assert!(
        cri_image_status(s.c.socket(), &b).await.is_none(),
        "CRI still resolves a deleted manifest's tag"
    );
    let left = imgbridge::containerd::Containerd::new(s.c.socket())
        .list_images(K8S, vec!["name~=\"reg-del\"".into()])
        .await
        .unwrap();
    assert!(
        left.is_empty(),
        "replicas left after the delete: {:?}",
        left.iter().map(|i| &i.name).collect::<Vec<_>>()
    );
}

/// buildctl builds and pushes (`push=true`) into the endpoint; buildkit
/// works in a namespace imgbridge does not replicate, so the pod runs
/// through the registry path alone. Blobs buildkit's containerd already
/// holds are linked, not uploaded: no push sends a byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buildctl_push_runs_at_once() {
    if peer("buildkit").is_none() {
        return;
    }
    let s = start("");
    let Some(bk) = Buildkitd::start(s.p.socket(), "bk-worker", Some(&s.addr)) else {
        return;
    };
    let busybox = std::fs::read("/bin/busybox").expect("static busybox");
    for n in 0..rounds() {
        let name = format!("{}/reg-bk/app:{n}", s.addr);
        let text = format!("built-and-pushed-{n}");
        bk.build(
            &format!("FROM scratch\nCOPY --chmod=755 busybox /bin/busybox\nCMD [\"/bin/busybox\", \"echo\", \"{text}\"]\n"),
            &[("busybox", &busybox)],
            &format!("type=image,name={name},push=true,registry.insecure=true"),
            &[],
        );
        run_pod(s.c.socket(), &name, &[], &text)
            .await
            .cleanup()
            .await;
        assert!(
            get_image(s.c.socket(), SRC, &name).await.is_some(),
            "the pushed record is in the registry's namespace"
        );
    }
    // buildkit's exporter wrote every blob (busybox's layer, the config)
    // into containerd, in its worker namespace, before pushing: the
    // endpoint answered each HEAD by linking the blob, so no push uploaded
    // a byte.
    assert_eq!(
        s.received(),
        0.0,
        "blobs were uploaded although containerd held them (busybox alone is {} bytes)",
        busybox.len()
    );
}

/// `helm push` of a real chart (`helm create`, `helm package`): stored,
/// listed, pulled back byte for byte by `helm pull`, and never given to
/// CRI: no replica, no ImageStatus.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_chart_is_stored_and_listed_never_given_to_cri() {
    if peer("helm").is_none() {
        return;
    }
    let s = start("");
    let work = tempdir("helm-");
    let helm = |args: &[&str]| {
        let mut c = peer_bin("helm", "helm").unwrap();
        let home = work.path().join("home");
        c.current_dir(work.path())
            .args(args)
            .env("HOME", &home)
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_DATA_HOME", home.join("data"));
        run(c, &format!("helm {args:?}"))
    };
    helm(&["create", "demo"]);
    helm(&["package", "demo", "--version", "0.1.0"]);
    let oci = format!("oci://{}/charts", s.addr);
    helm(&["push", "demo-0.1.0.tgz", &oci, "--plain-http"]);

    let repo = "charts/demo";
    let tags = http(&s.addr, "GET", &format!("/v2/{repo}/tags/list"), &[], b"");
    assert_eq!(tags.status, 200);
    let tags: serde_json::Value = serde_json::from_slice(&tags.body).unwrap();
    assert_eq!(tags["tags"], serde_json::json!(["0.1.0"]));
    let chart = format!("{oci}/demo");
    let shown = helm(&[
        "show",
        "chart",
        &chart,
        "--version",
        "0.1.0",
        "--plain-http",
    ]);
    assert!(shown.contains("name: demo"), "helm show chart:\n{shown}");
    let out = work.path().join("out");
    std::fs::create_dir(&out).unwrap();
    helm(&[
        "pull",
        &chart,
        "--version",
        "0.1.0",
        "--plain-http",
        "-d",
        out.to_str().unwrap(),
    ]);
    assert_eq!(
        std::fs::read(out.join("demo-0.1.0.tgz")).unwrap(),
        std::fs::read(work.path().join("demo-0.1.0.tgz")).unwrap(),
        "helm pull gave back other bytes than were pushed"
    );
    let name = format!("{}/{repo}:0.1.0", s.addr);
    assert_stored_never_given_to_cri(s.c.socket(), &name).await;
}

/// An artefact's record is in the registry's namespace, marked so the
/// replicator skips it, and neither a replica nor CRI knows the name.
async fn assert_stored_never_given_to_cri(sock: &std::path::Path, name: &str) {
    let record = get_image(sock, SRC, name)
        .await
        .unwrap_or_else(|| panic!("no record of {name} in the registry namespace"));
    assert_eq!(
        record
            .labels
            .get("io.imgbridge.replicate")
            .map(String::as_str),
        Some("false"),
        "{name} is not marked to be skipped"
    );
    assert!(
        get_image(sock, K8S, name).await.is_none(),
        "the artefact {name} was replicated"
    );
    assert!(cri_image_status(sock, name).await.is_none());
}

/// oras pushes a non-image artefact and attaches a referrer to it: both
/// stored, listed, pulled and discovered through the referrers API, and
/// never given to CRI.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oras_artefact_and_referrer_never_given_to_cri() {
    if peer("oras").is_none() {
        return;
    }
    let s = start("");
    let work = tempdir("oras-");
    let oras = |args: &[&str]| {
        let mut c = peer_bin("oras", "oras").unwrap();
        c.current_dir(work.path())
            .args(args)
            .env("HOME", work.path());
        run(c, &format!("oras {args:?}"))
    };
    std::fs::write(work.path().join("notes.txt"), "release notes\n").unwrap();
    std::fs::write(work.path().join("sig.txt"), "a signature\n").unwrap();
    let target = format!("{}/art/notes:1", s.addr);
    oras(&[
        "push",
        "--plain-http",
        &target,
        "--artifact-type",
        "application/vnd.imgbridge.test.notes",
        "notes.txt:text/plain",
    ]);
    let tags = oras(&[
        "repo",
        "tags",
        "--plain-http",
        &format!("{}/art/notes", s.addr),
    ]);
    assert_eq!(tags.trim(), "1", "{tags}");
    oras(&["pull", "--plain-http", &target, "-o", "out"]);
    assert_eq!(
        std::fs::read_to_string(work.path().join("out/notes.txt")).unwrap(),
        "release notes\n"
    );
    oras(&[
        "attach",
        "--plain-http",
        &target,
        "--artifact-type",
        "application/vnd.imgbridge.test.sig",
        "sig.txt:text/plain",
    ]);
    let found = oras(&["discover", "--plain-http", "--format", "json", &target]);
    assert!(
        found.contains("application/vnd.imgbridge.test.sig"),
        "the referrers API did not list the attached artefact:\n{found}"
    );
    assert_stored_never_given_to_cri(s.c.socket(), &target).await;
    let c = imgbridge::containerd::Containerd::new(s.c.socket());
    let in_k8s = c
        .list_images(K8S, vec!["name~=\"/art/\"".into()])
        .await
        .unwrap();
    assert!(in_k8s.is_empty(), "artefacts replicated: {in_k8s:?}");
}

/// Hostile and broken input: clear OCI error codes, and nothing
/// half-written left in containerd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_input_gets_oci_errors_and_leaves_nothing() {
    let s = start("");
    let a = &s.addr;
    // Names.
    for bad in [
        "/v2/../etc/manifests/x",
        "/v2/App/manifests/x",
        "/v2/a/../b/tags/list",
    ] {
        let r = http(a, "GET", bad, &[], b"");
        assert_eq!(
            (r.status, r.code().as_str()),
            (400, "NAME_INVALID"),
            "{bad}: {}",
            r.text()
        );
    }
    // A manifest over 4 MiB, declared and undeclared (chunked).
    let big = vec![b' '; (4 << 20) + 1];
    let r = put_manifest(a, "hostile", "big", OCI_MANIFEST, &big);
    assert_eq!(
        (r.status, r.code().as_str()),
        (413, "MANIFEST_INVALID"),
        "{}",
        r.text()
    );
    // Digest mismatch: the commit is refused, nothing is stored.
    let data = b"some bytes";
    let wrong = sha256(b"other bytes");
    let r = http(
        a,
        "POST",
        &format!("/v2/hostile/blobs/uploads/?digest={wrong}"),
        &[],
        data,
    );
    assert_eq!(
        (r.status, r.code().as_str()),
        (400, "DIGEST_INVALID"),
        "{}",
        r.text()
    );
    assert!(content_info(s.c.socket(), SRC, &wrong).await.is_none());
    assert!(content_info(s.c.socket(), SRC, &sha256(data))
        .await
        .is_none());
    // Chunks: out of order is 416, the upload stays usable.
    let r = http(a, "POST", "/v2/hostile/blobs/uploads/", &[], b"");
    assert_eq!(r.status, 202, "{}", r.text());
    let loc = r.header("location").unwrap().to_string();
    let r = http(a, "PATCH", &loc, &[("Content-Range", "0-4")], b"01234");
    assert_eq!(r.status, 202, "{}", r.text());
    let r = http(a, "PATCH", &loc, &[("Content-Range", "10-14")], b"abcde");
    assert_eq!(r.status, 416, "{}", r.text());
    assert_eq!(r.header("range"), Some("0-4"));
    let r = http(a, "PATCH", &loc, &[("Content-Range", "5-9")], b"56789");
    assert_eq!(
        (r.status, r.header("range")),
        (202, Some("0-9")),
        "{}",
        r.text()
    );
    let d = sha256(b"0123456789");
    let r = http(a, "PUT", &format!("{loc}?digest={d}"), &[], b"");
    assert_eq!(r.status, 201, "{}", r.text());
    // A manifest naming a blob that was never pushed.
    let missing = sha256(b"never pushed");
    let m = serde_json::json!({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": d, "size": 10},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": missing, "size": 12}]
    })
    .to_string();
    let r = put_manifest(a, "hostile", "v1", OCI_MANIFEST, m.as_bytes());
    assert_eq!(
        (r.status, r.code().as_str()),
        (400, "MANIFEST_BLOB_UNKNOWN"),
        "{}",
        r.text()
    );
    assert!(get_image(s.c.socket(), SRC, &format!("{a}/hostile:v1"))
        .await
        .is_none());
    let r = http(a, "GET", "/v2/hostile/manifests/v1", &[], b"");
    assert_eq!((r.status, r.code().as_str()), (404, "MANIFEST_UNKNOWN"));
    // A push addressed to another host would name its image there: refused.
    let config = push_blob(a, "hostile", b"{}");
    let m = serde_json::json!({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config, "size": 2},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": 10}]
    })
    .to_string();
    let r = http(
        a,
        "PUT",
        "/v2/library/app/manifests/latest",
        &[
            ("Host", "registry.example.invalid"),
            ("Content-Type", OCI_MANIFEST),
        ],
        m.as_bytes(),
    );
    assert_eq!(
        (r.status, r.code().as_str()),
        (403, "DENIED"),
        "{}",
        r.text()
    );
    let c = imgbridge::containerd::Containerd::new(s.c.socket());
    let spoofed = c
        .list_images(SRC, vec!["name~=\"example.invalid\"".into()])
        .await
        .unwrap();
    assert!(spoofed.is_empty(), "{spoofed:?}");
    // A truncated upload (the client goes away mid-body) is aborted.
    {
        let mut c = TcpStream::connect(a).unwrap();
        write!(c, "POST /v2/hostile/blobs/uploads/?digest={} HTTP/1.1\r\nHost: {a}\r\nContent-Length: 100000\r\n\r\n", sha256(b"x")).unwrap();
        c.write_all(&[b'x'; 5000]).unwrap();
    }
    let ingests = || {
        let statuses = block_on(c.content().list_statuses(imgbridge::containerd::request(
            SRC,
            None,
            containerd_client::services::v1::ListStatusesRequest::default(),
        )));
        statuses.ok().map(|s| s.into_inner().statuses.len())
    };
    // Nothing half-written: no ingest left open in the namespace.
    let left = poll(Duration::from_secs(10), || (ingests()? == 0).then_some(()));
    assert!(left.is_some(), "ingests left in {SRC}:\n{}", s.p.log_tail());
    // So too when containerd already has some of the bytes: the ingest,
    // open while the body streams, is aborted when the client goes away.
    {
        let mut c = TcpStream::connect(a).unwrap();
        write!(c, "POST /v2/hostile/blobs/uploads/?digest={} HTTP/1.1\r\nHost: {a}\r\nContent-Length: {}\r\n\r\n", sha256(b"y"), 8 << 20).unwrap();
        c.write_all(&vec![b'y'; 3 << 20]).unwrap();
        let open = poll(Duration::from_secs(10), || (ingests()? > 0).then_some(()));
        assert!(
            open.is_some(),
            "no ingest while the body streams:\n{}",
            s.p.log_tail()
        );
    }
    let left = poll(Duration::from_secs(10), || (ingests()? == 0).then_some(()));
    assert!(
        left.is_some(),
        "ingests left in {SRC} after a client went away mid-body:\n{}",
        s.p.log_tail()
    );
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
}

/// A thousand idle upload sessions: bounded (429 past the limit), and
/// once they expire their ingests are aborted and their leases released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_upload_sessions_are_bounded_and_expire() {
    // Thousands, as a client that never finishes its uploads would leave.
    const MAX: usize = 2000;
    // The expiry outlasts opening them all (1000 took a few seconds quiet,
    // 47 s on a machine at load 8) so none expires before the limit is
    // checked.
    const EXPIRY: Duration = Duration::from_secs(90);
    let s = start(&format!(
        "max_uploads = {MAX}\nupload_expiry = \"{}s\"",
        EXPIRY.as_secs()
    ));
    let opened = std::time::Instant::now();
    let c = imgbridge::containerd::Containerd::new(s.c.socket());
    let leases = || {
        block_on(c.leases().list(imgbridge::containerd::request(
            SRC,
            None,
            containerd_client::services::v1::ListRequest::default(),
        )))
        .map(|r| r.into_inner().leases.len())
        .unwrap_or(usize::MAX)
    };
    let baseline = leases();
    for i in 0..MAX {
        let r = http(&s.addr, "POST", "/v2/idle/blobs/uploads/", &[], b"");
        assert_eq!(r.status, 202, "session {i}: {}", r.text());
        if i % 20 == 0 {
            // Some with bytes in containerd: an open ingest each.
            let loc = r.header("location").unwrap().to_string();
            let r = http(&s.addr, "PATCH", &loc, &[], format!("chunk {i}").as_bytes());
            assert_eq!(r.status, 202, "{}", r.text());
        }
    }
    let r = http(&s.addr, "POST", "/v2/idle/blobs/uploads/", &[], b"");
    assert!(
        opened.elapsed() < EXPIRY,
        "opening {MAX} sessions took {:?}: longer than their expiry",
        opened.elapsed()
    );
    assert_eq!(
        (r.status, r.code().as_str()),
        (429, "TOOMANYREQUESTS"),
        "{}",
        r.text()
    );
    assert!(leases() >= baseline + MAX);
    let released = poll(EXPIRY + Duration::from_secs(60), || {
        let statuses = block_on(c.content().list_statuses(imgbridge::containerd::request(
            SRC,
            None,
            containerd_client::services::v1::ListStatusesRequest::default(),
        )))
        .ok()?
        .into_inner()
        .statuses;
        (statuses.is_empty() && leases() <= baseline).then_some(())
    });
    assert!(
        released.is_some(),
        "after expiry: {} leases (baseline {baseline}):\n{}",
        leases(),
        s.p.log_tail()
    );
    // And the endpoint takes uploads again.
    let r = http(&s.addr, "POST", "/v2/idle/blobs/uploads/", &[], b"");
    assert_eq!(r.status, 202, "{}", r.text());
}

/// imgbridge SIGKILLed in the middle of a 200 MiB push leaves its
/// upload's lease and half-written ingest in containerd (they would hold
/// the bytes until the lease expires, two hours later). The next
/// imgbridge on that socket releases them within seconds, and the
/// client's retry of the push succeeds and runs at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_push_leaves_nothing_behind() {
    const LAYER: usize = 200 << 20;
    let c = Scenario::cri().containerd();
    let cfg = config_file(
        "[reconcile]\nenabled = false\n[metrics]\nlisten = \"127.0.0.1:0\"\n[registry]\nlisten = \"127.0.0.1:0\"\n",
    );
    let (mut p, addr, _) = serve(&c, None, &cfg);
    let sock = p.socket().to_path_buf();
    let img = TestImage::build(
        "reg-killed:1",
        1,
        &["/bin/busybox", "cat", "/layer1.txt"],
        LAYER,
    );
    let layer = {
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(img.layout().join("index.json")).unwrap())
                .unwrap();
        let blob = |d: &str| {
            std::fs::read(
                img.layout()
                    .join("blobs/sha256")
                    .join(d.trim_start_matches("sha256:")),
            )
            .unwrap()
        };
        let m: serde_json::Value =
            serde_json::from_slice(&blob(index["manifests"][0]["digest"].as_str().unwrap()))
                .unwrap();
        let layers = m["layers"].as_array().unwrap();
        blob(layers.last().unwrap()["digest"].as_str().unwrap())
    };
    assert!(layer.len() >= LAYER, "layer of {} bytes", layer.len());

    // The push: a session, then one PATCH of the whole layer whose second
    // half never comes.
    let r = http(&addr, "POST", "/v2/reg-killed/blobs/uploads/", &[], b"");
    assert_eq!(r.status, 202, "{}", r.text());
    let loc = r.header("location").unwrap().to_string();
    let mut conn = TcpStream::connect(&addr).unwrap();
    write!(
        conn,
        "PATCH {loc} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\n\r\n",
        layer.len()
    )
    .unwrap();
    let half = layer.len() / 2;
    conn.write_all(&layer[..half]).unwrap();
    let written = poll(READY_TIMEOUT, || {
        let st = block_on(async {
            content_client(c.socket())
                .await
                .list_statuses(with_ns(
                    containerd_client::services::v1::ListStatusesRequest::default(),
                    SRC,
                ))
                .await
                .unwrap()
                .into_inner()
                .statuses
        });
        st.iter()
            .any(|s| s.offset as usize >= half - (2 << 20))
            .then_some(())
    });
    assert!(
        written.is_some(),
        "the first half never reached containerd:\n{}",
        p.log_tail()
    );

    p.kill9();
    drop(conn);
    let (leases, ingests) = leases_and_ingests(c.socket()).await;
    let dead: Vec<String> = leases.iter().filter_map(|(_, _, o)| o.clone()).collect();
    assert!(
        !dead.is_empty() && !ingests.is_empty(),
        "nothing left to clean up after the kill (leases {leases:?}, ingests {ingests:?})"
    );

    let restarted = std::time::Instant::now();
    let (_p2, addr2, _) = serve(&c, Some(&sock), &cfg);
    let clean = poll(Duration::from_secs(10), || {
        let (leases, ingests) = block_on(leases_and_ingests(c.socket()));
        let left: Vec<_> = leases
            .iter()
            .filter(|(_, _, o)| o.as_ref().is_some_and(|o| dead.contains(o)))
            .collect();
        (left.is_empty() && ingests.is_empty()).then_some(())
    });
    let (leases, ingests) = leases_and_ingests(c.socket()).await;
    assert!(
        clean.is_some(),
        "10 s after the restart, the killed imgbridge's leases ({dead:?}) or ingests remain: leases {leases:?}, ingests {ingests:?}"
    );
    eprintln!(
        "leftovers released {:?} after the restart",
        restarted.elapsed()
    );

    // The client's retry: the whole push again, and the pod at once.
    let dest = img.push(&addr2);
    run_pod(c.socket(), &dest, &[], "layer 1 of reg-killed:1")
        .await
        .cleanup()
        .await;
}
