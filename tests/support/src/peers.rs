//! The real clients: buildkitd and buildctl, nerdctl, crictl, built by
//! `scripts/peers.sh` from `tests/peers/` at the versions pinned there.
//!
//! `IMGBRIDGE_SKIP_PEERS=1` skips every test that needs one (a quick local
//! loop; CI never sets it): [`peer`] then returns `None` and says so.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use tempfile::TempDir;

use crate::ctr::snapshotter;
use crate::daemon::{Daemon, NotReady};
use crate::flavor::{fetched, flavor};
use crate::repo::{repo_root, script};
use crate::util::{
    output_with_timeout, poll, run_ok, tempdir, unique_name, POD_TIMEOUT, TOOL_TIMEOUT,
};

/// One built peer.
#[derive(Clone, Debug)]
pub struct Peer {
    pub name: String,
    pub version: String,
    pub bin_dir: PathBuf,
}

impl Peer {
    pub fn command(&self, bin: &str) -> Command {
        let mut cmd = Command::new(self.bin_dir.join(bin));
        // Its containerd's ctr/shim first, as for the daemon under test.
        cmd.env("PATH", flavor().path_env())
            .env_remove("CONTAINERD_ADDRESS")
            .env_remove("CONTAINERD_NAMESPACE");
        cmd
    }
}

/// The peers fetched so far, by name. Each is fetched on first use, alone
/// (`scripts/peers.sh fetch NAME`, under its build lock): a test never
/// waits for a peer it does not use, so `scripts/test.sh` starts the tests
/// while kubelet and the control plane are still building.
fn fetched_peers() -> &'static Mutex<HashMap<String, &'static Peer>> {
    static P: OnceLock<Mutex<HashMap<String, &'static Peer>>> = OnceLock::new();
    P.get_or_init(Default::default)
}

/// The peer `name` (`buildkit`, `nerdctl`, `crictl`, `spegel`, `kubelet`,
/// `etcd`, `crane`, `ko`, …: `scripts/peers.sh`'s list), or `None` when
/// peers are skipped.
pub fn peer(name: &str) -> Option<&'static Peer> {
    let p = peer_quietly(name);
    if p.is_none() {
        eprintln!("skipped: needs {name} (IMGBRIDGE_SKIP_PEERS=1)");
    }
    p
}

fn peer_quietly(name: &str) -> Option<&'static Peer> {
    if std::env::var_os("IMGBRIDGE_SKIP_PEERS").is_some_and(|v| v == "1") {
        return None;
    }
    let known = |n: &str| {
        let m = fetched_peers().lock().unwrap_or_else(|e| e.into_inner());
        m.get(n).copied()
    };
    if let Some(p) = known(name) {
        return Some(p);
    }
    // Not under the lock: a fetch may wait for a build in progress.
    let [n, version, bin_dir] = fetched("peers.sh", &["fetch", name])
        .into_iter()
        .find(|[n, _, _]| n == name)
        .unwrap_or_else(|| panic!("scripts/peers.sh gave no {name}"));
    let p: &'static Peer = Box::leak(Box::new(Peer {
        name: n,
        version,
        bin_dir: bin_dir.into(),
    }));
    let mut m = fetched_peers().lock().unwrap_or_else(|e| e.into_inner());
    Some(*m.entry(name.to_string()).or_insert(p))
}

