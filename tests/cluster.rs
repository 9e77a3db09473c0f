//! The chart as a cluster operator runs it: a real one-node control plane
//! (etcd, kube-apiserver, kube-controller-manager, kube-scheduler; see
//! `imgbridge_test_support::cluster`), the real kubelet registered as its
//! Node, and `helm install` of `charts/imgbridge` with the project's image
//! imported into `k8s.io` as docs/install.md says. The DaemonSet
//! controller makes the pod; `helm test` runs doctor on the node.
//!
//! Then the developer's loop as Tilt or Skaffold drive it: buildkitd builds
//! through the pod's socket and a Deployment is pointed at the fresh tag,
//! ten rounds, each rolling out with no pull (`IfNotPresent`, `Never`, and
//! with `imagePullSecrets` under KEP-2535's credential verification).
//! `helm uninstall` leaves the node's containerd and the running pods as
//! they were.

use std::time::{Duration, Instant};

use imgbridge_test_support::chart::{
    install, install_args, pull_events, App, ChartNode, Helm, OneNode, CHART, DS_PODS, NS, RELEASE,
};
use imgbridge_test_support::cluster::{ControlPlane, CLUSTER_TIMEOUT};
use imgbridge_test_support::peers::{peer, Buildkitd};
use imgbridge_test_support::prelude::*;
use imgbridge_test_support::project::project_image;
use serde_json::Value;

/// The dev loop's Deployment (namespace `default`).
const APP: &str = "dev-app";

