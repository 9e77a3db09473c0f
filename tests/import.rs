//! Directory auto-import against a real containerd 1.6 (with CRI) and a
//! loopback registry. Every wait is a poll with a deadline.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use imgbridge::config::{Import, ImportDir};
use imgbridge::containerd::Containerd;
use imgbridge::import::{self, Stats};
use imgbridge::ops::metrics::Metrics;
use imgbridge_test_support as support;
use imgbridge_test_support::bridge::Imgbridge;
use imgbridge_test_support::ctr::ctr_run;
use imgbridge_test_support::images::PAUSE_IMAGE;
use imgbridge_test_support::registry::Registry;

// ============================================================================
// Private test harness. Kept in this section so it can be swapped for the
// shared harness (`tests/support`) later: containerd launcher, registry, image
// fixtures built offline with umoci + skopeo.
// ============================================================================

mod harness {
    use super::*;

    pub fn run(cmd: &mut Command) -> String {
        let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        assert!(
            out.status.success(),
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A private containerd with CRI (the shared harness's), pulling from
    /// the loopback registry over plain http.
    pub struct TestContainerd {
        inner: support::containerd::Containerd,
        pub sock: PathBuf,
    }

    impl TestContainerd {
        pub async fn start() -> TestContainerd {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| "imgbridge=info".into()),
                )
                .with_test_writer()
                .try_init();
            let inner =
                support::containerd::Containerd::start(support::containerd::ContainerdOpts {
                    cri: true,
                    registry_mirror: Some(registry().addr()),
                    ..Default::default()
                });
            // The harness seeds CRI's pause image; these tests expect
            // `k8s.io` to start empty, as a node without it would.
            inner.ctr_ok("k8s.io", ["images", "rm", PAUSE_IMAGE]);
            let sock = inner.socket().to_path_buf();
            TestContainerd { inner, sock }
        }

        pub fn client(&self) -> Containerd {
            Containerd::new(&self.sock)
        }

        pub fn ctr(&self, args: &[&str]) -> String {
            self.inner.ctr_ok("k8s.io", args)
        }

        /// SIGKILL, as a crash.
        pub fn kill9(&mut self) {
            self.inner.kill9();
        }

        /// Starts it again on the same root; returns once CRI serves.
        pub fn restart(&mut self) {
            self.inner.restart();
        }
    }

    /// The loopback `docker-registry` (the shared harness's), one per test process.
    pub fn registry() -> &'static Registry {
        static R: OnceLock<Registry> = OnceLock::new();
        R.get_or_init(Registry::start)
    }

    /// Test images, built once and cached under the cargo target tmp dir.
    pub struct Fixtures {
        pub dir: PathBuf,
    }

    impl Fixtures {
        pub fn path(&self, name: &str) -> PathBuf {
            self.dir.join(name)
        }
        pub fn oci(&self) -> String {
            self.dir.join("oci").display().to_string()
        }
    }

    /// Tags in the fixture layout: each a busybox image with its own random file.
    pub const TAGS: [&str; 5] = ["a", "b", "c", "d", "e"];

