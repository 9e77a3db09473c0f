//! A real kubelet (standalone, static pods; tests/support/src/kubelet.rs) runs
//! what was just built: the dev loop with and without imgbridge in the path,
//! a rebuilt mutable tag, the socket swap with a live kubelet under restarts
//! of imgbridge and containerd, kubelet's image GC next to imgbridge's
//! replicas, and KEP-2535's credential verification of replicas.
//!
//! Runs on every containerd of the matrix (65-73 s each on two shared cores).

use std::time::{Duration, Instant};

use imgbridge_test_support::kubelet::{Kubelet, KubeletOpts, StaticPod, KUBELET_POD_TIMEOUT};
use imgbridge_test_support::peers::Buildkitd;
use imgbridge_test_support::prelude::*;
use imgbridge_test_support::scenario::config_file;

fn busybox() -> Vec<u8> {
    std::fs::read("/bin/busybox").expect("static busybox (busybox-static)")
}

/// What kubelet logs for a pull or a failed image resolution; none may
/// appear in a dev-loop round through imgbridge.
const PULL_SIGNS: [&str; 4] = [
    "ErrImageNeverPull",
    "ErrImagePull",
    "ImagePullBackOff",
    "Pulling image",
];

/// Builds `docker.io/library/<repo>:<tag>` holding busybox and `/v` =
/// `content` (FROM scratch: nothing to fetch), through `bk`.
fn build(bk: &Buildkitd, repo: &str, tag: &str, content: &str) -> String {
    let name = format!("docker.io/library/{repo}:{tag}");
    bk.build(
        "FROM scratch\nCOPY --chmod=755 busybox /bin/busybox\nCOPY v /v\n",
        &[("busybox", &busybox()), ("v", content.as_bytes())],
        &format!("type=image,name={name}"),
        &[],
    );
    name
}

/// A pod that prints `/v` and sleeps.
fn cat_v(pod: &str, image: &str) -> StaticPod {
    StaticPod::new(pod, image, "cat /v; echo; exec /bin/busybox sleep 100000")
}

/// One dev-loop round: build a new tag with new content, write the static
/// pod `dev-<n>` the moment buildctl returns (a new pod per build, as a
/// Deployment's rollout makes), wait (with a deadline) for kubelet to run
/// it. `Ok(build done -> running)`, or what kubelet did instead.
fn round(
    bk: &Buildkitd,
    k: &Kubelet,
    n: usize,
    policy: &str,
    within: Duration,
) -> Result<Duration, String> {
    let content = unique_name(&format!("devloop-round-{n}"));
    let tag = format!("r{n}-{}", std::process::id());
    let name = build(bk, "devapp", &tag, &content);
    let done = Instant::now();
    let image = format!("devapp:{tag}");
    let mark = k.log().len();
    let pod = format!("dev-{n}");
    k.write_pod(&cat_v(&pod, &image).policy(policy));
    let ran = poll(within, || {
        if let Some(c) = k.running(&pod, &image) {
            if k.container_log(&c).contains(&content) {
                return Some(Ok(done.elapsed()));
            }
        }
        let log = k.log();
        let new = &log[mark.min(log.len())..];
        PULL_SIGNS.iter().find(|s| new.contains(*s)).map(|s| {
            Err(format!(
                "round {n} ({policy}): kubelet logged {s:?} for {name}"
            ))
        })
    });
    let res =
        ran.unwrap_or_else(|| Err(format!("round {n}: {image} not running within {within:?}")));
    if res.is_ok() {
        let log = k.log();
        let new = &log[mark.min(log.len())..];
        if let Some(s) = PULL_SIGNS.iter().find(|s| new.contains(*s)) {
            return Err(format!(
                "round {n} ({policy}): ran, but kubelet logged {s:?}"
            ));
        }
    }
    res
}

/// The ten rounds: IfNotPresent, once Never (round 5); each round's pod
/// goes once the next one's result is in.
fn dev_loop(bk: &Buildkitd, k: &Kubelet, within: Duration) -> Vec<Result<Duration, String>> {
    (1..=10)
        .map(|n| {
            let r = round(
                bk,
                k,
                n,
                if n == 5 { "Never" } else { "IfNotPresent" },
                within,
            );
            k.remove_pod(&format!("dev-{}", n - 1));
            r
        })
        .collect()
}

fn ms(d: &Duration) -> u128 {
    d.as_millis()
}

