//! Never take containerd down, on every version of the matrix
//! (`IMGBRIDGE_CONTAINERD`, see `scripts/containerd-matrix.sh`).
//!
//! containerd 1.7 and 2.x dereference an image record's target before they
//! look at an `Images.Update`'s field mask: a label-only update without one
//! killed the daemon (1.6 accepted it). Every path that changes labels on a
//! record imgbridge did not just write is driven here against a real
//! containerd, and each test asserts that containerd's pid never changed
//! and that the labels end as the policy says. On 1.6.25+/1.7.10+/2.x CRI
//! must also report the pin (`Image.pinned`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use containerd_client::services::v1 as api;
use imgbridge_test_support::grpc::create_image;
use imgbridge_test_support::prelude::*;
use imgbridge_test_support::scenario::config_file;
use imgbridge_test_support::util::run_ok;

const SRC: &str = "buildkit";
const K8S: &str = "k8s.io";
const PINNED: &str = "io.cri-containerd.pinned";
const DEADLINE: Duration = Duration::from_secs(30);

async fn labels(sock: &Path, name: &str) -> Option<HashMap<String, String>> {
    get_image(sock, K8S, name).await.map(|i| i.labels)
}

async fn is_pinned(sock: &Path, name: &str) -> bool {
    labels(sock, name)
        .await
        .is_some_and(|l| l.get(PINNED).map(String::as_str) == Some("pinned"))
}

/// Polls until the record `name` in k8s.io is (un)pinned, then checks that
/// CRI says the same where it can.
async fn wait_pin(sock: &Path, name: &str, want: bool) {
    let ok = poll_async(DEADLINE, || async {
        let present = labels(sock, name).await.is_some();
        (present && is_pinned(sock, name).await == want).then_some(())
    })
    .await;
    assert!(
        ok.is_some(),
        "{name} never became pinned={want}: {:?}",
        labels(sock, name).await
    );
    assert_cri_pinned(sock, name, want).await;
}

/// CRI's `Image.pinned` follows the label on versions that honour it.
async fn assert_cri_pinned(sock: &Path, name: &str, want: bool) {
    if !flavor().honours_pinned() {
        return;
    }
    // CRI's cache follows containerd's events a few ms behind the record.
    let seen = poll_async(DEADLINE, || async {
        cri_image_status(sock, name)
            .await
            .filter(|i| i.pinned == want)
    })
    .await;
    assert!(
        seen.is_some(),
        "CRI ImageStatus({name}).pinned never became {want} on containerd {}",
        flavor().version
    );
}

/// containerd with CRI, imgbridge with `pin = true` (its config file is
/// returned), and `tag` imported into the source namespace through it.
fn pinned_replica(tag: &str) -> (Containerd, Imgbridge, PathBuf, std::sync::Arc<TestImage>) {
    let c = Scenario::cri().containerd();
    let cfg = config_file("[replication]\npin = true\n");
    let p = Imgbridge::start(c.socket(), &["--config", cfg.to_str().unwrap()]);
    let img = TestImage::hello(tag);
    ctr_import(p.socket(), SRC, &img.docker_archive());
    (c, p, cfg, img)
}

fn delete_req(name: &str) -> tonic::Request<api::DeleteImageRequest> {
    with_ns(
        api::DeleteImageRequest {
            name: name.into(),
            ..Default::default()
        },
        SRC,
    )
}

/// `delete_policy = "unpin"` with `pin = true`: a source image removed
/// through imgbridge (`ctr images rm`) and one removed on containerd's own
/// socket (the events path) both leave an unpinned replica and a running
/// containerd. Before the fix, containerd 1.7/2.x died on the first unpin.
#[tokio::test]
async fn delete_policy_unpin_through_imgbridge_and_directly_keeps_containerd_up() {
    let (mut c, p, _cfg, img) = pinned_replica("unpin-proxy:1");
    let pid = c.pid();
    let replica = img.normalized();
    assert!(
        is_pinned(c.socket(), &replica).await,
        "replica pinned on return"
    );
    assert_cri_pinned(c.socket(), &replica, true).await;
    ctr_ok(p.socket(), SRC, ["images", "rm", &img.normalized()]);
    wait_pin(c.socket(), &replica, false).await;
    c.assert_still_running(pid);

    // Written through imgbridge, deleted behind its back: the events
    // subscription applies the policy.
    let target = image_target(c.socket(), K8S, &replica).await;
    create_image(p.socket(), SRC, "unpin-direct:1", &target).await;
    let direct = "docker.io/library/unpin-direct:1";
    assert!(is_pinned(c.socket(), direct).await);
    images_client(c.socket())
        .await
        .delete(delete_req("unpin-direct:1"))
        .await
        .unwrap();
    wait_pin(c.socket(), direct, false).await;
    c.assert_still_running(pid);
    assert!(
        !p.log().contains("connection broke"),
        "no write of imgbridge's broke containerd's connection:\n{}",
        p.log()
    );
}

