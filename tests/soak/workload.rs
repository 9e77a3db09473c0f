//! The soak's workload, each kind of work in a thread of its own, all at
//! once: builds through buildkitd, pushes to the registry endpoint,
//! archives and pull lists in a watched directory, and kubelet's side —
//! a pod from every image the moment its write returns, and an image GC.

use std::fs;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use imgbridge_test_support::ctr::ctr;
use imgbridge_test_support::images::TestImage;
use imgbridge_test_support::peers::peer;
use imgbridge_test_support::util::{output_with_timeout, poll, TOOL_TIMEOUT};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::record::{Call, Outcome};
use crate::Node;

/// An image the work wrote, whatever its call returned (a build cut by a
/// containerd kill may have written its image all the same): the GC
/// worker deletes it at its source once done with it, as a user would,
/// and kubelet's GC may then take the replica.
pub struct Made {
    /// Where the image's source record lives (`None`: an import, whose
    /// file the importer owns).
    pub source_ns: Option<&'static str>,
    pub name: String,
}

/// What CRI says of `name` right now, asked once, as kubelet would the
/// moment a Deployment names it.
fn at_once(node: &Node, name: &str) -> Outcome {
    match node.crictl.inspecti(name) {
        Ok(Some(_)) => Outcome::Ok,
        Ok(None) => Outcome::Miss("CRI does not know it".into()),
        Err(e) => Outcome::Unconfirmed(e),
    }
}

/// A pod from `name` that must print `expect`.
fn pod(node: &Node, name: &str, expect: &str) -> Result<(), String> {
    node.crictl.try_run_pod(name, &[], expect).map(|_| ())
}

/// Ends a write: on success, CRI at once and a pod; recorded.
#[allow(clippy::too_many_arguments)]
fn finish(
    node: &Node,
    worker: &'static str,
    kind: &str,
    name: &str,
    start: f64,
    result: Result<(), String>,
    expect: &str,
    source_ns: Option<&'static str>,
) {
    let end = node.rec.now();
    let (outcome, pod_run) = match result {
        Err(e) => (Outcome::Failed(e), None),
        Ok(()) => match at_once(node, name) {
            Outcome::Ok => (Outcome::Ok, Some(pod(node, name, expect))),
            other => (other, None),
        },
    };
    node.rec.call(Call {
        start,
        end,
        worker,
        kind: kind.to_string(),
        name: name.to_string(),
        cri_ms: matches!(outcome, Outcome::Ok).then_some(0),
        outcome,
        pod: pod_run,
        pod_end: node.rec.now(),
    });
    node.made.lock().unwrap().push(Made {
        source_ns,
        name: name.to_string(),
    });
}

fn run(cmd: Command) -> Result<(), String> {
    status(output_with_timeout(cmd, TOOL_TIMEOUT))
}

fn status(out: std::process::Output) -> Result<(), String> {
    match out.status.success() {
        true => Ok(()),
        false => Err(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or_default()
        )),
    }
}

