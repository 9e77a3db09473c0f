//! The real buildkitd (containerd worker only, namespace `buildkit`)
//! writing through imgbridge. After every `buildctl build` returns, with no
//! wait, kubelet's view (crictl on containerd's own socket) resolves the new
//! image id and a crictl pod runs it.

use std::path::{Path, PathBuf};
use std::time::Instant;

use imgbridge_test_support::grpc::assert_cri_managed;
use imgbridge_test_support::peers::{Buildkitd, Crictl};
use imgbridge_test_support::prelude::*;

/// containerd with CRI, imgbridge in front, buildkitd through imgbridge,
/// crictl on containerd's socket, and a loopback registry with a base image.
struct Setup {
    c: Containerd,
    p: Imgbridge,
    bk: Buildkitd,
    cri: Crictl,
    reg: Registry,
    dir: tempfile::TempDir,
}

impl Setup {
    fn start() -> Option<Setup> {
        let c = Scenario::cri().containerd();
        let crictl = Crictl::new(c.socket())?;
        // Reconcile off: only the proxied writes can replicate, so a
        // replica in k8s.io on return is the proxy's doing, not a backstop's.
        let p = Imgbridge::with_config(c.socket(), "[reconcile]\nenabled = false\n");
        let dir = tempdir("bk-meta-");
        let reg = Registry::start();
        let bk = Buildkitd::start(p.socket(), "buildkit", Some(&reg.addr()))?;
        Some(Setup {
            c,
            p,
            bk,
            cri: crictl,
            reg,
            dir,
        })
    }

    /// A base image in the registry whose CMD prints its hello text.
    fn base(&self, tag: &str) -> (String, String) {
        let img = TestImage::hello(tag);
        (img.push(&self.reg.addr()), hello_text(tag))
    }

    /// Builds `dockerfile` into `name` and returns the config digest
    /// buildkit reports; then checks, with no wait, that CRI resolves
    /// `name` to it.
    fn build(
        &self,
        name: &str,
        dockerfile: &str,
        files: &[(&str, &[u8])],
        extra: &[&str],
    ) -> String {
        self.build_to(
            name,
            dockerfile,
            files,
            &format!("type=image,name={name}"),
            extra,
        )
    }

    fn build_to(
        &self,
        name: &str,
        dockerfile: &str,
        files: &[(&str, &[u8])],
        output: &str,
        extra: &[&str],
    ) -> String {
        let meta = self.dir.path().join(unique_name("meta"));
        let meta_arg = format!("--metadata-file={}", meta.display());
        let mut args = vec![meta_arg.as_str()];
        args.extend(extra);
        self.bk.build(dockerfile, files, output, &args);
        let config = config_digest(&meta, self.c.socket());
        let seen = self.cri.image_id(name);
        assert_eq!(
            seen.as_deref(),
            Some(config.as_str()),
            "right after the build returned, CRI resolves {name} to {seen:?}, not the new {config}\n{}",
            self.p.log_tail()
        );
        config
    }
}

/// The image config buildkit wrote (for an index, the one of the host's
/// platform manifest, which CRI resolves to).
fn config_digest(meta: &PathBuf, containerd: &Path) -> String {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(meta).unwrap()).unwrap();
    if let Some(c) = v["containerimage.config.digest"].as_str() {
        return c.to_string();
    }
    let index = v["containerimage.digest"]
        .as_str()
        .unwrap_or_else(|| panic!("no image digest in {v}"));
    let blob = |d: &str| -> serde_json::Value {
        serde_json::from_str(&ctr_ok(containerd, "buildkit", ["content", "get", d])).unwrap()
    };
    let index = blob(index);
    let manifest = index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["platform"]["architecture"] != "unknown")
        .unwrap_or_else(|| panic!("no platform manifest in {index}"));
    blob(manifest["digest"].as_str().unwrap())["config"]["digest"]
        .as_str()
        .unwrap()
        .to_string()
}

fn busybox() -> Vec<u8> {
    std::fs::read("/bin/busybox").expect("static busybox (busybox-static)")
}

#[test]
fn from_scratch_copy_runs_at_once() {
    let Some(s) = Setup::start() else { return };
    let name = "docker.io/library/bk-scratch:1";
    s.build(
        name,
        "FROM scratch\nCOPY --chmod=755 busybox /bin/busybox\n",
        &[("busybox", &busybox())],
        &[],
    );
    s.cri
        .run_pod(name, &["/bin/busybox", "echo", "scratch-ok"], "scratch-ok");
}

