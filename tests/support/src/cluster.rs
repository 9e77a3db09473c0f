//! A one-node Kubernetes control plane: etcd, kube-apiserver,
//! kube-controller-manager and kube-scheduler (the `etcd` and `kubelet`
//! peers, `k8s.io/kubernetes` at kubelet's version), on loopback, in a temp
//! dir, stopped by pid. The harness makes its own CA and certificates
//! (openssl, EC P-256): every component authenticates with a client
//! certificate and the API server authorizes with `Node,RBAC`, as a
//! kubeadm cluster does, so the kubelet is registered as a Node under the
//! node authorizer and helm runs as a `system:masters` admin.
//!
//! The kubelet itself is [`crate::kubelet::Kubelet`] with
//! [`KubeletOpts::registered`](crate::kubelet::KubeletOpts::registered); its
//! containerd needs a CNI network for the Node to be Ready
//! ([`crate::containerd::ContainerdOpts::cni_loopback`]).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;
use tempfile::TempDir;

use crate::daemon::{Daemon, NotReady};
use crate::kubelet::NODE;
use crate::peers::{peer, Peer};
use crate::util::{free_port, http_get, output_with_timeout, poll, run_ok, tempdir, TOOL_TIMEOUT};

/// A control-plane deadline: the API server's start on two busy cores, a
/// rollout (scheduling, kubelet's sync, probes).
pub const CLUSTER_TIMEOUT: Duration = Duration::from_secs(120);