/// A watched directory with its own config and state file, and one test
/// image to drop into it.
struct Watched {
    dir: tempfile::TempDir,
    img: std::sync::Arc<TestImage>,
}

impl Watched {
    fn new(tag: &str) -> Watched {
        let dir = tempdir("watch-");
        std::fs::create_dir_all(dir.path().join("images")).unwrap();
        Watched {
            dir,
            img: TestImage::hello(tag),
        }
    }

    fn file(&self) -> PathBuf {
        self.dir.path().join("images/image.tar")
    }

    /// Renamed in, as a finished copy would be.
    fn drop_in(&self) {
        let staged = self.dir.path().join("image.tar.part");
        std::fs::copy(self.img.docker_archive(), &staged).unwrap();
        std::fs::rename(&staged, self.file()).unwrap();
    }

    /// `imgbridge serve --watch-dir` (reconcile off: only the importer
    /// writes), with the same state file every time.
    fn serve(&self, c: &Containerd) -> Imgbridge {
        let d = self.dir.path();
        let cfg = config_file(&format!(
            "[reconcile]\nenabled = false\n[import]\nstate_file = \"{}\"\ndebounce = \"200ms\"\n",
            d.join("state.json").display()
        ));
        let watch = d.join("images");
        Imgbridge::start(
            c.socket(),
            &[
                "--config",
                cfg.to_str().unwrap(),
                "--watch-dir",
                watch.to_str().unwrap(),
            ],
        )
    }
}

/// A watched file deleted while imgbridge was down, with containerd
/// restarted as well: the next start still owes the unpin and pays it.
#[tokio::test]
async fn watch_dir_unpin_owed_across_restarts_is_paid() {
    let mut c = Scenario::cri().containerd();
    let w = Watched::new("watched-owed:1");
    let mut p = w.serve(&c);
    w.drop_in();
    let name = w.img.normalized();
    wait_pin(c.socket(), &name, true).await;
    p.kill9();
    std::fs::remove_file(w.file()).unwrap();
    c.kill9();
    c.restart();
    let pid = c.pid();
    assert!(is_pinned(c.socket(), &name).await, "nobody unpinned it yet");
    let _p = w.serve(&c);
    wait_pin(c.socket(), &name, false).await;
    c.assert_still_running(pid);
}

/// imgbridge killed between a pin and the state save that records it: the
/// state knows the file (written before anything is pinned) but not its
/// image. Once the file is gone, the pin is still paid: the image's label
/// names the file. (Made certain here by taking the image out of the saved
/// state; in the test above it is a race.)
#[tokio::test]
async fn watch_dir_unpin_of_a_pin_the_state_lost_is_paid() {
    let c = Scenario::cri().containerd();
    let w = Watched::new("watched-lost:1");
    let mut p = w.serve(&c);
    w.drop_in();
    let name = w.img.normalized();
    wait_pin(c.socket(), &name, true).await;
    let state = w.dir.path().join("state.json");
    let saved = poll_async(DEADLINE, || async {
        let s = std::fs::read_to_string(&state).ok()?;
        s.contains(&name).then_some(())
    })
    .await;
    assert!(saved.is_some(), "the state never listed {name}");
    p.kill9();
    let mut doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    let files = doc["files"].as_object_mut().expect("files");
    assert_eq!(files.len(), 1, "{files:?}");
    for f in files.values_mut() {
        f["images"] = serde_json::json!({});
    }
    std::fs::write(&state, serde_json::to_vec(&doc).unwrap()).unwrap();
    std::fs::remove_file(w.file()).unwrap();
    let _p = w.serve(&c);
    wait_pin(c.socket(), &name, false).await;
}

