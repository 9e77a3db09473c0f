//! The drop-in socket swap (docs/socket-swap.md): imgbridge listens where
//! clients expect containerd, so kubelet (crictl here), ctr and builders
//! all talk to imgbridge's socket as if it were containerd's.

use imgbridge_test_support::ctr::ctr_run;
use imgbridge_test_support::peers::Crictl;
use imgbridge_test_support::prelude::*;

const SRC: &str = "buildkit";

#[test]
fn crictl_and_ctr_use_imgbridges_socket_as_containerds() {
    let reg = Registry::start();
    // imgbridge's socket stands where containerd's was; every client,
    // kubelet included, is pointed at it.
    let (_c, p) = Scenario::cri().registry_mirror(&reg.addr()).start();
    let Some(kubelet) = Crictl::new(p.socket()) else {
        return;
    };
    let version = kubelet.ok(&["version"]);
    let (major, minor, patch) = flavor().semver;
    assert!(
        version.contains(&format!("{major}.{minor}.{patch}")),
        "{version}"
    );

    // A build client writes into its namespace through the same socket;
    // kubelet sees the image at once, through it too.
    let built = TestImage::hello("swap-built:1");
    ctr_import(p.socket(), SRC, &built.docker_archive());
    assert_eq!(
        kubelet.image_id(&built.normalized()),
        Some(built.config_digest())
    );

    // kubelet's own pull (CRI PullImage) and a pod, all relayed.
    let pulled = TestImage::hello("swap-pulled:1");
    let reference = pulled.push(&reg.addr());
    kubelet.ok(&["pull", &reference]);
    assert_eq!(kubelet.image_id(&reference), Some(pulled.config_digest()));
    let hello = hello_text("swap-built:1");
    kubelet.run_pod(
        &built.normalized(),
        &["/bin/busybox", "echo", &hello],
        &hello,
    );
    let images = kubelet.ok(&["images"]);
    assert!(images.contains("swap-pulled"), "{images}");

    // ctr, as an operator on the node would use it.
    let listed = ctr_ok(p.socket(), "k8s.io", ["images", "ls", "-q"]);
    for name in [built.normalized(), reference.clone()] {
        assert!(listed.lines().any(|l| l == name), "{name} not in\n{listed}");
    }
    let pulled_hello = hello_text("swap-pulled:1");
    let out = ctr_run(
        p.socket(),
        "k8s.io",
        &reference,
        &["/bin/busybox", "echo", &pulled_hello],
    );
    assert!(out.contains(&pulled_hello), "{out}");
}