/// The `go` command the peers are built with: ko runs it to build what it
/// packs, so a ko test needs it at run time too. Asked of
/// `scripts/lib/gobuild.sh`'s `gobuild_find_go`, the one place that says
/// where go is looked for. `None` (and says so) when there is none.
pub fn go_command() -> Option<PathBuf> {
    let out = Command::new("bash")
        .args(["-c", r#"source "$1" && gobuild_find_go"#, "go_command"])
        .arg(repo_root().join("scripts/lib/gobuild.sh"))
        .env("repo_root", repo_root())
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("bash: {e}"));
    let found = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let go = (out.status.success() && !found.is_empty()).then(|| PathBuf::from(found));
    if go.is_none() {
        eprintln!("skipped: needs go (scripts/lib/gobuild.sh's gobuild_find_go found none)");
    }
    go
}

fn ok(what: &str, out: Output) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

// ---------------------------------------------------------------------------
// crictl: what kubelet sees
// ---------------------------------------------------------------------------

/// crictl on a containerd's own socket, as kubelet talks to it.
#[derive(Clone)]
pub struct Crictl {
    peer: &'static Peer,
    endpoint: String,
}

impl Crictl {
    pub fn new(containerd_sock: &Path) -> Option<Crictl> {
        Some(Crictl {
            peer: peer("crictl")?,
            endpoint: format!("unix://{}", containerd_sock.display()),
        })
    }

    /// Like [`Crictl::new`], without saying so when peers are skipped (the
    /// harness then asks CRI over gRPC itself).
    pub fn quiet(containerd_sock: &Path) -> Option<Crictl> {
        let p = peer_quietly("crictl")?;
        Some(Crictl {
            peer: p,
            endpoint: format!("unix://{}", containerd_sock.display()),
        })
    }

    pub fn run<I, S>(&self, args: I) -> Output
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = self.peer.command("crictl");
        cmd.args(["--runtime-endpoint", &self.endpoint])
            .args(["--image-endpoint", &self.endpoint])
            .args(["--timeout", "20s"])
            .args(args)
            // No /etc/crictl.yaml of the machine's.
            .env("CRI_CONFIG_FILE", "/dev/null");
        output_with_timeout(cmd, TOOL_TIMEOUT)
    }

    pub fn ok(&self, args: &[&str]) -> String {
        ok(&format!("crictl {args:?}"), self.run(args))
    }

    /// `crictl inspecti -o json`: CRI's image status (`None`: not found).
    pub fn inspecti(&self, name: &str) -> Result<Option<serde_json::Value>, String> {
        let out = self.run(["inspecti", "-o", "json", name]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            return match stderr.contains("no such image") || stderr.contains("not found") {
                true => Ok(None),
                false => Err(format!("crictl inspecti {name}: {stderr}")),
            };
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .map_err(|e| format!("crictl inspecti {name}: {e}"))?;
        Ok(Some(v["status"].clone()).filter(|s| !s.is_null()))
    }

    /// The image id kubelet would get for `name`, or `None` if CRI does not
    /// resolve it.
    pub fn image_id(&self, name: &str) -> Option<String> {
        let s = self.inspecti(name).ok()??;
        s["id"].as_str().map(str::to_owned)
    }

    /// Whether CRI reports `name` pinned.
    pub fn pinned(&self, name: &str) -> Option<bool> {
        self.inspecti(name).ok()??["pinned"].as_bool()
    }

    /// `runp`, `create`, `start` of a host-network pod with one container
    /// `main` running `cmd` from `image`, logging to `log_dir/main.log`, as
    /// kubelet would. Returns the pod id (once there is one) and the
    /// container id or what failed.
    pub fn start_pod(
        &self,
        name: &str,
        image: &str,
        cmd: &[&str],
        log_dir: &Path,
    ) -> (Option<String>, Result<String, String>) {
        let ns = serde_json::json!({"network": 2, "pid": 2, "ipc": 2});
        let pod = serde_json::json!({
            "metadata": {"name": name, "namespace": "imgbridge-test", "uid": unique_name("uid"), "attempt": 0},
            "log_directory": log_dir.display().to_string(),
            "linux": {"security_context": {"namespace_options": ns}}
        });
        let ctr = serde_json::json!({
            "metadata": {"name": "main"},
            "image": {"image": image},
            "command": cmd,
            "log_path": "main.log",
            "linux": {"security_context": {"namespace_options": ns}}
        });
        let (pod_json, ctr_json) = (log_dir.join("pod.json"), log_dir.join("ctr.json"));
        fs::write(&pod_json, pod.to_string()).unwrap();
        fs::write(&ctr_json, ctr.to_string()).unwrap();
        let p = |p: &Path| p.display().to_string();
        let step = |args: &[&str]| -> Result<String, String> {
            let out = self.run(args);
            match out.status.success() {
                true => Ok(String::from_utf8_lossy(&out.stdout).trim().to_string()),
                false => Err(format!(
                    "crictl {}: {}",
                    args[0],
                    String::from_utf8_lossy(&out.stderr)
                )),
            }
        };
        let pod_id = match step(&["runp", &p(&pod_json)]) {
            Ok(id) => id,
            Err(e) => return (None, Err(e)),
        };
        let cid = step(&["create", &pod_id, &p(&ctr_json), &p(&pod_json)])
            .and_then(|cid| step(&["start", &cid]).map(|_| cid));
        (Some(pod_id), cid)
    }

    /// A pod running `image` with `cmd` until its log shows `expect`; then
    /// removed.
    pub fn run_pod(&self, image: &str, cmd: &[&str], expect: &str) -> String {
        self.try_run_pod(image, cmd, expect)
            .unwrap_or_else(|e| panic!("pod of {image}: {e}"))
    }

    /// [`Crictl::run_pod`] that says what failed instead of panicking
    /// (the soak counts failures rather than stopping at the first).
    pub fn try_run_pod(&self, image: &str, cmd: &[&str], expect: &str) -> Result<String, String> {
        let dir = tempdir("crictl-pod-");
        let (pod_id, cid) = self.start_pod(&unique_name("pod"), image, cmd, dir.path());
        let _guard = pod_id.map(|pod_id| PodGuard {
            crictl: self,
            pod_id,
        });
        let cid = cid?;
        poll(POD_TIMEOUT, || {
            let out = self.run(["logs", &cid]);
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            text.contains(expect).then_some(text)
        })
        .ok_or_else(|| {
            format!(
                "never printed {expect:?}: {}",
                String::from_utf8_lossy(&self.run(["ps", "-a"]).stdout)
            )
        })
    }
}

/// Stops and removes a pod however its test ends. containerd 1.6 can fail a
/// stop with "ttrpc: closed" while the shim exits, so it is retried as
/// kubelet does.
struct PodGuard<'a> {
    crictl: &'a Crictl,
    pod_id: String,
}

