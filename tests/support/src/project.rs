//! imgbridge's own image, made as the release makes it: the static binary
//! of `scripts/build-static.sh` in the no-base image of
//! `scripts/build-image.sh`. The chart's pod runs it under the real kubelet.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use tempfile::TempDir;

use crate::repo::{repo_root, script};
use crate::util::{run_ok, tempdir};

/// One build of the project's image: an oci-archive `ctr import` reads.
pub struct ProjectImage {
    pub archive: PathBuf,
    /// The chart's `image.tag` for it.
    pub tag: String,
    /// The normalized name it is imported as.
    pub name: String,
    _dir: TempDir,
}

/// imgbridge's version, as the release stamps it.
pub fn version() -> &'static str {
    imgbridge::VERSION
}

/// The static binary: `IMGBRIDGE_STATIC_BINARY` (scripts/test.sh builds it
/// once, before the matrix), else built here by `scripts/build-static.sh`
/// into a target dir of its own (the running `cargo test` holds the
/// default one's lock): minutes, once.
pub fn static_binary() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("IMGBRIDGE_STATIC_BINARY") {
            let p = PathBuf::from(p);
            assert!(p.is_file(), "IMGBRIDGE_STATIC_BINARY={} is no file", p.display());
            return p;
        }
        eprintln!("building the static binary (scripts/build-static.sh; set IMGBRIDGE_STATIC_BINARY to skip)");
        let mut cmd = Command::new(script("build-static.sh"));
        cmd.arg("x86_64")
            .env("CARGO_TARGET_DIR", repo_root().join("target/static-for-tests"));
        let out = run_ok(cmd);
        let line = String::from_utf8_lossy(&out.stdout);
        let path = line
            .split_whitespace()
            .nth(1)
            .unwrap_or_else(|| panic!("build-static.sh printed {line:?}"));
        PathBuf::from(path)
    })
}

/// The project's image with version `<crate version><suffix>` (a suffix
/// makes another image of the same binary: an upgrade's new image).
pub fn project_image(suffix: &str) -> ProjectImage {
    let dir = tempdir("project-image-");
    let tag = format!("{}{suffix}", version());
    let name = format!("docker.io/library/imgbridge:{tag}");
    let archive = dir.path().join("imgbridge-oci.tar");
    let mut cmd = Command::new(script("build-image.sh"));
    cmd.arg(&archive)
        .arg(format!("amd64={}", static_binary().display()))
        .env("IMGBRIDGE_VERSION", &tag)
        .env("IMGBRIDGE_IMAGE_NAME", &name);
    run_ok(cmd);
    ProjectImage {
        archive,
        tag,
        name,
        _dir: dir,
    }
}
