//! A build namespace never replaces what the node runs on: CRI's sandbox
//! image, images pinned in `k8s.io` by others, and `replication.protect`
//! names are refused by every real client's write (ctr tag, nerdctl tag,
//! a `buildctl build` named like them) with a message saying what lifts
//! it; `replication.overwrite` lifts it. After each, the protected record
//! in `k8s.io` is unchanged, a pod still starts, and an ordinary name of
//! the same run replicated.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use imgbridge_test_support::images::PAUSE_IMAGE;
use imgbridge_test_support::peers::{Buildkitd, Crictl, Nerdctl};
use imgbridge_test_support::prelude::*;
use imgbridge_test_support::util::block_on_thread;

struct Setup {
    c: Containerd,
    p: Imgbridge,
    cri: Crictl,
    bk: Buildkitd,
    n: Nerdctl,
    _reg: Registry,
    metrics: String,
    /// Imported into `buildkit` through imgbridge: every client tags it.
    ordinary: Arc<TestImage>,
}

/// The digest the record `name` in `ns` points at, read on containerd's own
/// socket.
fn record_digest(sock: &Path, ns: &str, name: &str) -> Option<String> {
    let filter = format!("name=={name}");
    let out = ctr_ok(sock, ns, ["images", "ls", filter.as_str()]);
    let line = out.lines().find(|l| l.starts_with(&format!("{name} ")))?;
    line.split_whitespace().nth(2).map(str::to_string)
}

/// How a client tried to write a name.
struct Attempt {
    client: &'static str,
    ok: bool,
    said: String,
}

impl Setup {
    /// `config`: imgbridge's `[replication]` lines.
    fn start(replication: &str) -> Option<Setup> {
        let c = Scenario::cri().containerd();
        let cri = Crictl::new(c.socket())?;
        let metrics = format!("127.0.0.1:{}", free_port());
        let p = Imgbridge::with_config(
            c.socket(),
            &format!("[replication]\n{replication}\n[metrics]\nlisten = \"{metrics}\"\n"),
        );
        let reg = Registry::start();
        let bk = Buildkitd::start(p.socket(), "buildkit", Some(&reg.addr()))?;
        let n = Nerdctl::new(p.socket(), "buildkit", None)?;
        let ordinary = TestImage::hello("prot-ordinary:1");
        ctr_import(p.socket(), "buildkit", &ordinary.docker_archive());
        Some(Setup {
            c,
            p,
            cri,
            bk,
            n,
            _reg: reg,
            metrics,
            ordinary,
        })
    }

    /// `img` written straight into `k8s.io` (not through imgbridge) as
    /// `name`, pinned by someone else if `pin`.
    fn node_image(&self, img: &TestImage, name: &str, pin: bool) {
        let dir = tempdir("prot-node-");
        let archive = dir.path().join("node.tar");
        img.export_docker_archive(&archive, name);
        ctr_import(self.c.socket(), "k8s.io", &archive);
        if pin {
            let label = "io.cri-containerd.pinned=pinned";
            ctr_ok(self.c.socket(), "k8s.io", ["images", "label", name, label]);
        }
    }

    /// ctr tag, nerdctl tag (containerd ≥ 1.7: nerdctl tags through
    /// Transfer) and `buildctl build` each writing `name` into `buildkit`
    /// through imgbridge; the source record is removed (on containerd's own
    /// socket) before each, so each is a write of its own.
    fn attempts(&self, name: &str) -> Vec<Attempt> {
        let src = self.ordinary.normalized();
        let mut out = Vec::new();
        let mut record = |client, o: std::process::Output| {
            out.push(Attempt {
                client,
                ok: o.status.success(),
                said: String::from_utf8_lossy(&o.stderr).into_owned(),
            });
            let _ = ctr(self.c.socket(), "buildkit", ["images", "rm", name]);
        };
        let tag = ["images", "tag", "--force", src.as_str(), name];
        record("ctr tag", ctr(self.p.socket(), "buildkit", tag));
        if flavor().has_transfer() {
            record("nerdctl tag", self.n.run(["tag", src.as_str(), name]));
        }
        let ctx = tempdir("prot-build-");
        std::fs::write(
            ctx.path().join("Dockerfile"),
            "FROM scratch\nCOPY --chmod=755 busybox /bin/busybox\n",
        )
        .unwrap();
        std::fs::copy("/bin/busybox", ctx.path().join("busybox")).unwrap();
        let c = ctx.path().display().to_string();
        let (context, dockerfile) = (format!("context={c}"), format!("dockerfile={c}"));
        let output = format!("type=image,name={name}");
        let args = [
            "build",
            "--frontend",
            "dockerfile.v0",
            "--local",
            &context,
            "--local",
            &dockerfile,
            "--output",
            &output,
        ];
        record("buildctl build", self.bk.buildctl(args));
        out
    }