/// buildkitd builds through imgbridge's socket: plain, `FROM` a lazy base
/// (only its config changes, so its layers are written without being
/// fetched first), multi-stage, and rebuilds of one tag; now and then a
/// nerdctl tag and rmi.
pub fn builder(node: Arc<Node>, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let busybox = fs::read("/bin/busybox").expect("/bin/busybox");
    let mut i = 0u64;
    while !node.stop.load(Ordering::Relaxed) {
        i += 1;
        let nonce = format!("soak-build-{i}-{}", rng.random::<u32>());
        let cat = r#"CMD ["/bin/busybox","cat","/v"]"#;
        let (kind, dockerfile, name) = match rng.random_range(0..4) {
            0 => (
                "plain",
                format!("FROM scratch\nCOPY --chmod=755 busybox /bin/busybox\nCOPY v /v\n{cat}\n"),
                format!("docker.io/library/soak-plain:{i}"),
            ),
            1 => (
                "lazy-base",
                format!(
                    "FROM {}\nCMD [\"/bin/busybox\",\"echo\",\"{nonce}\"]\n",
                    node.base
                ),
                format!("docker.io/library/soak-lazy:{i}"),
            ),
            2 => (
                "multi-stage",
                format!(
                    "FROM {} AS src\nCOPY v /v\nFROM scratch\nCOPY --chmod=755 busybox /bin/busybox\nCOPY --from=src /v /v\n{cat}\n",
                    node.base
                ),
                format!("docker.io/library/soak-multi:{i}"),
            ),
            _ => (
                "rebuild",
                format!("FROM scratch\nCOPY --chmod=755 busybox /bin/busybox\nCOPY v /v\n{cat}\n"),
                "docker.io/library/soak-dev:latest".to_string(),
            ),
        };
        let start = node.rec.now();
        let built = status(node.buildkit.try_build(
            &dockerfile,
            &[
                ("busybox", &busybox),
                ("v", format!("{nonce}\n").as_bytes()),
            ],
            &format!("type=image,name={name}"),
            &[],
        ));
        // A rebuilt tag is not consumed: the GC would race the next build.
        let source = (kind != "rebuild").then_some("buildkit");
        finish(&node, "build", kind, &name, start, built, &nonce, source);
        if let (Some(n), true) = (&node.nerdctl, i.is_multiple_of(5)) {
            // A tag and its removal through the socket, as a user does.
            let alias = format!("docker.io/library/soak-alias:{i}");
            let start = node.rec.now();
            let tagged =
                status(n.run(["tag", &name, &alias])).and_then(|()| status(n.run(["rmi", &alias])));
            if let Err(e) = &tagged {
                node.rec.call(Call {
                    start,
                    end: node.rec.now(),
                    worker: "build",
                    kind: "nerdctl-tag-rmi".into(),
                    name: alias,
                    outcome: Outcome::Failed(e.clone()),
                    cri_ms: None,
                    pod: None,
                    pod_end: node.rec.now(),
                });
            }
        }
    }
}

/// Pushes to the registry endpoint: a new one-layer image on the same
/// base each round (only the new layer is sent), by skopeo and crane in
/// turn.
pub fn pusher(node: Arc<Node>, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let crane = peer("crane");
    let mut i = 0u64;
    while !node.stop.load(Ordering::Relaxed) {
        i += 1;
        let nonce = format!("soak-push-{i}-{}", rng.random::<u32>());
        let img = TestImage::build(
            &format!("soak-push:{i}"),
            1,
            &["/bin/busybox", "echo", &nonce],
            0,
        );
        let start = node.rec.now();
        let (kind, name, pushed) = match (crane, rng.random_bool(0.5)) {
            (Some(crane), true) => {
                let name = format!("{}/soak/crane:{i}", node.endpoint);
                let mut cmd = crane.command("crane");
                cmd.args(["push", "--insecure"])
                    .arg(img.docker_archive())
                    .arg(&name);
                ("crane", name, run(cmd))
            }
            _ => {
                let name = format!("{}/soak/skopeo:{i}", node.endpoint);
                let mut cmd = Command::new("skopeo");
                cmd.args(["copy", "--quiet", "--dest-tls-verify=false"])
                    .arg(img.oci_ref())
                    .arg(format!("docker://{name}"));
                ("skopeo", name, run(cmd))
            }
        };
        finish(
            &node,
            "push",
            kind,
            &name,
            start,
            pushed,
            &nonce,
            Some("buildkit"),
        );
    }
}

/// Files in the watched directory: archives dropped (renamed in), replaced
/// and deleted; pull lists naming images of the loopback registry. An
/// import is asynchronous: its "return" is the file landing, and CRI must
/// resolve it within a minute.
pub fn importer(node: Arc<Node>, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut i = 0u64;
    while !node.stop.load(Ordering::Relaxed) {
        i += 1;
        let nonce = format!("soak-import-{i}-{}", rng.random::<u32>());
        let slot = rng.random_range(0..3);
        let img = TestImage::build(
            &format!("soak-import-{slot}:{i}"),
            1,
            &["/bin/busybox", "echo", &nonce],
            0,
        );
        let (kind, name, file) = match rng.random_range(0..3) {
            0 => {
                let f = node.watch.join(format!("list-{slot}.txt"));
                let pushed = img.push(&node.registry);
                ("pull-list", pushed, f)
            }
            1 if node.watch.join(format!("archive-{slot}.tar")).exists() => {
                // The file goes; its image is unpinned (the GC's to take).
                let f = node.watch.join(format!("archive-{slot}.tar"));
                let _ = fs::remove_file(&f);
                continue;
            }
            _ => (
                "archive",
                img.normalized(),
                node.watch.join(format!("archive-{slot}.tar")),
            ),
        };
        let start = node.rec.now();
        let tmp = node.watch.join(format!(".soak-{i}.part"));
        match kind {
            "pull-list" => fs::write(&tmp, format!("# soak round {i}\n{name}\n")).unwrap(),
            _ => {
                fs::copy(img.docker_archive(), &tmp).unwrap();
            }
        }
        fs::rename(&tmp, &file).unwrap();
        let resolved = poll(Duration::from_secs(60), || {
            matches!(node.crictl.inspecti(&name), Ok(Some(_))).then(|| node.rec.now())
        });
        let end = node.rec.now();
        let (outcome, cri_ms, pod_run) = match resolved {
            Some(at) => (
                Outcome::Ok,
                Some(((at - start) * 1000.0) as u64),
                Some(pod(&node, &name, &nonce)),
            ),
            None => (
                Outcome::Miss("not resolved by CRI within 60 s of the file landing".into()),
                None,
                None,
            ),
        };
        node.rec.call(Call {
            start,
            end,
            worker: "import",
            kind: kind.into(),
            name,
            outcome,
            cri_ms,
            pod: pod_run,
            pod_end: node.rec.now(),
        });
    }
}

