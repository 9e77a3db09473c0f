//! A private containerd per test: config, start, restart, stop.

use std::ffi::OsStr;
use std::fs;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::cri::try_cri_image_status;
use crate::ctr::{ctr, ctr_command, ctr_ok, snapshotter};
use crate::daemon::{keep_tmp, Daemon, NotReady, SHIM_ADDRESSES};
use crate::flavor::flavor;
use crate::images::{pause_image, PAUSE_IMAGE};
use crate::repo::script;
use crate::shims::{kill_shims, shims_of, unmount_under};
use crate::util::{
    block_on_thread, poll_async, run_ok, tempdir, try_output_with_timeout, READY_TIMEOUT,
};

/// Options for [`Containerd::start`].
#[derive(Clone, Debug, Default)]
pub struct ContainerdOpts {
    /// Enable the CRI plugin (and import [`PAUSE_IMAGE`] into `k8s.io`).
    pub cri: bool,
    /// `content_sharing_policy = "isolated"` for the bolt metadata plugin.
    pub isolated: bool,
    /// With `cri`: a registry `host:port` that CRI pulls from over plain http.
    pub registry_mirror: Option<String>,
    /// Run containerd (and so its shims and host-network pods) inside this
    /// network namespace (`/run/netns/<name>`), see [`crate::netns`].
    pub netns: Option<PathBuf>,
    /// With `cri`: `(registry host, hosts.toml)` pairs written under the
    /// registry `config_path` (`<dir>/certs.d`), which every version then
    /// names, with `discard_unpacked_layers = false` (a node that serves its
    /// layers to others must keep them). Not with `registry_mirror` (1.x
    /// refuses `mirrors` next to `config_path`).
    pub registry_hosts: Vec<(String, String)>,
    /// With `cri`: a CNI network in the CNI dirs, so CRI reports its
    /// network ready and a registered kubelet's Node becomes Ready (a node
    /// without one is NotReady and tainted). The network is Debian's
    /// `loopback` plugin (containernetworking-plugins): a pod of its own
    /// network gets `lo` and nothing else, so nothing is routed outside the
    /// machine; the pods here run on the host's network.
    pub cni_loopback: bool,
    /// Its dir is a shared mount (bound over itself), as everything under
    /// `/` is on a systemd node: a pod mounting containerd's socket dir
    /// with `mountPropagation: HostToContainer` needs a shared or slave
    /// source, and this machine's `/` is private.
    pub shared_mount: bool,
    /// Its root (content, snapshots, metadata) on a tmpfs of this many MiB
    /// of its own: a disk that a test can fill ([`Containerd::fill_root`])
    /// and free again.
    pub root_mib: Option<u64>,
}

/// A private containerd (the [`flavor`] under test) on sockets in its own temp dir.
pub struct Containerd {
    opts: ContainerdOpts,
    daemon: Daemon,
    config: PathBuf,
    sock: PathBuf,
    ttrpc: PathBuf,
    dir: TempDir,
}

impl Containerd {
    /// Writes a config, starts containerd and waits until `ctr version`
    /// succeeds (and, with `cri`, until CRI resolves the imported pause image).
    pub fn start(opts: ContainerdOpts) -> Containerd {
        let dir = tempdir("containerd-");
        let d = dir.path();
        let sock = d.join("containerd.sock");
        let ttrpc = d.join("containerd.sock.ttrpc");
        let config = d.join("config.toml");
        fs::write(&config, containerd_config(d, &opts)).expect("write containerd config");
        if opts.shared_mount {
            for args in [&["--bind"][..], &["--make-shared"][..]] {
                let mut m = Command::new("mount");
                m.args(args).arg(d);
                if args[0] == "--bind" {
                    m.arg(d);
                }
                run_ok(m);
            }
        }
        if let Some(mib) = opts.root_mib {
            fs::create_dir_all(d.join("root")).expect("mkdir root");
            let mut m = Command::new("mount");
            m.args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
                .arg(d.join("root"));
            run_ok(m);
        }
        let daemon = Self::spawn(&config, &sock, d, opts.netns.as_deref());
        let mut c = Containerd {
            opts,
            daemon,
            config,
            sock,
            ttrpc,
            dir,
        };
        c.wait_ready();
        if c.opts.cri {
            let archive = pause_image().docker_archive();
            c.ctr_ok(
                "k8s.io",
                [
                    OsStr::new("images"),
                    OsStr::new("import"),
                    archive.as_os_str(),
                ],
            );
            c.wait_cri_ready();
        }
        c
    }