    pub fn fixtures() -> &'static Fixtures {
        static F: OnceLock<Fixtures> = OnceLock::new();
        F.get_or_init(|| {
            let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
            let dir = base.join("import-fixtures-v2");
            // This binary runs against two containerds side by side
            // (scripts/test.sh), so two processes may get here at once: one
            // builds under the lock, into a directory of its own renamed
            // into place; the other waits and finds it done. (Unlocked, one
            // removed what the other was building.)
            let lock = std::fs::File::create(base.join("import-fixtures-v2.lock")).unwrap();
            let _held = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
                .map_err(|(_, e)| e)
                .expect("lock the import fixtures");
            if !dir.join("done").exists() {
                let tmp = base.join(format!("import-fixtures-v2.tmp-{}", std::process::id()));
                let _ = std::fs::remove_dir_all(&tmp);
                std::fs::create_dir_all(&tmp).unwrap();
                build_fixtures(&tmp);
                std::fs::write(tmp.join("done"), "").unwrap();
                let _ = std::fs::remove_dir_all(&dir);
                std::fs::rename(&tmp, &dir).unwrap();
            }
            Fixtures { dir }
        })
    }

    fn build_fixtures(dir: &Path) {
        let oci = dir.join("oci");
        let layout = oci.display().to_string();
        run(Command::new("umoci").args(["init", "--layout", &layout]));
        for tag in TAGS {
            let img = format!("{layout}:{tag}");
            let bundle = dir.join(format!("bundle-{tag}"));
            run(Command::new("umoci").args(["new", "--image", &img]));
            run(Command::new("umoci")
                .args(["unpack", "--image", &img])
                .arg(&bundle));
            let rootfs = bundle.join("rootfs");
            std::fs::create_dir_all(rootfs.join("bin")).unwrap();
            std::fs::copy("/usr/bin/busybox", rootfs.join("bin/busybox")).unwrap();
            let rnd: Vec<u8> = (0..4096).map(|_| rand::random::<u8>()).collect();
            std::fs::write(rootfs.join(format!("random-{tag}")), rnd).unwrap();
            run(Command::new("umoci")
                .args(["repack", "--image", &img])
                .arg(&bundle));
            run(Command::new("umoci").args([
                "config",
                "--image",
                &img,
                "--config.cmd",
                "/bin/busybox",
                "--config.cmd",
                "true",
            ]));
            std::fs::remove_dir_all(&bundle).unwrap();
        }
        let skopeo = |tag: &str, dest: String| {
            run(Command::new("skopeo").args(["copy", "-q", &format!("oci:{layout}:{tag}"), &dest]));
        };
        let p = |n: &str| dir.join(n).display().to_string();
        skopeo("a", format!("docker-archive:{}:app-a:dev", p("a.tar")));
        skopeo("b", format!("oci-archive:{}:app-b:dev", p("b.oci.tar")));
        skopeo("c", format!("docker-archive:{}:app-c:dev", p("c.tar")));
        skopeo("d", format!("docker-archive:{}:app-d:dev", p("d.tar")));
        skopeo("e", format!("oci-archive:{}:app-e:dev", p("e.oci.tar")));
    }

    pub fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    pub fn zstd(data: &[u8]) -> Vec<u8> {
        zstd::encode_all(data, 3).unwrap()
    }

    /// Pushes fixture `tag` to the loopback registry as `repo`.
    pub fn push(tag: &str, repo: &str) -> String {
        let r = format!("{}/{repo}", registry().addr());
        run(Command::new("skopeo").args([
            "copy",
            "-q",
            "--dest-tls-verify=false",
            &format!("oci:{}:{tag}", fixtures().oci()),
            &format!("docker://{r}"),
        ]));
        r
    }

    /// Polls `f` every 50 ms until it is true; panics after `secs`.
    pub async fn poll<F, Fut>(what: &str, secs: u64, mut f: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if f().await {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {secs}s waiting for: {what}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

// ============================================================================
// Test helpers on top of the harness.
// ============================================================================

use harness::{fixtures, gzip, poll, push, zstd, TestContainerd};

const PINNED: &str = "io.cri-containerd.pinned";
const IMPORT: &str = "io.imgbridge.import";

async fn labels(c: &Containerd, name: &str) -> Option<HashMap<String, String>> {
    c.get_image("k8s.io", name).await.unwrap().map(|i| i.labels)
}

async fn pinned(c: &Containerd, name: &str) -> bool {
    labels(c, name).await.is_some_and(|l| {
        l.get(PINNED).map(String::as_str) == Some("pinned") && l.contains_key(IMPORT)
    })
}

/// Present in containerd, complete, and resolvable by kubelet (CRI).
async fn usable(c: &Containerd, name: &str) -> bool {
    matches!(c.cri_image_id(name).await, Ok(Some(_)))
}

async fn wait_usable_pinned(c: &Containerd, name: &str) {
    poll(&format!("{name} imported and pinned"), 60, || async {
        usable(c, name).await && pinned(c, name).await
    })
    .await;
}

async fn wait_unpinned(c: &Containerd, name: &str) {
    poll(&format!("{name} unpinned"), 30, || async {
        labels(c, name)
            .await
            .is_some_and(|l| !l.contains_key(PINNED) && !l.contains_key(IMPORT))
    })
    .await;
}

/// A running library importer with its counters.
struct Running {
    stats: Arc<Stats>,
    /// What `serve` reports to Prometheus and `/status`.
    metrics: Arc<Metrics>,
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    fn start(c: &Containerd, dirs: &[&Path], state: &Path, max: Option<u64>) -> Running {
        Running::with_debounce(c, dirs, state, max, Duration::from_millis(300))
    }

    fn with_debounce(
        c: &Containerd,
        dirs: &[&Path],
        state: &Path,
        max: Option<u64>,
        debounce: Duration,
    ) -> Running {
        let mut cfg = import_config(dirs, state);
        cfg.debounce = debounce;
        if let Some(m) = max {
            cfg.max_decompressed_bytes = m;
        }
        Running::with_config(c, cfg)
    }

    fn with_config(c: &Containerd, cfg: Import) -> Running {
        let stats = Arc::new(Stats::default());
        let stop = tokio_util::sync::CancellationToken::new();
        let metrics = Arc::new(Metrics::new());
        let task = tokio::spawn(import::run(
            c.clone(),
            cfg,
            stop.clone(),
            vec![stats.clone(), metrics.clone()],
        ));
        Running {
            stats,
            metrics,
            stop,
            task,
        }
    }

    fn get(&self, f: impl Fn(&Stats) -> &std::sync::atomic::AtomicU64) -> u64 {
        f(&self.stats).load(Ordering::SeqCst)
    }

    async fn stop(self) -> Arc<Stats> {
        self.stop.cancel();
        self.task.await.unwrap();
        self.stats
    }
}

/// Watching `dirs` into `k8s.io`, state in `state`, a 300 ms debounce.
fn import_config(dirs: &[&Path], state: &Path) -> Import {
    Import {
        dirs: dirs
            .iter()
            .map(|d| ImportDir {
                path: d.to_path_buf(),
                namespace: "k8s.io".into(),
            })
            .collect(),
        state_file: state.into(),
        debounce: Duration::from_millis(300),
        ..Import::default()
    }
}

/// A front on `listen` that relays every call to `ctd` but the first
/// whose path ends with `method`: that one is never answered and, with
/// `cut`, every connection is dropped under it (a containerd that hangs or
/// breaks on cue, which no real one does). Returns the front (serving
/// until dropped) and whether that call came.
fn front_holding_first(
    ctd: &TestContainerd,
    listen: &Path,
    method: &'static str,
    cut: bool,
) -> (support::front::Front, Arc<std::sync::atomic::AtomicBool>) {
    use support::front;
    let mut f = front::Front::default();
    let came = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (killer, seen, real) = (f.killer(), came.clone(), ctd.sock.clone());
    f.serve(listen, move |req| {
        let (killer, seen, real) = (killer.clone(), seen.clone(), real.clone());
        async move {
            if req.uri().path().ends_with(method) && !seen.swap(true, Ordering::SeqCst) {
                if cut {
                    killer.drop_connections();
                }
                return std::future::pending().await;
            }
            front::relay(&real, req).await
        }
    });
    (f, came)
}

/// Where every test here starts: a containerd with CRI and an empty
/// `k8s.io`, the library's client on it, and a temp dir holding the
/// `images` dir to watch (created).
async fn stage() -> (TestContainerd, Containerd, tempfile::TempDir, PathBuf) {
    let (ctd, c, tmp, dir) = stage_without_dir().await;
    std::fs::create_dir(&dir).unwrap();
    (ctd, c, tmp, dir)
}

/// [`stage`] with the `images` dir not there yet.
async fn stage_without_dir() -> (TestContainerd, Containerd, tempfile::TempDir, PathBuf) {
    let ctd = TestContainerd::start().await;
    let c = ctd.client();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("images");
    (ctd, c, tmp, dir)
}

/// `ctr images check` in `k8s.io` says complete for every image whose
/// line contains `filter`.
fn assert_complete(ctd: &TestContainerd, filter: &str) {
    let check = ctd.ctr(&["images", "check"]);
    assert!(
        check
            .lines()
            .filter(|l| l.contains(filter))
            .all(|l| l.contains("complete")),
        "{check}"
    );
}

/// Whether the state file records `file`.
fn state_has(state: &Path, file: &Path) -> bool {
    let Ok(b) = std::fs::read(state) else {
        return false;
    };
    let v: serde_json::Value = serde_json::from_slice(&b).unwrap_or_default();
    v["files"].get(file.to_str().unwrap()).is_some()
}

fn copy_in(name: &str, dir: &Path, as_name: &str) {
    std::fs::copy(fixtures().path(name), dir.join(as_name)).unwrap();
}

/// Drops a file in by writing a dotfile and renaming it, as careful tools do.
fn rename_in(data: &[u8], dir: &Path, name: &str) {
    let tmp = dir.join(format!(".{name}.partial"));
    std::fs::write(&tmp, data).unwrap();
    std::fs::rename(tmp, dir.join(name)).unwrap();
}

fn read(name: &str) -> Vec<u8> {
    std::fs::read(fixtures().path(name)).unwrap()
}

/// Rewrites a tar archive, dropping entries whose path matches `drop`.
fn without_entries(data: &[u8], drop: impl Fn(&str) -> bool) -> Vec<u8> {
    let mut a = tar::Archive::new(data);
    let mut b = tar::Builder::new(Vec::new());
    for e in a.entries().unwrap() {
        let mut e = e.unwrap();
        let p = e.path().unwrap().to_string_lossy().into_owned();
        if drop(&p) {
            continue;
        }
        let mut h = e.header().clone();
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut e, &mut buf).unwrap();
        b.append_data(&mut h, &p, &buf[..]).unwrap();
    }
    b.into_inner().unwrap()
}

/// A tar whose only entry is named `name` verbatim (e.g. `../evil`).
fn raw_entry_tar(name: &str) -> Vec<u8> {
    let mut h = tar::Header::new_old();
    h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
    h.set_size(3);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_cksum();
    let mut b = tar::Builder::new(Vec::new());
    b.append(&h, &b"abc"[..]).unwrap();
    b.into_inner().unwrap()
}

const A: &str = "docker.io/library/app-a:dev";
const B: &str = "docker.io/library/app-b:dev";
const C: &str = "docker.io/library/app-c:dev";
const D: &str = "docker.io/library/app-d:dev";
const E: &str = "docker.io/library/app-e:dev";

// ============================================================================
// Tests
// ============================================================================

/// `imgbridge import`: docker-archive and OCI, plain/gzip/zstd detected by
/// magic under misleading names, a multi-platform index with an absent
/// platform, and bad files reported with exit status 1 while good ones land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_import_formats_and_failures() {
    let (ctd, c, tmp, ..) = stage_without_dir().await;
    let t = tmp.path();
    // gzip under a plain .tar name, zstd under a .tar.gz name.
    std::fs::write(t.join("a-is-gzip.tar"), gzip(&read("a.tar"))).unwrap();
    std::fs::write(t.join("b-is-zstd.tar.gz"), zstd(&read("b.oci.tar"))).unwrap();
    std::fs::copy(fixtures().path("c.tar"), t.join("c.tar")).unwrap();
    std::fs::write(t.join("e.multi.tar"), multi_platform(&read("e.oci.tar"))).unwrap();
    std::fs::write(t.join("corrupt.tar"), [0x42u8; 4096]).unwrap();
    let d = read("d.tar");
    std::fs::write(
        t.join("d-truncated.tar.zst"),
        &zstd(&d)[..zstd(&d).len() / 2],
    )
    .unwrap();
    let files = [
        "a-is-gzip.tar",
        "b-is-zstd.tar.gz",
        "c.tar",
        "e.multi.tar",
        "corrupt.tar",
        "d-truncated.tar.zst",
    ];
    let out = Command::new(env!("CARGO_BIN_EXE_imgbridge"))
        .arg("import")
        .arg("--upstream")
        .arg(&ctd.sock)
        .args(files.iter().map(|f| t.join(f)))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("2 failure(s)"), "{stderr}");
    assert!(
        stderr.contains("corrupt.tar: corrupt or unreadable tar"),
        "{stderr}"
    );
    assert!(
        stderr.contains("d-truncated.tar.zst: zstd stream is corrupt or truncated"),
        "{stderr}"
    );
    for n in [A, B, C, E] {
        wait_usable_pinned(&c, n).await;
    }
    assert!(
        labels(&c, D).await.is_none(),
        "no partial image from a truncated archive"
    );
    // The index keeps the present platform only; the image runs.
    let img = c.get_image("k8s.io", E).await.unwrap().unwrap();
    assert_eq!(
        img.target.unwrap().media_type,
        "application/vnd.oci.image.index.v1+json"
    );
    assert_complete(&ctd, "app-");
    let run = ctr_run(&ctd.sock, "k8s.io", A, &["/bin/busybox", "echo", "ran-a"]);
    assert_eq!(run, "ran-a\n");
}