/// Deletes the images the work made in their source namespace through
/// imgbridge (a user's `nerdctl rmi`: imgbridge unpins the replica), a
/// delete that failed (a fault) again on the next pass, then removes every
/// unpinned soak image from `k8s.io` through CRI as kubelet's image GC
/// does. The newest few are kept.
pub fn gc(node: Arc<Node>) {
    const KEEP: usize = 4;
    let mut pass = 0u64;
    while !node.stop.load(Ordering::Relaxed) {
        pass += 1;
        if pass.is_multiple_of(10) {
            // buildkitd's own GC, as a node runs it: unused cache goes.
            let _ = node.buildkit.buildctl(["prune", "--keep-duration", "30s"]);
        }
        let old: Vec<Made> = {
            let mut q = node.made.lock().unwrap();
            let n = q.len().saturating_sub(KEEP);
            q.drain(..n).collect()
        };
        let mut again = Vec::new();
        for c in old {
            if let Some(ns) = c.source_ns {
                let start = node.rec.now();
                let out = ctr(&node.ib_sock, ns, ["images", "rm", &c.name]);
                let err = String::from_utf8_lossy(&out.stderr);
                // A failed build may have written nothing: not found is done.
                if !out.status.success() && !err.contains("not found") {
                    node.rec.call(Call {
                        start,
                        end: node.rec.now(),
                        worker: "gc",
                        kind: "source-delete".into(),
                        name: c.name.clone(),
                        outcome: Outcome::Failed(err.into()),
                        cri_ms: None,
                        pod: None,
                        pod_end: node.rec.now(),
                    });
                    again.push(c);
                }
            }
        }
        node.made.lock().unwrap().splice(0..0, again);
        collect_unpinned(&node, false);
        // The GC's period (kubelet runs its image GC every 5 minutes).
        std::thread::sleep(Duration::from_secs(3));
    }
}

/// kubelet's `--minimum-image-ttl-duration` (2 min by default): its GC
/// takes no image it first saw less than this ago. Without it the soak's
/// GC took a pull list's image in the moment between CRI's pull and
/// imgbridge's pin, under a pod about to start (run 5 of the hour).
const MIN_IMAGE_AGE: Duration = Duration::from_secs(120);

/// One kubelet-style image GC pass: every image CRI reports unpinned that
/// it first saw at least [`MIN_IMAGE_AGE`] ago goes (`all`: every unpinned
/// one, for the drain); kubelet also spares images in use, and CRI refuses
/// those itself.
pub fn collect_unpinned(node: &Node, all: bool) -> usize {
    let out = node.crictl.run(["images", "-o", "json"]);
    let Ok(list) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else {
        return 0;
    };
    let mut seen = node.first_seen.lock().unwrap();
    let now = std::time::Instant::now();
    let listed: std::collections::HashSet<String> = list["images"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| i["id"].as_str().map(str::to_owned))
        .collect();
    seen.retain(|id, _| listed.contains(id));
    let mut removed = 0;
    for img in list["images"].as_array().into_iter().flatten() {
        let id = img["id"].as_str().unwrap_or_default();
        let first = *seen.entry(id.to_string()).or_insert(now);
        if img["pinned"] != true
            && (all || now.duration_since(first) >= MIN_IMAGE_AGE)
            && node.crictl.run(["rmi", id]).status.success()
        {
            removed += 1;
        }
    }
    removed
}
