//! A real kubelet, standalone: no API server, static pods from a manifest
//! dir, its own root dir, `cgroupfs`, host-network pods, started and
//! stopped by pid like every daemon here. What it did is read from its own
//! view: its `/pods` and `/metrics` (read-only port, loopback), its pod log
//! files and its log (events are logged at `-v=3`), never crictl's.
//!
//! The node is left as it was: kubelet sets six host sysctls with no
//! setting to stop it, and creates `/var/lib/kubelet/device-plugins/` and
//! `/var/log/containers/` whatever its root dir (and its flexvolume dir,
//! `/usr/libexec/kubernetes/...`, unless `volumePluginDir` moves it). It runs in a mount
//! namespace of its own (`unshare -m`, private propagation) where files
//! holding the values it wants are bind-mounted over those `/proc/sys`
//! entries and tmpfs over `/var/lib` and `/var/log`, so none of it reaches
//! the host; [`Kubelet::stop`] checks that. `cgroupsPerQOS: false` keeps it
//! from building a `kubepods` cgroup tree (pods go where crictl's go).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tempfile::TempDir;

use crate::daemon::{Daemon, NotReady};
use crate::peers::{peer, Peer};
use crate::repo::script;
use crate::util::{free_port, poll, run_ok, tail_file, tempdir};

/// The node name kubelet runs as (`--hostname-override`): static pod
/// `NAME` shows in `/pods` as `NAME-imgbridge-node`.
pub const NODE: &str = "imgbridge-node";

/// Deadline for a static pod's container to run and print its line: the
/// file source, sandbox and container start of a real kubelet take longer
/// than crictl's three calls.
pub const KUBELET_POD_TIMEOUT: Duration = Duration::from_secs(60);

