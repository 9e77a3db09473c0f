//! Doctor's checks for sharing images between nodes through a node-local
//! registry mirror (spegel, k3s's embedded mirror): an image imgbridge
//! replicates into `k8s.io` on one node reaches the others only if their CRI
//! resolves and pulls `docker.io/...` through the mirror on its own node.
//!
//! What CRI does is read from the running containerd where it says so, else
//! from its config file: 1.x reports its registry settings in CRI
//! `Status{verbose}` (`config.registry.configPath`,
//! `config.containerd.discardUnpackedLayers`); 2.x does not (its Status
//! carries only the runtime half of CRI), but newer releases (2.4.2 does,
//! v2.4.0-beta.0 does not) have the `io.containerd.cri.v1.images` plugin
//! export `RegistryConfigPath` and `DiscardUnpackedLayers` over
//! Introspection. Whether 2.x CRI pulls through the Transfer service is
//! only in the config file.
//!
//! Nothing here fails the doctor: a node without a mirror is a single-node
//! setup, which gets one warning pointing at `docs/multi-node.md`.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

mod hosts;

use hosts::imports;
pub use hosts::{
    from_config_file, from_status, host_dir, parse_hosts, parse_url, CriRegistry, Host, HostUrl,
    HostsFile, PullPath,
};

use super::{timed, Report};
use crate::containerd::Containerd;

/// The registry `docker.io/library/app:dev` (what `app:dev` means to
/// buildkit, nerdctl and kubelet) resolves at: it must go to the mirror.
pub const MIRRORED: &str = "docker.io";

/// The CRI images plugin of 2.x, whose exports carry its registry settings.
const IMAGES_PLUGIN: (&str, &str) = ("io.containerd.cri.v1", "images");

/// What the image-sharing checks are reported under, and where they point.
const WHAT: &str = "image sharing";
const GUIDE: &str = "see docs/multi-node.md";

/// Upper bound for the mirror's answer: spegel answers `/v2/` at once.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether `ip` is this node's: loopback, or an address a socket can bind
/// (the kernel refuses addresses no interface has).
fn is_local_ip(ip: IpAddr) -> bool {
    ip.is_loopback() || std::net::TcpListener::bind((ip, 0)).is_ok()
}

/// Whether a host URL names a mirror on this node.
async fn is_local(url: &str) -> bool {
    let Some(u) = parse_url(url) else {
        return false;
    };
    if u.host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    if let Ok(ip) = u.host.parse::<IpAddr>() {
        return is_local_ip(ip);
    }
    let lookup = tokio::net::lookup_host((u.host.as_str(), u.port.unwrap_or(80)));
    let local = match tokio::time::timeout(PROBE_TIMEOUT, lookup).await {
        Ok(Ok(mut addrs)) => addrs.any(|a| is_local_ip(a.ip())),
        _ => false,
    };
    local
}

/// The registry root under a host URL's path: `/v2/`, or the path itself
/// when it already ends in `/v2` (k3s-style `…/v2` hosts).
fn v2_path(path: &str) -> String {
    let path = path.trim_end_matches('/');
    if path.ends_with("/v2") {
        format!("{path}/")
    } else {
        format!("{path}/v2/")
    }
}

/// The HTTP status of `GET <target>` at a plain-http mirror.
async fn probe_http(host: &str, port: u16, target: &str) -> Result<u16, String> {
    use http_body_util::Empty;
    use hyper_util::rt::TokioIo;
    let authority = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let go = async {
        let tcp = tokio::net::TcpStream::connect(&authority)
            .await
            .map_err(|e| format!("{authority}: {e}"))?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let req = http::Request::get(target)
            .header(http::header::HOST, &authority)
            .body(Empty::<bytes::Bytes>::new())
            .map_err(|e| e.to_string())?;
        let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
        Ok(resp.status().as_u16())
    };
    match tokio::time::timeout(PROBE_TIMEOUT, go).await {
        Ok(r) => r,
        Err(_) => Err(format!(
            "no answer from {authority} within {PROBE_TIMEOUT:?}"
        )),
    }
}