/// Wraps an OCI archive's manifest in an index that also lists an arm64
/// manifest absent from the archive (like `ctr export` of one platform).
fn multi_platform(oci_tar: &[u8]) -> Vec<u8> {
    let mut a = tar::Archive::new(oci_tar);
    let mut entries = Vec::new();
    let mut index = Vec::new();
    for e in a.entries().unwrap() {
        let mut e = e.unwrap();
        let p = e.path().unwrap().to_string_lossy().into_owned();
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut e, &mut buf).unwrap();
        if p == "index.json" {
            index = buf;
        } else if e.header().entry_type().is_file() {
            entries.push((p, buf));
        }
    }
    let top: serde_json::Value = serde_json::from_slice(&index).unwrap();
    let m = &top["manifests"][0];
    let name = m["annotations"]["org.opencontainers.image.ref.name"].clone();
    let mut amd = m.clone();
    amd.as_object_mut().unwrap().remove("annotations");
    amd["platform"] = serde_json::json!({"os": "linux", "architecture": "amd64"});
    let arm = serde_json::json!({
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": format!("sha256:{}", "ab".repeat(32)),
        "size": 1234,
        "platform": {"os": "linux", "architecture": "arm64"},
    });
    let idx = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [arm, amd],
    }))
    .unwrap();
    let idx_hex = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&idx))
    };
    let new_top = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "digest": format!("sha256:{idx_hex}"),
            "size": idx.len(),
            "annotations": {"io.containerd.image.name": name},
        }],
    }))
    .unwrap();
    entries.push((format!("blobs/sha256/{idx_hex}"), idx));
    entries.push(("index.json".into(), new_top));
    let mut b = tar::Builder::new(Vec::new());
    for (p, data) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, p, &data[..]).unwrap();
    }
    b.into_inner().unwrap()
}

