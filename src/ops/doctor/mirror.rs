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

use super::{timed, Report};
use crate::containerd::Containerd;

/// The registry `docker.io/library/app:dev` (what `app:dev` means to
/// buildkit, nerdctl and kubelet) resolves at: it must go to the mirror.
pub const MIRRORED: &str = "docker.io";

/// The CRI images plugin of 2.x, whose exports carry its registry settings.
const IMAGES_PLUGIN: (&str, &str) = ("io.containerd.cri.v1", "images");

/// 2.2+'s `config_path` when the file sets none (and no `mirrors`).
const DEFAULT_CONFIG_PATH_2_2: &str = "/etc/containerd/certs.d:/etc/docker/certs.d";

/// Upper bound for the mirror's answer: spegel answers `/v2/` at once.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// How CRI pulls images, which decides how it reads `config_path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PullPath {
    /// The client pull (1.x, 2.0, or 2.1+ with `use_local_image_pull` or a
    /// setting that forces it): `config_path` is a `:`-separated list.
    Local(String),
    /// 2.1+'s default: the Transfer service, which takes `config_path` as
    /// one directory (containerd issue 12415).
    Transfer,
    /// 2.1+ without a readable config file.
    Unknown,
}

/// CRI's registry settings that decide whether pulls reach a local mirror.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CriRegistry {
    /// `registry.config_path` in effect; empty when none.
    pub config_path: String,
    /// `discard_unpacked_layers`; `None` when it could not be read.
    pub discard_unpacked_layers: Option<bool>,
    pub pull: PullPath,
    /// Where the settings were read, for the report.
    pub from: String,
    /// 1.x layout (`io.containerd.grpc.v1.cri`) for the fixes, else 2.x's.
    pub v1_layout: bool,
}

impl CriRegistry {
    /// The TOML that sets `config_path` to `dir`.
    fn config_path_line(&self, dir: &str) -> String {
        if self.v1_layout {
            format!("[plugins.\"io.containerd.grpc.v1.cri\".registry] config_path = \"{dir}\"")
        } else {
            format!("[plugins.\"io.containerd.cri.v1.images\".registry] config_path = \"{dir}\"")
        }
    }

    fn discard_line(&self) -> &'static str {
        if self.v1_layout {
            "[plugins.\"io.containerd.grpc.v1.cri\".containerd] discard_unpacked_layers = false"
        } else {
            "[plugins.\"io.containerd.cri.v1.images\"] discard_unpacked_layers = false"
        }
    }

    /// The directories of `config_path` as the client pull reads it (the
    /// user's intent).
    pub fn dirs(&self) -> Vec<String> {
        std::env::split_paths(&self.config_path)
            .map(|p| p.display().to_string())
            .filter(|p| !p.is_empty())
            .collect()
    }

    /// The roots containerd looks under for `hosts.toml`, as this pull path
    /// reads `config_path`.
    pub fn roots(&self) -> Vec<String> {
        match self.pull {
            PullPath::Transfer => vec![self.config_path.clone()],
            _ => self.dirs(),
        }
    }
}

/// 1.x: CRI's registry settings from `Status{verbose}`'s `config` JSON.
/// `None` when the JSON has no `registry` (2.x).
pub fn from_status(config_json: &str) -> Option<CriRegistry> {
    let v: serde_json::Value = serde_json::from_str(config_json).ok()?;
    let reg = v.get("registry")?;
    Some(CriRegistry {
        config_path: reg
            .get("configPath")
            .and_then(|p| p.as_str())
            .unwrap_or("")
            .to_string(),
        discard_unpacked_layers: v
            .get("containerd")
            .and_then(|c| c.get("discardUnpackedLayers"))
            .and_then(|d| d.as_bool()),
        pull: PullPath::Local("containerd 1.x CRI pulls with the client".into()),
        from: "CRI Status".into(),
        v1_layout: true,
    })
}

