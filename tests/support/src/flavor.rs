//! Which containerd version the tests run against (`IMGBRIDGE_CONTAINERD`),
//! and what doctor says that version can do.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// The containerd version every test of this process runs against.
///
/// `IMGBRIDGE_CONTAINERD` picks it: a label of `scripts/containerd-matrix.sh`
/// (`1.6`, `1.7`, `2.1`, `2.4`), whose binaries that script fetches or builds
/// into its cache, or a directory holding `containerd`, `ctr` and
/// `containerd-shim-runc-v2`. Unset, the `containerd` on PATH is used (the
/// Debian package `scripts/test.sh` installs). That version's bin dir comes
/// first on PATH for containerd (so it starts its own shim) and for ctr.
pub struct Flavor {
    /// What `IMGBRIDGE_CONTAINERD` said (`system` when unset).
    pub label: String,
    /// The bin dir put first on PATH; `None` for the system's.
    pub bin_dir: Option<PathBuf>,
    /// As `containerd --version` prints it (`1.7.24~ds1`, `v2.4.2`).
    pub version: String,
    /// (major, minor, patch) parsed from `version`.
    pub semver: (u64, u64, u64),
}

impl Flavor {
    /// 2.x: `version = 3` configs, Transfer by default in ctr, CRI split
    /// into `io.containerd.cri.v1.images` / `.runtime`.
    pub fn is_v2(&self) -> bool {
        self.semver.0 >= 2
    }

    /// The config version this containerd reads natively (older ones are
    /// migrated with a warning at every start), as doctor expects it.
    pub fn config_version(&self) -> i64 {
        imgbridge::ops::doctor::native_config_version(self.semver).unwrap_or(4)
    }

    /// Has the Transfer service, as doctor says (1.7+): the tests that use
    /// it then check that claim against the real containerd.
    pub fn has_transfer(&self) -> bool {
        imgbridge::ops::doctor::ships_transfer(self.semver)
    }

    /// CRI reports a pin on a named record, as doctor says (1.6.25+,
    /// 1.7.10+, 2.x): the pin tests then check that claim against CRI.
    pub fn honours_pinned(&self) -> bool {
        use imgbridge::ops::doctor::{pinned_support, PinnedSupport};
        pinned_support(self.semver) == PinnedSupport::Full
    }

    /// PATH with this version's bin dir first.
    pub fn path_env(&self) -> std::ffi::OsString {
        let old = std::env::var_os("PATH").unwrap_or_default();
        match &self.bin_dir {
            Some(d) => {
                let mut p = d.as_os_str().to_owned();
                p.push(":");
                p.push(old);
                p
            }
            None => old,
        }
    }

    /// One of this version's binaries (`containerd`, `ctr`): in its bin
    /// dir, or the bare name, found on PATH.
    pub fn bin(&self, name: &str) -> PathBuf {
        match &self.bin_dir {
            Some(d) => d.join(name),
            None => PathBuf::from(name),
        }
    }

    /// A command for one of this version's binaries (`containerd`, `ctr`).
    pub fn command(&self, bin: &str) -> Command {
        let mut cmd = Command::new(self.bin(bin));
        cmd.env("PATH", self.path_env());
        cmd
    }
}

/// Parses `1.7.24~ds1-5`, `v2.4.2`, `2.1.9+unknown` into (major, minor,
/// patch), as `imgbridge doctor` does.
pub fn parse_semver(v: &str) -> Option<(u64, u64, u64)> {
    imgbridge::ops::doctor::parse_version(v)
}

pub fn flavor() -> &'static Flavor {
    static F: OnceLock<Flavor> = OnceLock::new();
    F.get_or_init(|| {
        let label = std::env::var("IMGBRIDGE_CONTAINERD").unwrap_or_default();
        let bin_dir = if label.is_empty() || label == "system" {
            None
        } else if label.contains('/') {
            Some(PathBuf::from(&label))
        } else {
            Some(matrix_bin_dir(&label))
        };
        let mut f = Flavor {
            label: if label.is_empty() {
                "system".into()
            } else {
                label
            },
            bin_dir,
            version: String::new(),
            semver: (0, 0, 0),
        };
        let out = f
            .command("containerd")
            .arg("--version")
            .output()
            .unwrap_or_else(|e| panic!("containerd ({}) cannot run: {e}", f.label));
        // "containerd github.com/containerd/containerd/v2 v2.4.2 <commit>"
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        f.version = text
            .split_whitespace()
            .nth(2)
            .unwrap_or_else(|| panic!("unexpected `containerd --version` output: {text}"))
            .to_string();
        f.semver = parse_semver(&f.version)
            .unwrap_or_else(|| panic!("cannot parse containerd version {:?}", f.version));
        eprintln!(
            "harness: containerd {} ({}, {})",
            f.version,
            f.label,
            f.bin_dir
                .as_deref()
                .map_or("PATH".into(), |d| d.display().to_string())
        );
        f
    })
}

/// The bin dir `scripts/containerd-matrix.sh` gives for `label` (fetched or
/// built on first use, cached after).
pub(crate) fn matrix_bin_dir(label: &str) -> PathBuf {
    fetched("containerd-matrix.sh", &["fetch", label])
        .into_iter()
        .find(|[l, _, _]| l == label)
        .map(|[_, _, dir]| PathBuf::from(dir))
        .unwrap_or_else(|| panic!("scripts/containerd-matrix.sh gave no bin dir for {label}"))
}

/// Runs `scripts/<script> <args>`, whose stdout is one `<name> <version>
/// <bin dir>` line per item it fetched or built; panics if it fails.
pub fn fetched(script: &str, args: &[&str]) -> Vec<[String; 3]> {
    let script = crate::repo::script(script);
    let out = Command::new(&script)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{} {args:?} failed ({}): {text}",
        script.display(),
        out.status
    );
    text.lines()
        .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            [a, b, c] => Some([a.to_string(), b.to_string(), c.to_string()]),
            _ => None,
        })
        .collect()
}