#[test]
fn from_registry_base_with_run_runs_at_once() {
    let Some(s) = Setup::start() else { return };
    let (base, _) = s.base("bk-base-run:1");
    let name = "docker.io/library/bk-run:1";
    s.build(
        name,
        &format!(
            "FROM {base}\nRUN [\"/bin/busybox\", \"sh\", \"-c\", \"echo run-ok > /run-ok\"]\n"
        ),
        &[],
        &[],
    );
    s.cri
        .run_pod(name, &["/bin/busybox", "cat", "/run-ok"], "run-ok");
}

/// `FROM` with only a `LABEL`: buildkit names the image before it fetches
/// the base layers it never needed (lazy), yet the pod runs at once. 20
/// builds, each from a base of its own, so each has lazy layers to fetch.
#[test]
fn label_only_lazy_base_20_builds_each_runs_at_once() {
    let Some(s) = Setup::start() else { return };
    for n in 0..20 {
        let (base, hello) = s.base(&format!("bk-base-lazy-{n}:1"));
        let name = format!("docker.io/library/bk-lazy:{n}");
        s.build(
            &name,
            &format!("FROM {base}\nLABEL built=by-test round={n}\n"),
            &[],
            &[],
        );
        s.cri
            .run_pod(&name, &["/bin/busybox", "echo", &hello], &hello);
    }
}

#[test]
fn unpack_true_runs_at_once() {
    let Some(s) = Setup::start() else { return };
    let (base, _) = s.base("bk-base-unpack:1");
    let name = "docker.io/library/bk-unpack:1";
    s.build_to(
        name,
        &format!("FROM {base}\nCOPY note /note\n"),
        &[("note", b"unpacked")],
        &format!("type=image,name={name},unpack=true"),
        &[],
    );
    s.cri
        .run_pod(name, &["/bin/busybox", "cat", "/note"], "unpacked");
}

/// An index with a provenance attestation manifest next to the image's.
#[test]
fn provenance_attestation_index_runs_at_once() {
    let Some(s) = Setup::start() else { return };
    let name = "docker.io/library/bk-attest:1";
    let id = s.build(
        name,
        "FROM scratch\nCOPY --chmod=755 busybox /bin/busybox\n",
        &[("busybox", &busybox())],
        &["--opt", "attest:provenance=mode=min"],
    );
    // The index names this platform's manifest, so the replica went in the
    // way CRI's own pull writes it: marked managed, after its id record.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (replica, record) = rt.block_on(async {
        let replica = get_image(s.c.socket(), "k8s.io", name).await.unwrap();
        (replica, get_image(s.c.socket(), "k8s.io", &id).await)
    });
    let record = record.expect("the id record");
    assert_eq!(
        record.target, replica.target,
        "the id record names the index"
    );
    assert_cri_managed(&[&record, &replica]);
    s.cri
        .run_pod(name, &["/bin/busybox", "echo", "attest-ok"], "attest-ok");
}

/// The CI pattern: a build exports only its cache; a buildkitd with its own
/// empty state builds from that cache, so the layer the cache holds is
/// written (lazily, after the image is named) by the export. 20 rounds,
/// each with a layer of its own; the pod runs at once every time.
#[test]
fn import_cache_from_another_buildkitd_20_builds_each_runs_at_once() {
    let Some(s) = Setup::start() else { return };
    let (base, _) = s.base("bk-base-cache:1");
    let fresh = Buildkitd::start(s.p.socket(), "buildkit", Some(&s.reg.addr())).unwrap();
    assert_ne!(s.bk.dir(), fresh.dir());
    for n in 0..20 {
        let cache = s.dir.path().join(format!("cache-{n}"));
        let dockerfile = format!(
            "FROM {base}\nRUN [\"/bin/busybox\", \"sh\", \"-c\", \"echo cached-{n} > /cached\"]\n"
        );
        let export = format!("type=local,dest={}", cache.display());
        // No --output: only the cache leaves this build.
        let ctx = tempdir("bk-cache-ctx-");
        std::fs::write(ctx.path().join("Dockerfile"), &dockerfile).unwrap();
        let c = ctx.path().display().to_string();
        let out = s.bk.buildctl([
            "build",
            "--frontend",
            "dockerfile.v0",
            "--local",
            &format!("context={c}"),
            "--local",
            &format!("dockerfile={c}"),
            "--export-cache",
            &export,
        ]);
        assert!(out.status.success(), "{out:?}");
        let import = format!("type=local,src={}", cache.display());
        let name = format!("docker.io/library/bk-cache:{n}");
        let meta = s.dir.path().join(unique_name("meta"));
        let meta_arg = format!("--metadata-file={}", meta.display());
        fresh.build(
            &dockerfile,
            &[],
            &format!("type=image,name={name}"),
            &[&meta_arg, "--import-cache", &import],
        );
        let config = config_digest(&meta, s.c.socket());
        assert_eq!(s.cri.image_id(&name).as_deref(), Some(config.as_str()));
        let want = format!("cached-{n}");
        s.cri
            .run_pod(&name, &["/bin/busybox", "cat", "/cached"], &want);
    }
}