/// The sysctls kubelet's container manager sets (`setupKernelTunables`):
/// `scripts/lib/kubelet-ns.sh` hides each behind a file in kubelet's mount
/// namespace and lists them.
fn sysctls() -> Vec<String> {
    let out = run_ok({
        let mut c = Command::new(script("lib/kubelet-ns.sh"));
        c.arg("--sysctls");
        c
    });
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// Host paths kubelet creates whatever its root dir (hidden by the tmpfs
/// mounts; checked after it stops).
const HOST_LEFTOVERS: [&str; 3] = [
    "/var/lib/kubelet",
    "/var/log/containers",
    "/usr/libexec/kubernetes",
];

/// The parts of a `KubeletConfiguration` the tests change.
#[derive(Clone, Debug)]
pub struct KubeletOpts {
    /// The CRI socket (both endpoints, unless `extra` sets them).
    pub endpoint: PathBuf,
    /// More `KubeletConfiguration` fields (YAML lines, top level).
    pub extra: String,
    /// Registered with an API server through this kubeconfig
    /// ([`crate::cluster::ControlPlane::kubelet_kubeconfig`]) instead of
    /// standalone.
    pub kubeconfig: Option<PathBuf>,
}

impl KubeletOpts {
    pub fn new(endpoint: &Path) -> KubeletOpts {
        KubeletOpts {
            endpoint: endpoint.to_path_buf(),
            extra: String::new(),
            kubeconfig: None,
        }
    }

    /// A kubelet registered as Node [`NODE`] through `kubeconfig`.
    pub fn registered(mut self, kubeconfig: &Path) -> KubeletOpts {
        self.kubeconfig = Some(kubeconfig.to_path_buf());
        self
    }

    /// Adds top-level YAML lines to the configuration.
    pub fn with(mut self, yaml: &str) -> KubeletOpts {
        self.extra.push_str(yaml);
        if !yaml.ends_with('\n') {
            self.extra.push('\n');
        }
        self
    }
}

/// A standalone kubelet.
pub struct Kubelet {
    peer: &'static Peer,
    daemon: Option<Daemon>,
    opts: KubeletOpts,
    dir: TempDir,
    read_only: String,
    host_before: Vec<(String, Option<String>)>,
}

/// One of kubelet's containers, as its `/pods` reports it.
#[derive(Clone, Debug)]
pub struct PodContainer {
    /// The static pod's name in `/pods` (`NAME-imgbridge-node`).
    pub pod: String,
    pub uid: String,
    /// Without the `containerd://` prefix.
    pub id: String,
    pub image_id: String,
    pub restart_count: u64,
}

impl Kubelet {
    /// Starts kubelet on `opts.endpoint` and waits until its read-only port
    /// answers `/healthz`. `None` when peers are skipped.
    pub fn start(opts: KubeletOpts) -> Option<Kubelet> {
        let peer = peer("kubelet")?;
        let dir = tempdir("kubelet-");
        for sub in ["manifests", "root", "pod-logs"] {
            fs::create_dir_all(dir.path().join(sub)).expect("kubelet dirs");
        }
        let read_only = format!("127.0.0.1:{}", free_port());
        let mut k = Kubelet {
            peer,
            daemon: None,
            opts,
            dir,
            read_only,
            host_before: host_state(),
        };
        k.spawn();
        Some(k)
    }

    /// From `scripts/lib/kubelet-config.sh`, the one generator (the dev-loop
    /// bench uses it too); `opts.extra` overrides its defaults.
    fn config(&self) -> String {
        let d = self.dir.path();
        let extra = d.join("extra.yaml");
        fs::write(&extra, &self.opts.extra).expect("write kubelet extra config");
        let port = self.read_only.rsplit(':').next().unwrap_or_default();
        let mut cmd = Command::new(script("lib/kubelet-config.sh"));
        cmd.arg("--dir")
            .arg(d)
            .arg("--endpoint")
            .arg(&self.opts.endpoint)
            .args(["--port", &free_port().to_string()])
            .args(["--read-only-port", port])
            .args(["--healthz-port", &free_port().to_string()])
            .arg("--extra")
            .arg(&extra);
        String::from_utf8(run_ok(cmd).stdout).expect("kubelet-config.sh printed UTF-8")
    }

    fn spawn(&mut self) {
        let d = self.dir.path().to_path_buf();
        let config = d.join("kubelet.yaml");
        fs::write(&config, self.config()).expect("write kubelet config");
        // Its own mount namespace (scripts/lib/kubelet-ns.sh), which execs
        // kubelet: the pid stays the one spawned, so it is stopped by that pid.
        let mut cmd = Command::new(script("lib/kubelet-ns.sh"));
        cmd.arg(&d)
            .arg(self.peer.bin_dir.join("kubelet"))
            .arg(format!("--config={}", config.display()))
            .arg(format!("--root-dir={}", d.join("root").display()))
            .arg(format!("--hostname-override={NODE}"))
            .args(
                self.opts
                    .kubeconfig
                    .iter()
                    .map(|k| format!("--kubeconfig={}", k.display())),
            )
            // Events are logged at 3; its HTTP log would be a line a poll.
            .args(["--v=3", "--vmodule=httplog=2"]);
        let log = d.join("kubelet.log");
        let mut daemon = Daemon::spawn("kubelet", cmd, &log);
        let ro = self.read_only.clone();
        let ready = daemon.wait_ready(|| get(&ro, "/healthz").is_some_and(|b| b == "ok"));
        match ready {
            Ok(()) => {}
            Err(NotReady::Exited(st)) => {
                panic!("kubelet exited ({st}):\n{}", daemon.log_tail(60))
            }
            Err(NotReady::TimedOut) => {
                panic!("kubelet not healthy:\n{}", daemon.log_tail(60))
            }
        }
        self.daemon = Some(daemon);
    }

    /// Stops kubelet (SIGTERM; its containers keep running, as on a node)
    /// and starts it again with `opts` (the same dirs: pods, logs, records).
    pub fn restart_with(&mut self, opts: KubeletOpts) {
        self.halt();
        self.opts = opts;
        self.spawn();
    }

    pub fn opts(&self) -> &KubeletOpts {
        &self.opts
    }

    fn halt(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            d.stop();
        }
    }

    /// Stops kubelet and checks the host kept its sysctls and got none of
    /// kubelet's paths.
    pub fn stop(mut self) {
        self.halt();
        let after = host_state();
        assert_eq!(
            self.host_before, after,
            "kubelet changed the host (sysctls / {HOST_LEFTOVERS:?})"
        );
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("kubelet.log")
    }

    /// The whole kubelet log so far.
    pub fn log(&self) -> String {
        fs::read(self.log_path())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    pub fn log_tail(&self) -> String {
        tail_file(&self.log_path(), 60)
    }

    /// Writes (or replaces) static pod `pod` atomically: kubelet ignores
    /// dot files, so it never reads half a manifest.
    pub fn write_pod(&self, pod: &StaticPod) {
        let dir = self.dir.path().join("manifests");
        let tmp = dir.join(format!(".{}.json.tmp", pod.name));
        fs::write(&tmp, pod.manifest().to_string()).expect("write manifest");
        fs::rename(&tmp, dir.join(format!("{}.json", pod.name))).expect("rename manifest");
    }

    /// The dir kubelet reads static pods from (`staticPodPath`), for a
    /// manifest rendered elsewhere (the chart's pod: `scripts/static-pod.sh`).
    pub fn manifests(&self) -> PathBuf {
        self.dir.path().join("manifests")
    }

    /// Static pod `name` of namespace `ns` whatever its image, as `/pods`
    /// has it.
    pub fn pod_in(&self, ns: &str, name: &str) -> Option<Value> {
        let full = format!("{name}-{NODE}");
        self.pods()
            .into_iter()
            .find(|p| p["metadata"]["name"] == full.as_str() && p["metadata"]["namespace"] == ns)
    }

    /// The log file of container `container` of `pod` (a `/pods` item) in
    /// its current run.
    pub fn log_path_of(&self, pod: &Value, container: &str) -> PathBuf {
        let m = &pod["metadata"];
        let restarts = pod["status"]["containerStatuses"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == container))
            .and_then(|c| c["restartCount"].as_u64())
            .unwrap_or_default();
        self.dir
            .path()
            .join("pod-logs")
            .join(format!(
                "{}_{}_{}",
                m["namespace"].as_str().unwrap_or_default(),
                m["name"].as_str().unwrap_or_default(),
                m["uid"].as_str().unwrap_or_default()
            ))
            .join(container)
            .join(format!("{restarts}.log"))
    }

    /// What container `container` of `pod` wrote in its current run.
    pub fn log_of(&self, pod: &Value, container: &str) -> String {
        fs::read_to_string(self.log_path_of(pod, container)).unwrap_or_default()
    }

    /// Removes static pod `name`'s manifest: kubelet stops the pod.
    pub fn remove_pod(&self, name: &str) {
        let _ = fs::remove_file(
            self.dir
                .path()
                .join("manifests")
                .join(format!("{name}.json")),
        );
    }

    /// `GET /pods` of the read-only port: kubelet's pods with the status its
    /// status manager holds (static pods included).
    pub fn pods(&self) -> Vec<Value> {
        get(&self.read_only, "/pods")
            .and_then(|b| serde_json::from_str::<Value>(&b).ok())
            .and_then(|v| v["items"].as_array().cloned())
            .unwrap_or_default()
    }

    /// Static pod `name` running `image`, as `/pods` has it.
    pub fn pod(&self, name: &str, image: &str) -> Option<Value> {
        let full = format!("{name}-{NODE}");
        self.pods().into_iter().find(|p| {
            p["metadata"]["name"] == full.as_str() && p["spec"]["containers"][0]["image"] == image
        })
    }

    /// The container of static pod `name` (image `image`) once kubelet
    /// reports it running.
    pub fn running(&self, name: &str, image: &str) -> Option<PodContainer> {
        let p = self.pod(name, image)?;
        let s = &p["status"]["containerStatuses"][0];
        s["state"]["running"].as_object()?;
        Some(PodContainer {
            pod: p["metadata"]["name"].as_str()?.to_string(),
            uid: p["metadata"]["uid"].as_str()?.to_string(),
            id: s["containerID"]
                .as_str()?
                .trim_start_matches("containerd://")
                .to_string(),
            image_id: s["imageID"].as_str().unwrap_or_default().to_string(),
            restart_count: s["restartCount"].as_u64().unwrap_or_default(),
        })
    }

    /// What the container wrote, from kubelet's pod log file
    /// (`<podLogsDir>/default_<pod>_<uid>/<container>/<restarts>.log`).
    pub fn container_log(&self, c: &PodContainer) -> String {
        let path = self
            .dir
            .path()
            .join("pod-logs")
            .join(format!("default_{}_{}", c.pod, c.uid))
            .join(CONTAINER)
            .join(format!("{}.log", c.restart_count));
        fs::read_to_string(path).unwrap_or_default()
    }

    /// Waits until static pod `name` runs `image` and its log shows
    /// `expect`; panics with what kubelet reports otherwise.
    pub fn wait_running(&self, name: &str, image: &str, expect: &str) -> PodContainer {
        self.try_wait_running(name, image, expect, KUBELET_POD_TIMEOUT)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Kubelet::wait_running`] returning what went wrong instead.
    pub fn try_wait_running(
        &self,
        name: &str,
        image: &str,
        expect: &str,
        within: Duration,
    ) -> Result<PodContainer, String> {
        poll(within, || {
            let c = self.running(name, image)?;
            self.container_log(&c).contains(expect).then_some(c)
        })
        .ok_or_else(|| {
            format!(
                "static pod {name} ({image}) did not run and print {expect:?} within {within:?}; kubelet reports {}\n--- kubelet log ---\n{}",
                self.pod(name, image)
                    .map(|p| p["status"].to_string())
                    .unwrap_or_else(|| "no such pod".into()),
                self.log_tail()
            )
        })
    }

    /// Waits until kubelet reports static pod `name` (`image`) waiting with
    /// one of `reasons` (`ErrImagePull`, ...); returns the reason.
    pub fn wait_waiting(
        &self,
        name: &str,
        image: &str,
        reasons: &[&str],
        within: Duration,
    ) -> Option<String> {
        poll(within, || {
            let p = self.pod(name, image)?;
            let r = p["status"]["containerStatuses"][0]["state"]["waiting"]["reason"].as_str()?;
            reasons.contains(&r).then(|| r.to_string())
        })
    }

    /// One counter or gauge of kubelet's `/metrics` (the exact series,
    /// labels included), 0 when absent.
    pub fn metric(&self, series: &str) -> f64 {
        get(&self.read_only, "/metrics")
            .unwrap_or_default()
            .lines()
            .find_map(|l| {
                l.strip_prefix(series)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or(0.0)
    }

    /// CRI calls of `operation` that succeeded, by kubelet's own count
    /// (`kubelet_runtime_operations_total` minus `..._errors_total`).
    pub fn runtime_ok(&self, operation: &str) -> f64 {
        let l = format!("{{operation_type=\"{operation}\"}}");
        self.metric(&format!("kubelet_runtime_operations_total{l}"))
            - self.metric(&format!("kubelet_runtime_operations_errors_total{l}"))
    }

    /// Time until kubelet makes a successful ListPodSandbox (its PLEG
    /// relists every second) after `since`: kubelet's runtime is back.
    pub fn wait_runtime_back(&self, since: Instant, within: Duration) -> Option<Duration> {
        let before = self.runtime_ok("list_podsandbox");
        poll(within, || {
            (self.runtime_ok("list_podsandbox") > before).then(|| since.elapsed())
        })
    }

    /// Event lines kubelet logged (`"Event occurred"`, `-v=3`) with
    /// `reason`, in `log` (a slice of [`Kubelet::log`]).
    pub fn events<'a>(log: &'a str, reason: &str) -> Vec<&'a str> {
        let needle = format!("reason=\"{reason}\"");
        log.lines()
            .filter(|l| l.contains("Event occurred") && l.contains(&needle))
            .collect()
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.halt();
    }
}

/// `GET path` on kubelet's read-only port: the body. HTTP/1.0, so the
/// answer is never chunked (its `/pods` and `/metrics` are large).
fn get(addr: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let sa = addr.parse().ok()?;
    let mut s = std::net::TcpStream::connect_timeout(&sa, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200")
        .then(|| body.to_string())
        .or_else(|| head.starts_with("HTTP/1.0 200").then(|| body.to_string()))
}

/// The host's values of kubelet's sysctls and whether its paths exist.
pub(crate) fn host_state() -> Vec<(String, Option<String>)> {
    sysctls()
        .iter()
        .map(|p| format!("/proc/sys/{p}"))
        .chain(HOST_LEFTOVERS.iter().map(|p| p.to_string()))
        .map(|p| {
            let v = fs::read_to_string(&p).ok().or_else(|| {
                Path::new(&p)
                    .symlink_metadata()
                    .ok()
                    .map(|_| "exists".to_string())
            });
            (p, v)
        })
        .collect()
}

/// The one container of every static pod here.
pub const CONTAINER: &str = "app";

/// A static pod: one host-network container `app`.
#[derive(Clone, Debug)]
pub struct StaticPod {
    pub name: String,
    pub image: String,
    pub pull_policy: String,
    pub command: Vec<String>,
    /// Changing one replaces the pod (as `kubectl rollout restart` does).
    pub annotations: Vec<(String, String)>,
}

impl StaticPod {
    /// `image` with `imagePullPolicy: IfNotPresent`, running `sh -c
    /// "<script>"` from the image's busybox.
    pub fn new(name: &str, image: &str, script: &str) -> StaticPod {
        StaticPod {
            name: name.into(),
            image: image.into(),
            pull_policy: "IfNotPresent".into(),
            command: ["/bin/busybox", "sh", "-c", script]
                .map(String::from)
                .to_vec(),
            annotations: Vec::new(),
        }
    }

    /// Prints `line`, then sleeps (exec: busybox `sh` ignores SIGTERM).
    pub fn printing(name: &str, image: &str, line: &str) -> StaticPod {
        StaticPod::new(
            name,
            image,
            &format!("echo {line}; exec /bin/busybox sleep 100000"),
        )
    }

    pub fn policy(mut self, p: &str) -> StaticPod {
        self.pull_policy = p.into();
        self
    }

    pub fn manifest(&self) -> Value {
        let spec = json!({
            "hostNetwork": true,
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": CONTAINER,
                "image": self.image,
                "imagePullPolicy": self.pull_policy,
                "command": self.command,
            }],
        });
        let annotations: serde_json::Map<String, Value> = self
            .annotations
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": self.name, "namespace": "default", "annotations": annotations},
            "spec": spec,
        })
    }
}