/// containerd with CRI, imgbridge in front with reconcile off (a replica in
/// time is the proxied write's doing), buildkitd through imgbridge and a
/// kubelet on containerd's own socket; `None` without the peers.
fn through_imgbridge() -> Option<(Containerd, Imgbridge, Buildkitd, Kubelet)> {
    let c = Scenario::cri().containerd();
    let p = Imgbridge::with_config(c.socket(), "[reconcile]\nenabled = false\n");
    let bk = Buildkitd::start(p.socket(), "buildkit", None)?;
    let k = Kubelet::start(KubeletOpts::new(c.socket()))?;
    Some((c, p, bk, k))
}

/// Tilt's loop through imgbridge: each round's content runs under the real
/// kubelet with no pull, no `ErrImageNeverPull`, no back-off.
#[test]
fn dev_loop_through_imgbridge_runs_each_build_at_once() {
    let Some((_c, p, bk, k)) = through_imgbridge() else {
        return;
    };
    let results = dev_loop(&bk, &k, KUBELET_POD_TIMEOUT);
    let times: Vec<u128> = results
        .iter()
        .map(|r| match r {
            Ok(d) => ms(d),
            Err(e) => panic!(
                "{e}\n--- kubelet ---\n{}\n--- imgbridge ---\n{}",
                k.log_tail(),
                p.log_tail()
            ),
        })
        .collect();
    eprintln!("kubelet dev loop through imgbridge: build done -> running (ms) {times:?}");
    k.stop();
}

/// The same rounds with buildkitd writing to containerd's own socket: the
/// image stays in `buildkit`, kubelet cannot find it (IfNotPresent pulls,
/// Never fails), every round fails. The loop above can fail.
#[test]
fn dev_loop_without_imgbridge_fails_every_round() {
    let c = Scenario::cri().containerd();
    let Some(bk) = Buildkitd::start(c.socket(), "buildkit", None) else {
        return;
    };
    let Some(k) = Kubelet::start(KubeletOpts::new(c.socket())) else {
        return;
    };
    let results = dev_loop(&bk, &k, Duration::from_secs(30));
    for r in &results {
        let e = r
            .as_ref()
            .err()
            .unwrap_or_else(|| panic!("a round ran without imgbridge: {results:?}"));
        assert!(PULL_SIGNS.iter().any(|s| e.contains(s)), "{e}");
    }
    eprintln!(
        "kubelet dev loop without imgbridge: {} of 10 rounds failed as expected",
        results.len()
    );
    k.stop();
}

/// `app:dev` rebuilt and the static pod replaced (an annotation changes,
/// as `kubectl rollout restart` does): kubelet resolves the tag to the new
/// image and the new container runs the new content.
#[test]
fn rebuilt_mutable_tag_runs_the_new_content() {
    let Some((_c, _p, bk, k)) = through_imgbridge() else {
        return;
    };
    let mut seen = Vec::new();
    for n in 1..=2 {
        let content = unique_name(&format!("mutable-{n}"));
        build(&bk, "app", "dev", &content);
        let mut pod = cat_v("app", "app:dev");
        pod.annotations
            .push(("restartedAt".into(), content.clone()));
        k.write_pod(&pod);
        let ctr = k.wait_running("app", "app:dev", &content);
        // The old pod's container is gone before the new one counts.
        seen.push(ctr);
    }
    assert_ne!(seen[0].uid, seen[1].uid, "the static pod was not replaced");
    assert_ne!(
        seen[0].image_id, seen[1].image_id,
        "kubelet ran the rebuilt tag from the old image"
    );
    eprintln!(
        "mutable tag: image ids {} -> {}",
        seen[0].image_id, seen[1].image_id
    );
    k.stop();
}

/// How a downtime ends, for the socket swap.
#[derive(Debug, Clone, Copy)]
enum Outage {
    ImgbridgeSigterm,
    ImgbridgeSigkill,
    ContainerdRestart,
}