/// The identities the harness issues, each a client certificate signed by
/// its CA: (file stem, subject).
fn clients() -> [(&'static str, String); 5] {
    [
        ("admin", "/O=system:masters/CN=imgbridge-test-admin".into()),
        ("kubelet", format!("/O=system:nodes/CN=system:node:{NODE}")),
        (
            "controller-manager",
            "/CN=system:kube-controller-manager".into(),
        ),
        ("scheduler", "/CN=system:kube-scheduler".into()),
        (
            "apiserver-kubelet-client",
            "/O=system:masters/CN=kube-apiserver-kubelet-client".into(),
        ),
    ]
}

/// etcd, the API server, the controller manager and the scheduler.
pub struct ControlPlane {
    peer: &'static Peer,
    dir: TempDir,
    /// The API server's URL.
    server: String,
    scheduler: Option<Daemon>,
    controller_manager: Option<Daemon>,
    apiserver: Option<Daemon>,
    etcd: Option<Daemon>,
    /// The host's kubelet paths before the daemons started: none of them
    /// may create one (checked when it is dropped).
    host_before: Vec<(String, Option<String>)>,
}

impl ControlPlane {
    /// Starts the four daemons and waits until the API server is ready and
    /// the controller manager has made the `default` service account.
    /// `None` when peers are skipped.
    pub fn start() -> Option<ControlPlane> {
        let kube = peer("kubelet")?;
        let etcd_peer = peer("etcd")?;
        let host_before = crate::kubelet::host_state();
        let dir = tempdir("control-plane-");
        let d = dir.path().to_path_buf();
        let pki = d.join("pki");
        fs::create_dir_all(&pki).expect("pki dir");
        issue_certificates(&pki);

        let etcd_client = free_port();
        let etcd = {
            let mut cmd = Command::new(etcd_peer.bin_dir.join("etcd"));
            let peer_url = format!("http://127.0.0.1:{}", free_port());
            let client_url = format!("http://127.0.0.1:{etcd_client}");
            cmd.arg("--name=imgbridge-test")
                .arg(format!("--data-dir={}", d.join("etcd").display()))
                .arg(format!("--listen-client-urls={client_url}"))
                .arg(format!("--advertise-client-urls={client_url}"))
                .arg(format!("--listen-peer-urls={peer_url}"))
                .arg(format!("--initial-advertise-peer-urls={peer_url}"))
                .arg(format!("--initial-cluster=imgbridge-test={peer_url}"))
                .arg(format!(
                    "--listen-metrics-urls=http://127.0.0.1:{}",
                    free_port()
                ))
                // A throwaway store: no fsync (the machine's disk is shared
                // with every other test).
                .arg("--unsafe-no-fsync");
            let mut e = Daemon::spawn("etcd", cmd, &d.join("etcd.log"));
            let addr = format!("127.0.0.1:{etcd_client}");
            ready(&mut e, "etcd", || {
                http_get(&addr, "/health").is_some_and(|b| b.contains("\"health\":\"true\""))
            });
            e
        };

        let port = free_port();
        let server = format!("https://127.0.0.1:{port}");
        let p = |f: &str| pki.join(f).display().to_string();
        let mut cp = ControlPlane {
            peer: kube,
            dir,
            server,
            scheduler: None,
            controller_manager: None,
            apiserver: None,
            etcd: Some(etcd),
            host_before,
        };
        for (stem, _) in clients() {
            fs::write(cp.kubeconfig_of(stem), cp.kubeconfig_text(stem)).expect("write kubeconfig");
        }

        let mut cmd = Command::new(kube.bin_dir.join("kube-apiserver"));
        cmd.arg(format!("--etcd-servers=http://127.0.0.1:{etcd_client}"))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--secure-port={port}"))
            .arg("--advertise-address=127.0.0.1")
            // The `kubernetes` Service's endpoints would be 127.0.0.1, which
            // EndpointSlice validation refuses: nothing here needs them.
            .arg("--endpoint-reconciler-type=none")
            .arg(format!("--tls-cert-file={}", p("apiserver.crt")))
            .arg(format!("--tls-private-key-file={}", p("apiserver.key")))
            .arg(format!("--client-ca-file={}", p("ca.crt")))
            .arg(format!(
                "--kubelet-client-certificate={}",
                p("apiserver-kubelet-client.crt")
            ))
            .arg(format!(
                "--kubelet-client-key={}",
                p("apiserver-kubelet-client.key")
            ))
            .arg("--service-account-issuer=https://kubernetes.default.svc.cluster.local")
            .arg(format!("--service-account-key-file={}", p("sa.pub")))
            .arg(format!(
                "--service-account-signing-key-file={}",
                p("sa.key")
            ))
            .arg("--service-cluster-ip-range=10.96.0.0/16")
            .arg("--authorization-mode=Node,RBAC")
            .arg("--profiling=false")
            .arg(format!(
                "--cert-dir={}",
                d.join("apiserver-certs").display()
            ));
        let mut api = Daemon::spawn("kube-apiserver", cmd, &d.join("kube-apiserver.log"));
        ready_within(&mut api, "kube-apiserver", APISERVER_READY, || {
            cp.kubectl(["get", "--raw", "/readyz"]).status.success()
        });
        cp.apiserver = Some(api);

        cp.controller_manager = Some(cp.component(
            "kube-controller-manager",
            "controller-manager",
            &[
                "--use-service-account-credentials=true".into(),
                format!("--service-account-private-key-file={}", p("sa.key")),
                format!("--root-ca-file={}", p("ca.crt")),
                // Its flexvolume prober creates this dir (default under
                // /usr/libexec/kubernetes): a kubelet test running beside
                // saw the host changed on a fresh machine.
                format!(
                    "--flex-volume-plugin-dir={}",
                    d.join("flexvolume").display()
                ),
            ],
        ));
        cp.scheduler = Some(cp.component("kube-scheduler", "scheduler", &[]));

        // The controller manager is up once its service-account controller
        // has made `default` (pods cannot be admitted before that).
        poll(CLUSTER_TIMEOUT, || {
            cp.kubectl(["-n", "default", "get", "serviceaccount", "default"])
                .status
                .success()
                .then_some(())
        })
        .unwrap_or_else(|| {
            panic!(
                "no default service account within {CLUSTER_TIMEOUT:?}\n--- kube-controller-manager ---\n{}",
                cp.log_tail("kube-controller-manager")
            )
        });
        Some(cp)
    }

    /// Starts `bin` (the controller manager or the scheduler) as identity
    /// `stem`: its kubeconfig for the API and for delegated authn/authz,
    /// its secure port on loopback, no leader election, `extra` flags.
    fn component(&self, bin: &str, stem: &str, extra: &[String]) -> Daemon {
        let d = self.dir.path();
        let kubeconfig = self.kubeconfig_of(stem).display().to_string();
        let mut cmd = Command::new(self.peer.bin_dir.join(bin));
        for flag in [
            "kubeconfig",
            "authentication-kubeconfig",
            "authorization-kubeconfig",
        ] {
            cmd.arg(format!("--{flag}={kubeconfig}"));
        }
        cmd.arg("--bind-address=127.0.0.1")
            .arg(format!("--secure-port={}", free_port()))
            .arg("--leader-elect=false")
            .arg(format!(
                "--cert-dir={}",
                d.join(format!("{stem}-certs")).display()
            ))
            .args(extra);
        Daemon::spawn(bin, cmd, &d.join(format!("{bin}.log")))
    }

    /// The admin's kubeconfig (`system:masters`), for kubectl and helm.
    pub fn kubeconfig(&self) -> PathBuf {
        self.kubeconfig_of("admin")
    }

    /// The kubelet's kubeconfig (`system:node:imgbridge-node`).
    pub fn kubelet_kubeconfig(&self) -> PathBuf {
        self.kubeconfig_of("kubelet")
    }

    fn kubeconfig_of(&self, stem: &str) -> PathBuf {
        self.dir.path().join(format!("{stem}.kubeconfig"))
    }

    fn kubeconfig_text(&self, stem: &str) -> String {
        let pki = self.dir.path().join("pki");
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: {stem}\n  user:\n    client-certificate: {}\n    client-key: {}\ncontexts:\n- name: test\n  context: {{cluster: test, user: {stem}}}\ncurrent-context: test\n",
            self.server,
            pki.join("ca.crt").display(),
            pki.join(format!("{stem}.crt")).display(),
            pki.join(format!("{stem}.key")).display(),
        )
    }

    /// `kubectl` as the admin.
    fn kubectl_command(&self) -> Command {
        let mut cmd = Command::new(self.peer.bin_dir.join("kubectl"));
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig().display()))
            .arg("--request-timeout=20s");
        cmd
    }

    /// `kubectl ARGS` as the admin.
    pub fn kubectl<I, S>(&self, args: I) -> Output
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        let mut cmd = self.kubectl_command();
        cmd.args(args);
        output_with_timeout(cmd, TOOL_TIMEOUT)
    }

    /// `kubectl ARGS`, which must succeed: its stdout.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let mut cmd = self.kubectl_command();
        cmd.args(args);
        String::from_utf8_lossy(&run_ok(cmd).stdout).into_owned()
    }

    /// `kubectl get ARGS -o json`, or `None` when it fails (not found).
    pub fn get(&self, args: &[&str]) -> Option<Value> {
        let out = self.kubectl(args.iter().copied().chain(["-o", "json"]));
        out.status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).ok())
            .flatten()
    }

    /// The pods of namespace `ns` matching label `selector` (any phase).
    pub fn pods(&self, ns: &str, selector: &str) -> Option<Vec<Value>> {
        let pods = self.get(&["-n", ns, "get", "pods", "-l", selector])?;
        pods["items"].as_array().cloned()
    }

    /// `kubectl apply` of one object.
    pub fn apply(&self, object: &Value) {
        let f = self
            .dir
            .path()
            .join(format!("apply-{}.json", crate::util::unique_name("obj")));
        fs::write(&f, object.to_string()).expect("write object");
        self.kubectl_ok(&["apply", "-f", &f.display().to_string()]);
        let _ = fs::remove_file(f);
    }

    /// Waits until the node is registered and Ready.
    pub fn wait_node_ready(&self) {
        poll(CLUSTER_TIMEOUT, || {
            let n = self.get(&["get", "node", NODE])?;
            n["status"]["conditions"]
                .as_array()?
                .iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
                .then_some(())
        })
        .unwrap_or_else(|| {
            panic!(
                "node {NODE} not Ready within {CLUSTER_TIMEOUT:?}: {}",
                self.get(&["get", "node", NODE])
                    .map(|n| n["status"]["conditions"].to_string())
                    .unwrap_or_else(|| "not registered".into())
            )
        })
    }

    /// The events of namespace `ns` about object `name` (`reason: message`).
    pub fn events(&self, ns: &str, name: &str) -> Vec<String> {
        let field = format!("involvedObject.name={name}");
        self.get(&["-n", ns, "get", "events", "--field-selector", &field])
            .and_then(|v| v["items"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .map(|e| {
                format!(
                    "{}: {}",
                    e["reason"].as_str().unwrap_or(""),
                    e["message"].as_str().unwrap_or("")
                )
            })
            .collect()
    }

    /// The last lines of a component's log (`etcd`, `kube-apiserver`, …).
    pub fn log_tail(&self, component: &str) -> String {
        crate::util::tail_file(&self.dir.path().join(format!("{component}.log")), 40)
    }
}

impl Drop for ControlPlane {
    /// Stops the daemons in the reverse order of their start.
    fn drop(&mut self) {
        for d in [
            &mut self.scheduler,
            &mut self.controller_manager,
            &mut self.apiserver,
            &mut self.etcd,
        ] {
            if let Some(mut d) = d.take() {
                d.stop();
            }
        }
        if !std::thread::panicking() {
            assert_eq!(
                self.host_before,
                crate::kubelet::host_state(),
                "the control plane changed the host"
            );
        }
    }
}

/// Waits for `daemon` with the harness's start deadline; panics with its log.
fn ready(daemon: &mut Daemon, name: &str, check: impl FnMut() -> bool) {
    ready_within(daemon, name, crate::util::READY_TIMEOUT, check)
}

/// kube-apiserver's `/readyz` waits for every post-start hook (RBAC
/// bootstrap roles, priority classes, the service CIDR): on two cores
/// shared with the hour's soak and a CI lane it took over 20 s (a cold CI
/// went red on it), where a daemon that only opens a socket takes one.
const APISERVER_READY: std::time::Duration = std::time::Duration::from_secs(90);

/// Waits for `daemon` up to `deadline`; panics with its log.
fn ready_within(
    daemon: &mut Daemon,
    name: &str,
    deadline: std::time::Duration,
    check: impl FnMut() -> bool,
) {
    match daemon.wait_ready_within(deadline, check) {
        Ok(()) => {}
        Err(NotReady::Exited(st)) => panic!("{name} exited ({st}):\n{}", daemon.log_tail(60)),
        Err(NotReady::TimedOut) => panic!("{name} not ready:\n{}", daemon.log_tail(60)),
    }
}

/// The CA, the API server's serving certificate (127.0.0.1 and localhost),
/// a client certificate for each of [`clients`] and the service-account
/// signing key, all EC P-256, valid two days.
fn issue_certificates(pki: &Path) {
    let openssl = |args: &[&str]| {
        let mut cmd = Command::new("openssl");
        cmd.current_dir(pki).args(args);
        run_ok(cmd);
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    openssl(
        &[
            &["req", "-x509"][..],
            &ec,
            &[
                "-keyout",
                "ca.key",
                "-out",
                "ca.crt",
                "-days",
                "2",
                "-subj",
                "/CN=imgbridge-test-ca",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
        ]
        .concat(),
    );
    let leaf = |stem: &str, subj: &str, ext: &str| {
        fs::write(pki.join(format!("{stem}.ext")), ext).expect("write ext");
        openssl(
            &[
                &["req"][..],
                &ec,
                &[
                    "-keyout",
                    &format!("{stem}.key"),
                    "-out",
                    &format!("{stem}.csr"),
                    "-subj",
                    subj,
                ],
            ]
            .concat(),
        );
        openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{stem}.csr"),
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            &format!("{stem}.crt"),
            "-extfile",
            &format!("{stem}.ext"),
        ]);
    };
    leaf(
        "apiserver",
        "/CN=kube-apiserver",
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default.svc,IP:10.96.0.1\n",
    );
    for (stem, subject) in clients() {
        leaf(
            stem,
            &subject,
            "keyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n",
        );
    }
    openssl(&[
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        "sa.key",
    ]);
    openssl(&["pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub"]);
}