/// `helm install`, `helm test`, ten rounds of build → Deployment, then
/// `helm uninstall` with the workload untouched.
#[test]
fn helm_install_serves_a_dev_loop_of_deployments_and_uninstalls_cleanly() {
    let Some(cl) = OneNode::start() else { return };
    let Some(helm) = Helm::new(&cl.cp) else {
        return;
    };
    let (c, cp, k) = (&cl.c, &cl.cp, &cl.k);
    let image = project_image("");
    ctr_import(c.socket(), "k8s.io", &image.archive);
    let node = ChartNode::new();
    let app = App::new(APP);

    let started = Instant::now();
    install(&helm, &cl, &node, &image);
    let pod = one_pod(cp, NS, DS_PODS);
    assert_eq!(pod["spec"]["nodeName"], "imgbridge-node");
    let pulls = pull_events(cp, NS, pod["metadata"]["name"].as_str().unwrap_or_default());
    assert!(
        pulls.is_empty(),
        "the chart's pod pulled its image: {pulls:?}"
    );
    eprintln!(
        "helm install → DaemonSet pod Ready in {:?}",
        started.elapsed()
    );

    // (Its log from kubelet's files: the API server cannot reach this
    // kubelet, which serves on loopback only.)
    let test = helm.ok(&["test", RELEASE, "-n", NS, "--timeout", "2m"], cp);
    assert!(
        test.contains("Phase:          Succeeded"),
        "helm test:\n{test}"
    );
    let doctor = cp
        .get(&["-n", NS, "get", "pod", &format!("{RELEASE}-doctor")])
        .expect("the doctor pod");
    let report = k.log_of(&doctor, "doctor");
    // The node's containerd config, mounted by the chart (CRI's sandbox
    // image on 2.x is read from it), not another file or none.
    let config_line = format!("containerd config: {} has", c.config_path().display());
    assert!(
        report.contains(&config_line),
        "doctor did not read this containerd's config ({config_line}):\n{report}"
    );

    // The dev loop: each round a new tag, built through the pod's socket.
    let reg = Registry::start();
    let Some(bk) = Buildkitd::start(&node.socket(), "buildkit", Some(&reg.addr())) else {
        return;
    };
    cp.kubectl_ok(&[
        "create",
        "secret",
        "docker-registry",
        "regcred",
        "--docker-server=registry.invalid",
        "--docker-username=dev",
        "--docker-password=secret",
    ]);
    let mut took = Vec::new();
    let mut last = None;
    for round in 1..=10 {
        let content = unique_name(&format!("round-{round}"));
        let image = app.build(&bk, &round.to_string(), &content);
        let built = Instant::now();
        // IfNotPresent (a tag's default), Never, and with a pull secret.
        let (policy, secret) = match round % 3 {
            1 => ("IfNotPresent", false),
            2 => ("Never", false),
            _ => ("IfNotPresent", true),
        };
        cp.apply(&app.manifest(&image, "/v", policy, secret));
        let p = app.wait_running(cp, k, &image, &content);
        took.push(built.elapsed());
        let pulls = pull_events(
            cp,
            "default",
            p["metadata"]["name"].as_str().unwrap_or_default(),
        );
        assert!(
            pulls.is_empty(),
            "round {round} ({policy}, secret: {secret}): {pulls:?}"
        );
        // The rollout ends with the old pod gone (1 s grace).
        app.wait_rolled_out(cp);
        last = Some(p);
    }
    took.sort();
    eprintln!(
        "dev loop: build done → Deployment pod running, 10 rounds: p50 {:?}, max {:?}",
        took[took.len() / 2],
        took[took.len() - 1]
    );

    // helm uninstall: the DaemonSet's pod goes; the app keeps running, the
    // node's containerd keeps answering and keeps the images.
    let last = last.expect("a round ran");
    let app_id = container_id(&last);
    helm.ok(
        &["uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "2m"],
        cp,
    );
    poll(CLUSTER_TIMEOUT, || {
        cp.pods(NS, DS_PODS)?.is_empty().then_some(())
    })
    .expect("the DaemonSet's pod is gone after helm uninstall");
    let now = one_pod(cp, "default", &format!("app={APP}"));
    assert_eq!(
        (
            container_id(&now),
            now["status"]["containerStatuses"][0]["restartCount"].as_u64()
        ),
        (app_id, Some(0)),
        "the app's container changed across helm uninstall"
    );
    assert!(
        c.ctr("default", ["version"]).status.success(),
        "containerd stopped answering"
    );
    let images = c.ctr("k8s.io", ["images", "ls", "-q"]);
    let images = String::from_utf8_lossy(&images.stdout);
    let kept = last["status"]["containerStatuses"][0]["image"]
        .as_str()
        .unwrap_or_default();
    assert!(
        images.lines().any(|l| l == kept),
        "{kept} left k8s.io with helm uninstall:\n{images}"
    );
    assert!(!node.socket().exists(), "the pod left its socket behind");
    drop(bk);
}

/// The one pod matching `selector` in `ns`.
fn one_pod(cp: &ControlPlane, ns: &str, selector: &str) -> Value {
    let items = cp.pods(ns, selector).expect("list pods");
    assert_eq!(items.len(), 1, "pods of {selector}: {items:?}");
    items.into_iter().next().unwrap()
}

fn container_id(pod: &Value) -> String {
    pod["status"]["containerStatuses"][0]["containerID"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// `helm upgrade` to a new image under a client loop on the node's socket
/// (a plain connect and a `ctr version` every 50 ms):
/// the surge pod takes the socket over from the old one (bound beside it,
/// renamed over it), which keeps its connections and drains. No call of the
/// loop fails, and a build whose write is in flight across the handover
/// completes through the old pod, its image in `k8s.io` when it returns.
#[test]
fn helm_upgrade_hands_the_socket_over_with_no_gap() {
    use std::os::unix::fs::MetadataExt;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    let Some(cl) = OneNode::start() else { return };
    let Some(helm) = Helm::new(&cl.cp) else {
        return;
    };
    let (c, cp, k) = (&cl.c, &cl.cp, &cl.k);
    let (v1, v2) = (project_image(""), project_image("-next"));
    for img in [&v1, &v2] {
        ctr_import(c.socket(), "k8s.io", &img.archive);
    }
    let node = ChartNode::new();
    let app = App::new(APP);
    install(&helm, &cl, &node, &v1);
    let old = one_pod(cp, NS, DS_PODS);

    let reg = Registry::start();
    let Some(bk) = Buildkitd::start(&node.socket(), "buildkit", Some(&reg.addr())) else {
        return;
    };
    // FROM a base in the registry with only a LABEL: buildkit names the
    // image, then writes the base's layers it never fetched (the second is
    // 96 MiB). It is frozen in the middle of that write.
    let base = TestImage::build("up-base:1", 1, &[], 96 << 20);
    let base_ref = base.push(&reg.addr());
    let name = format!("docker.io/library/{APP}:upgrade");
    let sock = node.socket();
    let inode = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.ino()).ok();
    let stop = AtomicBool::new(false);
    let oks = AtomicU32::new(0);
    let (failed, longest) = std::thread::scope(|s| {
        // However the scope ends (a panic too), the client loop stops, or
        // the scope would wait for it forever.
        let _stop = StopOnDrop(&stop);
        // Clients on the node's socket, new connections every 50 ms.
        let client = s.spawn(|| {
            let (mut failed, mut longest, mut last) = (Vec::new(), Duration::ZERO, Instant::now());
            while !stop.load(Ordering::Relaxed) {
                // A client that does not redial: one connect, refused or not
                // (ctr's own dial waits for a socket to come back).
                if let Err(e) = std::os::unix::net::UnixStream::connect(&sock) {
                    failed.push(format!("connect: {e}"));
                }
                let out = imgbridge_test_support::ctr::ctr(&sock, "default", ["version"]);
                if out.status.success() {
                    oks.fetch_add(1, Ordering::Relaxed);
                    longest = longest.max(last.elapsed());
                    last = Instant::now();
                } else {
                    failed.push(String::from_utf8_lossy(&out.stderr).into_owned());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            (failed, longest)
        });
        let build = s.spawn(|| {
            bk.build_on(&base_ref, &name);
            Instant::now()
        });
        bk.freeze_mid_write(c, "buildkit", &name);
        let before = inode(&sock);
        let upgrade = Instant::now();
        let tag = format!("image.tag={}", v2.tag);
        helm.ok(
            &[
                "upgrade",
                RELEASE,
                CHART,
                "-n",
                NS,
                "--reuse-values",
                "--set-string",
                &tag,
            ],
            cp,
        );
        // The surge pod's socket replaces the old one's: then the frozen
        // write goes on, through the old pod that holds its connection.
        let handed_over = poll(CLUSTER_TIMEOUT, || {
            let now = inode(&sock);
            (now.is_some() && now != before).then(|| upgrade.elapsed())
        });
        bk.thaw();
        let handed_over = handed_over.unwrap_or_else(|| {
            panic!(
                "no pod took the socket over:\n{}",
                cp.kubectl_ok(&["-n", NS, "get", "pods,events", "-o", "wide"])
            )
        });
        let built = build.join().expect("the build in flight at the upgrade");
        // The rollout ends: one pod, the new image, Ready.
        let new = poll(CLUSTER_TIMEOUT, || {
            let items = cp.pods(NS, DS_PODS)?;
            let p = items.first()?;
            let ready = p["status"]["containerStatuses"][0]["ready"] == true;
            (items.len() == 1
                && ready
                && p["spec"]["containers"][0]["image"] == format!("imgbridge:{}", v2.tag))
            .then(|| p.clone())
        })
        .unwrap_or_else(|| {
            panic!(
                "the rollout did not end:\n{}",
                cp.kubectl_ok(&["-n", NS, "get", "pods,events", "-o", "wide"])
            )
        });
        // Twenty more calls of the loop on the new pod alone.
        let seen = oks.load(Ordering::Relaxed);
        poll(CLUSTER_TIMEOUT, || {
            (oks.load(Ordering::Relaxed) >= seen + 20).then_some(())
        })
        .expect("the client loop stalled on the new pod");
        stop.store(true, Ordering::Relaxed);
        assert!(
            k.log_of(&new, "imgbridge").contains("took the socket over"),
            "the new pod did not take the socket over:\n{}",
            k.log_of(&new, "imgbridge")
        );
        eprintln!("upgrade: socket handed over {handed_over:?} after helm upgrade; the build returned {:?} after it", built - upgrade);
        client.join().expect("the client loop")
    });
    let ok = oks.load(Ordering::Relaxed);
    eprintln!("client loop across the upgrade: {ok} calls ok, {} failed, longest gap between successes {longest:?}", failed.len());
    assert!(
        failed.is_empty(),
        "calls failed across the upgrade: {failed:?}"
    );
    assert_ne!(
        old["metadata"]["uid"],
        one_pod(cp, NS, DS_PODS)["metadata"]["uid"]
    );

    // The build's image was in k8s.io as buildctl returned: it runs.
    cp.apply(&app.manifest(&format!("{APP}:upgrade"), "/layer1.txt", "Never", false));
    app.wait_running(cp, k, &format!("{APP}:upgrade"), "layer 1 of up-base:1");
}

/// Sets its flag when dropped.
struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// KEP-1755 as a cluster has it: kind's registry script, ctlptl or k3d made
/// `kube-public/local-registry-hosting` before; `helm install` with the
/// registry endpoint fails naming the two ways out, and once the ConfigMap
/// is annotated for adoption as the message says, the release publishes
/// the endpoint in it. A developer's tool reads it from the API server
/// (tilt-dev's localregistry-go, ctlptl and Skaffold are not on the module
/// proxy here: kubectl reads the same fields), pushes to the `host` it
/// read, and a Deployment naming `hostFromContainerRuntime` runs the image
/// with no pull.
#[test]
fn local_registry_hosting_is_adopted_and_its_host_pushed_to() {
    let Some(cl) = OneNode::start() else { return };
    let Some(helm) = Helm::new(&cl.cp) else {
        return;
    };
    let Some(crane) = peer("crane") else { return };
    let (c, cp, k) = (&cl.c, &cl.cp, &cl.k);
    let image = project_image("");
    ctr_import(c.socket(), "k8s.io", &image.archive);
    let node = ChartNode::new();
    let app = App::new(APP);
    let port = free_port();
    cp.kubectl_ok(&[
        "-n",
        "kube-public",
        "create",
        "configmap",
        "local-registry-hosting",
        "--from-literal=localRegistryHosting.v1=host: \"localhost:5001\"\n",
    ]);

    let owned = install_args(
        &cl,
        &node,
        &image,
        &[
            "--set".into(),
            "registry.enabled=true".into(),
            "--set".into(),
            format!("registry.port={port}"),
        ],
    );
    let mut args: Vec<&str> = owned.iter().map(String::as_str).collect();
    let refused = helm.run(&args);
    let said = String::from_utf8_lossy(&refused.stderr).into_owned();
    assert!(
        !refused.status.success()
            && said.contains("kube-public/local-registry-hosting already exists"),
        "helm install over an existing local-registry-hosting: {said}"
    );
    // The way out the message gives: let this release own it.
    let adopt = said
        .split("let this release own it: ")
        .nth(1)
        .and_then(|rest| rest.split(" ; then").next())
        .unwrap_or_else(|| panic!("no adoption command in: {said}"));
    for cmd in adopt.split(" && ") {
        let words: Vec<&str> = cmd.split_whitespace().collect();
        assert_eq!(words.first(), Some(&"kubectl"), "{cmd}");
        cp.kubectl_ok(&words[1..]);
    }
    assert!(said.contains("--force-conflicts"), "{said}");
    args.push("--force-conflicts");
    helm.ok(&args, cp);

    // What a tool reads from the API server.
    let cm = cp
        .get(&[
            "-n",
            "kube-public",
            "get",
            "configmap",
            "local-registry-hosting",
        ])
        .expect("the ConfigMap");
    let v1 = cm["data"]["localRegistryHosting.v1"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let field = |key: &str| {
        v1.lines()
            .find_map(|l| l.trim().strip_prefix(&format!("{key}: ")))
            .map(|v| v.trim_matches('"').to_string())
            .unwrap_or_else(|| panic!("localRegistryHosting.v1 has no {key}:\n{v1}"))
    };
    let (host, runtime_host, help) = (
        field("host"),
        field("hostFromContainerRuntime"),
        field("help"),
    );
    assert_eq!(
        (host.as_str(), runtime_host.as_str()),
        (
            format!("localhost:{port}").as_str(),
            format!("localhost:{port}").as_str()
        )
    );
    assert!(help.starts_with("https://"), "help: {help}");

    // Push where it says, run what the runtime is told to pull.
    let img = TestImage::hello("kep-app:1");
    let mut push = crane.command("crane");
    push.args(["push", "--insecure"])
        .arg(img.docker_archive())
        .arg(format!("{host}/kep-app:1"));
    imgbridge_test_support::util::run_ok(push);
    let pod_image = format!("{runtime_host}/kep-app:1");
    cp.apply(&app.manifest(&pod_image, "/layer1.txt", "IfNotPresent", false));
    let p = app.wait_running(cp, k, &pod_image, "layer 1 of kep-app:1");
    let pulls = pull_events(
        cp,
        "default",
        p["metadata"]["name"].as_str().unwrap_or_default(),
    );
    assert!(pulls.is_empty(), "the pushed image was pulled: {pulls:?}");
}