/// The drop-in socket swap with a live kubelet: both of kubelet's
/// endpoints set as `packaging/swap/kubelet-config.yaml` says (its path
/// replaced by this imgbridge's socket). Two static pods
/// run; imgbridge SIGTERM + restart, SIGKILL + restart, and a containerd
/// restart: their containers never restart, kubelet's CRI calls succeed
/// again within 5 s of the return, and a pod written while imgbridge was
/// down runs once it is back.
#[test]
fn socket_swap_live_kubelet_rides_out_restarts() {
    let mut c = Scenario::cri().containerd();
    let first = Imgbridge::start(c.socket(), &[]);
    let sock = first.socket().to_path_buf();
    let mut current = Some(first);
    let mut stopped = Vec::new();
    for name in ["swap-a:1", "swap-b:1", "swap-new:1"] {
        ctr_import(&sock, "buildkit", &TestImage::hello(name).docker_archive());
    }
    let swap = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/packaging/swap/kubelet-config.yaml"
    ))
    .unwrap()
    .replace(
        "/run/containerd/containerd.sock",
        &sock.display().to_string(),
    );
    assert_eq!(
        swap.matches(&*sock.display().to_string()).count(),
        2,
        "{swap}"
    );
    // The endpoint given here is not used: the packaged lines set both.
    let Some(k) = Kubelet::start(KubeletOpts::new(c.socket()).with(&swap)) else {
        return;
    };
    let pods = [("swap-a", "swap-a:1"), ("swap-b", "swap-b:1")];
    let before: Vec<_> = pods
        .iter()
        .map(|(n, img)| {
            k.write_pod(&StaticPod::printing(n, img, &format!("{n}-up")));
            k.wait_running(n, img, &format!("{n}-up"))
        })
        .collect();

    let mut report = Vec::new();
    for outage in [
        Outage::ImgbridgeSigterm,
        Outage::ImgbridgeSigkill,
        Outage::ContainerdRestart,
    ] {
        let errors = || {
            k.metric("kubelet_runtime_operations_errors_total{operation_type=\"list_podsandbox\"}")
        };
        let errs = errors();
        match outage {
            Outage::ImgbridgeSigterm => {
                let mut p = current.take().unwrap();
                p.sigterm();
                stopped.push(p);
            }
            Outage::ImgbridgeSigkill => {
                let mut p = current.take().unwrap();
                p.kill9();
                stopped.push(p);
            }
            Outage::ContainerdRestart => c.stop(),
        }
        // kubelet noticed: its relists fail.
        poll(Duration::from_secs(15), || (errors() > errs).then_some(())).unwrap_or_else(|| {
            panic!(
                "{outage:?}: kubelet never saw the runtime go\n{}",
                k.log_tail()
            )
        });
        if let Outage::ImgbridgeSigkill = outage {
            k.write_pod(&StaticPod::printing(
                "swap-new",
                "swap-new:1",
                "swap-new-up",
            ));
        }
        let back = match outage {
            Outage::ContainerdRestart => {
                c.restart();
                Instant::now()
            }
            _ => {
                let p = Imgbridge::start_at(&sock, c.socket(), &[]);
                current = Some(p);
                Instant::now()
            }
        };
        let took = k
            .wait_runtime_back(back, Duration::from_secs(30))
            .unwrap_or_else(|| {
                panic!(
                    "{outage:?}: kubelet's runtime calls never succeeded again\n{}",
                    k.log_tail()
                )
            });
        eprintln!(
            "socket swap: {outage:?}: kubelet's CRI calls succeed {} ms after the return",
            ms(&took)
        );
        report.push((outage, took));
        assert!(
            took <= Duration::from_secs(5),
            "{outage:?}: kubelet took {took:?} to reach the runtime again\n{}",
            k.log_tail()
        );
        for (b, (n, img)) in before.iter().zip(pods) {
            let now = k
                .running(n, img)
                .unwrap_or_else(|| panic!("{outage:?}: {n} not running: {:?}", k.pod(n, img)));
            assert_eq!(
                (&now.id, now.restart_count),
                (&b.id, 0),
                "{outage:?}: {n} restarted"
            );
        }
    }
    k.wait_running("swap-new", "swap-new:1", "swap-new-up");
    // Still the same containers once everything settled.
    for (b, (n, img)) in before.iter().zip(pods) {
        let now = k.running(n, img).expect("running");
        assert_eq!((&now.id, now.restart_count), (&b.id, 0), "{n} restarted");
    }
    eprintln!("socket swap recovery: {report:?}");
    k.stop();
    drop(current);
    drop(stopped);
}