/// CRI's registry settings from the best source this containerd offers.
async fn cri_registry(
    c: &Containerd,
    version: Option<(u64, u64, u64)>,
    file: Option<&Path>,
) -> Result<CriRegistry, String> {
    if let Some(reg) = timed(c.cri_status_config())
        .await?
        .as_deref()
        .and_then(from_status)
    {
        return Ok(reg);
    }
    let v = version.ok_or("containerd's version does not parse")?;
    let text = file.map(|f| (f, std::fs::read_to_string(f)));
    let mut reg = match &text {
        Some((f, Ok(t))) => {
            let mut reg = from_config_file(t, v)
                .map_err(|e| format!("{} does not parse: {e}", f.display()))?;
            reg.from = f.display().to_string();
            if let Some(imports) = imports(t) {
                // containerd merges them in; doctor does not follow them.
                reg.from = format!("{}, whose imports {imports} doctor does not read", reg.from);
            }
            reg
        }
        // No file: containerd runs on its defaults (or a file doctor was
        // not told about).
        _ => {
            let mut reg = from_config_file("version = 3", v)?;
            reg.from = "containerd's defaults (no config file read)".into();
            if v >= (2, 1, 0) {
                reg.pull = PullPath::Unknown;
            }
            reg
        }
    };
    // Releases that export them (2.4.2): the running plugin's values win.
    if let Ok(ps) = timed(c.plugins(&format!(
        "type=={},id=={}",
        IMAGES_PLUGIN.0, IMAGES_PLUGIN.1
    )))
    .await
    {
        if let Some(ex) = ps.first().map(|p| &p.exports) {
            if let Some(path) = ex.get("RegistryConfigPath") {
                reg.config_path = path.clone();
                reg.from = format!("containerd's Introspection; the rest from {}", reg.from);
            }
            if let Some(d) = ex.get("DiscardUnpackedLayers") {
                reg.discard_unpacked_layers = d.parse().ok();
            }
        }
    }
    Ok(reg)
}

/// Runs the mirror checks (CRI must be loaded).
pub(super) async fn checks(
    c: &Containerd,
    version: Option<(u64, u64, u64)>,
    env: Option<&Path>,
    candidates: &[PathBuf],
    r: &mut Report,
) {
    let (what, guide) = (WHAT, GUIDE);
    let file = crate::containerd::node_config::locate(env, candidates);
    let reg = match cri_registry(c, version, file.as_deref()).await {
        Ok(reg) => reg,
        Err(e) => {
            r.warn(
                what,
                format!("cannot read CRI's registry settings: {e}"),
                format!(
                    "set {} to containerd's config file; {guide}",
                    super::CONFIG_ENV
                ),
            );
            return;
        }
    };
    let Some(found) = local_mirror(&reg, r).await else {
        return;
    };
    r.pass(
        "registry config_path",
        format!("{} (from {})", reg.config_path, reg.from),
    );
    mirror_hosts(&found, r);
    unpacked_layers(&reg, r);
    pull_path(&reg, &found.first_root, r);
    probe_mirror(&found.mirror.url, r).await;
}

/// The node's own mirror, as CRI's settings lead to it.
struct Found {
    hosts_path: PathBuf,
    hosts: HostsFile,
    /// The first host on this node that pulls.
    mirror: Host,
    /// The first root of `config_path`, named in fixes.
    first_root: String,
}

/// Follows `config_path` to the `hosts.toml` for [`MIRRORED`] and a mirror
/// on this node in it; `None` (reported: a single-node setup) when any step
/// is missing.
async fn local_mirror(reg: &CriRegistry, r: &mut Report) -> Option<Found> {
    let (what, guide) = (WHAT, GUIDE);
    let example = "/etc/containerd/certs.d";
    if reg.config_path.is_empty() {
        r.warn(
            what,
            format!("single node: CRI has no registry config_path (read from {}), so kubelet pulls of images built on another node go to the registry", reg.from),
            format!("to share images between nodes through spegel: {} and a {example}/{MIRRORED}/hosts.toml naming the node's mirror; {guide}", reg.config_path_line(example)),
        );
        return None;
    }
    // Where the user meant mirrors to be found: every root of the list.
    let roots = reg.dirs();
    let first_root = roots.first().cloned().unwrap_or_default();
    let Some(dir) = host_dir(&roots, MIRRORED) else {
        r.warn(
            what,
            format!("single node: no hosts.toml for {MIRRORED} (nor _default) under config_path {}", reg.config_path),
            format!("to share images between nodes through spegel, write {first_root}/{MIRRORED}/hosts.toml with [host.\"http://127.0.0.1:<mirror port>\"] capabilities = [\"pull\", \"resolve\"] (spegel writes it itself); {guide}"),
        );
        return None;
    };
    let hosts_path = dir.join("hosts.toml");
    let hosts = match std::fs::read_to_string(&hosts_path) {
        Ok(t) => match parse_hosts(&t) {
            Ok(h) => h,
            Err(e) => {
                r.warn(
                    "mirror hosts.toml",
                    format!(
                        "{} does not parse: {e}; containerd then ignores it",
                        hosts_path.display()
                    ),
                    format!("correct it; {guide}"),
                );
                return None;
            }
        },
        Err(e) => {
            r.warn(
                what,
                format!("single node: {} takes {MIRRORED}'s settings but has no readable hosts.toml ({e})", dir.display()),
                format!("write {} with [host.\"http://127.0.0.1:<mirror port>\"] capabilities = [\"pull\", \"resolve\"]; {guide}", hosts_path.display()),
            );
            return None;
        }
    };
    let mut local = Vec::new();
    for h in &hosts.hosts {
        if is_local(&h.url).await {
            local.push(h.clone());
        }
    }
    let Some(mirror) = local.iter().find(|h| h.pull).cloned() else {
        let named: Vec<&str> = hosts.hosts.iter().map(|h| h.url.as_str()).collect();
        r.warn(
            what,
            format!("single node: {} names no mirror on this node for pulls ({})", hosts_path.display(), if named.is_empty() { "no [host] at all".to_string() } else { named.join(", ") }),
            format!("add [host.\"http://127.0.0.1:<mirror port>\"] capabilities = [\"pull\", \"resolve\"] before the others (spegel writes it itself); {guide}"),
        );
        return None;
    };
    Some(Found {
        hosts_path,
        hosts,
        mirror,
        first_root,
    })
}

