//! The chart's DaemonSet pod, run for real: the project's own image (the
//! release's static binary, no base image) imported into `k8s.io`, the
//! chart's pod rendered for this test's containerd (`scripts/static-pod.sh`:
//! the DaemonSet's pod template, nothing added) and run as a static pod by
//! the real kubelet, with its read-only root, dropped capabilities, seccomp
//! profile and probes. buildkitd builds through the socket the pod exposes,
//! and kubelet runs each build's image the moment buildctl returns.
//!
//! Then an upgrade, as a DaemonSet's rolling update makes it: the pod's
//! image is replaced while a build is in flight. The old pod drains the
//! build's write, whose image is then in `k8s.io` when buildctl returns;
//! the next build goes through the new pod.

use std::fs::File;
use std::io::Read;
use std::thread;
use std::time::{Duration, Instant};

use imgbridge_test_support::chart::{App, ChartNode, NS};
use imgbridge_test_support::kubelet::{Kubelet, KubeletOpts, StaticPod, KUBELET_POD_TIMEOUT};
use imgbridge_test_support::peers::Buildkitd;
use imgbridge_test_support::prelude::*;
use imgbridge_test_support::project::{project_image, ProjectImage};
use serde_json::Value;

/// The chart's pod: `imgbridge` in `kube-system`, container `imgbridge`.
const POD: &str = "imgbridge";

/// Renders the chart's pod for `image` into kubelet's manifest dir
/// (replacing the one there: kubelet rolls the pod).
fn render(node: &ChartNode, k: &Kubelet, c: &Containerd, image: &ProjectImage) {
    node.static_pod(&k.manifests().join("imgbridge.json"), c, image);
}

/// Waits until kubelet reports the chart's pod running `image` and ready
/// (its readiness probe passed), and its socket answers.
fn wait_ready(node: &ChartNode, k: &Kubelet, image: &ProjectImage) -> Value {
    let want = format!("imgbridge:{}", image.tag);
    let sock = node.socket();
    poll(KUBELET_POD_TIMEOUT, || {
        let p = k.pod_in(NS, POD)?;
        let s = &p["status"];
        let ready = s["conditions"].as_array()?.iter().any(|c| c["type"] == "Ready" && c["status"] == "True");
        let image_ok = p["spec"]["containers"][0]["image"] == want.as_str();
        let answers = std::os::unix::net::UnixStream::connect(&sock).is_ok();
        (ready && image_ok && answers).then_some(p)
    })
    .unwrap_or_else(|| {
        panic!(
            "the chart's pod ({want}) is not ready within {KUBELET_POD_TIMEOUT:?}: kubelet reports {}\n--- its log ---\n{}\n--- kubelet log ---\n{}",
            k.pod_in(NS, POD).map(|p| p["status"].to_string()).unwrap_or_else(|| "no such pod".into()),
            k.pod_in(NS, POD).map(|p| k.log_of(&p, POD)).unwrap_or_default(),
            k.log_tail()
        )
    })
}

/// Runs `image` in static pod `pod` (`imagePullPolicy: Never`: kubelet
/// uses what is in k8s.io or fails at once) printing `/v` or `file`.
fn run_at_once(k: &Kubelet, pod: &str, image: &str, file: &str, expect: &str) {
    let script = format!("cat {file}; echo; exec /bin/busybox sleep 100000");
    k.write_pod(&StaticPod::new(pod, image, &script).policy("Never"));
    k.wait_running(pod, image, expect);
}

fn text_from(s: &str, from: usize) -> &str {
    s.get(from..).unwrap_or_default()
}