    fn spawn(config: &Path, sock: &Path, dir: &Path, netns: Option<&Path>) -> Daemon {
        let mut cmd = flavor().command("containerd");
        cmd.arg("--config").arg(config);
        // Keep containerd away from any system-wide client settings.
        cmd.env_remove("CONTAINERD_ADDRESS")
            .env_remove("CONTAINERD_NAMESPACE");
        if let Some(ns) = netns {
            cmd = crate::netns::wrap_in(ns, cmd);
        }
        let mut addrs = SHIM_ADDRESSES.lock().unwrap_or_else(|e| e.into_inner());
        if !addrs.iter().any(|a| a == sock) {
            addrs.push(sock.to_path_buf());
        }
        drop(addrs);
        Daemon::spawn("containerd", cmd, &dir.join("containerd.log"))
    }

    fn wait_ready(&mut self) {
        let start = Instant::now();
        let sock = self.sock.clone();
        let ready = self.daemon.wait_ready(|| {
            StdUnixStream::connect(&sock).is_ok()
                && ctr(&sock, "default", ["version"]).status.success()
        });
        match ready {
            Ok(()) => {}
            Err(NotReady::Exited(status)) => panic!(
                "containerd exited during startup ({status}); log tail:\n{}",
                self.log_tail()
            ),
            Err(NotReady::TimedOut) => panic!(
                "containerd not ready after {:?} (socket {}); log tail:\n{}",
                start.elapsed(),
                self.sock.display(),
                self.log_tail()
            ),
        }
    }

    /// Polls until CRI resolves the pause image, or, where a test removed
    /// it from `k8s.io` (to start from an empty one), until CRI answers.
    fn wait_cri_ready(&mut self) {
        let sock = self.sock.clone();
        let seeded = self
            .ctr_ok("k8s.io", ["images", "ls", "-q"])
            .lines()
            .any(|l| l == PAUSE_IMAGE);
        let found = block_on_thread(async move {
            poll_async(READY_TIMEOUT, || {
                let sock = sock.clone();
                async move {
                    match try_cri_image_status(&sock, PAUSE_IMAGE).await {
                        Ok(Some(_)) => Some(()),
                        Ok(None) if !seeded => Some(()),
                        _ => None,
                    }
                }
            })
            .await
        });
        if found.is_none() {
            panic!(
                "CRI did not resolve {PAUSE_IMAGE} within {READY_TIMEOUT:?}; log tail:\n{}",
                self.log_tail()
            );
        }
    }

    /// gRPC socket.
    pub fn socket(&self) -> &Path {
        &self.sock
    }

    /// ttrpc socket.
    pub fn ttrpc_socket(&self) -> &Path {
        &self.ttrpc
    }

    /// Temp dir holding config, root, state, sockets and log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Root directory (`root = ...` in the config).
    pub fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    /// containerd's in-progress writes in `ns` (the offset of each), read
    /// on its own socket.
    pub fn ingests(&self, ns: &str) -> Vec<i64> {
        let (sock, ns) = (self.sock.clone(), ns.to_string());
        block_on_thread(async move {
            let mut content = crate::grpc::content_client(&sock).await;
            let req = containerd_client::services::v1::ListStatusesRequest::default();
            content
                .list_statuses(crate::grpc::with_ns(req, &ns))
                .await
                .map(|r| r.into_inner().statuses.iter().map(|s| s.offset).collect())
                .unwrap_or_default()
        })
    }