/// `imgbridge serve --watch-dir`: the directory does not exist at start, is
/// created later, a file is renamed in (imported, pinned), then removed
/// (unpinned, not deleted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_watch_dir_created_later_rename_in_and_remove() {
    let (ctd, c, tmp, ..) = stage_without_dir().await;
    let watch = tmp.path().join("not/yet/images");
    let cfg = tmp.path().join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "[import]\nstate_file = \"{}\"\ndebounce = \"300ms\"\n",
            tmp.path().join("state.json").display()
        ),
    )
    .unwrap();
    let listen = tmp.path().join("ib.sock");
    let mut serve = Imgbridge::start_at(
        &listen,
        &ctd.sock,
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--watch-dir",
            watch.to_str().unwrap(),
        ],
    );
    std::fs::create_dir_all(&watch).unwrap();
    rename_in(&read("a.tar"), &watch, "a.tar");
    wait_usable_pinned(&c, A).await;
    std::fs::remove_file(watch.join("a.tar")).unwrap();
    wait_unpinned(&c, A).await;
    assert!(usable(&c, A).await, "unpinning never deletes");
    serve.kill9();
    let log = serve.log();
    assert!(log.contains("imported"), "{log}");
}

/// `rm -rf` of the watched directory unpins its images; recreating it with
/// new files imports them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dir_deleted_and_recreated() {
    let (_ctd, c, tmp, dir) = stage().await;
    copy_in("a.tar", &dir, "a.tar");
    let r = Running::start(&c, &[&dir], &tmp.path().join("state.json"), None);
    wait_usable_pinned(&c, A).await;
    std::fs::remove_dir_all(&dir).unwrap();
    wait_unpinned(&c, A).await;
    std::fs::create_dir(&dir).unwrap();
    std::fs::create_dir(dir.join("nested")).unwrap();
    copy_in("c.tar", &dir.join("nested"), "c.tar");
    copy_in("a.tar", &dir, "a.tar");
    wait_usable_pinned(&c, C).await;
    wait_usable_pinned(&c, A).await;
    r.stop().await;
}