/// Whether the mirror also resolves tags (an image built on another node
/// exists nowhere else).
fn mirror_hosts(found: &Found, r: &mut Report) {
    let Found {
        hosts_path,
        hosts,
        mirror,
        ..
    } = found;
    let then = hosts
        .server
        .as_deref()
        .map(|s| format!(", then {s}"))
        .unwrap_or_default();
    if mirror.resolve {
        r.pass(
            "mirror hosts.toml",
            format!(
                "{}: {MIRRORED} → {} (pull, resolve){then}",
                hosts_path.display(),
                mirror.url
            ),
        );
    } else {
        r.warn(
            "mirror hosts.toml",
            format!("{}: {MIRRORED} → {} pulls only: tags resolve at the registry, where an image built on another node (app:dev) does not exist", hosts_path.display(), mirror.url),
            format!("capabilities = [\"pull\", \"resolve\"] under [host.\"{}\"] (spegel: --resolve-tags, the default)", mirror.url),
        );
    }
}

/// Whether images pulled here keep the layer blobs other nodes would pull.
fn unpacked_layers(reg: &CriRegistry, r: &mut Report) {
    match reg.discard_unpacked_layers {
        Some(false) => r.pass("unpacked layers", "kept (discard_unpacked_layers = false): images pulled here can be served on to other nodes"),
        Some(true) => r.warn(
            "unpacked layers",
            "discard_unpacked_layers = true: CRI drops an image's layer blobs once unpacked, so images pulled here cannot be served on to other nodes",
            reg.discard_line(),
        ),
        None => r.warn(
            "unpacked layers",
            format!("could not read discard_unpacked_layers ({})", reg.from),
            reg.discard_line(),
        ),
    }
}

/// Whether the mirror a `hosts.toml` names answers as a registry (and, for
/// spegel, is ready).
async fn probe_mirror(url: &str, r: &mut Report) {
    let Some(HostUrl {
        scheme,
        host,
        port,
        path,
    }) = parse_url(url)
    else {
        return;
    };
    let port = port.unwrap_or(if scheme == "https" { 443 } else { 80 });
    let host = host.as_str();
    if scheme != "http" {
        match tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect((host, port)))
            .await
        {
            Ok(Ok(_)) => r.pass(
                "mirror",
                format!("{} accepts connections ({scheme}: not probed further)", url),
            ),
            Ok(Err(e)) => r.warn(
                "mirror",
                format!("{}: {e}", url),
                "start the mirror (spegel's DaemonSet pod on this node; k3s: --embedded-registry)",
            ),
            Err(_) => r.warn(
                "mirror",
                format!("{}: no answer within {PROBE_TIMEOUT:?}", url),
                "start the mirror, or check the address",
            ),
        }
        return;
    }
    // spegel answers 200 at the registry root, a registry that wants a
    // token 401.
    match probe_http(host, port, &v2_path(&path)).await {
        Ok(code @ (200 | 401)) => match probe_http(host, port, "/readyz").await {
            // spegel's /readyz is 500 until its router has peers.
            Ok(500 | 503) => r.warn(
                "mirror",
                format!("{} answers GET /v2/ but its /readyz is not ready: spegel has no peers yet, so it finds nothing on other nodes", url),
                "let the nodes reach each other on spegel's router port (5001; k3s: 5001 and 6443) and check its log (kubectl -n spegel logs)",
            ),
            Ok(200) => r.pass(
                "mirror",
                format!("{} answers GET /v2/ (HTTP {code}) and /readyz (ready)", url),
            ),
            // Not spegel (no /readyz): the registry root is all there is to ask.
            _ => r.pass(
                "mirror",
                format!("{} answers GET /v2/ (HTTP {code})", url),
            ),
        },
        Ok(code) => r.warn(
            "mirror",
            format!("{} answers GET /v2/ with HTTP {code}: not a registry", url),
            "point the hosts.toml host at the mirror's registry port (spegel: 30020 with the Helm chart)",
        ),
        Err(e) => r.warn(
            "mirror",
            format!("{} does not answer: {e}", url),
            "start the mirror (spegel's DaemonSet pod on this node, kubectl -n spegel get pods -o wide); until then pulls fall through to the registry",
        ),
    }
}

