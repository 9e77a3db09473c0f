//! The chart on a one-node cluster: containerd with CRI, the control plane
//! ([`crate::cluster`]) and a registered kubelet ([`OneNode`]); helm as the
//! admin ([`Helm`]); the chart's values for the node's paths
//! ([`ChartNode`]) and its `helm install` ([`install`]); and an app
//! Deployment pointed at fresh builds ([`App`]). `tests/cluster.rs` and
//! `examples/bench_deployments.rs` share them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tempfile::TempDir;

use crate::cluster::{ControlPlane, CLUSTER_TIMEOUT};
use crate::containerd::{Containerd, ContainerdOpts};
use crate::kubelet::{Kubelet, KubeletOpts};
use crate::peers::{peer, Buildkitd};
use crate::project::ProjectImage;
use crate::util::{free_port, output_with_timeout, poll, tempdir, TOOL_TIMEOUT};

/// The release's namespace and name.
pub const NS: &str = "kube-system";
pub const RELEASE: &str = "imgbridge";
/// The DaemonSet's pods.
pub const DS_PODS: &str = "app.kubernetes.io/name=imgbridge";

/// The events of pod `name` in `ns` that tell of a pull or a failure: a
/// fresh build's pod must have none.
pub fn pull_events(cp: &ControlPlane, ns: &str, name: &str) -> Vec<String> {
    cp.events(ns, name)
        .into_iter()
        .filter(|e| {
            // Reason `Failed` is kubelet's failed pull; `FailedMount` and
            // the like (a loaded API server's slow ConfigMap sync) are not.
            e.starts_with("Pulling") || e.contains("ErrImageNeverPull") || e.starts_with("Failed:")
        })
        .collect()
}

/// helm as the admin, with its own config, cache and data dirs.
pub struct Helm {
    bin: PathBuf,
    kubeconfig: PathBuf,
    home: TempDir,
}

impl Helm {
    pub fn new(cp: &ControlPlane) -> Option<Helm> {
        Some(Helm {
            bin: peer("helm")?.bin_dir.join("helm"),
            kubeconfig: cp.kubeconfig(),
            home: tempdir("helm-home-"),
        })
    }

    pub fn run(&self, args: &[&str]) -> Output {
        let h = self.home.path();
        let mut cmd = Command::new(&self.bin);
        cmd.args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("HELM_CONFIG_HOME", h.join("config"))
            .env("HELM_CACHE_HOME", h.join("cache"))
            .env("HELM_DATA_HOME", h.join("data"));
        output_with_timeout(
            cmd,
            TOOL_TIMEOUT.max(CLUSTER_TIMEOUT + Duration::from_secs(30)),
        )
    }

    pub fn ok(&self, args: &[&str], cp: &ControlPlane) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "helm {args:?} failed:\n{}{}\n--- pods ---\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            cp.kubectl_ok(&["get", "pods", "-A", "-o", "wide"])
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// The node's paths the chart's pod uses, under one temp dir.
pub struct ChartNode {
    dir: TempDir,
    metrics: u16,
}

impl Default for ChartNode {
    fn default() -> ChartNode {
        ChartNode {
            dir: tempdir("node-"),
            metrics: free_port(),
        }
    }
}

impl ChartNode {
    pub fn new() -> ChartNode {
        ChartNode::default()
    }

    /// The socket the pod exposes (the chart's `socket.dir`).
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("run-imgbridge/containerd.sock")
    }

    /// Renders the chart's pod for `image` as static pod `manifest`
    /// (`scripts/static-pod.sh`, config under this node's dir): for a
    /// kubelet without an API server.
    pub fn static_pod(&self, manifest: &Path, c: &Containerd, image: &ProjectImage) {
        let mut cmd = Command::new(crate::repo::script("static-pod.sh"));
        cmd.arg(manifest)
            .arg(self.dir.path().join("etc-imgbridge"))
            .args(self.values(c, image));
        crate::util::run_ok(cmd);
    }

    /// The chart's values for this node and `image`: `--set-string` for
    /// paths and names, `--set` for typed values.
    pub fn values(&self, c: &Containerd, image: &ProjectImage) -> Vec<String> {
        let d = self.dir.path();
        let strings = [
            format!("containerdSocket={}", c.socket().display()),
            format!("containerdConfig={}", c.config_path().display()),
            format!("image.tag={}", image.tag),
            format!("socket.dir={}", d.join("run-imgbridge").display()),
            format!("stateDir={}", d.join("state").display()),
        ];
        let typed = [
            "hostNetwork=true".to_string(),
            format!("metrics.port={}", self.metrics),
            "test.enabled=true".into(),
            // A replica in k8s.io when buildctl returns is the proxied
            // write's doing, not the catch-up pass's.
            "config.reconcile.enabled=false".into(),
        ];
        let flag = |f: &'static str| move |v: String| [f.to_string(), v];
        strings
            .into_iter()
            .flat_map(flag("--set-string"))
            .chain(typed.into_iter().flat_map(flag("--set")))
            .collect()
    }
}

/// A cluster of one node: containerd with CRI, the control plane, and the
/// kubelet registered and Ready.
pub struct OneNode {
    pub c: Containerd,
    pub cp: ControlPlane,
    pub k: Kubelet,
}