/// Two builds to one tag at once: when both have returned, CRI resolves the
/// tag to what containerd holds in `buildkit`, one of the two.
#[test]
fn concurrent_builds_to_one_tag_converge() {
    let Some(s) = Setup::start() else { return };
    let name = "docker.io/library/bk-race:1";
    let configs: Vec<String> = std::thread::scope(|t| {
        let runs: Vec<_> = ["one", "two"]
            .into_iter()
            .map(|which| {
                let s = &s;
                t.spawn(move || {
                    let meta = s.dir.path().join(unique_name("meta"));
                    let arg = format!("--metadata-file={}", meta.display());
                    s.bk.build(
                        "FROM scratch\nCOPY --chmod=755 busybox /bin/busybox\nCOPY which /which\n",
                        &[("busybox", &busybox()), ("which", which.as_bytes())],
                        &format!("type=image,name={name}"),
                        &[&arg],
                    );
                    config_digest(&meta, s.c.socket())
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let held = ctr_ok(s.c.socket(), "buildkit", ["images", "ls"]);
    let seen = s.cri.image_id(name).expect("CRI resolves the tag");
    assert!(configs.contains(&seen), "{seen} is neither of {configs:?}");
    let target = held
        .lines()
        .find(|l| l.starts_with(name))
        .unwrap_or_else(|| panic!("{name} not in buildkit:\n{held}"))
        .to_string();
    let which = if seen == configs[0] { "one" } else { "two" };
    s.cri
        .run_pod(name, &["/bin/busybox", "cat", "/which"], which);
    // containerd's record in buildkit is the one CRI follows.
    let source_target = target.split_whitespace().nth(2).unwrap().to_string();
    let replica = image_target_sync(s.c.socket(), "k8s.io", name);
    assert_eq!(replica, source_target);
}

fn image_target_sync(sock: &std::path::Path, ns: &str, name: &str) -> String {
    let sock = sock.to_path_buf();
    let (ns, name) = (ns.to_string(), name.to_string());
    std::thread::spawn(move || {
        tokio::runtime::Runtime::new()
            .unwrap()
            .block_on(async { image_target(&sock, &ns, &name).await.digest })
    })
    .join()
    .unwrap()
}

/// `buildctl prune --all` drops buildkit's cache; every replica still runs
/// (k8s.io holds its own references).
#[test]
fn prune_all_leaves_replicas_runnable() {
    let Some(s) = Setup::start() else { return };
    let (base, _) = s.base("bk-base-prune:1");
    let names = [
        "docker.io/library/bk-prune:1",
        "docker.io/library/bk-prune:2",
    ];
    for (i, name) in names.iter().enumerate() {
        s.build(
            name,
            &format!("FROM {base}\nCOPY n /n\n"),
            &[("n", format!("prune-{i}").as_bytes())],
            &[],
        );
    }
    let out = s.bk.buildctl(["prune", "--all"]);
    assert!(out.status.success(), "{out:?}");
    for (i, name) in names.iter().enumerate() {
        let want = format!("prune-{i}");
        s.cri.run_pod(name, &["/bin/busybox", "cat", "/n"], &want);
    }
}

/// The dev loop: 20 rebuilds of one tag, each resolved by CRI to the new
/// image the moment buildctl returns; no misses.
#[test]
fn twenty_rebuilds_zero_misses() {
    let Some(s) = Setup::start() else { return };
    let name = "docker.io/library/bk-loop:dev";
    let bb = busybox();
    let started = Instant::now();
    let mut last = String::new();
    for i in 0..20 {
        let v = format!("loop-{i}");
        last = s.build(
            name,
            "FROM scratch\nCOPY --chmod=755 busybox /bin/busybox\nCOPY v /v\n",
            &[("busybox", &bb), ("v", v.as_bytes())],
            &[],
        );
    }
    eprintln!("20 rebuilds in {:?}", started.elapsed());
    assert_eq!(s.cri.image_id(name).as_deref(), Some(last.as_str()));
    s.cri
        .run_pod(name, &["/bin/busybox", "cat", "/v"], "loop-19");
}