/// The watched path is a symlink swapped atomically to another directory:
/// the new target's files are imported, the old target's unpinned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn symlink_swap() {
    let (_ctd, c, tmp, ..) = stage_without_dir().await;
    let (t1, t2) = (tmp.path().join("v1"), tmp.path().join("v2"));
    std::fs::create_dir(&t1).unwrap();
    std::fs::create_dir(&t2).unwrap();
    copy_in("a.tar", &t1, "a.tar");
    copy_in("c.tar", &t2, "c.tar");
    let link = tmp.path().join("images");
    std::os::unix::fs::symlink(&t1, &link).unwrap();
    let r = Running::start(&c, &[&link], &tmp.path().join("state.json"), None);
    wait_usable_pinned(&c, A).await;
    let new = tmp.path().join("images.new");
    std::os::unix::fs::symlink(&t2, &new).unwrap();
    std::fs::rename(&new, &link).unwrap();
    wait_usable_pinned(&c, C).await;
    wait_unpinned(&c, A).await;
    // Files added to the new target are seen too.
    copy_in("d.tar", &t2, "d.tar");
    wait_usable_pinned(&c, D).await;
    r.stop().await;
}

/// A file written in chunks over 3 s is imported once, complete, after it
/// has been quiet for the debounce period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_copy_imported_once() {
    let (ctd, c, tmp, dir) = stage().await;
    // Chunks come every 250 ms; the debounce must outlast the gaps.
    let r = Running::with_debounce(
        &c,
        &[&dir],
        &tmp.path().join("state.json"),
        None,
        Duration::from_millis(1500),
    );
    poll("first scan", 10, || async { r.get(|s| &s.scans) >= 1 }).await;
    let data = gzip(&read("a.tar"));
    let mut f = std::fs::File::create(dir.join("slow.tar.gz")).unwrap();
    let chunks = 12;
    let step = data.len().div_ceil(chunks);
    for part in data.chunks(step) {
        f.write_all(part).unwrap();
        f.flush().unwrap();
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(r.get(|s| &s.failures), 0, "a partial file was read");
    }
    drop(f);
    wait_usable_pinned(&c, A).await;
    // Stays at one import: nothing else happens once quiet. Asserting an
    // absence needs a window; it spans two debounce periods (1.5 s) so a
    // second, debounced import would have shown.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let stats = r.stop().await;
    assert_eq!(stats.imported.load(Ordering::SeqCst), 1);
    assert_eq!(stats.failures.load(Ordering::SeqCst), 0);
    assert_complete(&ctd, "app-a");
}

