//! Scenario builders: the set-up most tests start their story with, said
//! once. `Scenario::cri().config("[replication]\npin = true\n").start()`
//! is a containerd with CRI and an imgbridge in front of it, configured so.

use std::fs;
use std::path::{Path, PathBuf};

use crate::bridge::Imgbridge;
use crate::containerd::{Containerd, ContainerdOpts};
use crate::ctr::ctr_ok;
use crate::util::tempdir;

/// A containerd of the flavour under test, with or without an imgbridge in
/// front of it. Build it, then [`Scenario::start`] (both) or
/// [`Scenario::containerd`] (containerd alone, for tests that start
/// imgbridge later or in front of something else).
#[derive(Clone, Debug, Default)]
#[must_use = "a scenario does nothing until it is started"]
pub struct Scenario {
    opts: ContainerdOpts,
    config: Option<String>,
    args: Vec<String>,
}

impl Scenario {
    /// containerd without CRI.
    pub fn plain() -> Scenario {
        Scenario::default()
    }

    /// containerd with CRI (and the pause image imported into `k8s.io`).
    pub fn cri() -> Scenario {
        let mut s = Scenario::default();
        s.opts.cri = true;
        s
    }

    /// `content_sharing_policy = "isolated"`: blobs must be copied between
    /// namespaces.
    pub fn isolated(mut self) -> Scenario {
        self.opts.isolated = true;
        self
    }

    /// CRI pulls from the plain-HTTP registry at `addr` (`host:port`).
    pub fn registry_mirror(mut self, addr: &str) -> Scenario {
        self.opts.registry_mirror = Some(addr.to_string());
        self
    }

    /// imgbridge's config file (TOML), passed with `--config`.
    pub fn config(mut self, toml: &str) -> Scenario {
        self.config = Some(toml.to_string());
        self
    }

    /// More `imgbridge serve` arguments.
    pub fn args(mut self, args: &[&str]) -> Scenario {
        self.args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// The containerd alone.
    pub fn containerd(&self) -> Containerd {
        Containerd::start(self.opts.clone())
    }

    /// imgbridge, configured as built, in front of `upstream`.
    pub fn imgbridge(&self, upstream: &Path) -> Imgbridge {
        let mut args = self.args.clone();
        if let Some(toml) = &self.config {
            args.extend([
                "--config".to_string(),
                config_file(toml).display().to_string(),
            ]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Imgbridge::start(upstream, &args)
    }

    /// containerd and an imgbridge in front of it. Bind the pair as
    /// `let (c, p) = ...`: imgbridge then stops before its containerd.
    pub fn start(self) -> (Containerd, Imgbridge) {
        let c = self.containerd();
        let p = self.imgbridge(c.socket());
        (c, p)
    }
}

/// An imgbridge config file holding `toml`, in a temp dir of its own that
/// lives as long as the test process (an imgbridge may read it again).
pub fn config_file(toml: &str) -> PathBuf {
    let path = tempdir("cfg-").keep().join("config.toml");
    fs::write(&path, toml).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    path
}

/// `ctr images import` of `archive` into `ns` through `sock` (containerd's
/// socket, or imgbridge's), as a build client would.
pub fn ctr_import(sock: &Path, ns: &str, archive: &Path) {
    ctr_ok(
        sock,
        ns,
        [
            std::ffi::OsStr::new("images"),
            std::ffi::OsStr::new("import"),
            archive.as_os_str(),
        ],
    );
}