    /// Fills the filesystem of its root (see [`ContainerdOpts::root_mib`])
    /// with one file, so that every write there fails with ENOSPC until
    /// the file is removed; returns the file and the bytes it took.
    pub fn fill_root(&self) -> (PathBuf, u64) {
        let f = self.root().join("imgbridge-test-fill");
        let st = nix::sys::statvfs::statvfs(&self.root()).expect("statvfs root");
        let free = st.blocks_available() as u64 * st.fragment_size() as u64;
        let file = fs::File::create(&f).expect("create fill file");
        // fallocate may stop a few blocks short of the whole; that is a
        // full disk to every writer but this one.
        // SAFETY: a plain syscall on a file descriptor this function owns.
        let _ = unsafe {
            libc::fallocate(
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
                0,
                free as libc::off_t,
            )
        };
        (f, free)
    }

    pub fn config_path(&self) -> &Path {
        &self.config
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("containerd.log")
    }

    pub fn opts(&self) -> ContainerdOpts {
        self.opts.clone()
    }

    /// Pid of the running containerd. Panics if it is stopped.
    pub fn pid(&self) -> u32 {
        self.daemon.pid().expect("containerd is not running")
    }

    /// Last 60 lines of the containerd log (accumulates across restarts).
    pub fn log_tail(&self) -> String {
        self.daemon.log_tail(60)
    }

    /// Panics, with the log tail (where a Go panic shows), unless the
    /// containerd that had `pid` is still the one running: imgbridge must
    /// never take the runtime down.
    pub fn assert_still_running(&mut self, pid: u32) {
        if let Some(st) = self.daemon.try_reap() {
            panic!(
                "containerd {} (pid {pid}) died ({st}); log tail:\n{}",
                flavor().version,
                self.log_tail()
            );
        }
        assert_eq!(self.pid(), pid, "containerd was restarted");
        assert!(
            !fs::read_to_string(self.log_path())
                .unwrap_or_default()
                .contains("panic:"),
            "containerd logged a panic; log tail:\n{}",
            self.log_tail()
        );
    }

    /// SIGKILL containerd (its shims keep running, as in a real crash).
    pub fn kill9(&mut self) {
        self.daemon.kill9();
    }

    /// Graceful stop: SIGTERM, wait up to [`crate::util::STOP_GRACE`], then SIGKILL.
    pub fn stop(&mut self) {
        self.daemon.stop();
    }

    /// Starts containerd again with the same config/root/state (stopping it
    /// first if it is still running) and waits until it serves again.
    pub fn restart(&mut self) {
        if self.daemon.running() {
            self.stop();
        }
        self.daemon = Self::spawn(
            &self.config,
            &self.sock,
            self.dir.path(),
            self.opts.netns.as_deref(),
        );
        self.wait_ready();
        if self.opts.cri {
            self.wait_cri_ready();
        }
    }

    /// [`ctr`] against this containerd.
    pub fn ctr<I, S>(&self, ns: &str, args: I) -> Output
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        ctr(&self.sock, ns, args)
    }

    /// [`ctr_ok`] against this containerd.
    pub fn ctr_ok<I, S>(&self, ns: &str, args: I) -> String
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        ctr_ok(&self.sock, ns, args)
    }
}

impl Containerd {
    /// Best effort, never panics: force-deletes every task in every namespace
    /// through the live containerd, so runc removes cgroups, mounts and state
    /// and the shims exit cleanly.
    fn delete_all_tasks(&self) {
        let run = |ns: &str, args: &[&str]| -> Option<String> {
            let out =
                try_output_with_timeout(ctr_command(&self.sock, ns, args), Duration::from_secs(30))
                    .ok()?;
            out.status
                .success()
                .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
        };
        let Some(namespaces) = run("default", &["namespaces", "ls", "-q"]) else {
            return;
        };
        for ns in namespaces.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let Some(tasks) = run(ns, &["tasks", "ls", "-q"]) else {
                continue;
            };
            let ids: Vec<&str> = tasks
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            if !ids.is_empty() {
                let mut args = vec!["tasks", "delete", "--force"];
                args.extend(ids);
                let _ = run(ns, &args);
            }
        }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if self.daemon.running() && !shims_of(&self.sock).is_empty() {
            self.delete_all_tasks();
        }
        self.daemon.stop();
        kill_shims(&self.sock);
        SHIM_ADDRESSES
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|a| a != &self.sock);
        if keep_tmp() {
            return;
        }
        let left = unmount_under(self.dir.path());
        if left > 0 {
            eprintln!(
                "warning: {left} mounts remain under {}; leaving it in place",
                self.dir.path().display()
            );
            self.dir.disable_cleanup(true);
        }
    }
}