/// A pull list through CRI from the loopback registry: present images are
/// skipped, a missing one is retried with backoff while an archive in the
/// same directory imports, and a line leaving the list unpins its image.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_list_retry_and_line_removal() {
    let (_ctd, c, tmp, dir) = stage().await;
    let first = push("c", "lib/pull-first:1");
    let later = format!(
        "{}/lib/pull-later-{}:1",
        harness::registry().addr(),
        std::process::id()
    );
    std::fs::write(
        dir.join("list.txt"),
        format!("# images for the node\n\n{first}\n{later}  # pushed later\nNot/A:Valid:Ref\n"),
    )
    .unwrap();
    copy_in("a.tar", &dir, "a.tar");
    let r = Running::start(&c, &[&dir], &tmp.path().join("state.json"), None);
    wait_usable_pinned(&c, &first).await;
    wait_usable_pinned(&c, A).await;
    poll("a failed pull of the missing image", 30, || async {
        r.get(|s| &s.pull_failures) >= 1
    })
    .await;
    assert!(r.get(|s| &s.failures) >= 1, "the invalid line is counted");
    // /status shows the file's latest error: the failed pull, naming it.
    let list = dir.join("list.txt").display().to_string();
    let last = r.metrics.file_errors()[&list].clone();
    assert_eq!(last.context, later, "{last:?}");
    push("d", later.split_once('/').unwrap().1);
    wait_usable_pinned(&c, &later).await;
    poll("the pulled reference's error cleared", 30, || async {
        !r.metrics.file_errors().contains_key(&list)
    })
    .await;
    // The first image leaves the list: unpinned, still present.
    std::fs::write(dir.join("list.txt"), format!("{later}\n")).unwrap();
    wait_unpinned(&c, &first).await;
    assert!(usable(&c, &first).await);
    assert!(pinned(&c, &later).await);
    r.stop().await;
}

/// A pull list rewritten while containerd is down: the image that left it
/// could not be unpinned then, and is once containerd is back (it stayed
/// pinned for good before, out of kubelet's GC's reach: the hour's soak
/// left one per few containerd kills, docs/reliability.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_leaving_a_list_while_containerd_is_down_is_unpinned_once_it_is_back() {
    let (mut ctd, c, tmp, dir) = stage().await;
    let first = push("c", "lib/down-first:1");
    let next = push("d", "lib/down-next:1");
    std::fs::write(dir.join("list.txt"), format!("{first}\n")).unwrap();
    let r = Running::start(&c, &[&dir], &tmp.path().join("state.json"), None);
    wait_usable_pinned(&c, &first).await;
    let failed = r.get(|s| &s.pull_failures);

    ctd.kill9();
    std::fs::write(dir.join("list.txt"), format!("{next}\n")).unwrap();
    // The new list was read (its pull failed: containerd is down), so the
    // unpin of the image that left it was tried, and failed, too.
    poll(
        "the rewritten list read while containerd is down",
        30,
        || async { r.get(|s| &s.pull_failures) > failed },
    )
    .await;
    ctd.restart();
    wait_usable_pinned(&c, &next).await;
    wait_unpinned(&c, &first).await;
    assert!(usable(&c, &first).await, "unpinned, not removed");
    r.stop().await;
}

/// An import whose call never answers (its first `Content.Write` held
/// forever) is cancelled once it made no progress for
/// `import.progress_timeout`, and tried again: the importer goes on. A
/// front holds the call, as no real containerd hangs on cue; the hour
/// under faults saw the importer stop for good (docs/reliability.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_that_makes_no_progress_is_cancelled_and_tried_again() {
    let (ctd, direct, tmp, dir) = stage().await;
    let listen = tmp.path().join("front.sock");
    let (_front, held) = front_holding_first(&ctd, &listen, ".Content/Write", false);
    let mut cfg = import_config(&[&dir], &tmp.path().join("state.json"));
    cfg.progress_timeout = Duration::from_secs(2);
    let r = Running::with_config(&Containerd::new(&listen), cfg);
    copy_in("a.tar", &dir, "a.tar");
    wait_usable_pinned(&direct, A).await;
    assert!(held.load(Ordering::SeqCst), "the front never held a write");
    assert!(
        r.get(|s| &s.failures) >= 1,
        "the stalled import was not counted"
    );
    r.stop().await;
}

/// containerd restarted gracefully (SIGTERM) while an archive is being
/// imported, at steps from the import's start to past its end: each file
/// is imported once containerd is back, and the importer goes on to the
/// next. The hour under faults hung its importer for good this way
/// (docs/reliability.md, run 5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_containerd_restart_mid_import_does_not_stop_the_importer() {
    use support::images::TestImage;
    let (mut ctd, c, tmp, dir) = stage().await;
    let state = tmp.path().join("state.json");
    let r = Running::start(&c, &[&dir], &state, None);
    for (i, after_ms) in [0u64, 20, 100, 300].into_iter().enumerate() {
        // A layer of its own (8 MiB of random bytes), so every blob is written.
        let img = TestImage::build(&format!("cut/restart-{i}:1"), 1, &[], 8 << 20);
        let file = dir.join(format!("cut-{i}.tar"));
        rename_in(
            &std::fs::read(img.docker_archive()).unwrap(),
            &dir,
            &format!("cut-{i}.tar"),
        );
        tokio::task::block_in_place(|| {
            // The state file records the file just before its import begins.
            let deadline = Instant::now() + Duration::from_secs(30);
            while !state_has(&state, &file) {
                assert!(
                    Instant::now() < deadline,
                    "the import of {} never began",
                    file.display()
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            // Placing the fault in the import, not waiting for anything.
            std::thread::sleep(Duration::from_millis(after_ms));
            ctd.restart();
        });
        let name = img.normalized();
        poll(
            &format!("{name}, cut {after_ms} ms into its import, imported once containerd is back"),
            60,
            || async { usable(&c, &name).await && pinned(&c, &name).await },
        )
        .await;
    }
    r.stop().await;
}

/// containerd's connection breaking while an archive's image is recorded
/// (its last step, after the blobs) is containerd going away, not a bad
/// image: the import is tried again, not recorded as failed until the file
/// changes. A restart mid-import hit this step once in 27 tries here; a
/// front cuts every connection at the first `Images.Get` to hit it on cue,
/// which no real containerd does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_broken_while_recording_an_image_is_retried() {
    let (ctd, direct, tmp, dir) = stage().await;
    let listen = tmp.path().join("front.sock");
    let (_front, cut) = front_holding_first(&ctd, &listen, ".Images/Get", true);
    let r = Running::start(
        &Containerd::new(&listen),
        &[&dir],
        &tmp.path().join("state.json"),
        None,
    );
    copy_in("a.tar", &dir, "a.tar");
    wait_usable_pinned(&direct, A).await;
    assert!(
        cut.load(Ordering::SeqCst),
        "the front never cut the recording"
    );
    r.stop().await;
}

