//! The real nerdctl through imgbridge (`--address`, namespace `buildkit`):
//! load, pull, tag, rmi, image prune and build, each followed at once by
//! kubelet's view (crictl on containerd's own socket).

use imgbridge_test_support::peers::{Buildkitd, Crictl, Nerdctl};
use imgbridge_test_support::prelude::*;

const PINNED: &str = "io.cri-containerd.pinned";

struct Setup {
    c: Containerd,
    _p: Imgbridge,
    reg: Registry,
    cri: Crictl,
    n: Nerdctl,
    _bk: Buildkitd,
}

impl Setup {
    /// Reconcile off, so a replica on return is the proxy's doing; pins on,
    /// so the delete policy (unpin) shows.
    fn start() -> Option<Setup> {
        let c = Scenario::cri().containerd();
        let cri = Crictl::new(c.socket())?;
        let p = Imgbridge::with_config(
            c.socket(),
            "[replication]\npin = true\n[reconcile]\nenabled = false\n",
        );
        let reg = Registry::start();
        let bk = Buildkitd::start(p.socket(), "buildkit", Some(&reg.addr()))?;
        let n = Nerdctl::new(p.socket(), "buildkit", Some(&bk))?;
        Some(Setup {
            c,
            _p: p,
            reg,
            cri,
            n,
            _bk: bk,
        })
    }

    /// CRI resolves `name` to the config of `img`, right now.
    fn resolves(&self, name: &str, img: &TestImage) {
        assert_eq!(
            self.cri.image_id(name).as_deref(),
            Some(img.config_digest().as_str()),
            "CRI does not resolve {name} right after nerdctl returned"
        );
    }

    fn pinned_label(&self, name: &str) -> Option<bool> {
        let out = ctr(
            self.c.socket(),
            "k8s.io",
            ["images", "ls", &format!("name=={name}")],
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let line = text.lines().find(|l| l.starts_with(name))?;
        Some(line.contains(&format!("{PINNED}=pinned")))
    }
}

#[test]
fn load_pull_tag_rmi_prune_each_seen_by_kubelet_at_once() {
    if !flavor().has_transfer() {
        // nerdctl ≥ 2.3 loads, pulls and tags through containerd's Transfer
        // service ("unknown service ... Streaming" on 1.6, imgbridge or not).
        eprintln!("skipped: nerdctl needs the Transfer service (containerd ≥ 1.7)");
        return;
    }
    let Some(s) = Setup::start() else { return };

    // load of a docker-archive
    let loaded = TestImage::hello("nerd-load:1");
    let archive = loaded.docker_archive();
    s.n.ok(&["load", "-i", archive.to_str().unwrap()]);
    s.resolves(&loaded.normalized(), &loaded);

    // pull from the loopback registry
    let pulled = TestImage::hello("nerd-pull:1");
    let reference = pulled.push(&s.reg.addr());
    s.n.ok(&["pull", "--insecure-registry", &reference]);
    s.resolves(&reference, &pulled);

    // tag
    let tag = "docker.io/library/nerd-tag:2";
    s.n.ok(&["tag", &loaded.normalized(), tag]);
    s.resolves(tag, &loaded);
    s.cri
        .run_pod(tag, &["/bin/busybox", "echo", "nerd-tag-ok"], "nerd-tag-ok");

    // rmi: the replica stays (kubelet may be running it) and is unpinned
    assert_eq!(s.pinned_label(tag), Some(true));
    s.n.ok(&["rmi", tag]);
    assert_eq!(
        s.pinned_label(tag),
        Some(false),
        "rmi leaves the replica unpinned (delete_policy = unpin)"
    );
    s.resolves(tag, &loaded);

    // image prune --all removes every unused image in buildkit; the
    // replicas stay runnable.
    s.n.ok(&["image", "prune", "--all", "--force"]);
    let left = s.n.ok(&["images", "-q"]);
    assert!(left.trim().is_empty(), "prune left: {left}");
    for (name, img) in [(loaded.normalized(), &loaded), (reference.clone(), &pulled)] {
        s.resolves(&name, img);
        assert_eq!(s.pinned_label(&name), Some(false), "{name} unpinned");
        // CRI's pin is per image: it drops once no reference is pinned
        // (its cache follows containerd's events a few ms behind).
        if flavor().honours_pinned() {
            let unpinned = poll(std::time::Duration::from_secs(10), || {
                (s.cri.pinned(&name) == Some(false)).then_some(())
            });
            assert!(unpinned.is_some(), "CRI still reports {name} pinned");
        }
    }
    s.cri.run_pod(
        &reference,
        &["/bin/busybox", "echo", &hello_text("nerd-pull:1")],
        &hello_text("nerd-pull:1"),
    );
}

#[test]
fn build_through_the_same_buildkitd_runs_at_once() {
    let Some(s) = Setup::start() else { return };
    let base = TestImage::hello("nerd-base:1").push(&s.reg.addr());
    let ctx = tempdir("nerd-build-");
    std::fs::write(
        ctx.path().join("Dockerfile"),
        format!("FROM {base}\nCOPY note /note\n"),
    )
    .unwrap();
    std::fs::write(ctx.path().join("note"), "nerd-built").unwrap();
    let name = "docker.io/library/nerd-build:1";
    s.n.ok(&["build", "-t", name, ctx.path().to_str().unwrap()]);
    assert!(
        s.cri.image_id(name).is_some(),
        "CRI does not resolve {name} right after nerdctl build returned"
    );
    s.cri
        .run_pod(name, &["/bin/busybox", "cat", "/note"], "nerd-built");
}