    /// Every attempt at `name` was refused with a message that names the
    /// image, the target, `why` and the setting that lifts it, and the
    /// record in `k8s.io` still points at `digest`.
    fn refused(&self, name: &str, why: &str, digest: Option<&str>) {
        for a in self.attempts(name) {
            assert!(
                !a.ok,
                "{}: writing protected {name} succeeded\n{}",
                a.client,
                self.p.log_tail()
            );
            for want in [
                name,
                "is protected in k8s.io",
                why,
                "replication.overwrite",
                "left there as written",
            ] {
                assert!(
                    a.said.contains(want),
                    "{}: the client was not told {want:?}: {}",
                    a.client,
                    a.said
                );
            }
            assert_eq!(
                record_digest(self.c.socket(), "k8s.io", name).as_deref(),
                digest,
                "{}: the protected record in k8s.io changed",
                a.client
            );
        }
        // The code under the message, as a containerd client gets it.
        let (sock, src) = (self.p.socket().to_path_buf(), self.ordinary.normalized());
        let n = name.to_string();
        let code = block_on_thread(async move {
            let target = image_target(&sock, "buildkit", &src).await;
            let mut images = images_client(&sock).await;
            let r = images
                .create(create_image_req("buildkit", &n, &target))
                .await;
            r.map(|_| ()).map_err(|e| e.code())
        });
        let _ = ctr(self.c.socket(), "buildkit", ["images", "rm", name]);
        assert_eq!(code, Err(tonic::Code::FailedPrecondition));
        let refusal = format!("buildkit/{name}");
        let status = http_get(&self.metrics, "/status").expect("/status");
        let status: serde_json::Value = serde_json::from_str(&status).unwrap();
        assert!(
            status["protected"][&refusal]["error"]
                .as_str()
                .is_some_and(|e| e.contains(why)),
            "/status lists no refusal of {refusal}: {}",
            status["protected"]
        );
        let metrics = http_get(&self.metrics, "/metrics").expect("/metrics");
        assert!(
            metrics.lines().any(|l| l.starts_with(
                "imgbridge_replications_total{outcome=\"protected\",target=\"k8s.io\"}"
            ) && !l.ends_with(" 0")),
            "no protected outcome counted:\n{metrics}"
        );
    }

    /// The ordinary image of this run replicated, and a pod (whose sandbox
    /// is CRI's sandbox image) runs it.
    fn ordinary_runs(&self) {
        let name = self.ordinary.normalized();
        assert_eq!(
            self.cri.image_id(&name).as_deref(),
            Some(self.ordinary.config_digest().as_str()),
            "the ordinary image of the run was not replicated"
        );
        let hello = hello_text("prot-ordinary:1");
        self.cri
            .run_pod(&name, &["/bin/busybox", "echo", &hello], &hello);
    }
}

#[test]
fn the_sandbox_image_is_never_replaced() {
    let Some(s) = Setup::start("") else { return };
    let before = record_digest(s.c.socket(), "k8s.io", PAUSE_IMAGE);
    assert!(before.is_some(), "the harness imports {PAUSE_IMAGE}");
    // 2.x's CRI also pins its sandbox image itself: either protection may
    // apply, but the record must stay either way.
    let why = match flavor().is_v2() {
        true => "is protected in k8s.io (it is",
        false => "CRI's sandbox image",
    };
    s.refused(PAUSE_IMAGE, why, before.as_deref());
    s.ordinary_runs();
}

