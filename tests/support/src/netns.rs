//! Nodes on one machine: network namespaces of the test's own, joined by a
//! veth pair, and spegel (which must run in its node's namespace: it drops
//! loopback addresses from what it advertises, so two spegels on the host's
//! loopback cannot find each other).
//!
//! Each pair gets its own namespaces (`ibn-<pid>-<n>-{a,b}`) and a veth pair
//! that lives only inside them, with [`NODE_ADDRS`]: nothing is added to the
//! host's namespace, no route leads out, so two tests may use the same
//! addresses at once. Namespaces are deleted on drop; those of a test
//! process that was killed are swept when the next pair is made.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use tempfile::TempDir;

use crate::daemon::{Daemon, NotReady};
use crate::util::{run_ok, tempdir, try_output_with_timeout};

/// Node addresses, from the benchmarking range (RFC 2544, 198.18.0.0/15):
/// never routed, and unlike 10/8 or 192.168/16 not what a lab network uses.
pub const NODE_ADDRS: [&str; 2] = ["198.18.0.1", "198.18.0.2"];
const PREFIX: &str = "ibn";

/// One network namespace (a node), with its address on the veth pair.
pub struct Netns {
    name: String,
    addr: String,
}

impl Netns {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/run/netns/<name>`, what `nsenter --net=` takes.
    pub fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    /// The node's address on the veth pair.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// `cmd` run inside this namespace (`nsenter --net`, which enters the
    /// network namespace only: files, mounts and sockets stay the host's,
    /// so the harness still sees and unmounts what a containerd here
    /// mounts). Program, arguments, environment and working dir are kept.
    pub fn wrap(&self, cmd: Command) -> Command {
        wrap_in(&self.path(), cmd)
    }

    /// `ip` inside this namespace; panics on failure.
    fn ip(&self, args: &[&str]) {
        ip(&[&["-n", &self.name], args].concat());
    }
}

/// [`Netns::wrap`] for a namespace given by path.
pub fn wrap_in(netns: &Path, cmd: Command) -> Command {
    let mut w = Command::new("nsenter");
    w.arg(format!("--net={}", netns.display()))
        .arg("--")
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => w.env(k, v),
            None => w.env_remove(k),
        };
    }
    if let Some(d) = cmd.get_current_dir() {
        w.current_dir(d);
    }
    w
}

fn ip(args: &[&str]) {
    let out = run_ok({
        let mut c = Command::new("ip");
        c.args(args);
        c
    });
    drop(out);
}

/// Two nodes joined by a veth pair; both namespaces are deleted on drop
/// (the veth goes with them).
pub struct NodePair {
    pub a: Netns,
    pub b: Netns,
}

impl NodePair {
    pub fn new() -> NodePair {
        static N: AtomicU32 = AtomicU32::new(0);
        sweep_stale_namespaces();
        let base = format!(
            "{PREFIX}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        );
        let mk = |side: &str, addr: &str| {
            let name = format!("{base}-{side}");
            ip(&["netns", "add", &name]);
            Netns {
                name,
                addr: addr.into(),
            }
        };
        // Built up one step at a time; a failed step panics and the drop
        // of what exists deletes it.
        let mut pair = NodePair {
            a: mk("a", NODE_ADDRS[0]),
            b: Netns {
                name: String::new(),
                addr: String::new(),
            },
        };
        pair.b = mk("b", NODE_ADDRS[1]);
        // Created straight inside the namespaces, so the names cannot clash
        // with the host's links or another pair's.
        ip(&[
            "link",
            "add",
            "veth0",
            "netns",
            &pair.a.name,
            "type",
            "veth",
            "peer",
            "name",
            "veth0",
            "netns",
            &pair.b.name,
        ]);
        for n in [&pair.a, &pair.b] {
            n.ip(&["link", "set", "lo", "up"]);
            n.ip(&["addr", "add", &format!("{}/30", n.addr), "dev", "veth0"]);
            n.ip(&["link", "set", "veth0", "up"]);
        }
        // No reachability probe here (the machine has no ping): spegel's
        // bootstrap retries until the link carries, and its readiness is
        // polled.
        pair
    }
}

impl Default for NodePair {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for NodePair {
    fn drop(&mut self) {
        for n in [&self.a, &self.b] {
            if !n.name.is_empty() {
                let _ = Command::new("ip").args(["netns", "del", &n.name]).output();
            }
        }
    }
}

/// Deletes `ibn-<pid>-…` namespaces whose test process is gone (killed
/// before its drops ran).
fn sweep_stale_namespaces() {
    let Ok(entries) = fs::read_dir("/run/netns") else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(&format!("{PREFIX}-")) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("ip").args(["netns", "del", &name]).output();
        }
    }
}

// ---------------------------------------------------------------------------
// spegel
// ---------------------------------------------------------------------------

/// Spegel's registry port on every node (what hosts.toml names).
pub const SPEGEL_REGISTRY_PORT: u16 = 5000;
/// Spegel's p2p router port.
pub const SPEGEL_ROUTER_PORT: u16 = 5001;
/// Where each spegel serves its own peer id for the HTTP bootstrapper.
pub const SPEGEL_BOOTSTRAP_PORT: u16 = 5002;
const SPEGEL_METRICS_PORT: u16 = 9090;

/// The hosts.toml that routes a registry through the node's own spegel, as
/// spegel's `configuration` subcommand writes it (resolve + pull, short
/// dial timeout) with `server` left at the registry itself.
pub fn spegel_hosts_toml(registry: &str, node_addr: &str) -> String {
    let server = match registry {
        "docker.io" => "https://registry-1.docker.io".to_string(),
        r => format!("https://{r}"),
    };
    format!(
        "server = '{server}'\n\n[host.'http://{node_addr}:{SPEGEL_REGISTRY_PORT}']\ncapabilities = ['pull', 'resolve']\ndial_timeout = '200ms'\n"
    )
}

/// One spegel (`registry` subcommand) in a node's namespace, serving what
/// that node's containerd holds in `k8s.io`.
pub struct Spegel {
    daemon: Daemon,
    addr: String,
    dir: TempDir,
}

impl Spegel {
    /// Starts spegel in `node` on `containerd`'s socket and content dir,
    /// bootstrapping over HTTP from `peer_addr` (the other node: spegel
    /// fetches its peer id from `http://<peer>:5002/id` and retries with
    /// backoff until it answers, and serves its own there). No Kubernetes
    /// API; the static bootstrapper would need every peer's id up front
    /// (`/ip4/…/tcp/…/p2p/<id>`: without it spegel exits with "invalid p2p
    /// multiaddr"). Returns `None` when peers are skipped.
    pub fn start(
        node: &Netns,
        containerd_sock: &Path,
        containerd_root: &Path,
        peer_addr: &str,
    ) -> Option<Spegel> {
        let peer = crate::peers::peer("spegel")?;
        let dir = tempdir("spegel-");
        let a = node.addr();
        let mut cmd = Command::new(peer.bin_dir.join("spegel"));
        cmd.env_remove("CONTAINERD_ADDRESS")
            .env_remove("CONTAINERD_NAMESPACE")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .arg("registry")
            .arg(format!("--registry-addr={a}:{SPEGEL_REGISTRY_PORT}"))
            .arg(format!("--router-addr={a}:{SPEGEL_ROUTER_PORT}"))
            .arg(format!("--metrics-addr={a}:{SPEGEL_METRICS_PORT}"))
            .arg(format!("--containerd-sock={}", containerd_sock.display()))
            .arg("--containerd-namespace=k8s.io")
            .arg(format!(
                "--containerd-content-path={}",
                containerd_root
                    .join("io.containerd.content.v1.content")
                    .display()
            ))
            .arg(format!("--data-dir={}", dir.path().join("data").display()))
            .arg("--bootstrap-kind=http")
            .arg(format!("--http-bootstrap-addr={a}:{SPEGEL_BOOTSTRAP_PORT}"))
            .arg(format!(
                "--http-bootstrap-peer=http://{peer_addr}:{SPEGEL_BOOTSTRAP_PORT}"
            ))
            .arg("--log-level=DEBUG")
            .current_dir(dir.path());
        let mut daemon = Daemon::spawn("spegel", node.wrap(cmd), &dir.path().join("spegel.log"));
        let addr = format!("{a}:{SPEGEL_REGISTRY_PORT}");
        // Serving: /livez answers (readiness needs the other node too; see
        // [`Spegel::wait_peered`]).
        let ready = {
            let live = node_http_status(node, &addr, "/livez");
            daemon.wait_ready(|| live() == Some(200))
        };
        match ready {
            Ok(()) => {}
            Err(NotReady::Exited(st)) => panic!("spegel exited ({st}):\n{}", daemon.log_tail(40)),
            Err(NotReady::TimedOut) => panic!("spegel not serving:\n{}", daemon.log_tail(40)),
        }
        Some(Spegel { daemon, addr, dir })
    }