/// The chart's pod serves builds, and survives an upgrade with a build in
/// flight.
#[test]
fn chart_pod_serves_builds_and_upgrades_with_a_build_in_flight() {
    // The pod mounts containerd's dir with HostToContainer propagation.
    let c = Containerd::start(ContainerdOpts {
        cri: true,
        shared_mount: true,
        ..Default::default()
    });
    let Some(k) = Kubelet::start(KubeletOpts::new(c.socket())) else {
        return;
    };
    let (v1, v2) = (project_image(""), project_image("-next"));
    for img in [&v1, &v2] {
        ctr_import(c.socket(), "k8s.io", &img.archive);
    }
    let node = ChartNode::new();
    let app = App::new("ds-app");
    render(&node, &k, &c, &v1);
    let started = Instant::now();
    let old = wait_ready(&node, &k, &v1);
    eprintln!("the chart's pod ready in {:?}", started.elapsed());

    // A build through the pod's socket runs at once.
    let reg = Registry::start();
    let Some(bk) = Buildkitd::start(&node.socket(), "buildkit", Some(&reg.addr())) else {
        return;
    };
    let first = unique_name("ds-first");
    let image = app.build(&bk, "1", &first);
    run_at_once(&k, "app-1", &image, "/v", &first);

    // The upgrade, with a build in flight: FROM a base in the registry with
    // only a LABEL, buildkit names the image, then writes the base's layers
    // it never fetched (lazy; the second is 96 MiB), then returns. buildkitd
    // is frozen in the middle of that last write; the pod's image is
    // replaced; once the old pod has let go of the socket (SIGTERM: it
    // drains), buildkitd goes on.
    let base = TestImage::build("ds-base:1", 1, &[], 96 << 20);
    let base_ref = base.push(&reg.addr());
    let name = "docker.io/library/ds-app:2";
    let sock = node.socket();
    let old_log = thread::scope(|s| {
        let build = s.spawn(|| {
            bk.build_on(&base_ref, name);
            Instant::now()
        });
        bk.freeze_mid_write(&c, "buildkit", name);
        let in_flight = c.ingests("buildkit");
        // Opened now: kubelet removes the old pod's log with the pod.
        let mut old_log = File::open(k.log_path_of(&old, POD)).expect("the old pod's log");
        let upgrade = Instant::now();
        render(&node, &k, &c, &v2);
        let released = poll(Duration::from_secs(30), || {
            (!sock.exists()).then(|| upgrade.elapsed())
        });
        bk.thaw();
        let released = released.unwrap_or_else(|| {
            panic!(
                "the old pod kept its socket 30 s after the upgrade:\n{}",
                k.log_tail()
            )
        });
        wait_ready(&node, &k, &v2);
        let serving = upgrade.elapsed();
        let built = build.join().expect("the build in flight at the upgrade");
        eprintln!(
            "upgrade: {} write(s) in flight at offsets {in_flight:?}; after the new manifest: \
             socket released {released:?}, new pod ready {serving:?}, the build returned {:?}",
            in_flight.len(),
            built - upgrade
        );
        let mut text = String::new();
        old_log
            .read_to_string(&mut text)
            .expect("read the old pod's log");
        text
    });
    // The build's image is in k8s.io as buildctl returns: kubelet runs it.
    run_at_once(
        &k,
        "app-2",
        "ds-app:2",
        "/layer1.txt",
        "layer 1 of ds-base:1",
    );
    // The old pod linked the frozen write's blob after SIGTERM, then
    // drained and stopped, within the drain timeout.
    let after = |from: usize, what: &str| {
        (text_from(&old_log, from).find(what)).map(|i| from + i + what.len())
    };
    let order = after(0, "SIGTERM received")
        .and_then(|i| after(i, "linked a blob that arrived after its image"))
        .and_then(|i| after(i, "\"drained\""))
        .and_then(|i| after(i, "imgbridge stopped"));
    assert!(
        order.is_some() && !old_log.contains("still running at drain timeout"),
        "the old pod did not drain the write in flight:\n{old_log}"
    );

    // The next build goes through the new pod.
    let new = wait_ready(&node, &k, &v2);
    assert_ne!(old["metadata"]["uid"], new["metadata"]["uid"]);
    let next = unique_name("ds-next");
    let image = app.build(&bk, "3", &next);
    run_at_once(&k, "app-3", &image, "/v", &next);
    assert!(
        k.log_of(&new, POD).contains("replicated"),
        "the next build did not go through the new pod"
    );
    k.stop();
}
