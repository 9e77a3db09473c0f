//! Offline-built test images (busybox base, extra layers, archives) and
//! the pause image.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex, OnceLock};

use tempfile::TempDir;

use crate::grpc::sha256_digest;
use crate::util::{run_ok, tempdir};

/// Name under which the pause image is imported into `k8s.io`; it is also the
/// configured CRI `sandbox_image`.
pub const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.6";

pub(crate) fn umoci<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new("umoci");
    cmd.args(args);
    run_ok(cmd)
}

pub(crate) fn skopeo<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new("skopeo");
    cmd.arg("--insecure-policy").args(args);
    run_ok(cmd)
}

/// OCI layout with one layer holding the static busybox (+ sh, echo, sleep,
/// cat symlinks) under tag `base`; built once per process.
pub(crate) fn base_layout() -> &'static Path {
    static BASE: OnceLock<PathBuf> = OnceLock::new();
    BASE.get_or_init(|| {
        let dir = tempdir("base-image-").keep();
        let layout = dir.join("oci");
        let bundle = dir.join("bundle");
        let image = format!("{}:base", layout.display());
        umoci([
            OsStr::new("init"),
            OsStr::new("--layout"),
            layout.as_os_str(),
        ]);
        umoci(["new", "--image", &image]);
        let mut unpack = vec!["unpack".to_string()];
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            unpack.push("--rootless".into());
        }
        unpack.extend([
            "--image".into(),
            image.clone(),
            bundle.display().to_string(),
        ]);
        umoci(&unpack);
        let bin = bundle.join("rootfs/bin");
        fs::create_dir_all(&bin).expect("mkdir rootfs/bin");
        fs::copy("/bin/busybox", bin.join("busybox"))
            .expect("copy /bin/busybox (install busybox-static)");
        for l in ["sh", "echo", "sleep", "cat"] {
            std::os::unix::fs::symlink("busybox", bin.join(l)).expect("symlink");
        }
        umoci([
            OsStr::new("repack"),
            OsStr::new("--image"),
            OsStr::new(&image),
            bundle.as_os_str(),
        ]);
        umoci([
            "config",
            "--image",
            &image,
            "--config.env",
            "PATH=/bin",
            "--config.workingdir",
            "/",
        ]);
        let _ = fs::remove_dir_all(&bundle);
        layout
    })
}

/// Splits `name[:tag]` (a `:` after the last `/`) into name and tag (default
/// `latest`).
fn split_name_tag(name_tag: &str) -> (String, String) {
    match name_tag.rfind(':') {
        Some(i) if !name_tag[i..].contains('/') => {
            (name_tag[..i].to_string(), name_tag[i + 1..].to_string())
        }
        _ => (name_tag.to_string(), "latest".to_string()),
    }
}

/// Docker-style normalisation of a `name[:tag]` reference:
/// `foo:1` → `docker.io/library/foo:1`, `a/b` → `docker.io/a/b:latest`,
/// `registry.k8s.io/pause:3.6` unchanged.
fn normalize_ref(name_tag: &str) -> String {
    let (name, tag) = split_name_tag(name_tag);
    let full = match name.split_once('/') {
        Some((first, _)) if first.contains('.') || first.contains(':') || first == "localhost" => {
            name
        }
        Some(_) => format!("docker.io/{name}"),
        None => format!("docker.io/library/{name}"),
    };
    format!("{full}:{tag}")
}

/// Output of images built with [`TestImage::hello`]: `hello-from-<name_tag>`
/// with `/` and `:` replaced by `-`.
pub fn hello_text(name_tag: &str) -> String {
    format!("hello-from-{}", name_tag.replace(['/', ':'], "-"))
}

/// An offline-built image: an OCI layout dir with one tag.
pub struct TestImage {
    /// Repository name as given (e.g. `foo`, `registry.k8s.io/pause`).
    pub name: String,
    /// Tag (also the tag inside the OCI layout).
    pub tag: String,
    layout: PathBuf,
    dir: TempDir,
    docker_archive: OnceLock<PathBuf>,
    oci_archive: OnceLock<PathBuf>,
}