    /// Waits until spegel's `/readyz` says its router has a peer and the
    /// bootstrap is done (how the Helm chart's readiness probe decides).
    pub fn wait_peered(&mut self, node: &Netns) {
        let addr = self.addr.clone();
        let ready = node_http_status(node, &addr, "/readyz");
        if self.daemon.wait_ready(|| ready() == Some(200)).is_err() {
            panic!(
                "spegel at {addr} never ready (exited, or not within the ready timeout):\n{}",
                self.daemon.log_tail(40)
            );
        }
    }

    /// `host:port` of its registry.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("spegel.log")
    }

    pub fn log_tail(&self) -> String {
        self.daemon.log_tail(60)
    }
}

/// A probe of `http://<addr><path>` from inside `node`: the status code, or
/// `None` when nothing answers. Uses curl (spegel listens only in its
/// namespace).
fn node_http_status<'a>(
    node: &'a Netns,
    addr: &'a str,
    path: &'a str,
) -> impl Fn() -> Option<u16> + 'a {
    move || {
        let mut c = Command::new("curl");
        c.args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "2",
        ])
        .arg(format!("http://{addr}{path}"));
        let out = try_output_with_timeout(node.wrap(c), std::time::Duration::from_secs(5)).ok()?;
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|c| *c != 0)
    }
}