/// An image provided by two files stays pinned until both are gone; an
/// image pinned by someone else is never touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpin_rules() {
    let (ctd, c, tmp, ..) = stage_without_dir().await;
    // Someone else imported and pinned app-c (no io.imgbridge.import label).
    let cli = Command::new(env!("CARGO_BIN_EXE_imgbridge"))
        .args(["import", "--no-pin", "--upstream"])
        .arg(&ctd.sock)
        .arg(fixtures().path("c.tar"))
        .output()
        .unwrap();
    assert!(cli.status.success());
    ctd.ctr(&["images", "label", C, "io.cri-containerd.pinned=pinned"]);
    let dir = tmp.path().join("images");
    std::fs::create_dir(&dir).unwrap();
    copy_in("a.tar", &dir, "a1.tar");
    copy_in("a.tar", &dir, "a2.tar");
    copy_in("c.tar", &dir, "c.tar");
    let state = tmp.path().join("state.json");
    let r = Running::start(&c, &[&dir], &state, None);
    wait_usable_pinned(&c, A).await;
    poll("a1 and a2 both listed", 30, || async {
        labels(&c, A)
            .await
            .is_some_and(|l| l.get(IMPORT).is_some_and(|v| v.split(',').count() == 2))
    })
    .await;
    poll("c.tar processed", 30, || async {
        r.get(|s| &s.imported) >= 3
    })
    .await;
    let lc = labels(&c, C).await.unwrap();
    assert_eq!(lc.get(PINNED).map(String::as_str), Some("pinned"));
    assert!(
        !lc.contains_key(IMPORT),
        "someone else's pin is not taken over"
    );
    // What imgbridge_pins_total reports: a1 and a2 each pinned A for their
    // file; c.tar's record was written but its pin is someone else's.
    assert_eq!(r.get(|s| &s.images), 3);
    assert_eq!(r.get(|s| &s.pinned), 2);
    std::fs::remove_file(dir.join("a1.tar")).unwrap();
    poll("a1 removed from the label", 30, || async {
        labels(&c, A)
            .await
            .is_some_and(|l| l.get(IMPORT).is_some_and(|v| !v.contains(',')))
    })
    .await;
    assert!(pinned(&c, A).await, "a2 still provides it");
    std::fs::remove_file(dir.join("c.tar")).unwrap();
    std::fs::remove_file(dir.join("a2.tar")).unwrap();
    wait_unpinned(&c, A).await;
    poll("c.tar removal handled", 30, || async {
        !state_has(&state, &dir.join("c.tar"))
    })
    .await;
    let lc = labels(&c, C).await.unwrap();
    assert_eq!(
        lc.get(PINNED).map(String::as_str),
        Some("pinned"),
        "never touched"
    );
    r.stop().await;
}

/// After a restart, unchanged files are not imported again, but a file
/// whose image was removed meanwhile is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_skips_unchanged_and_reimports_removed() {
    let (_ctd, c, tmp, dir) = stage().await;
    copy_in("a.tar", &dir, "a.tar");
    copy_in("b.oci.tar", &dir, "b.tar");
    let state = tmp.path().join("state/import.json");
    let r = Running::start(&c, &[&dir], &state, None);
    wait_usable_pinned(&c, A).await;
    wait_usable_pinned(&c, B).await;
    let s = r.stop().await;
    assert_eq!(s.imported.load(Ordering::SeqCst), 2);
    let b_before = c.get_image("k8s.io", B).await.unwrap().unwrap().updated_at;
    // Kubelet GC (or ctr rm) removes app-a while imgbridge is down.
    c.delete_image("k8s.io", A, true).await.unwrap();
    let r = Running::start(&c, &[&dir], &state, None);
    wait_usable_pinned(&c, A).await;
    poll("b.tar seen unchanged", 30, || async {
        r.get(|s| &s.skipped) >= 1
    })
    .await;
    // An absence (no second import of b.tar) needs a window, not a poll: it
    // spans two debounce periods (300 ms), so a debounced import would show.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let s = r.stop().await;
    assert_eq!(s.imported.load(Ordering::SeqCst), 1, "only a.tar again");
    let b_after = c.get_image("k8s.io", B).await.unwrap().unwrap().updated_at;
    assert_eq!(b_before, b_after, "b's record untouched");
}