impl TestImage {
    /// Builds `name_tag` from the busybox base: `1 + layers` layers in total,
    /// extra layer `N` (1-based) holding `/layerN.txt` (distinct text) plus,
    /// if `extra_layer_bytes > 0`, `/layerN.bin` with that many random bytes.
    /// `cmd` becomes the image CMD (empty: no CMD).
    pub fn build(
        name_tag: &str,
        layers: usize,
        cmd: &[&str],
        extra_layer_bytes: usize,
    ) -> TestImage {
        let (name, tag) = split_name_tag(name_tag);
        let dir = tempdir("image-");
        let layout = dir.path().join("oci");
        let mut cp = Command::new("cp");
        cp.arg("-a").arg(base_layout()).arg(&layout);
        run_ok(cp);
        let base_ref = format!("{}:base", layout.display());
        let image = format!("{}:{tag}", layout.display());
        if tag != "base" {
            umoci(["tag", "--image", &base_ref, &tag]);
            umoci(["rm", "--image", &base_ref]);
        }
        for n in 1..=layers {
            let stage = dir.path().join(format!("stage-{n}"));
            fs::create_dir(&stage).expect("mkdir stage");
            fs::set_permissions(&stage, fs::Permissions::from_mode(0o755)).expect("chmod stage");
            fs::write(
                stage.join(format!("layer{n}.txt")),
                format!("layer {n} of {name_tag}\n"),
            )
            .expect("write layer file");
            if extra_layer_bytes > 0 {
                let mut f = File::create(stage.join(format!("layer{n}.bin"))).expect("create bin");
                let mut rng = rand::rng();
                let mut buf = vec![0u8; 1 << 20];
                let mut left = extra_layer_bytes;
                while left > 0 {
                    let k = left.min(buf.len());
                    rand::RngCore::fill_bytes(&mut rng, &mut buf[..k]);
                    f.write_all(&buf[..k]).expect("write random data");
                    left -= k;
                }
            }
            umoci([
                OsStr::new("insert"),
                OsStr::new("--image"),
                OsStr::new(&image),
                stage.as_os_str(),
                OsStr::new("/"),
            ]);
            let _ = fs::remove_dir_all(&stage);
        }
        if !cmd.is_empty() {
            let mut args = vec!["config", "--image", &image];
            for c in cmd {
                args.push("--config.cmd");
                args.push(c);
            }
            umoci(&args);
        }
        umoci([OsStr::new("gc"), OsStr::new("--layout"), layout.as_os_str()]);
        TestImage {
            name,
            tag,
            layout,
            dir,
            docker_archive: OnceLock::new(),
            oci_archive: OnceLock::new(),
        }
    }

    /// Like [`TestImage::build`] but memoised per process on all arguments.
    pub fn cached(
        name_tag: &str,
        layers: usize,
        cmd: &[&str],
        extra_layer_bytes: usize,
    ) -> Arc<TestImage> {
        type Key = (String, usize, Vec<String>, usize);
        static CACHE: OnceLock<Mutex<HashMap<Key, Arc<TestImage>>>> = OnceLock::new();
        let key = (
            name_tag.to_string(),
            layers,
            cmd.iter().map(|s| s.to_string()).collect(),
            extra_layer_bytes,
        );
        let mut cache = CACHE
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        cache
            .entry(key)
            .or_insert_with(|| Arc::new(TestImage::build(name_tag, layers, cmd, extra_layer_bytes)))
            .clone()
    }

    /// Cached image with one extra layer whose CMD prints [`hello_text`]`(name_tag)`.
    pub fn hello(name_tag: &str) -> Arc<TestImage> {
        let text = hello_text(name_tag);
        TestImage::cached(name_tag, 1, &["/bin/busybox", "echo", &text], 0)
    }

    /// `name:tag` as given.
    pub fn name_tag(&self) -> String {
        format!("{}:{}", self.name, self.tag)
    }

    /// Normalised reference, e.g. `docker.io/library/foo:1`: the name that
    /// `ctr images import` of [`TestImage::docker_archive`] creates and that
    /// CRI resolves.
    pub fn normalized(&self) -> String {
        normalize_ref(&self.name_tag())
    }

    /// The OCI layout directory.
    pub fn layout(&self) -> &Path {
        &self.layout
    }

    /// `oci:<layout>:<tag>` for skopeo.
    pub fn oci_ref(&self) -> String {
        format!("oci:{}:{}", self.layout.display(), self.tag)
    }