impl Drop for PodGuard<'_> {
    fn drop(&mut self) {
        let _ = poll(Duration::from_secs(30), || {
            let stopped = self.crictl.run(["stopp", &self.pod_id]).status.success();
            (stopped && self.crictl.run(["rmp", &self.pod_id]).status.success()).then_some(())
        });
    }
}

// ---------------------------------------------------------------------------
// buildkitd
// ---------------------------------------------------------------------------

/// A private buildkitd with only the containerd worker, in namespace
/// `buildkit`, writing through `containerd` (imgbridge's socket, or
/// containerd's own for a baseline).
pub struct Buildkitd {
    peer: &'static Peer,
    daemon: Daemon,
    addr: String,
    dir: TempDir,
}

impl Buildkitd {
    /// `namespace` is buildkit's worker namespace; `registry` a loopback
    /// registry `host:port` it may pull from over plain http.
    pub fn start(containerd: &Path, namespace: &str, registry: Option<&str>) -> Option<Buildkitd> {
        let peer = peer("buildkit")?;
        let dir = tempdir("buildkitd-");
        let d = dir.path();
        let addr = format!("unix://{}", d.join("buildkitd.sock").display());
        // scripts/lib/buildkitd-config.sh: the one generator (the dev-loop
        // bench uses it too).
        let mut gen = Command::new(script("lib/buildkitd-config.sh"));
        gen.arg("--dir")
            .arg(d)
            .arg("--containerd")
            .arg(containerd)
            .args(["--namespace", namespace, "--snapshotter", snapshotter()]);
        if let Some(r) = registry {
            gen.args(["--registry", r]);
        }
        let cfg = run_ok(gen).stdout;
        fs::write(d.join("buildkitd.toml"), cfg).unwrap();
        let mut cmd = peer.command("buildkitd");
        cmd.arg("--config").arg(d.join("buildkitd.toml"));
        let mut daemon = Daemon::spawn("buildkitd", cmd, &d.join("buildkitd.log"));
        let workers = || buildctl(peer, &addr, ["debug", "workers"]).status.success();
        match daemon.wait_ready(workers) {
            Ok(()) => {}
            Err(NotReady::Exited(st)) => {
                panic!("buildkitd exited ({st}):\n{}", daemon.log_tail(40))
            }
            Err(NotReady::TimedOut) => panic!("buildkitd not ready:\n{}", daemon.log_tail(40)),
        }
        Some(Buildkitd {
            peer,
            daemon,
            addr,
            dir,
        })
    }