/// KEP-2535 on (`KubeletEnsureSecretPulledImages`): a replica runs under the
/// default `imagePullCredentialsVerificationPolicy`
/// (NeverVerifyPreloadedImages: kubelet never pulled it, so it is
/// "preloaded" and the pod's credentials are not even looked up). Under
/// AlwaysVerify kubelet must pull it to check the pod's credentials (a
/// replica of a local build is in no registry: ErrImagePull);
/// NeverVerifyAllowlistedImages runs it when its repository is in
/// `preloadedImagesVerificationAllowlist`. Static pods may not reference
/// secrets (kubelet refuses the manifest), so these pods name none: the
/// policy decides before any secret would be read.
#[test]
fn credential_verification_lets_replicas_run_under_the_default_policy() {
    let c = Scenario::cri().containerd();
    let p = Imgbridge::start(c.socket(), &[]);
    let img = TestImage::hello("cred-app:1");
    ctr_import(p.socket(), "buildkit", &img.docker_archive());
    let image = img.normalized();
    let gates = KubeletOpts::new(c.socket())
        .with("featureGates:\n  KubeletEnsureSecretPulledImages: true\n");
    let Some(mut k) = Kubelet::start(gates.clone()) else {
        return;
    };
    let pod = |name: &str| StaticPod::printing(name, &image, &format!("{name}-up"));

    let mark = k.log().len();
    k.write_pod(&pod("cred-default"));
    k.wait_running("cred-default", &image, "cred-default-up");
    let log = k.log();
    assert!(
        !log[mark..].contains("Pulling image"),
        "default policy: kubelet pulled a replica\n{}",
        k.log_tail()
    );

    k.restart_with(
        gates
            .clone()
            .with("imagePullCredentialsVerificationPolicy: AlwaysVerify\n"),
    );
    k.write_pod(&pod("cred-always"));
    let reason = k.wait_waiting(
        "cred-always",
        &image,
        &["ErrImagePull", "ImagePullBackOff"],
        KUBELET_POD_TIMEOUT,
    );
    assert!(
        reason.is_some(),
        "AlwaysVerify ran a replica without a pull\n{}",
        k.log_tail()
    );
    k.remove_pod("cred-always");

    k.restart_with(gates.with(
        "imagePullCredentialsVerificationPolicy: NeverVerifyAllowlistedImages\npreloadedImagesVerificationAllowlist: [\"docker.io/library/cred-app\"]\n",
    ));
    k.write_pod(&pod("cred-allow"));
    k.wait_running("cred-allow", &image, "cred-allow-up");
    eprintln!("credential verification: default runs, AlwaysVerify {reason:?}, allowlisted runs");
    k.stop();
}

/// kubelet's image GC, forced: its periodic run (at start, then every
/// 5 min, fixed) over a 1 % high threshold frees down to 0 %; and, every
/// 10 s (the eviction manager's period), disk "pressure" below 99 % free
/// makes kubelet reclaim with the same image GC (`DeleteUnusedImages`).
/// Images of any age: `0s` would be defaulted to 2 min, and the age counts
/// from when this kubelet first saw the image, so an image goes at the
/// second look.
const GC_ON: &str = "imageGCHighThresholdPercent: 1\nimageGCLowThresholdPercent: 0\nimageMinimumGCAge: 1ns\nevictionHard:\n  imagefs.available: \"99%\"\n";

/// What kubelet logs each time its eviction manager runs the image GC.
const GC_RUN: &str = "Attempting to delete unused images";

fn in_k8s_io(c: &Containerd, name: &str) -> bool {
    c.ctr_ok("k8s.io", ["images", "ls", "-q"])
        .lines()
        .any(|l| l == name)
}

fn gc_runs(k: &Kubelet) -> usize {
    k.log().matches(GC_RUN).count()
}