/// The config of the containerd in `d`, from
/// `scripts/lib/containerd-config.sh`: the one generator, which `try.sh` and
/// the bench scripts use too (it picks the config version from this
/// containerd's `--version`). The GC runs only
/// when asked for (`--manual-gc`): tests stand in for buildkit with `ctr
/// content ingest`, which leaves a blob unreferenced until the test labels
/// it or names an image after it, and containerd's default GC (100 ms
/// after start, at once after any deletion) made that window a race.
///
/// `registry_hosts` are written here, not by the script: their contents
/// are each test's own (the script writes only a `--mirror`'s hosts.toml,
/// whose form depends on the containerd version).
pub(crate) fn containerd_config(d: &Path, opts: &ContainerdOpts) -> String {
    let f = flavor();
    let mut cmd = Command::new(script("lib/containerd-config.sh"));
    cmd.env("PATH", f.path_env())
        .arg("--dir")
        .arg(d)
        .arg("--containerd")
        .arg(f.bin("containerd"))
        .arg("--manual-gc");
    if opts.isolated {
        cmd.arg("--isolated");
    }
    if opts.cri {
        cmd.args(["--cri", "--snapshotter", snapshotter()])
            .args(["--sandbox-image", PAUSE_IMAGE]);
        if let Some(mirror) = &opts.registry_mirror {
            cmd.args(["--mirror", mirror]);
        }
        if !opts.registry_hosts.is_empty() {
            let certs = d.join("certs.d");
            write_registry_hosts(&certs, opts);
            cmd.arg("--certs").arg(&certs).arg("--keep-unpacked-layers");
        }
    }
    if opts.cri && opts.cni_loopback {
        write_cni_loopback(d);
    }
    let out = run_ok(cmd);
    let cfg = String::from_utf8(out.stdout).expect("containerd-config.sh printed UTF-8");
    // The generator and doctor agree on the version this containerd reads.
    let version = f.config_version();
    assert!(
        cfg.starts_with(&format!("version = {version}\n")),
        "containerd-config.sh wrote another version than doctor's {version} for containerd {}:\n{cfg}",
        f.version
    );
    cfg
}

/// Writes `opts.registry_hosts` as `<certs>/<registry>/hosts.toml`.
fn write_registry_hosts(certs: &Path, opts: &ContainerdOpts) {
    assert!(
        opts.registry_hosts.is_empty() || opts.registry_mirror.is_none(),
        "registry_hosts and registry_mirror do not go together"
    );
    for (registry, hosts) in &opts.registry_hosts {
        let dir = certs.join(registry);
        fs::create_dir_all(&dir).expect("create certs.d");
        fs::write(dir.join("hosts.toml"), hosts).expect("write hosts.toml");
    }
}

/// The CNI network of [`ContainerdOpts::cni_loopback`], in the CNI dirs of
/// `scripts/lib/containerd-config.sh` (`DIR/cni`).
fn write_cni_loopback(d: &Path) {
    const PLUGIN: &str = "/usr/lib/cni/loopback";
    assert!(
        Path::new(PLUGIN).is_file(),
        "{PLUGIN} missing (apt-get install containernetworking-plugins)"
    );
    let (bin, conf) = (d.join("cni/bin"), d.join("cni/net.d"));
    fs::create_dir_all(&bin).expect("cni bin dir");
    fs::create_dir_all(&conf).expect("cni conf dir");
    let link = bin.join("loopback");
    if !link.exists() {
        std::os::unix::fs::symlink(PLUGIN, &link).expect("link the loopback plugin");
    }
    fs::write(
        conf.join("10-loopback.conflist"),
        r#"{"cniVersion": "1.0.0", "name": "imgbridge-test-lo", "plugins": [{"type": "loopback"}]}"#,
    )
    .expect("write the CNI network");
}