    pub fn buildctl<I, S>(&self, args: I) -> Output
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        buildctl(self.peer, &self.addr, args)
    }

    /// `buildctl build` of `dockerfile` with `files` as its context and
    /// `--output <output>`; panics with buildkitd's log on failure.
    pub fn build(&self, dockerfile: &str, files: &[(&str, &[u8])], output: &str, extra: &[&str]) {
        let out = self.try_build(dockerfile, files, output, extra);
        if !out.status.success() {
            panic!(
                "buildctl build --output {output} failed:\n{}\n--- buildkitd log ---\n{}",
                String::from_utf8_lossy(&out.stderr),
                self.daemon.log_tail(40)
            );
        }
    }

    /// [`Buildkitd::build`] that returns buildctl's output, whatever it
    /// is (the soak counts failures rather than stopping at the first).
    pub fn try_build(
        &self,
        dockerfile: &str,
        files: &[(&str, &[u8])],
        output: &str,
        extra: &[&str],
    ) -> Output {
        let ctx = tempdir("build-ctx-");
        fs::write(ctx.path().join("Dockerfile"), dockerfile).unwrap();
        for (name, data) in files {
            fs::write(ctx.path().join(name), data).unwrap();
        }
        let c = ctx.path().display().to_string();
        let mut args = vec![
            "build".to_string(),
            "--frontend".into(),
            "dockerfile.v0".into(),
            "--local".into(),
            format!("context={c}"),
            "--local".into(),
            format!("dockerfile={c}"),
            "--output".into(),
            output.into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        self.buildctl(&args)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn log_tail(&self) -> String {
        self.daemon.log_tail(60)
    }
    /// buildkitd's pid: a test freezes it (SIGSTOP) mid-call.
    pub fn pid(&self) -> u32 {
        self.daemon.pid().expect("buildkitd runs")
    }

    /// Freezes buildkitd (SIGSTOP) in the middle of whatever it is doing.
    pub fn freeze(&self) {
        self.daemon.signal(nix::sys::signal::Signal::SIGSTOP);
    }

    /// Lets a frozen buildkitd go on (SIGCONT).
    pub fn thaw(&self) {
        self.daemon.signal(nix::sys::signal::Signal::SIGCONT);
    }

    /// Builds image `name` `FROM base` with only a `LABEL`: buildkit names
    /// the image, then writes the base's layers it never fetched (lazy),
    /// then returns; a write [`Buildkitd::freeze_mid_write`] can catch.
    pub fn build_on(&self, base: &str, name: &str) {
        self.build(
            &format!("FROM {base}\nLABEL round=upgrade\n"),
            &[],
            &format!("type=image,name={name}"),
            &[],
        );
    }

    /// Freezes buildkitd with a write in flight: once it has named image
    /// `name` in namespace `ns` of `c` and one of its ingests there is past
    /// 2 MiB (a build `FROM` a lazy base with only a `LABEL` names the
    /// image, then writes the layers it never fetched). Panics, thawed,
    /// when that does not happen within a minute.
    pub fn freeze_mid_write(&self, c: &crate::containerd::Containerd, ns: &str, name: &str) {
        let frozen = poll(Duration::from_secs(60), || {
            let named = c.ctr(ns, ["images", "ls", "-q"]);
            let named = String::from_utf8_lossy(&named.stdout)
                .lines()
                .any(|l| l == name);
            (named && c.ingests(ns).iter().any(|&o| o > 2 << 20)).then(|| self.freeze())
        });
        if frozen.is_none() {
            self.thaw();
            panic!("the build never wrote its lazy layer:\n{}", self.log_tail());
        }
    }
}

/// `buildctl --addr <addr> <args...>`.
fn buildctl<I, S>(peer: &Peer, addr: &str, args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = peer.command("buildctl");
    cmd.args(["--addr", addr]).args(args);
    output_with_timeout(cmd, TOOL_TIMEOUT)
}

// ---------------------------------------------------------------------------
// nerdctl
// ---------------------------------------------------------------------------

/// nerdctl on `address` (imgbridge's socket) in one namespace, with its own
/// data root; `nerdctl build` uses the given buildkitd (and buildctl).
pub struct Nerdctl {
    peer: &'static Peer,
    address: PathBuf,
    namespace: String,
    data_root: TempDir,
    buildkit_host: Option<String>,
}

impl Nerdctl {
    pub fn new(address: &Path, namespace: &str, buildkit: Option<&Buildkitd>) -> Option<Nerdctl> {
        Some(Nerdctl {
            peer: peer("nerdctl")?,
            address: address.to_path_buf(),
            namespace: namespace.into(),
            data_root: tempdir("nerdctl-"),
            buildkit_host: buildkit.map(|b| b.addr.clone()),
        })
    }

    pub fn run<I, S>(&self, args: I) -> Output
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = self.peer.command("nerdctl");
        cmd.arg("--address")
            .arg(&self.address)
            .args(["--namespace", &self.namespace])
            .arg("--data-root")
            .arg(self.data_root.path())
            .args(["--snapshotter", snapshotter()]);
        if let Some(h) = &self.buildkit_host {
            // `nerdctl build` runs buildctl from PATH.
            let bk = peer("buildkit").expect("buildkit");
            let mut path = bk.bin_dir.as_os_str().to_owned();
            path.push(":");
            path.push(flavor().path_env());
            cmd.env("PATH", path).env("BUILDKIT_HOST", h);
        }
        cmd.args(args);
        output_with_timeout(cmd, TOOL_TIMEOUT)
    }

    pub fn ok(&self, args: &[&str]) -> String {
        ok(&format!("nerdctl {args:?}"), self.run(args))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `gobuild_find_go` prints is a `go` that runs (not, say, a path
    /// with the shell's newline still on it).
    #[test]
    fn go_command_is_a_go_that_runs() {
        let Some(go) = go_command() else { return };
        let out = Command::new(&go)
            .arg("version")
            .output()
            .unwrap_or_else(|e| panic!("{}: {e}", go.display()));
        assert!(out.status.success(), "{}: {out:?}", go.display());
        assert!(out.stdout.starts_with(b"go version"), "{out:?}");
    }
}