/// Bad inputs each give one failure and no image, and never block a good
/// file in the same directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_do_not_block_good_files() {
    let (_ctd, c, tmp, dir) = stage().await;
    let b = read("b.oci.tar");
    let d = read("d.tar");
    let e = read("e.oci.tar");
    std::fs::write(dir.join("corrupt.tar"), [7u8; 10000]).unwrap();
    std::fs::write(
        dir.join("trunc.tar.gz"),
        &gzip(&b)[..gzip(&b).len() * 2 / 3],
    )
    .unwrap();
    std::fs::write(dir.join("trunc.tar.zst"), &zstd(&e)[..zstd(&e).len() / 2]).unwrap();
    std::fs::write(dir.join("escape.tar"), raw_entry_tar("../evil")).unwrap();
    std::fs::write(dir.join("bomb.tar.gz"), gzip(&vec![0u8; 96 << 20])).unwrap();
    // d.tar without its layer file: the manifest names an absent layer.
    std::fs::write(
        dir.join("missing-layer.tar"),
        without_entries(&d, |p| p.ends_with(".tar") && !p.contains('/')),
    )
    .unwrap();
    let big = format!("[{}]", " ".repeat(5 << 20));
    let mut t = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(big.len() as u64);
    h.set_mode(0o644);
    h.set_cksum();
    t.append_data(&mut h, "manifest.json", big.as_bytes())
        .unwrap();
    std::fs::write(dir.join("huge-manifest.tar"), t.into_inner().unwrap()).unwrap();
    std::fs::write(dir.join("bad.txt"), "UPPER/Case:1\nno spaces allowed\n").unwrap();
    copy_in("a.tar", &dir, "good.tar");
    let r = Running::start(&c, &[&dir], &tmp.path().join("state.json"), Some(64 << 20));
    wait_usable_pinned(&c, A).await;
    // 7 archives fail once each, the list has 2 bad lines.
    poll("every bad file reported", 60, || async {
        r.get(|s| &s.failures) >= 9
    })
    .await;
    // An absence (no bad file read twice) needs a window, not a poll: it
    // spans two debounce periods (300 ms); these errors are permanent, never
    // put on the retry timer.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let metrics = r.metrics.clone();
    let s = r.stop().await;
    assert_eq!(
        s.failures.load(Ordering::SeqCst),
        9,
        "each failure once, no retries of bad files"
    );
    assert_eq!(
        s.imported.load(Ordering::SeqCst),
        2,
        "good.tar, and missing-layer.tar with its image failed"
    );
    for n in [B, D, E] {
        assert!(labels(&c, n).await.is_none(), "no partial image {n}");
    }
    let names: Vec<String> = c
        .list_images("k8s.io", vec![])
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.name)
        .filter(|n| !n.starts_with("sha256:"))
        .collect();
    assert_eq!(names, vec![A.to_string()]);
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tmp.path().join("state.json")).unwrap()).unwrap();
    let err = |f: &str| {
        state["files"][dir.join(f).to_str().unwrap()]["error"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    for (file, reason) in [
        ("corrupt.tar", "corrupt or unreadable tar"),
        ("trunc.tar.gz", "gzip stream is corrupt or truncated"),
        ("trunc.tar.zst", "zstd stream"),
        ("escape.tar", "escapes the archive"),
        ("bomb.tar.gz", "exceeds the cap"),
        ("missing-layer.tar", "not in the archive"),
        ("huge-manifest.tar", "limit for metadata"),
    ] {
        assert!(err(file).contains(reason), "{file}: {}", err(file));
        // /status and Prometheus say the same as the state file.
        let last = &metrics.file_errors()[dir.join(file).to_str().unwrap()];
        assert!(last.error.contains(reason), "{file}: {last:?}");
    }
    let bad = &metrics.file_errors()[dir.join("bad.txt").to_str().unwrap()];
    assert_eq!(bad.context, "line 1", "{bad:?}");
    assert!(!metrics
        .file_errors()
        .contains_key(dir.join("good.tar").to_str().unwrap()));
    let text = metrics.encode();
    for line in [
        "imgbridge_imported_files_total{outcome=\"failed\"} 9",
        "imgbridge_imported_files_total{outcome=\"ok\"} 2",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
}