/// A watched archive: imported and pinned, unpinned when deleted, pinned
/// again by `imgbridge import` of the same file; containerd stays up.
#[tokio::test]
async fn watch_dir_unpin_and_cli_import_repin_keep_containerd_up() {
    let mut c = Scenario::cri().containerd();
    let pid = c.pid();
    let w = Watched::new("watched:1");
    let mut p = w.serve(&c);
    w.drop_in();
    let name = w.img.normalized();
    wait_pin(c.socket(), &name, true).await;
    std::fs::remove_file(w.file()).unwrap();
    wait_pin(c.socket(), &name, false).await;
    c.assert_still_running(pid);
    p.kill9();
    let img = &w.img;

    // The one-shot CLI pins what it imports.
    let mut import = std::process::Command::new(env!("CARGO_BIN_EXE_imgbridge"));
    import
        .args(["import", "--upstream"])
        .arg(c.socket())
        .arg(img.docker_archive());
    run_ok(import);
    wait_pin(c.socket(), &name, true).await;
    c.assert_still_running(pid);
}

/// A delete imgbridge never saw (it was down; then containerd restarted as
/// well) is applied by the catch-up pass of the next start: the replica ends
/// unpinned, and the restarted containerd stays up through it.
#[tokio::test]
async fn catch_up_applies_the_delete_policy_it_missed_across_restarts() {
    let (mut c, mut p, cfg, img) = pinned_replica("missed-delete:1");
    let cfg = cfg.to_str().unwrap().to_string();
    let replica = img.normalized();
    let target = image_target(c.socket(), K8S, &replica).await;
    let dref = format!("docker.io/library/missed-delete@{}", target.digest);
    assert!(is_pinned(c.socket(), &replica).await && is_pinned(c.socket(), &dref).await);
    p.kill9();

    images_client(c.socket())
        .await
        .delete(delete_req(&replica))
        .await
        .unwrap();
    // containerd restarts in between, as after the crash this guards.
    c.kill9();
    c.restart();
    let pid = c.pid();
    assert!(
        is_pinned(c.socket(), &replica).await,
        "nobody unpinned it yet"
    );

    let p = Imgbridge::start(c.socket(), &["--config", &cfg]);
    wait_pin(c.socket(), &replica, false).await;
    wait_pin(c.socket(), &dref, false).await;
    c.assert_still_running(pid);
    assert!(p.log().contains("applying delete_policy"), "{}", p.log());
}

/// ctr through the real Transfer service (1.7 with `--local=false`, the
/// default from 2.0; also what nerdctl ≥ 2.3 uses): import, pull and tag
/// into the source namespace are in k8s.io, resolvable by CRI, the moment
/// ctr returns. 1.6 has no Transfer service.
#[tokio::test]
async fn transfer_import_pull_and_tag_are_replicated_before_ctr_returns() {
    if !flavor().has_transfer() {
        eprintln!("containerd {} has no Transfer service", flavor().version);
        return;
    }
    let mut c = Scenario::cri().containerd();
    let pid = c.pid();
    // Reconcile off: only the Transfer interception can replicate.
    let p = Imgbridge::with_config(c.socket(), "[reconcile]\nenabled = false\n");
    let resolves = |name: String| {
        let sock = c.socket().to_path_buf();
        async move { cri_image_status(&sock, &name).await.map(|i| i.id) }
    };

    let imported = TestImage::hello("xfer-import:1");
    let archive = imported.docker_archive();
    ctr_ok(
        p.socket(),
        SRC,
        [
            "images",
            "import",
            "--local=false",
            archive.to_str().unwrap(),
        ],
    );
    assert_eq!(
        resolves(imported.normalized()).await,
        Some(imported.config_digest()),
        "imported through Transfer: replicated before ctr returned"
    );

    // ctr 1.7's Transfer pull has no plain-http registry (--plain-http is
    // honoured from 2.0): the loopback registry is pulled from on 2.x.
    let (tagged, config) = if flavor().is_v2() {
        let reg = Registry::start();
        let pulled = TestImage::hello("xfer-pull:1");
        let reference = pulled.push(&reg.addr());
        ctr_ok(
            p.socket(),
            SRC,
            [
                "images",
                "pull",
                "--local=false",
                "--plain-http",
                &reference,
            ],
        );
        assert_eq!(
            resolves(reference.clone()).await,
            Some(pulled.config_digest()),
            "pulled through Transfer: replicated before ctr returned"
        );
        (reference, pulled.config_digest())
    } else {
        (imported.normalized(), imported.config_digest())
    };

    ctr_ok(
        p.socket(),
        SRC,
        [
            "images",
            "tag",
            "--local=false",
            &tagged,
            "docker.io/library/xfer-tag:2",
        ],
    );
    assert_eq!(
        resolves("docker.io/library/xfer-tag:2".into()).await,
        Some(config),
        "tagged through Transfer: replicated before ctr returned"
    );
    c.assert_still_running(pid);
}