#[test]
fn an_image_pinned_by_others_is_never_replaced() {
    let Some(s) = Setup::start("") else { return };
    let system = TestImage::hello("prot-system:1");
    let name = "docker.io/library/prot-system:1";
    s.node_image(&system, name, true);
    let before = record_digest(s.c.socket(), "k8s.io", name);
    s.refused(name, "pinned there", before.as_deref());
    // Written behind imgbridge's back (containerd's own socket): the events
    // backstop and the catch-up pass refuse it too.
    let refusals = || s.p.log().matches("not replicated").count();
    let seen = refusals();
    let src = s.ordinary.normalized();
    ctr_ok(
        s.c.socket(),
        "buildkit",
        ["images", "tag", src.as_str(), name],
    );
    let backstop = poll(Duration::from_secs(10), || {
        (refusals() > seen).then_some(())
    });
    assert!(backstop.is_some(), "the events backstop never met {name}");
    assert_eq!(record_digest(s.c.socket(), "k8s.io", name), before);
    s.ordinary_runs();
    let hello = hello_text("prot-system:1");
    s.cri
        .run_pod(name, &["/bin/busybox", "echo", &hello], &hello);
}

#[test]
fn a_protect_glob_refuses_present_and_absent_names() {
    let Some(s) = Setup::start("protect = [\"example.test/sys/**\"]") else {
        return;
    };
    let agent = TestImage::hello("prot-agent:1");
    let present = "example.test/sys/agent:1";
    s.node_image(&agent, present, false);
    let before = record_digest(s.c.socket(), "k8s.io", present);
    // nerdctl escapes the quotes around the glob when it prints the message.
    let glob = "it matches replication.protect glob";
    s.refused(present, glob, before.as_deref());
    s.refused("example.test/sys/deep/absent:1", glob, None);
    s.ordinary_runs();
}

#[test]
fn overwrite_lifts_a_protection_and_only_for_its_names() {
    let Some(s) = Setup::start(
        "protect = [\"example.test/sys/**\"]\noverwrite = [\"example.test/sys/lifted:*\"]",
    ) else {
        return;
    };
    let old = TestImage::hello("prot-old:1");
    let lifted = "example.test/sys/lifted:1";
    s.node_image(&old, lifted, true);
    let lifted_before = record_digest(s.c.socket(), "k8s.io", lifted);
    let kept = "example.test/sys/kept:1";
    s.node_image(&old, kept, true);
    let kept_before = record_digest(s.c.socket(), "k8s.io", kept);
    // Lifted: every client's write replaces the record with the build's.
    for a in s.attempts(lifted) {
        assert!(a.ok, "{}: {}", a.client, a.said);
        let now = record_digest(s.c.socket(), "k8s.io", lifted);
        assert_ne!(
            now, lifted_before,
            "{}: overwrite did not lift the protection",
            a.client
        );
    }
    s.cri
        .run_pod(lifted, &["/bin/busybox", "echo", "lifted-ok"], "lifted-ok");
    // The sibling the overwrite glob does not name stays protected (and
    // pinned by others too).
    s.refused(kept, "is protected in k8s.io", kept_before.as_deref());
    s.ordinary_runs();
}

/// `on_failure = "warn"`: the refused write returns OK; the refusal is a
/// WARN, and the protected record stays.
#[test]
fn with_on_failure_warn_the_write_returns_ok_and_the_record_stays() {
    let (c, p) = Scenario::cri()
        .config("[replication]\non_failure = \"warn\"\nprotect = [\"example.test/sys/**\"]\n")
        .start();
    let img = TestImage::hello("prot-warn:1");
    ctr_import(p.socket(), "buildkit", &img.docker_archive());
    let name = "example.test/sys/warned:1";
    let src = img.normalized();
    ctr_ok(
        p.socket(),
        "buildkit",
        ["images", "tag", src.as_str(), name],
    );
    p.wait_for_log(
        "not replicated: the name is protected",
        Duration::from_secs(10),
        "the refusal is logged as a WARN",
    );
    assert_eq!(record_digest(c.socket(), "k8s.io", name), None);
}