    /// Digest of the image manifest in the OCI layout (a docker-archive
    /// export gets a different, converted manifest).
    pub fn manifest_digest(&self) -> String {
        let index: serde_json::Value = serde_json::from_slice(
            &fs::read(self.layout.join("index.json")).expect("read index.json"),
        )
        .expect("parse index.json");
        index["manifests"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == self.tag.as_str())
            .and_then(|m| m["digest"].as_str())
            .expect("tag in index.json")
            .to_string()
    }

    /// Config digest (the CRI image id is `sha256:<this>` after import).
    pub fn config_digest(&self) -> String {
        let m = self.manifest_digest();
        let (alg, hex) = m.split_once(':').expect("digest");
        let manifest: serde_json::Value = serde_json::from_slice(
            &fs::read(self.layout.join("blobs").join(alg).join(hex)).expect("read manifest"),
        )
        .expect("parse manifest");
        manifest["config"]["digest"]
            .as_str()
            .expect("config digest")
            .to_string()
    }

    /// `docker-archive` tarball tagged `name:tag` (cached).
    pub fn docker_archive(&self) -> PathBuf {
        self.docker_archive
            .get_or_init(|| {
                let f = self.dir.path().join("docker-archive.tar");
                self.export_docker_archive(&f, &self.name_tag());
                f
            })
            .clone()
    }

    /// Writes a `docker-archive` to `dest` tagged `ref_name` (e.g. a
    /// different name than the image's own).
    pub fn export_docker_archive(&self, dest: &Path, ref_name: &str) {
        let _ = fs::remove_file(dest);
        skopeo([
            "copy".to_string(),
            "--quiet".into(),
            self.oci_ref(),
            format!("docker-archive:{}:{ref_name}", dest.display()),
        ]);
    }

    /// `oci-archive` tarball (cached) whose `org.opencontainers.image.ref.name`
    /// is the normalised name; import it with
    /// `ctr images import --base-name docker.io/library/<name> FILE`
    /// (`ctr` 1.6 otherwise prefixes/filters the ref name).
    pub fn oci_archive(&self) -> PathBuf {
        self.oci_archive
            .get_or_init(|| {
                let f = self.dir.path().join("oci-archive.tar");
                skopeo([
                    "copy".to_string(),
                    "--quiet".into(),
                    self.oci_ref(),
                    format!("oci-archive:{}:{}", f.display(), self.normalized()),
                ]);
                f
            })
            .clone()
    }

    /// Pushes to the plain-HTTP registry at `registry_addr` (`host:port`) as
    /// `<addr>/<name without registry domain>:<tag>`; returns that reference.
    pub fn push(&self, registry_addr: &str) -> String {
        let repo = normalize_ref(&self.name_tag());
        let (repo, _) = split_name_tag(&repo);
        let path = repo.split_once('/').map(|(_, p)| p).unwrap_or(&repo);
        let path = path.strip_prefix("library/").unwrap_or(path);
        let dest = format!("{registry_addr}/{path}:{}", self.tag);
        skopeo([
            "copy".to_string(),
            "--quiet".into(),
            "--dest-tls-verify=false".into(),
            self.oci_ref(),
            format!("docker://{dest}"),
        ]);
        dest
    }
}

/// The pause image ([`PAUSE_IMAGE`], CMD `busybox sleep 86400`), built once.
pub fn pause_image() -> &'static TestImage {
    static PAUSE: OnceLock<TestImage> = OnceLock::new();
    PAUSE.get_or_init(|| TestImage::build(PAUSE_IMAGE, 0, &["/bin/busybox", "sleep", "86400"], 0))
}

/// This host's architecture as containerd names it (GOARCH).
pub fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "powerpc64" => "ppc64le",
        a => a,
    }
}

/// `n` architectures other than this host's, for the foreign entries of a
/// multi-platform index.
pub fn other_archs(n: usize) -> Vec<&'static str> {
    ["arm64", "s390x", "ppc64le", "riscv64"]
        .into_iter()
        .filter(|a| *a != host_arch())
        .take(n)
        .collect()
}

/// A small image of one platform, built in memory: a config naming
/// `linux/<arch>` and one uncompressed layer holding `/platform.txt`. Used
/// for the entries of a multi-platform index: real blobs, written where a
/// test wants them.
pub struct PlatformImage {
    pub arch: String,
    pub layer: Vec<u8>,
    pub config: Vec<u8>,
    pub manifest: Vec<u8>,
}

