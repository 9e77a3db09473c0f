//! The one configuration type: TOML file, CLI overrides, validation.
//!
//! Every key has a default; unknown keys are rejected (`deny_unknown_fields`)
//! so a typo never silently turns a feature off.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub const DEFAULT_CONFIG: &str = "/etc/imgbridge/config.toml";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config {path}: {source}")]
    Parse {
        path: PathBuf,
        source: Box<toml::de::Error>,
    },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Socket imgbridge listens on (clients point here).
    pub listen: PathBuf,
    /// containerd's gRPC socket.
    pub upstream: PathBuf,
    /// Mode of the created socket, octal string.
    pub socket_mode: String,
    /// Group (name or numeric gid) owning the socket; empty = root.
    pub socket_group: String,
    /// Also relay `<listen>.ttrpc` to `<upstream>.ttrpc`.
    pub ttrpc: bool,
    /// A live socket at `listen` is taken over (bound beside it and renamed
    /// over it) instead of refused, and the TCP ports are shared with the
    /// instance before: the chart's surge upgrade (docs/daemonset.md).
    pub socket_handover: bool,
    /// How long in-flight calls may finish after SIGTERM.
    #[serde(with = "duration")]
    pub drain_timeout: Duration,
    pub replication: Replication,
    pub reconcile: Reconcile,
    pub import: Import,
    pub metrics: Metrics,
    pub log: Log,
    pub registry: Registry,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DeletePolicy {
    /// Drop the pin imgbridge set on the replica, keep the image.
    Unpin,
    /// Delete the replica too.
    Delete,
    /// Leave the replica as it is.
    Keep,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum OnFailure {
    /// The caller gets a gRPC error naming image, target and cause.
    Fail,
    /// The caller gets OK; the failure is logged, counted and retried.
    Warn,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Replication {
    pub source_namespaces: Vec<String>,
    pub target_namespaces: Vec<String>,
    /// Label replicas `io.cri-containerd.pinned=pinned`.
    pub pin: bool,
    /// Also write `name@sha256:<digest>` records (for spegel / embedded mirrors).
    pub digest_refs: bool,
    /// Image writes made straight into `k8s.io` through imgbridge also
    /// return only once CRI resolves them (nothing is replicated).
    pub confirm_direct_writes: bool,
    pub delete_policy: DeletePolicy,
    pub on_failure: OnFailure,
    /// Upper bound for one replication into one target.
    #[serde(with = "duration")]
    pub timeout: Duration,
    /// How long to wait for CRI ImageStatus to resolve a replica.
    #[serde(with = "duration")]
    pub cri_wait: Duration,
    /// How long a blob missing in the source is waited for.
    #[serde(with = "duration")]
    pub pending_give_up: Duration,
    /// A blob still missing after this long is logged as a WARN (once):
    /// pods of its image cannot start until it is written. Only blobs a pod
    /// on this node could need, while an image in the source names them.
    #[serde(with = "duration")]
    pub pending_warn_after: Duration,
    /// Names in a target a replica never replaces (globs over the
    /// normalised name, `*` within a path segment, `**` across them), on top
    /// of CRI's sandbox image and images pinned by others
    /// ([docs/protected-names.md](../docs/protected-names.md)).
    pub protect: Vec<String>,
    /// Globs that lift every protection for the names they match: an
    /// operator who really wants a build to replace one.
    pub overwrite: Vec<String>,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Reconcile {
    /// Full pass at start and after every reconnect.
    pub enabled: bool,
    /// Subscribe to image events as a backstop for writes that bypass the proxy.
    pub events: bool,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Import {
    pub dirs: Vec<ImportDir>,
    /// Where imported file state is kept across restarts.
    pub state_file: PathBuf,
    /// A file must be quiet (size and mtime stable) this long before import.
    #[serde(with = "duration")]
    pub debounce: Duration,
    /// Cap on decompressed bytes read from one archive (decompression bombs).
    pub max_decompressed_bytes: u64,
    /// Cap on decompressed bytes per compressed byte read, checked once an
    /// archive has produced 64 MiB (0 = off). A gzip bomb is ~1000:1; real
    /// image archives hold already-compressed layers (~1:1) or layer tars
    /// of binaries and text (typically 2–5:1), so the default 100 stops a
    /// bomb after about 1 MiB read and no real image hits it.
    pub max_decompression_ratio: u64,
    /// Attempts per pull-list reference before giving up (an invalid
    /// reference gets one); retries back off 1 s, 2 s, 4 s … up to 5 min.
    /// A changed list starts over.
    pub pull_attempts: u32,
    /// Registry hosts pull lists may name even though they are refused by
    /// default: link-local addresses (169.254.0.0/16, fe80::/10) and cloud
    /// metadata services (`metadata.google.internal`, `169.254.169.254`,
    /// `fd00:ec2::254`, …). Host names or IP literals, port ignored.
    /// Private ranges (10/8, 192.168/16, fd00::/8 …) are always allowed.
    pub pull_hosts_allow: Vec<String>,
    /// Registry hosts pull lists may never name (wins over the allow list).
    pub pull_hosts_deny: Vec<String>,
    /// Pin imported and pulled images.
    pub pin: bool,
    /// An archive import that completes no step (a chunk handed on, a blob
    /// committed, a record written) for this long is cancelled and tried
    /// again, as containerd's CRI does with `image_pull_progress_timeout`.
    #[serde(with = "duration")]
    pub progress_timeout: Duration,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ImportDir {
    pub path: PathBuf,
    #[serde(default = "k8s_ns")]
    pub namespace: String,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Metrics {
    /// `host:port` or a unix socket path; empty = off.
    pub listen: String,
}

/// `[registry]`: the node-local OCI distribution endpoint
/// ([docs/registry.md](../docs/registry.md)). Off unless `listen` is set.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Registry {
    /// `host:port` on a loopback address; empty = off.
    pub listen: String,
    /// Namespace pushed images are written into; empty = the first
    /// replication source, so replication applies to them unchanged.
    pub namespace: String,
    /// Largest manifest or index accepted (distribution's limit: 4 MiB).
    pub max_manifest_bytes: u64,
    /// Largest blob accepted (0 = no limit).
    pub max_blob_bytes: u64,
    /// An upload session idle this long is dropped (its ingest aborted, its
    /// lease released); an uploaded blob no manifest names is released
    /// after it too.
    #[serde(with = "duration")]
    pub upload_expiry: Duration,
    /// Upload sessions open at once; more are refused with 429.
    pub max_uploads: usize,
    /// Host names (besides `localhost` and loopback IPs) clients may push
    /// to: the host part of a pushed image's name.
    pub hosts: Vec<String>,
}

impl Default for Registry {
    fn default() -> Self {
        Registry {
            listen: String::new(),
            namespace: String::new(),
            max_manifest_bytes: 4 << 20,
            max_blob_bytes: 0,
            upload_expiry: Duration::from_secs(3600),
            max_uploads: 1024,
            hosts: Vec::new(),
        }
    }
}

impl Registry {
    /// The namespace pushes go into (see [`Registry::namespace`]).
    pub fn namespace<'a>(&'a self, r: &'a Replication) -> &'a str {
        if self.namespace.is_empty() {
            r.source_namespaces
                .first()
                .map_or("buildkit", String::as_str)
        } else {
            &self.namespace
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Log {
    /// `text` or `json`.
    pub format: String,
    /// `RUST_LOG`-style filter; the `RUST_LOG` variable wins when set.
    pub filter: String,
}

fn k8s_ns() -> String {
    "k8s.io".into()
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: "/run/imgbridge/containerd.sock".into(),
            upstream: "/run/containerd/containerd.sock".into(),
            socket_mode: "0660".into(),
            socket_group: String::new(),
            ttrpc: true,
            socket_handover: false,
            drain_timeout: Duration::from_secs(10),
            replication: Replication::default(),
            reconcile: Reconcile::default(),
            import: Import::default(),
            metrics: Metrics::default(),
            log: Log::default(),
            registry: Registry::default(),
        }
    }
}

impl Default for Replication {
    fn default() -> Self {
        Replication {
            source_namespaces: vec!["buildkit".into()],
            target_namespaces: vec![k8s_ns()],
            pin: false,
            digest_refs: true,
            confirm_direct_writes: false,
            delete_policy: DeletePolicy::Unpin,
            on_failure: OnFailure::Fail,
            timeout: Duration::from_secs(120),
            cri_wait: Duration::from_secs(5),
            pending_give_up: Duration::from_secs(30 * 60),
            pending_warn_after: Duration::from_secs(60),
            protect: Vec::new(),
            overwrite: Vec::new(),
        }
    }
}

impl Default for Reconcile {
    fn default() -> Self {
        Reconcile {
            enabled: true,
            events: true,
        }
    }
}

impl Default for Import {
    fn default() -> Self {
        Import {
            dirs: Vec::new(),
            state_file: "/var/lib/imgbridge/import-state.json".into(),
            debounce: Duration::from_secs(2),
            max_decompressed_bytes: 64 << 30,
            max_decompression_ratio: 100,
            pull_attempts: 10,
            pull_hosts_allow: Vec::new(),
            pull_hosts_deny: Vec::new(),
            pin: true,
            progress_timeout: Duration::from_secs(300),
        }
    }
}

impl Default for Log {
    fn default() -> Self {
        Log {
            format: "text".into(),
            filter: "info".into(),
        }
    }
}

impl Config {
    /// Where live imgbridges serving `listen` mark themselves alive
    /// ([`crate::containerd::orphans`]): beside the socket, which every
    /// instance that serves it shares.
    pub fn owners_dir(&self) -> PathBuf {
        self.listen
            .parent()
            .unwrap_or(std::path::Path::new("/"))
            .join("imgbridge-owners")
    }

    /// Parses TOML text; `origin` names the file in errors.
    pub fn from_toml(text: &str, origin: &std::path::Path) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.into(),
            source: Box::new(e),
        })
    }

    /// Loads `path`; a missing default file means all defaults.
    pub fn load(path: Option<&std::path::Path>) -> Result<Config, ConfigError> {
        let (p, required) = match path {
            Some(p) => (p.to_path_buf(), true),
            None => (PathBuf::from(DEFAULT_CONFIG), false),
        };
        match std::fs::read_to_string(&p) {
            Ok(t) => Config::from_toml(&t, &p),
            Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => {
                Ok(Config::default())
            }
            Err(source) => Err(ConfigError::Read { path: p, source }),
        }
    }

    /// Refuses configurations that cannot work or would loop.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let r = &self.replication;
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if r.source_namespaces.is_empty() {
            return bad("replication.source_namespaces is empty: name at least one build namespace (default \"buildkit\")".into());
        }
        if r.target_namespaces.is_empty() {
            return bad("replication.target_namespaces is empty: name at least one target (default \"k8s.io\")".into());
        }
        for ns in r.source_namespaces.iter().chain(&r.target_namespaces) {
            if !valid_namespace(ns) {
                return bad(format!("namespace {ns:?} is not a valid containerd namespace (letters, digits, '.', '_', '-'; must start with a letter or digit)"));
            }
        }
        let sources: BTreeSet<_> = r.source_namespaces.iter().collect();
        if let Some(ns) = r.target_namespaces.iter().find(|t| sources.contains(t)) {
            return bad(format!(
                "namespace {ns:?} is both a replication source and a target: that would replicate it into itself"
            ));
        }
        for (key, globs) in [
            ("replication.protect", &r.protect),
            ("replication.overwrite", &r.overwrite),
        ] {
            if let Err(e) = crate::globs::Globs::new(globs) {
                return bad(format!("{key}: {e}"));
            }
        }
        if self.listen == self.upstream {
            return bad(format!(
                "listen and upstream are the same socket {}: imgbridge would proxy to itself",
                self.listen.display()
            ));
        }
        self.socket_mode()?;
        if !matches!(self.log.format.as_str(), "text" | "json") {
            return bad(format!(
                "log.format {:?}: expected \"text\" or \"json\"",
                self.log.format
            ));
        }
        if self.import.progress_timeout.is_zero() {
            return bad("import.progress_timeout is 0: every import would be cancelled at once (default \"5m\")".into());
        }
        for d in &self.import.dirs {
            if !valid_namespace(&d.namespace) {
                return bad(format!(
                    "import.dirs namespace {:?} is not valid",
                    d.namespace
                ));
            }
        }
        if let Err(e) = tracing_subscriber::EnvFilter::builder().parse(&self.log.filter) {
            return bad(format!("log.filter {:?}: {e}", self.log.filter));
        }
        let m = &self.metrics.listen;
        if !m.is_empty() && !m.contains('/') {
            let port = m.rsplit_once(':').map(|(h, p)| (h, p.parse::<u16>()));
            if !matches!(port, Some((h, Ok(_))) if !h.is_empty()) {
                return bad(format!(
                    "metrics.listen {m:?}: expected host:port (e.g. \"127.0.0.1:9090\") or a Unix socket path"
                ));
            }
        }
        self.validate_registry()
    }

    fn validate_registry(&self) -> Result<(), ConfigError> {
        let g = &self.registry;
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if g.listen.is_empty() {
            return Ok(());
        }
        let Ok(addr) = g.listen.parse::<std::net::SocketAddr>() else {
            return bad(format!(
                "registry.listen {:?}: expected an IP address and port such as \"127.0.0.1:5000\"",
                g.listen
            ));
        };
        if !addr.ip().is_loopback() {
            return bad(format!(
                "registry.listen {:?} is not a loopback address: the registry endpoint has no authentication or TLS, and whoever reaches it can replace the images kubelet runs; listen on 127.0.0.1 or [::1] (and reach it from elsewhere through an authenticating, TLS-terminating proxy)",
                g.listen
            ));
        }
        let ns = g.namespace(&self.replication);
        if !self.replication.source_namespaces.iter().any(|s| s == ns) {
            return bad(format!(
                "registry.namespace {ns:?} is not one of replication.source_namespaces {:?}: pushed images are written into a source namespace so that replication (and its read-your-writes) applies to them",
                self.replication.source_namespaces
            ));
        }
        if g.max_manifest_bytes == 0 || g.max_manifest_bytes > crate::containerd::MAX_MESSAGE as u64
        {
            return bad(format!(
                "registry.max_manifest_bytes {}: expected 1 to {} (manifests are read whole)",
                g.max_manifest_bytes,
                crate::containerd::MAX_MESSAGE
            ));
        }
        if let Some(h) = g.hosts.iter().find(|h| {
            h.is_empty()
                || !h
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
        }) {
            return bad(format!(
                "registry.hosts entry {h:?}: expected a host name without port (e.g. \"registry.local\")"
            ));
        }
        if g.max_uploads == 0 {
            return bad("registry.max_uploads is 0: no push could start".into());
        }
        if g.upload_expiry < Duration::from_secs(1) {
            return bad(format!(
                "registry.upload_expiry {:?} is shorter than a second",
                g.upload_expiry
            ));
        }
        Ok(())
    }

    pub fn socket_mode(&self) -> Result<u32, ConfigError> {
        u32::from_str_radix(self.socket_mode.trim_start_matches("0o"), 8)
            .ok()
            .filter(|m| *m <= 0o777)
            .ok_or_else(|| {
                ConfigError::Invalid(format!(
                    "socket_mode {:?}: expected an octal mode such as \"0660\"",
                    self.socket_mode
                ))
            })
    }

    /// The socket's group id: a numeric gid as is, a name through /etc/group.
    pub fn socket_gid(&self) -> Result<Option<u32>, ConfigError> {
        let g = self.socket_group.trim();
        if g.is_empty() {
            return Ok(None);
        }
        if let Ok(id) = g.parse() {
            return Ok(Some(id));
        }
        group_gid(g, Path::new("/etc/group"))
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_default()
    }
}

/// The gid of group `g` in the group file `path`, read directly: the static
/// release binary has no working `getgrnam`.
fn group_gid(g: &str, path: &Path) -> Result<Option<u32>, ConfigError> {
    match crate::etc_group::gid_in_file(path, g) {
        Ok(Some(gid)) => Ok(Some(gid)),
        Ok(None) => Err(ConfigError::Invalid(format!(
            "socket_group {g:?}: no such group in {}",
            path.display()
        ))),
        Err(e) => Err(ConfigError::Invalid(format!(
            "socket_group {g:?}: reading {}: {e}",
            path.display()
        ))),
    }
}

/// containerd's namespace rule (`identifiers.Validate`).
pub fn valid_namespace(ns: &str) -> bool {
    let b = ns.as_bytes();
    !b.is_empty()
        && b.len() <= 76
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(c))
}

/// Durations as human strings ("5s", "30m") in TOML.
mod duration {
    use super::*;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s).map_err(|e| {
            serde::de::Error::custom(format!(
                "{s:?} is not a duration like \"5s\" or \"30m\": {e}"
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn socket_group_numeric_or_from_the_group_file() {
        let mut c = Config::default();
        assert_eq!(c.socket_gid().unwrap(), None);
        c.socket_group = " 1234 ".into();
        assert_eq!(c.socket_gid().unwrap(), Some(1234));
        // root is in every /etc/group, and a static binary must still find it.
        c.socket_group = "root".into();
        assert_eq!(c.socket_gid().unwrap(), Some(0));

        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("group");
        std::fs::write(&f, "root:x:0:\nimgbridge:x:4321:builder\n").unwrap();
        assert_eq!(group_gid("imgbridge", &f).unwrap(), Some(4321));
        let e = group_gid("nosuch", &f).unwrap_err().to_string();
        assert!(e.contains("\"nosuch\": no such group in"), "{e}");
        let e = group_gid("imgbridge", &dir.path().join("missing"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no such group"), "{e}");
    }

    #[test]
    fn defaults_validate() {
        Config::default().validate().unwrap();
    }

    #[test]
    fn rejects_loop_and_empty() {
        let mut c = Config::default();
        c.replication.target_namespaces.push("buildkit".into());
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("both a replication source and a target"), "{e}");
        let mut c = Config::default();
        c.replication.source_namespaces.clear();
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("source_namespaces is empty"));
        let mut c = Config::default();
        c.replication.target_namespaces.clear();
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("target_namespaces is empty"));
    }

    #[test]
    fn unknown_key_and_bad_value_named() {
        let e = Config::from_toml("[replication]\npinn = true\n", Path::new("x.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("pinn"), "{e}");
        let e = Config::from_toml("[replication]\ncri_wait = \"soon\"\n", Path::new("x.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cri_wait") || e.contains("soon"), "{e}");
        let e = Config::from_toml(
            "[replication]\ndelete_policy = \"nuke\"\n",
            Path::new("x.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("nuke"), "{e}");
    }

    /// The shipped example, `packaging/config.toml`.
    const EXAMPLE: &str = include_str!("../packaging/config.toml");

    /// Dotted paths of every key in `v` (array-of-tables items under their
    /// array's path).
    fn keys(prefix: &str, v: &toml::Value, out: &mut Vec<String>) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let p = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    if !matches!(v, toml::Value::Table(_)) {
                        out.push(p.clone());
                    }
                    keys(&p, v, out);
                }
            }
            toml::Value::Array(a) => {
                for item in a.iter().filter(|i| i.is_table()) {
                    keys(prefix, item, out);
                }
            }
            _ => {}
        }
    }

    /// Every key `Config` serialises, including those of an import dir.
    pub(crate) fn all_keys() -> Vec<String> {
        let mut c = Config::default();
        c.import.dirs.push(ImportDir {
            path: "/d".into(),
            namespace: k8s_ns(),
        });
        let mut out = Vec::new();
        keys("", &toml::from_str(&c.to_toml()).unwrap(), &mut out);
        out.sort();
        out.dedup();
        out
    }

    #[test]
    fn example_config_is_the_default() {
        let c = Config::from_toml(EXAMPLE, Path::new("packaging/config.toml")).unwrap();
        assert_eq!(c, Config::default());
    }

    #[test]
    fn example_config_lists_every_key() {
        let example: toml::Value = toml::from_str(EXAMPLE).unwrap();
        let mut live = Vec::new();
        keys("", &example, &mut live);
        let mut defaults = Vec::new();
        keys(
            "",
            &toml::from_str(&Config::default().to_toml()).unwrap(),
            &mut defaults,
        );
        for k in &defaults {
            assert!(live.contains(k), "packaging/config.toml lacks key {k}");
        }
        // Keys that only exist inside a list entry (import.dirs) appear as
        // commented-out examples.
        for k in all_keys().iter().filter(|k| !defaults.contains(k)) {
            let leaf = k.rsplit('.').next().unwrap();
            let documented = EXAMPLE.lines().any(|l| {
                l.trim_start_matches(['#', ' '])
                    .strip_prefix(leaf)
                    .is_some_and(|r| r.trim_start().starts_with('='))
            });
            assert!(documented, "packaging/config.toml does not document {k}");
        }
        assert!(EXAMPLE.contains("# [[import.dirs]]"));
    }

    #[test]
    fn configuration_table_lists_every_key() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let docs: String = ["docs/configuration.md"]
            .iter()
            .filter_map(|f| std::fs::read_to_string(root.join(f)).ok())
            .collect();
        for k in all_keys() {
            assert!(
                docs.contains(&format!("| `{k}` |")),
                "docs/configuration.md's table lacks `{k}`"
            );
        }
    }

    #[test]
    fn registry_listens_on_loopback_only() {
        let with = |listen: &str, ns: &str| Config {
            registry: Registry {
                listen: listen.into(),
                namespace: ns.into(),
                ..Registry::default()
            },
            ..Config::default()
        };
        with("127.0.0.1:5000", "").validate().unwrap();
        with("[::1]:5000", "buildkit").validate().unwrap();
        assert_eq!(
            with("127.0.0.1:5000", "")
                .registry
                .namespace(&Replication::default()),
            "buildkit"
        );
        for bad in ["0.0.0.0:5000", "10.1.2.3:5000", "[::]:5000"] {
            let e = with(bad, "").validate().unwrap_err().to_string();
            assert!(
                e.contains("not a loopback address") && e.contains("TLS"),
                "{e}"
            );
        }
        let e = with("localhost", "").validate().unwrap_err().to_string();
        assert!(e.contains("registry.listen"), "{e}");
        let e = with("127.0.0.1:5000", "k8s.io")
            .validate()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not one of replication.source_namespaces"),
            "{e}"
        );
    }

    #[test]
    fn unknown_keys_rejected_at_every_level() {
        for (text, key) in [
            ("listn = \"/x\"\n", "listn"),
            ("[metrics]\nlisten_addr = \"x\"\n", "listen_addr"),
            ("[log]\nlevel = \"debug\"\n", "level"),
            ("[[import.dirs]]\npath = \"/d\"\nns = \"k8s.io\"\n", "ns"),
            ("[bogus]\nx = 1\n", "bogus"),
        ] {
            let e = Config::from_toml(text, Path::new("c.toml"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key) && e.contains("c.toml"), "{text:?}: {e}");
        }
    }

    #[test]
    fn invalid_values_named() {
        // Wrong types: toml's error quotes the offending line, key included.
        for (text, key) in [
            ("ttrpc = \"yes\"\n", "ttrpc"),
            ("drain_timeout = 10\n", "drain_timeout"),
            (
                "[import]\nmax_decompressed_bytes = -1\n",
                "max_decompressed_bytes",
            ),
            ("[replication]\non_failure = \"explode\"\n", "on_failure"),
        ] {
            let e = Config::from_toml(text, Path::new("c.toml"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{text:?}: {e}");
        }
        // Well-typed but invalid: validate() names the key.
        let check = |f: &dyn Fn(&mut Config), key: &str| {
            let mut c = Config::default();
            f(&mut c);
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{key}: {e}");
        };
        check(&|c| c.socket_mode = "999".into(), "socket_mode");
        check(&|c| c.log.format = "xml".into(), "log.format");
        check(&|c| c.log.filter = "imgbridge=loud".into(), "log.filter");
        check(&|c| c.metrics.listen = "9090".into(), "metrics.listen");
        check(&|c| c.metrics.listen = ":9090".into(), "metrics.listen");
        let mut c = Config::default();
        c.metrics.listen = "127.0.0.1:9090".into();
        c.validate().unwrap();
        c.metrics.listen = "localhost:0".into();
        c.validate().unwrap();
        c.metrics.listen = "/run/imgbridge/metrics.sock".into();
        c.validate().unwrap();
    }

    #[test]
    fn roundtrips_through_toml() {
        let c = Config::default();
        let back = Config::from_toml(&c.to_toml(), Path::new("x")).unwrap();
        assert_eq!(c, back);
    }
}