/// 2.1+'s Transfer trap: CRI pulls through Transfer pass `config_path` to
/// `HostDirFromRoot` as one directory, so a list matches no `hosts.toml`
/// and mirrors are silently skipped
/// (<https://github.com/containerd/containerd/issues/12415>,
/// <https://github.com/containerd/containerd/issues/12636>).
fn pull_path(reg: &CriRegistry, first_root: &str, r: &mut Report) {
    let what = "CRI pull path";
    let list = reg.dirs().len() > 1;
    match &reg.pull {
        PullPath::Local(why) => r.pass(what, format!("client pull ({why}): config_path is read as a list")),
        PullPath::Transfer if list => r.warn(
            what,
            format!("CRI pulls through the Transfer service, which reads config_path {:?} as one directory: it finds no hosts.toml and skips the mirror", reg.config_path),
            format!("{} (one directory), or [plugins.\"io.containerd.cri.v1.images\"] use_local_image_pull = true", reg.config_path_line(first_root)),
        ),
        PullPath::Transfer => r.pass(what, "Transfer service, config_path is one directory: honoured"),
        PullPath::Unknown if list => r.warn(
            what,
            format!("config file not read: if CRI pulls through the Transfer service (the default from 2.1), config_path {:?} is read as one directory and the mirror is skipped", reg.config_path),
            format!("{} (one directory), or set {} so doctor can read the file", reg.config_path_line(first_root), super::CONFIG_ENV),
        ),
        PullPath::Unknown => r.pass(what, "config_path is one directory: honoured by both the client pull and the Transfer service"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn knows_local_addresses() {
        assert!(is_local("http://127.0.0.1:30020").await);
        assert!(is_local("http://[::1]:30020").await);
        assert!(is_local("http://localhost:5000").await);
        // TEST-NET-3 (RFC 5737) is on no interface.
        assert!(!is_local("http://203.0.113.7:30020").await);
        assert!(!is_local("not a url").await);
    }

    #[test]
    fn registry_root_under_a_host_path() {
        assert_eq!(v2_path("/"), "/v2/");
        assert_eq!(v2_path(""), "/v2/");
        assert_eq!(v2_path("/v2"), "/v2/");
        assert_eq!(v2_path("/v2/"), "/v2/");
        assert_eq!(v2_path("/prefix"), "/prefix/v2/");
    }

    /// A stand-in for a spegel whose router has no peers: fault injection,
    /// since a real spegel is ready once it has peers and the state under
    /// test is the one before. Answers `/v2/` 200 and `/readyz` 500, one
    /// connection per request, until dropped.
    async fn unready_spegel() -> (u16, tokio::task::JoinHandle<()>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                let mut buf = vec![0; 4096];
                let n = s.read(&mut buf).await.unwrap();
                let head = String::from_utf8_lossy(&buf[..n]).into_owned();
                let status = if head.starts_with("GET /readyz ") {
                    "500 Internal Server Error"
                } else {
                    "200 OK"
                };
                let reply =
                    format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                s.write_all(reply.as_bytes()).await.unwrap();
            }
        });
        (port, task)
    }

    #[tokio::test]
    async fn an_unready_spegel_is_a_warning() {
        let (port, task) = unready_spegel().await;
        let mut r = Report::default();
        probe_mirror(&format!("http://127.0.0.1:{port}"), &mut r).await;
        task.abort();
        let l: Vec<String> = r.checks.iter().map(|c| c.to_string()).collect();
        assert_eq!(l.len(), 1, "{l:?}");
        assert!(
            l[0].starts_with(&format!(
                "! mirror: http://127.0.0.1:{port} answers GET /v2/ but its /readyz is not ready"
            )) && l[0].contains("fix: let the nodes reach each other"),
            "{l:?}"
        );
    }

    #[tokio::test]
    async fn probing_nothing_is_an_error() {
        // A port that was free a moment ago; tests/ops.rs probes a real
        // registry.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = probe_http("127.0.0.1", port, "/v2/").await.unwrap_err();
        assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");
    }
}