/// kubelet's image GC next to imgbridge's replicas: pinned replicas
/// (`replication.pin = true`) and directory imports (pinned by the
/// importer) survive; an unpinned replica no pod uses is removed by kubelet
/// and not re-created while imgbridge runs (3 GC periods watched); the one
/// a pod uses stays. A restart of imgbridge re-creates it (the catch-up pass
/// cannot tell it from a write missed while down) and kubelet's next GC
/// removes it again: no loop, one copy per restart.
#[test]
fn image_gc_removes_unused_unpinned_replicas_and_keeps_pinned_ones() {
    let c = Scenario::cri().containerd();
    let state = tempdir("gc-");
    let dir = state.path().join("images");
    std::fs::create_dir(&dir).unwrap();
    let imported = TestImage::hello("gc-dir:1");
    std::fs::copy(imported.docker_archive(), dir.join("gc-dir.tar")).unwrap();
    // Two imgbridges on one containerd: the unpinned one for `buildkit`
    // (reconcile and its event backstop on, as shipped), the pinned one for
    // `pinned`, which also imports the directory.
    let unpinned_cfg = "[replication]\nsource_namespaces = [\"buildkit\"]\npin = false\n";
    let a = Imgbridge::with_config(c.socket(), unpinned_cfg);
    let b = Imgbridge::with_config(
        c.socket(),
        &format!(
            "[replication]\nsource_namespaces = [\"pinned\"]\npin = true\n[import]\nstate_file = \"{}\"\ndebounce = \"300ms\"\n[[import.dirs]]\npath = \"{}\"\n",
            state.path().join("state.json").display(),
            dir.display()
        ),
    );
    let unused = TestImage::hello("gc-unused:1");
    let used = TestImage::hello("gc-used:1");
    let pinned = TestImage::hello("gc-pinned:1");
    ctr_import(a.socket(), "buildkit", &unused.docker_archive());
    ctr_import(a.socket(), "buildkit", &used.docker_archive());
    ctr_import(b.socket(), "pinned", &pinned.docker_archive());
    poll(Duration::from_secs(30), || {
        in_k8s_io(&c, &imported.normalized()).then_some(())
    })
    .unwrap_or_else(|| panic!("directory import never landed\n{}", b.log_tail()));
    // Pins protect from kubelet's GC only where CRI honours them (doctor
    // says which); elsewhere they go too, as doctor warns.
    let pinned_names = [imported.normalized(), pinned.normalized()];
    let mut keep = vec![used.normalized()];
    if flavor().honours_pinned() {
        keep.extend(pinned_names.iter().cloned());
    }
    for name in keep
        .iter()
        .chain(&pinned_names)
        .chain([&unused.normalized()])
    {
        assert!(in_k8s_io(&c, name), "{name} not in k8s.io");
    }

    // A pod uses one replica before GC is on (else the first run takes it).
    let Some(mut k) = Kubelet::start(KubeletOpts::new(c.socket())) else {
        return;
    };
    k.write_pod(&StaticPod::printing(
        "gc-used",
        &used.normalized(),
        "gc-used-up",
    ));
    k.wait_running("gc-used", &used.normalized(), "gc-used-up");
    let on = k.opts().clone().with(GC_ON);
    k.restart_with(on);
    poll(Duration::from_secs(60), || {
        (!in_k8s_io(&c, &unused.normalized())).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "kubelet's GC left {}\n{}",
            unused.normalized(),
            k.log_tail()
        )
    });
    let t_removed = Instant::now();
    for run in 1..=3 {
        let before = gc_runs(&k);
        poll(Duration::from_secs(30), || {
            (gc_runs(&k) > before).then_some(())
        })
        .unwrap_or_else(|| panic!("GC run {run} never came\n{}", k.log_tail()));
        assert!(
            !in_k8s_io(&c, &unused.normalized()),
            "GC run {run}: imgbridge re-created the replica kubelet removed\n{}",
            a.log_tail()
        );
        for name in &keep {
            assert!(
                in_k8s_io(&c, name),
                "GC run {run}: {name} was removed\n{}",
                k.log_tail()
            );
        }
    }
    if !flavor().honours_pinned() {
        for name in &pinned_names {
            assert!(
                !in_k8s_io(&c, name),
                "containerd {} ignores pins, yet kubelet's GC kept {name}",
                flavor().version
            );
        }
    }
    // The source is untouched: kubelet's GC works in k8s.io only.
    assert!(c
        .ctr_ok("buildkit", ["images", "ls", "-q"])
        .contains(&unused.normalized()));
    eprintln!(
        "image GC: unpinned unused replica removed, 3 more GC runs over {:?} kept it gone; in-use kept; pinned and imported {}",
        t_removed.elapsed(),
        if flavor().honours_pinned() { "kept" } else { "removed (pins not honoured)" }
    );

    // imgbridge restarts: its catch-up pass writes the replica again ...
    let mut a = a;
    let sock = a.socket().to_path_buf();
    a.sigterm();
    let _a2 = Imgbridge::start_at(
        &sock,
        c.socket(),
        &["--config", &config_file(unpinned_cfg).display().to_string()],
    );
    poll(Duration::from_secs(30), || {
        in_k8s_io(&c, &unused.normalized()).then_some(())
    })
    .expect("the catch-up pass re-creates the replica");
    // ... and kubelet's next GC runs remove it again.
    poll(Duration::from_secs(60), || {
        (!in_k8s_io(&c, &unused.normalized())).then_some(())
    })
    .unwrap_or_else(|| panic!("next GC run kept the re-created replica\n{}", k.log_tail()));
    k.stop();
    drop(b);
}