impl PlatformImage {
    pub fn new(arch: &str, text: &str) -> PlatformImage {
        let data = format!("{text} for linux/{arch}\n");
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, "platform.txt", data.as_bytes())
            .expect("tar");
        let layer = b.into_inner().expect("tar");
        let config = serde_json::json!({
            "architecture": arch,
            "os": "linux",
            "config": {"Cmd": ["/bin/cat", "/platform.txt"]},
            "rootfs": {"type": "layers", "diff_ids": [sha256_digest(&layer)]},
        })
        .to_string()
        .into_bytes();
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": sha256_digest(&config), "size": config.len()},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                        "digest": sha256_digest(&layer), "size": layer.len()}],
        })
        .to_string()
        .into_bytes();
        PlatformImage {
            arch: arch.into(),
            layer,
            config,
            manifest,
        }
    }

    pub fn manifest_digest(&self) -> String {
        sha256_digest(&self.manifest)
    }

    pub fn layer_digest(&self) -> String {
        sha256_digest(&self.layer)
    }

    /// Its entry in an index, with its platform.
    pub fn entry(&self) -> serde_json::Value {
        serde_json::json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": self.manifest_digest(),
            "size": self.manifest.len(),
            "platform": {"architecture": self.arch, "os": "linux"},
        })
    }

    /// Every blob, children first.
    pub fn blobs(&self) -> [&[u8]; 3] {
        [&self.layer, &self.config, &self.manifest]
    }
}

/// An OCI image index (bytes) of `entries`.
pub fn index_of(entries: &[serde_json::Value]) -> Vec<u8> {
    serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": entries,
    })
    .to_string()
    .into_bytes()
}

/// A multi-platform index in an OCI layout: `img` (built for this host)
/// and one [`PlatformImage`] per other architecture, all blobs real.
pub struct MultiPlatform {
    pub others: Vec<PlatformImage>,
    pub index: Vec<u8>,
    tag: String,
    layout: PathBuf,
    _dir: TempDir,
}

impl MultiPlatform {
    pub fn new(img: &TestImage, archs: &[&str]) -> MultiPlatform {
        let dir = tempdir("multi-platform-");
        let layout = dir.path().join("oci");
        let mut cp = Command::new("cp");
        cp.arg("-a").arg(img.layout()).arg(&layout);
        run_ok(cp);
        let manifest = img.manifest_digest();
        let size = fs::metadata(blob_file(&layout, &manifest))
            .expect("host manifest")
            .len();
        let host = serde_json::json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest,
            "size": size,
            "platform": {"architecture": host_arch(), "os": "linux"},
        });
        let others: Vec<_> = archs
            .iter()
            .map(|a| PlatformImage::new(a, &img.name_tag()))
            .collect();
        let mut entries = vec![host];
        for o in &others {
            for b in o.blobs() {
                fs::write(blob_file(&layout, &sha256_digest(b)), b).expect("write blob");
            }
            entries.push(o.entry());
        }
        let index = index_of(&entries);
        fs::write(blob_file(&layout, &sha256_digest(&index)), &index).expect("write index");
        let layout_index = serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": "application/vnd.oci.image.index.v1+json",
                "digest": sha256_digest(&index),
                "size": index.len(),
                "annotations": {"org.opencontainers.image.ref.name": img.tag},
            }],
        });
        fs::write(layout.join("index.json"), layout_index.to_string()).expect("index.json");
        MultiPlatform {
            others,
            index,
            tag: img.tag.clone(),
            layout,
            _dir: dir,
        }
    }

    pub fn index_digest(&self) -> String {
        sha256_digest(&self.index)
    }

    /// Pushes every platform to the plain-HTTP registry at `registry_addr`
    /// as `<addr>/<repo>:<tag>`; returns that reference.
    pub fn push(&self, registry_addr: &str, repo: &str) -> String {
        let dest = format!("{registry_addr}/{repo}:{}", self.tag);
        skopeo([
            "copy".to_string(),
            "--quiet".into(),
            "--all".into(),
            "--preserve-digests".into(),
            "--dest-tls-verify=false".into(),
            format!("oci:{}:{}", self.layout.display(), self.tag),
            format!("docker://{dest}"),
        ]);
        dest
    }
}

fn blob_file(layout: &Path, digest: &str) -> PathBuf {
    layout
        .join("blobs/sha256")
        .join(digest.trim_start_matches("sha256:"))
}