/// 2.x: CRI's image settings from containerd's config file, with what
/// containerd `version` does to it: a version 1/2 file's
/// `io.containerd.grpc.v1.cri` keys are migrated into
/// `io.containerd.cri.v1.images` (plugins/cri/images/plugin.go), and 2.2+
/// defaults `config_path` to [`DEFAULT_CONFIG_PATH_2_2`].
pub fn from_config_file(text: &str, version: (u64, u64, u64)) -> Result<CriRegistry, String> {
    let t: toml::Table = toml::from_str(text).map_err(|e| super::one_line(&e.to_string()))?;
    let file_version = t.get("version").and_then(|v| v.as_integer()).unwrap_or(1);
    let plugins = t.get("plugins").and_then(|p| p.as_table());
    let plugin = |id: &str| plugins.and_then(|p| p.get(id)).and_then(|p| p.as_table());
    let mut images = plugin("io.containerd.cri.v1.images")
        .cloned()
        .unwrap_or_default();
    if file_version < 3 {
        // Version 1 names the plugin `cri`; version 2 by its full id.
        if let Some(cri) = plugin("io.containerd.grpc.v1.cri").or_else(|| plugin("cri")) {
            for key in [
                "registry",
                "max_concurrent_downloads",
                "image_pull_with_sync_fs",
            ] {
                if let Some(v) = cri.get(key) {
                    images.insert(key.into(), v.clone());
                }
            }
            if let Some(c) = cri.get("containerd").and_then(|c| c.as_table()) {
                for key in ["disable_snapshot_annotations", "discard_unpacked_layers"] {
                    if let Some(v) = c.get(key) {
                        images.insert(key.into(), v.clone());
                    }
                }
            }
        }
    }
    let registry = images.get("registry").and_then(|r| r.as_table());
    let non_empty = |key: &str| {
        registry
            .and_then(|r| r.get(key))
            .and_then(|m| m.as_table())
            .is_some_and(|m| !m.is_empty())
    };
    let mirrors = non_empty("mirrors");
    let mut config_path = registry
        .and_then(|r| r.get("config_path"))
        .and_then(|p| p.as_str())
        .unwrap_or("")
        .to_string();
    if config_path.is_empty() && !mirrors && (version.0, version.1) >= (2, 2) {
        config_path = DEFAULT_CONFIG_PATH_2_2.into();
    }
    let flag = |key: &str| images.get(key).and_then(|v| v.as_bool());
    let discard = flag("discard_unpacked_layers").unwrap_or(false);
    // CheckLocalImagePullConfigs (internal/cri/config/config.go, 2.1+):
    // the first of these present makes CRI fall back to the client pull.
    let forced = [
        (
            flag("disable_snapshot_annotations") == Some(false),
            "disable_snapshot_annotations = false",
        ),
        (discard, "discard_unpacked_layers = true"),
        (mirrors, "registry.mirrors"),
        (non_empty("configs"), "registry.configs"),
        (non_empty("auths"), "registry.auths"),
        (
            images
                .get("max_concurrent_downloads")
                .and_then(|v| v.as_integer())
                .is_some_and(|n| n != 3),
            "max_concurrent_downloads ≠ 3",
        ),
        (
            flag("image_pull_with_sync_fs") == Some(true),
            "image_pull_with_sync_fs = true",
        ),
    ]
    .into_iter()
    .find_map(|(set, name)| set.then_some(name));
    let pull = if (version.0, version.1) < (2, 1) {
        PullPath::Local(format!(
            "containerd {}.{} CRI pulls with the client",
            version.0, version.1
        ))
    } else if flag("use_local_image_pull") == Some(true) {
        PullPath::Local("use_local_image_pull = true".into())
    } else if let Some(name) = forced {
        PullPath::Local(format!("{name} makes CRI fall back to the client pull"))
    } else {
        PullPath::Transfer
    };
    Ok(CriRegistry {
        config_path,
        discard_unpacked_layers: Some(discard),
        pull,
        from: String::new(),
        v1_layout: file_version < 3,
    })
}

/// One `[host."…"]` of a `hosts.toml`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Host {
    pub url: String,
    pub pull: bool,
    pub resolve: bool,
}

/// The parts of a `hosts.toml` doctor reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostsFile {
    pub server: Option<String>,
    pub hosts: Vec<Host>,
}