impl OneNode {
    pub fn start() -> Option<OneNode> {
        let c = Containerd::start(ContainerdOpts {
            cri: true,
            cni_loopback: true,
            shared_mount: true,
            ..Default::default()
        });
        let cp = ControlPlane::start()?;
        let k = Kubelet::start(
            KubeletOpts::new(c.socket())
                .registered(&cp.kubelet_kubeconfig())
                // KEP-2535 on, at the default policy
                // (NeverVerifyPreloadedImages), as on a 1.35+ node.
                .with("featureGates:\n  KubeletEnsureSecretPulledImages: true\n"),
        )?;
        let started = Instant::now();
        cp.wait_node_ready();
        eprintln!("node Ready in {:?}", started.elapsed());
        Some(OneNode { c, cp, k })
    }
}

/// The chart in this checkout.
pub const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../charts/imgbridge");

/// `helm install` of the chart for `node` and `image` with `extra` flags
/// (`--wait`): its arguments.
pub fn install_args(
    cl: &OneNode,
    node: &ChartNode,
    image: &ProjectImage,
    extra: &[String],
) -> Vec<String> {
    let mut args: Vec<String> = [
        "install",
        RELEASE,
        CHART,
        "-n",
        NS,
        "--wait",
        "--timeout",
        "3m",
    ]
    .map(String::from)
    .to_vec();
    args.extend(node.values(&cl.c, image));
    args.extend(extra.iter().cloned());
    args
}

/// `helm install` of the chart for `node` and `image` (`--wait`); the
/// DaemonSet's one pod is Ready.
pub fn install(helm: &Helm, cl: &OneNode, node: &ChartNode, image: &ProjectImage) {
    let owned = install_args(cl, node, image, &[]);
    let args: Vec<&str> = owned.iter().map(String::as_str).collect();
    helm.ok(&args, &cl.cp);
    let ds = cl
        .cp
        .get(&["-n", NS, "get", "daemonset", RELEASE])
        .expect("the DaemonSet");
    assert_eq!(
        (
            ds["status"]["desiredNumberScheduled"].as_u64(),
            ds["status"]["numberReady"].as_u64()
        ),
        (Some(1), Some(1)),
        "DaemonSet status: {}",
        ds["status"]
    );
}

/// A Deployment in `default` (label `app=<name>`, one replica, surge
/// rollouts) that a dev loop points at each fresh build.
pub struct App {
    pub name: String,
}

impl App {
    pub fn new(name: &str) -> App {
        App {
            name: name.to_string(),
        }
    }

    /// Builds `docker.io/library/<app>:<tag>` holding busybox and `/v` =
    /// `content` (FROM scratch: nothing to fetch).
    pub fn build(&self, bk: &Buildkitd, tag: &str, content: &str) -> String {
        let app = &self.name;
        bk.build(
            "FROM scratch\nCOPY --chmod=755 busybox /bin/busybox\nCOPY v /v\n",
            &[("busybox", &busybox()), ("v", content.as_bytes())],
            &format!("type=image,name=docker.io/library/{app}:{tag}"),
            &[],
        );
        format!("{app}:{tag}")
    }

    /// Its manifest, pointed at `image`, printing `file`.
    pub fn manifest(&self, image: &str, file: &str, policy: &str, secret: bool) -> Value {
        let app = self.name.as_str();
        let mut spec = json!({
            "hostNetwork": true,
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "app",
                "image": image,
                "imagePullPolicy": policy,
                "command": ["/bin/busybox", "sh", "-c", format!("cat {file}; echo; exec /bin/busybox sleep 100000")],
            }],
        });
        if secret {
            spec["imagePullSecrets"] = json!([{"name": "regcred"}]);
        }
        json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": app, "namespace": "default"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": app}},
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                "template": {"metadata": {"labels": {"app": app}}, "spec": spec},
            },
        })
    }

    /// Its pods (any phase).
    pub fn pods(&self, cp: &ControlPlane) -> Option<Vec<Value>> {
        cp.pods("default", &format!("app={}", self.name))
    }

    /// Waits until a rollout has left one pod (the old one gone).
    pub fn wait_rolled_out(&self, cp: &ControlPlane) {
        poll(CLUSTER_TIMEOUT, || {
            (self.pods(cp)?.len() == 1).then_some(())
        })
        .unwrap_or_else(|| panic!("the old pods of {} never went", self.name));
    }

    /// Waits until its pod of `image` runs and printed `content`.
    pub fn wait_running(
        &self,
        cp: &ControlPlane,
        k: &Kubelet,
        image: &str,
        content: &str,
    ) -> Value {
        poll(CLUSTER_TIMEOUT, || {
            let pods = cp.get(&[
                "-n",
                "default",
                "get",
                "pods",
                "-l",
                &format!("app={}", self.name),
            ])?;
            pods["items"].as_array()?.iter().find_map(|p| {
                let st = &p["status"]["containerStatuses"][0];
                let running = p["spec"]["containers"][0]["image"] == image
                    && st["state"]["running"].is_object()
                    && p["metadata"]["deletionTimestamp"].is_null();
                (running && k.log_of(p, "app").contains(content)).then(|| p.clone())
            })
        })
        .unwrap_or_else(|| {
            panic!(
                "no pod of {image} running within {CLUSTER_TIMEOUT:?}:\n{}\n--- kubelet ---\n{}",
                cp.kubectl_ok(&["-n", "default", "get", "pods,events", "-o", "wide"]),
                k.log_tail()
            )
        })
    }
}

fn busybox() -> Vec<u8> {
    std::fs::read("/bin/busybox").expect("static busybox (busybox-static)")
}