/// Parses a `hosts.toml`. Capabilities default to pull, resolve and push,
/// as containerd's (core/remotes/docker/config/hosts.go).
pub fn parse_hosts(text: &str) -> Result<HostsFile, String> {
    let t: toml::Table = toml::from_str(text).map_err(|e| super::one_line(&e.to_string()))?;
    let server = t.get("server").and_then(|s| s.as_str()).map(String::from);
    let hosts = t
        .get("host")
        .and_then(|h| h.as_table())
        .map(|h| {
            h.iter()
                .map(|(url, v)| {
                    let caps: Option<Vec<&str>> = v
                        .get("capabilities")
                        .and_then(|c| c.as_array())
                        .map(|a| a.iter().filter_map(|c| c.as_str()).collect());
                    let has = |c: &str| caps.as_ref().is_none_or(|cs| cs.contains(&c));
                    Host {
                        url: url.clone(),
                        pull: has("pull"),
                        resolve: has("resolve"),
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(HostsFile { server, hosts })
}

/// The host directory containerd uses for `registry` under `roots`: per
/// root, `host_port_`, `host`, then `_default`; the first directory that
/// exists wins, with or without a `hosts.toml` in it
/// (`HostDirFromRoot`, core/remotes/docker/config).
pub fn host_dir(roots: &[String], registry: &str) -> Option<PathBuf> {
    let mut names = Vec::new();
    if let Some(i) = registry.rfind(':').filter(|&i| i > 0) {
        names.push(format!("{}_{}_", &registry[..i], &registry[i + 1..]));
    }
    names.push(registry.to_string());
    names.push("_default".to_string());
    roots.iter().find_map(|root| {
        names
            .iter()
            .map(|n| Path::new(root).join(n))
            .find(|p| p.exists())
    })
}

/// The parts of a `[host."…"]` URL doctor uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostUrl {
    pub scheme: String,
    /// Without IPv6 brackets.
    pub host: String,
    pub port: Option<u16>,
    pub path: String,
}

/// Parses a host URL such as `http://127.0.0.1:30020` or
/// `https://[::1]:6443/v2`; `None` without a scheme or host.
pub fn parse_url(url: &str) -> Option<HostUrl> {
    let uri: http::Uri = url.parse().ok()?;
    Some(HostUrl {
        scheme: uri.scheme_str()?.to_string(),
        host: uri
            .host()?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string(),
        port: uri.port_u16(),
        path: uri.path().to_string(),
    })
}

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

/// The config file's non-empty `imports = [...]`, as written.
fn imports(text: &str) -> Option<String> {
    let t: toml::Table = toml::from_str(text).ok()?;
    let list: Vec<&str> = t
        .get("imports")?
        .as_array()?
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    (!list.is_empty()).then(|| list.join(", "))
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
    let guide = "see docs/multi-node.md";
    let what = "image sharing";
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
    let example = "/etc/containerd/certs.d";
    if reg.config_path.is_empty() {
        r.warn(
            what,
            format!("single node: CRI has no registry config_path (read from {}), so kubelet pulls of images built on another node go to the registry", reg.from),
            format!("to share images between nodes through spegel: {} and a {example}/{MIRRORED}/hosts.toml naming the node's mirror; {guide}", reg.config_path_line(example)),
        );
        return;
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
        return;
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
                return;
            }
        },
        Err(e) => {
            r.warn(
                what,
                format!("single node: {} takes {MIRRORED}'s settings but has no readable hosts.toml ({e})", dir.display()),
                format!("write {} with [host.\"http://127.0.0.1:<mirror port>\"] capabilities = [\"pull\", \"resolve\"]; {guide}", hosts_path.display()),
            );
            return;
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
        return;
    };
    r.pass(
        "registry config_path",
        format!("{} (from {})", reg.config_path, reg.from),
    );
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
    pull_path(&reg, &first_root, r);
    probe_mirror(&mirror.url, r).await;
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
/// and mirrors are silently skipped (containerd issues 12415, 12636).
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

    /// Trimmed from CRI `Status{verbose}` `info["config"]` on containerd 1.6.20.
    const STATUS_1_6: &str = r#"{"containerd":{"snapshotter":"overlayfs","discardUnpackedLayers":false,"defaultRuntimeName":"runc"},"registry":{"auths":null,"configPath":"/etc/containerd/certs.d","configs":null,"headers":null,"mirrors":null},"sandboxImage":"registry.k8s.io/pause:3.6"}"#;
    /// Trimmed from the same on containerd 2.4.2: no registry at all.
    const STATUS_2_4: &str = r#"{"containerd":{"defaultRuntimeName":"runc","runtimes":{"runc":{"runtimeType":"io.containerd.runc.v2","snapshotter":""}}},"containerdRootDir":"/var/lib/containerd"}"#;

    #[test]
    fn reads_1x_status() {
        let r = from_status(STATUS_1_6).unwrap();
        assert_eq!(r.config_path, "/etc/containerd/certs.d");
        assert_eq!(r.discard_unpacked_layers, Some(false));
        assert!(matches!(r.pull, PullPath::Local(_)));
        assert!(r.v1_layout);
        let discard = STATUS_1_6
            .replace(
                r#""discardUnpackedLayers":false"#,
                r#""discardUnpackedLayers":true"#,
            )
            .replace(
                r#""configPath":"/etc/containerd/certs.d""#,
                r#""configPath":"""#,
            );
        let r = from_status(&discard).unwrap();
        assert_eq!(r.config_path, "");
        assert_eq!(r.discard_unpacked_layers, Some(true));
        assert_eq!(from_status(STATUS_2_4), None);
        assert_eq!(from_status("not json"), None);
    }

    const V3: &str = "version = 3\n[plugins.'io.containerd.cri.v1.images'.registry]\n  config_path = '/etc/containerd/certs.d'\n";

    #[test]
    fn reads_2x_config_files() {
        let v21 = (2, 1, 9);
        let r = from_config_file(V3, v21).unwrap();
        assert_eq!(r.config_path, "/etc/containerd/certs.d");
        assert_eq!(r.pull, PullPath::Transfer);
        assert_eq!(r.discard_unpacked_layers, Some(false));
        assert!(!r.v1_layout);
        // 2.0 has no Transfer pull in CRI.
        assert!(matches!(
            from_config_file(V3, (2, 0, 7)).unwrap().pull,
            PullPath::Local(_)
        ));
        // Unset: nothing before 2.2, the two-directory list from 2.2.
        assert_eq!(
            from_config_file("version = 3\n", v21).unwrap().config_path,
            ""
        );
        assert_eq!(
            from_config_file("version = 3\n", (2, 4, 2))
                .unwrap()
                .config_path,
            DEFAULT_CONFIG_PATH_2_2
        );
        // ... but not with mirrors (which also force the client pull).
        let mirrors = "version = 3\n[plugins.'io.containerd.cri.v1.images'.registry.mirrors.'docker.io']\n  endpoint = ['http://127.0.0.1:5000']\n";
        let r = from_config_file(mirrors, (2, 2, 1)).unwrap();
        assert_eq!(r.config_path, "");
        assert_eq!(
            r.pull,
            PullPath::Local("registry.mirrors makes CRI fall back to the client pull".into())
        );
        // Settings that force the client pull, and the explicit switch.
        let with = |line: &str| {
            from_config_file(
                &format!("version = 3\n[plugins.'io.containerd.cri.v1.images']\n  {line}\n"),
                v21,
            )
            .unwrap()
            .pull
        };
        assert_eq!(
            with("use_local_image_pull = true"),
            PullPath::Local("use_local_image_pull = true".into())
        );
        assert_eq!(with("use_local_image_pull = false"), PullPath::Transfer);
        assert!(
            matches!(with("discard_unpacked_layers = true"), PullPath::Local(w) if w.starts_with("discard_unpacked_layers"))
        );
        assert!(matches!(
            with("max_concurrent_downloads = 10"),
            PullPath::Local(_)
        ));
        assert_eq!(with("max_concurrent_downloads = 3"), PullPath::Transfer);
        assert!(matches!(
            with("disable_snapshot_annotations = false"),
            PullPath::Local(_)
        ));
        assert_eq!(
            with("disable_snapshot_annotations = true"),
            PullPath::Transfer
        );
        assert!(matches!(
            with("image_pull_with_sync_fs = true"),
            PullPath::Local(_)
        ));
        assert!(from_config_file("version = = 3", v21).is_err());
    }

    #[test]
    fn migrates_version_2_files_on_2x() {
        let v2 = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  discard_unpacked_layers = true\n[plugins.\"io.containerd.grpc.v1.cri\".registry]\n  config_path = \"/etc/containerd/certs.d\"\n";
        let r = from_config_file(v2, (2, 1, 9)).unwrap();
        assert_eq!(r.config_path, "/etc/containerd/certs.d");
        assert_eq!(r.discard_unpacked_layers, Some(true));
        assert!(r.v1_layout);
        assert!(matches!(r.pull, PullPath::Local(_)));
        // Version 3 ignores the old plugin's keys.
        let v3 = v2.replace("version = 2", "version = 3");
        let r = from_config_file(&v3, (2, 1, 9)).unwrap();
        assert_eq!(r.config_path, "");
        assert_eq!(r.discard_unpacked_layers, Some(false));
        // Version 1 names the plugin `cri`.
        let v1 = "[plugins.cri.registry]\n  config_path = \"/x\"\n";
        assert_eq!(from_config_file(v1, (2, 1, 9)).unwrap().config_path, "/x");
    }

    #[test]
    fn names_imports() {
        assert_eq!(
            imports("version = 2\nimports = [\"/etc/containerd/config.d/*.toml\", \"x.toml\"]\n")
                .as_deref(),
            Some("/etc/containerd/config.d/*.toml, x.toml")
        );
        assert_eq!(imports("version = 2\nimports = []\n"), None);
        assert_eq!(imports("version = 2\n"), None);
    }

    #[test]
    fn roots_follow_the_pull_path() {
        let mut r = from_config_file("version = 3\n", (2, 2, 0)).unwrap();
        assert_eq!(r.roots(), vec![DEFAULT_CONFIG_PATH_2_2.to_string()]);
        r.pull = PullPath::Local("x".into());
        assert_eq!(
            r.roots(),
            vec!["/etc/containerd/certs.d", "/etc/docker/certs.d"]
        );
    }

    #[test]
    fn parses_hosts_toml() {
        // In the layout spegel writes (its server is the registry's own endpoint).
        let spegel = "server = 'https://upstream.invalid'\n\n[host.'http://127.0.0.1:30020']\ncapabilities = ['pull', 'resolve']\ndial_timeout = '200ms'\n";
        let h = parse_hosts(spegel).unwrap();
        assert_eq!(h.server.as_deref(), Some("https://upstream.invalid"));
        assert_eq!(
            h.hosts,
            vec![Host {
                url: "http://127.0.0.1:30020".into(),
                pull: true,
                resolve: true
            }]
        );
        let pull_only = "[host.\"http://10.0.0.1:5000\"]\n  capabilities = [\"pull\"]\n[host.\"https://m.example\"]\n";
        let h = parse_hosts(pull_only).unwrap();
        assert_eq!(h.server, None);
        assert!(h.hosts.contains(&Host {
            url: "http://10.0.0.1:5000".into(),
            pull: true,
            resolve: false
        }));
        // No capabilities: containerd's default, everything.
        assert!(h.hosts.contains(&Host {
            url: "https://m.example".into(),
            pull: true,
            resolve: true
        }));
        assert_eq!(parse_hosts("").unwrap(), HostsFile::default());
        assert!(parse_hosts("[host\n").is_err());
    }

    #[test]
    fn finds_host_dirs_as_containerd_does() {
        let d = tempfile::tempdir().unwrap();
        let a = d.path().join("a");
        let b = d.path().join("b");
        let root = |p: &Path| p.display().to_string();
        std::fs::create_dir_all(b.join("docker.io")).unwrap();
        std::fs::create_dir_all(a.join("_default")).unwrap();
        // The first root with any match wins, even if only by _default.
        assert_eq!(
            host_dir(&[root(&a), root(&b)], "docker.io"),
            Some(a.join("_default"))
        );
        assert_eq!(
            host_dir(&[root(&b), root(&a)], "docker.io"),
            Some(b.join("docker.io"))
        );
        // A list as one root matches nothing (the Transfer trap).
        let joined = format!("{}:{}", root(&a), root(&b));
        assert_eq!(host_dir(&[joined], "docker.io"), None);
        std::fs::create_dir_all(a.join("localhost_5000_")).unwrap();
        assert_eq!(
            host_dir(&[root(&a)], "localhost:5000"),
            Some(a.join("localhost_5000_"))
        );
        assert_eq!(host_dir(&[], "docker.io"), None);
    }

    #[test]
    fn parses_host_urls() {
        let u = |s| parse_url(s).map(|u| (u.scheme, u.host, u.port, u.path));
        let t = |a: &str, b: &str, c, d: &str| Some((a.into(), b.into(), c, d.into()));
        assert_eq!(
            u("http://127.0.0.1:30020"),
            t("http", "127.0.0.1", Some(30020), "/")
        );
        assert_eq!(
            u("https://[::1]:6443/v2"),
            t("https", "::1", Some(6443), "/v2")
        );
        assert_eq!(
            u("https://mirror.example/"),
            t("https", "mirror.example", None, "/")
        );
        assert_eq!(u("127.0.0.1:5000"), None);
    }

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
