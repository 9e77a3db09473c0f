//! `imgbridge doctor`: checks a node and says what to fix, one line per
//! check: `✓` fine, `!` works but worth fixing, `✗` broken (exit status 1).
//!
//! Besides imgbridge's own setup it reports the containerd facts that change
//! imgbridge's behaviour: version (against [`TESTED`]), pinned-label support,
//! the Transfer service, the config file's `version`, content sharing, CRI,
//! and CRI's snapshotter against the source namespaces'. containerd's config
//! file is not visible over its API, so doctor reads it from disk: the path in
//! `IMGBRIDGE_CONTAINERD_CONFIG` ([`CONFIG_ENV`]) if set, else the first of
//! [`CONFIG_PATHS`] that exists.
//!
//! On a node with CRI it also checks sharing images with other nodes
//! through a node-local registry mirror ([`mirror`]).

pub mod mirror;
mod protected;

use std::collections::HashMap;
use std::fmt::{self, Display};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::Config;
use crate::containerd::introspect::PluginState;
use crate::containerd::Containerd;

/// containerd release lines imgbridge's test suite runs against, with the
/// exact release tested on each: `(major, minor, release)`. The one place
/// the matrix is written down; doctor warns outside it.
pub const TESTED: &[(u64, u64, &str)] = &[
    (1, 6, "1.6.20"),
    (1, 7, "1.7.24"),
    (2, 1, "2.1.9"),
    (2, 4, "2.4.2"),
];

pub use crate::containerd::node_config::{
    candidates as config_candidates, parse_version, CONFIG_ENV, CONFIG_PATHS,
};

/// Namespace label that sets the snapshotter clients default to there.
use crate::labels::DEFAULT_SNAPSHOTTER as NS_SNAPSHOTTER_LABEL;
/// containerd's (and buildkit's containerd worker's) snapshotter on Linux
/// when nothing chooses another.
const DEFAULT_SNAPSHOTTER: &str = "overlayfs";

/// Upper bound for each question asked to containerd or the proxy.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Pass,
    Warn,
    Fail,
}

impl Level {
    pub fn mark(self) -> char {
        match self {
            Level::Pass => '✓',
            Level::Warn => '!',
            Level::Fail => '✗',
        }
    }
}

/// One checked fact.
#[derive(Clone, Debug)]
pub struct Check {
    pub level: Level,
    /// Short name of what was checked (`upstream`, `proxy socket`, …).
    pub what: String,
    pub detail: String,
    /// What to do about it (for `Warn` and `Fail`).
    pub fix: Option<String>,
}

impl Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.level.mark(), self.what, self.detail)?;
        if let Some(fix) = &self.fix {
            write!(f, " — fix: {fix}")?;
        }
        Ok(())
    }
}

/// All checks, in the order they ran.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub checks: Vec<Check>,
}

impl Report {
    /// True when any check is `✗` (doctor then exits 1).
    pub fn failed(&self) -> bool {
        self.checks.iter().any(|c| c.level == Level::Fail)
    }

    fn pass(&mut self, what: &str, detail: impl Into<String>) {
        self.push(Level::Pass, what, detail.into(), None);
    }

    fn warn(&mut self, what: &str, detail: impl Into<String>, fix: impl Into<String>) {
        self.push(Level::Warn, what, detail.into(), Some(fix.into()));
    }

    fn fail(&mut self, what: &str, detail: impl Into<String>, fix: impl Into<String>) {
        self.push(Level::Fail, what, detail.into(), Some(fix.into()));
    }

    fn push(&mut self, level: Level, what: &str, detail: String, fix: Option<String>) {
        self.checks.push(Check {
            level,
            what: what.into(),
            detail: one_line(&detail),
            fix,
        });
    }
}

impl Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in &self.checks {
            writeln!(f, "{c}")?;
        }
        let n = |l| self.checks.iter().filter(|c| c.level == l).count();
        writeln!(
            f,
            "{} ok, {} warnings, {} failed",
            n(Level::Pass),
            n(Level::Warn),
            n(Level::Fail)
        )
    }
}

/// Folds a multi-line message (toml quotes the offending line with `|` and
/// `^` markers) into one line.
fn one_line(s: &str) -> String {
    s.lines()
        .map(|l| {
            let l = l.trim();
            // Only a `12 | ` gutter is dropped: details may start with digits.
            let rest = l
                .trim_start_matches(|c: char| c.is_ascii_digit())
                .trim_start();
            match rest.strip_prefix('|') {
                Some(quoted) => quoted.trim(),
                None => l,
            }
        })
        .filter(|l| !l.is_empty() && !l.chars().all(|c| c == '^'))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Whether a containerd version makes CRI honour `io.cri-containerd.pinned`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinnedSupport {
    /// 1.6.25+, 1.7.10+, 2.x: pinned on any reference of an image counts.
    Full,
    /// 1.6.22–1.6.24, 1.7.3–1.7.9: honoured, but CRI's per-image cache did
    /// not merge the label across references (fixed by 7f7ba31b6).
    Partial,
    /// Before 1.6.22 / 1.7.3: the label is ignored.
    No,
}

/// Pinned-label support of a parsed containerd version.
pub fn pinned_support((major, minor, patch): (u64, u64, u64)) -> PinnedSupport {
    match (major, minor) {
        (0, _) => PinnedSupport::No,
        (1, m) if m < 6 => PinnedSupport::No,
        (1, 6) if patch >= 25 => PinnedSupport::Full,
        (1, 6) if patch >= 22 => PinnedSupport::Partial,
        (1, 6) => PinnedSupport::No,
        (1, 7) if patch >= 10 => PinnedSupport::Full,
        (1, 7) if patch >= 3 => PinnedSupport::Partial,
        (1, 7) => PinnedSupport::No,
        _ => PinnedSupport::Full,
    }
}

/// Where a containerd version stands against [`TESTED`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Matrix {
    /// Its minor line is in [`TESTED`].
    Tested,
    /// 1.6 or newer, but a line the tests do not run on (2.0, 2.2, 2.5, 3.x…).
    Untested,
    /// 1.5 or older: no CRI `runtime.v1` API (imgbridge confirms replicas
    /// with it; kubelet ≥ 1.26 needs it), and long out of upstream support.
    TooOld,
}

/// Classifies a parsed containerd version against [`TESTED`].
pub fn matrix((major, minor, _): (u64, u64, u64)) -> Matrix {
    if TESTED.iter().any(|&(ma, mi, _)| (ma, mi) == (major, minor)) {
        Matrix::Tested
    } else if (major, minor) < (1, 6) {
        Matrix::TooOld
    } else {
        Matrix::Untested
    }
}

/// `1.6, 1.7, 2.1, 2.4` (lines) or `1.6.20, 1.7.24, …` (releases).
fn tested_list(releases: bool) -> String {
    TESTED
        .iter()
        .map(|&(ma, mi, rel)| {
            if releases {
                rel.to_string()
            } else {
                format!("{ma}.{mi}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether this containerd ships the Transfer service (1.7 and later).
pub fn ships_transfer(v: (u64, u64, u64)) -> bool {
    (v.0, v.1) >= (1, 7)
}

/// The config `version` containerd reads without migrating it: 2 for 1.x
/// (1 still loads there, deprecated), 3 for 2.0–2.2, 4 from 2.3 (server
/// settings moved into plugins). `None` for releases newer than known.
pub fn native_config_version((major, minor, _): (u64, u64, u64)) -> Option<i64> {
    match (major, minor) {
        (0 | 1, _) => Some(2),
        (2, m) if m < 3 => Some(3),
        (2, _) => Some(4),
        _ => None,
    }
}

/// The top-level `version` of a containerd config file. A file without one
/// is a version 1 config to every containerd.
pub fn config_file_version(text: &str) -> Result<i64, String> {
    let t: toml::Table = toml::from_str(text).map_err(|e| one_line(&e.to_string()))?;
    match t.get("version") {
        None => Ok(1),
        Some(toml::Value::Integer(v)) => Ok(*v),
        Some(v) => Err(format!("`version` is not an integer: {v}")),
    }
}

/// The snapshotter CRI unpacks images with for its default runtime, from
/// CRI `Status{verbose}`'s `config` JSON: that runtime's own `snapshotter`
/// (1.7+), else `containerd.snapshotter` (1.x). 2.x keeps the image
/// snapshotter out of this JSON; `None` then means "ask ImageFsInfo".
pub fn cri_snapshotter(config_json: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(config_json).ok()?;
    let ctd = v.get("containerd")?;
    let non_empty = |s: Option<&serde_json::Value>| {
        s.and_then(|s| s.as_str())
            .filter(|s| !s.is_empty())
            .map(String::from)
    };
    let runtime = ctd
        .get("defaultRuntimeName")
        .and_then(|n| n.as_str())
        .and_then(|n| ctd.get("runtimes")?.get(n));
    non_empty(runtime.and_then(|r| r.get("snapshotter")))
        .or_else(|| non_empty(ctd.get("snapshotter")))
}

/// Names the snapshotter behind a CRI image filesystem path: the plugin
/// whose exported root it is, else the `io.containerd.snapshotter.v1.<id>`
/// directory containerd names snapshotter roots after.
pub fn snapshotter_of_path(path: &str, roots: &[(String, String)]) -> Option<String> {
    let path = path.trim_end_matches('/');
    if let Some((id, _)) = roots.iter().find(|(_, r)| r.trim_end_matches('/') == path) {
        return Some(id.clone());
    }
    Path::new(path)
        .file_name()?
        .to_str()?
        .strip_prefix("io.containerd.snapshotter.v1.")
        .filter(|id| !id.is_empty())
        .map(String::from)
}

async fn timed<T, E: Display>(
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(CALL_TIMEOUT, f).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {CALL_TIMEOUT:?}")),
    }
}

/// Runs every check for `config`. `load_error` is the configuration file's
/// error, if it could not be loaded (the other checks then use defaults).
/// containerd's own config file is read from `$IMGBRIDGE_CONTAINERD_CONFIG`
/// or the usual paths ([`CONFIG_PATHS`]).
pub async fn run(config: &Config, load_error: Option<&dyn Display>) -> Report {
    let mut r = Report::default();
    match load_error {
        Some(e) => r.fail(
            "configuration",
            e.to_string(),
            "correct the file (imgbridge serve --print-config shows every key with its default)",
        ),
        None => match config.validate() {
            Ok(()) => r.pass(
                "configuration",
                format!(
                    "valid; replicating {} → {}",
                    config.replication.source_namespaces.join(", "),
                    config.replication.target_namespaces.join(", ")
                ),
            ),
            Err(e) => r.fail("configuration", e.to_string(), "correct the named key"),
        },
    }
    if upstream_checks(config, &mut r).await {
        namespaces(config, &mut r).await;
    }
    proxy_socket(config, &mut r).await;
    watched_dirs(config, &mut r);
    r
}

/// Upstream reachability, version, pinned label, sharing policy, CRI.
/// Returns whether containerd answered.
async fn upstream_checks(config: &Config, r: &mut Report) -> bool {
    let sock = &config.upstream;
    let fix_reach = "start containerd (systemctl start containerd), or point --upstream / upstream = at its socket \
         (k3s: /run/k3s/containerd/containerd.sock; drop-in swap: /run/containerd/containerd-real.sock)";
    match std::fs::symlink_metadata(sock) {
        Err(e) => {
            r.fail("upstream", format!("{}: {e}", sock.display()), fix_reach);
            return false;
        }
        Ok(m) if !m.file_type().is_socket() && !m.file_type().is_symlink() => {
            r.fail(
                "upstream",
                format!("{} exists but is not a socket", sock.display()),
                fix_reach,
            );
            return false;
        }
        Ok(_) => {}
    }
    let c = Containerd::new(sock);
    let version = match timed(c.version()).await {
        Ok(v) => v,
        Err(e) => {
            r.fail(
                "upstream",
                format!("{} does not answer: {e}", sock.display()),
                fix_reach,
            );
            return false;
        }
    };
    r.pass(
        "upstream",
        format!("containerd {version} answers at {}", sock.display()),
    );
    let parsed = parse_version(&version);
    version_matrix(&version, parsed, r);
    pinned(config, &version, r);
    transfer(&c, &version, parsed, r).await;
    let env = std::env::var_os(CONFIG_ENV).map(PathBuf::from);
    containerd_config(
        &version,
        parsed,
        env.as_deref(),
        &config_candidates(sock),
        r,
    );
    match timed(c.sharing_policy()).await {
        Ok(p) if p == "shared" => r.pass(
            "content sharing",
            "policy \"shared\": replication links blobs without copying bytes",
        ),
        Ok(p) => r.warn(
            "content sharing",
            format!("policy {p:?}: every replicated blob is copied byte for byte (slower, uses disk)"),
            "set content_sharing_policy = \"shared\" under [plugins.\"io.containerd.metadata.v1.bolt\"] in containerd's config and restart it",
        ),
        Err(e) => r.warn(
            "content sharing",
            format!("could not read the policy: {e}"),
            "check that the Introspection service is enabled",
        ),
    }
    let cri = timed(c.has_cri()).await;
    match &cri {
        Ok(true) => r.pass(
            "CRI plugin",
            "loaded: replicas are confirmed with CRI ImageStatus",
        ),
        Ok(false) => r.warn(
            "CRI plugin",
            "not loaded: kubelet cannot use replicas and imgbridge cannot confirm they are visible",
            "remove \"cri\" from disabled_plugins in containerd's config and restart it",
        ),
        Err(e) => r.warn(
            "CRI plugin",
            format!("could not tell: {e}"),
            "check that the Introspection service is enabled",
        ),
    }
    let cri_loaded = matches!(cri, Ok(true));
    match cri {
        Ok(true) => snapshotters(config, &c, r).await,
        Ok(false) => r.pass("snapshotters", "not compared: the CRI plugin is not loaded"),
        Err(_) => r.pass(
            "snapshotters",
            "not compared: cannot tell whether the CRI plugin is loaded",
        ),
    }
    if cri_loaded {
        mirror::checks(&c, parsed, env.as_deref(), &config_candidates(sock), r).await;
    }
    true
}

/// Where the running version stands against [`TESTED`], plus 1.6's end of
/// upstream support (tested, because Debian 12 ships it, but unpatched).
fn version_matrix(version: &str, parsed: Option<(u64, u64, u64)>, r: &mut Report) {
    let what = "containerd version";
    let Some(v) = parsed else {
        r.warn(
            what,
            format!(
                "cannot parse {version:?}; imgbridge is tested on {}",
                tested_list(true)
            ),
            "report issues with this output",
        );
        return;
    };
    match matrix(v) {
        Matrix::Tested => {
            let rel = TESTED.iter().find(|t| (t.0, t.1) == (v.0, v.1)).map_or("", |t| t.2);
            r.pass(
                what,
                format!("{version} is in imgbridge's tested matrix ({}; tested on {rel})", tested_list(false)),
            );
        }
        Matrix::Untested => r.warn(
            what,
            format!("{version} is not in imgbridge's tested matrix ({}); expected to work", tested_list(false)),
            format!("report issues with this output; tested releases: {}", tested_list(true)),
        ),
        Matrix::TooOld => r.warn(
            what,
            format!("{version} predates imgbridge's tested matrix ({}): it has no CRI runtime.v1 API, which imgbridge confirms replicas with (and kubelet ≥ 1.26 needs), and is long out of upstream support", tested_list(false)),
            "upgrade containerd to 1.7 or 2.x",
        ),
    }
    if (v.0, v.1) == (1, 6) {
        r.warn(
            "containerd support",
            format!("1.6 is out of support upstream (end of life August 2025): {version} gets no more fixes"),
            "upgrade containerd to 1.7 or 2.x",
        );
    }
}

/// The Transfer gRPC service (`io.containerd.grpc.v1` `transfer`, backed by
/// `io.containerd.transfer.v1` `local`): clients that use it write images
/// server-side, with no Images call on the wire.
async fn transfer(c: &Containerd, version: &str, parsed: Option<(u64, u64, u64)>, r: &mut Report) {
    let what = "Transfer service";
    let uses = "ctr 2.x and nerdctl ≥ 2.3 import, pull and tag through Transfer";
    match timed(c.plugin_state("io.containerd.grpc.v1", "transfer")).await {
        Ok(PluginState::Loaded) => {
            // 1.7's Transfer stores images without publishing events.
            let events = if parsed.is_some_and(|v| (v.0, v.1) == (1, 7)) {
                "; containerd 1.7 publishes no image events for it, so a Transfer that bypasses imgbridge is only caught at its next start"
            } else {
                ""
            };
            r.pass(what, format!("present: {uses}; imgbridge intercepts it{events}"));
        }
        Ok(PluginState::Absent) if parsed.is_some_and(ships_transfer) => r.warn(
            what,
            format!("absent although containerd {version} ships it (disabled_plugins?): {uses} by default"),
            "remove io.containerd.grpc.v1.transfer and io.containerd.transfer.v1.local from disabled_plugins, or use ctr --local",
        ),
        Ok(PluginState::Absent) => r.pass(
            what,
            format!("absent (containerd {version}; it arrived in 1.7): clients write images through the Images API, which imgbridge intercepts"),
        ),
        Ok(PluginState::Failed(e)) => r.warn(
            what,
            format!("failed to load: {e}"),
            "see containerd's log; ctr --local avoids Transfer",
        ),
        Err(e) => r.warn(
            what,
            format!("could not tell: {e}"),
            "check that the Introspection service is enabled",
        ),
    }
}

/// The config file's `version` against what this containerd reads natively.
/// The file is not visible over the API: `env` (from [`CONFIG_ENV`]) names
/// it, else the first of `candidates` that exists; none found is not a fault.
fn containerd_config(
    version: &str,
    parsed: Option<(u64, u64, u64)>,
    env: Option<&Path>,
    candidates: &[PathBuf],
    r: &mut Report,
) {
    let what = "containerd config";
    let path = match env {
        Some(p) if !p.exists() => {
            r.warn(
                what,
                format!("{CONFIG_ENV}={}: no such file", p.display()),
                format!("point {CONFIG_ENV} at the file containerd runs with (its --config)"),
            );
            return;
        }
        Some(p) => p.to_path_buf(),
        None => match candidates.iter().find(|p| p.exists()) {
            Some(p) => p.clone(),
            None => {
                let tried: Vec<_> = candidates.iter().map(|p| p.display().to_string()).collect();
                r.pass(
                    what,
                    format!("not found (tried {}); cannot check its version (set {CONFIG_ENV} to its path)", tried.join(", ")),
                );
                return;
            }
        },
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => {
            r.pass(
                what,
                format!("{}: {e}; cannot check its version", path.display()),
            );
            return;
        }
    };
    let file = match config_file_version(&text) {
        Ok(v) => v,
        Err(e) => {
            r.warn(
                what,
                format!("{} does not parse: {e}", path.display()),
                format!("if containerd does not run with this file, set {CONFIG_ENV} to the one it does"),
            );
            return;
        }
    };
    let Some(native) = parsed.and_then(native_config_version) else {
        r.pass(
            what,
            format!(
                "{} has version = {file}; which version containerd {version} expects is unknown",
                path.display()
            ),
        );
        return;
    };
    let p = path.display();
    let major = parsed.map_or(0, |v| v.0);
    if file == native {
        r.pass(
            what,
            format!("{p} has version = {file}, which containerd {version} reads as is"),
        );
    } else if file > native {
        r.warn(
            what,
            format!("{p} has version = {file}, newer than containerd {version} reads (≤ {native}): this is probably not the file it runs with"),
            format!("set {CONFIG_ENV} to the file containerd runs with (its --config)"),
        );
    } else if major >= 2 {
        r.warn(
            what,
            format!("{p} has version = {file}: containerd {version} migrates it to version {native} with a warning on every start"),
            format!("containerd config migrate > config.new, review it, replace {p} and restart containerd"),
        );
    } else {
        r.warn(
            what,
            format!("{p} has version = {file} (deprecated): containerd {version} expects version = 2"),
            "rewrite it as version = 2 (containerd config default prints that layout); 2.x would migrate version 1 on every start",
        );
    }
}

/// CRI's snapshotter against each source namespace's. Snapshots belong to
/// one snapshotter and one namespace, so CRI unpacks every replica itself on
/// its first container start; a different snapshotter additionally keeps
/// the node's layers in two stores.
async fn snapshotters(config: &Config, c: &Containerd, r: &mut Report) {
    let what = "snapshotters";
    let cri = match cri_snapshotter_of(c).await {
        Ok(s) => s,
        Err(e) => {
            r.warn(
                what,
                format!("could not tell CRI's snapshotter: {e}"),
                "check containerd's log for CRI errors",
            );
            return;
        }
    };
    let mut sources = Vec::new();
    for ns in &config.replication.source_namespaces {
        let labels: Option<HashMap<String, String>> = match timed(c.namespace_labels(ns)).await {
            Ok(l) => l,
            Err(e) => {
                r.warn(
                    what,
                    format!("could not read namespace {ns}: {e}"),
                    "check containerd's log",
                );
                return;
            }
        };
        let (sn, why) = match labels.as_ref().and_then(|l| l.get(NS_SNAPSHOTTER_LABEL)) {
            Some(s) => (s.clone(), "namespace label"),
            None => (DEFAULT_SNAPSHOTTER.to_string(), "containerd's default"),
        };
        sources.push((ns.clone(), sn, why));
    }
    let mut described = vec![format!("CRI {cri}")];
    described.extend(
        sources
            .iter()
            .map(|(ns, sn, why)| format!("{ns} {sn} ({why})")),
    );
    let described = described.join(", ");
    if let Some((_, sn, _)) = sources.iter().find(|s| s.1 != cri) {
        r.warn(
            what,
            format!("{described}: fine, CRI unpacks each replica with {cri} on its first start either way (snapshots are per snapshotter and per namespace), but the node keeps layers in two snapshot stores"),
            format!("optional: build with {cri} too (buildkitd.toml [worker.containerd] snapshotter = \"{cri}\"; ctr/nerdctl follow the namespace label {NS_SNAPSHOTTER_LABEL}); {sn} keeps working"),
        );
    } else {
        r.pass(
            what,
            format!("{described}: the same; CRI still unpacks each replica on its first start (snapshots are per namespace)"),
        );
    }
}

/// CRI's snapshotter: from CRI Status's config (1.x), else by naming the
/// snapshotter whose root CRI reports as its image filesystem (2.x).
async fn cri_snapshotter_of(c: &Containerd) -> Result<String, String> {
    if let Some(s) = timed(c.cri_status_config())
        .await?
        .as_deref()
        .and_then(cri_snapshotter)
    {
        return Ok(s);
    }
    let fs = timed(c.cri_image_fs()).await?;
    let first = fs
        .first()
        .ok_or("CRI ImageFsInfo names no image filesystem")?;
    let roots = timed(c.snapshotter_roots()).await?;
    snapshotter_of_path(first, &roots)
        .ok_or_else(|| format!("no snapshotter has CRI's image filesystem {first} as its root"))
}

fn pinned(config: &Config, version: &str, r: &mut Report) {
    let wanted = config.replication.pin || config.import.pin;
    let what = "pinned label";
    let Some(v) = parse_version(version) else {
        r.warn(
            what,
            format!("cannot parse containerd version {version:?}"),
            "io.cri-containerd.pinned is honoured from 1.6.22 / 1.7.3 (fully from 1.6.25 / 1.7.10) and by 2.x",
        );
        return;
    };
    let upgrade = "upgrade containerd to ≥ 1.6.25, ≥ 1.7.10 or 2.x";
    match (pinned_support(v), wanted) {
        (PinnedSupport::Full, _) => r.pass(
            what,
            format!("containerd {version} honours io.cri-containerd.pinned"),
        ),
        (_, false) => r.pass(
            what,
            format!("containerd {version} would not fully honour io.cri-containerd.pinned, but pinning is off (replication.pin, import.pin)"),
        ),
        (PinnedSupport::Partial, true) => r.warn(
            what,
            format!("containerd {version} honours io.cri-containerd.pinned only when every reference of the image carries it (CRI cache merge fixed in 1.6.25 / 1.7.10)"),
            upgrade,
        ),
        (PinnedSupport::No, true) => r.warn(
            what,
            format!("containerd {version} ignores io.cri-containerd.pinned (added in 1.6.22 / 1.7.3): kubelet image GC may delete pinned replicas and imports under disk pressure"),
            upgrade,
        ),
    }
}

async fn namespaces(config: &Config, r: &mut Report) {
    let c = Containerd::new(&config.upstream);
    let list = timed(async {
        c.namespaces()
            .list(containerd_client::services::v1::ListNamespacesRequest::default())
            .await
    })
    .await;
    let present: Vec<String> = match list {
        Ok(l) => l
            .into_inner()
            .namespaces
            .into_iter()
            .map(|n| n.name)
            .collect(),
        Err(e) => {
            r.warn(
                "namespaces",
                format!("could not list: {e}"),
                "check containerd's logs",
            );
            return;
        }
    };
    let rep = &config.replication;
    let missing = |want: &[String]| -> Vec<String> {
        want.iter()
            .filter(|n| !present.contains(n))
            .cloned()
            .collect()
    };
    let ms = missing(&rep.source_namespaces);
    if ms.is_empty() {
        r.pass("source namespaces", rep.source_namespaces.join(", "));
    } else {
        r.warn(
            "source namespaces",
            format!("{} not present yet (nothing was built there)", ms.join(", ")),
            "point buildkit at imgbridge with [worker.containerd] namespace set to a source namespace; it is created on the first build",
        );
    }
    let mt = missing(&rep.target_namespaces);
    if mt.is_empty() {
        r.pass("target namespaces", rep.target_namespaces.join(", "));
    } else {
        r.warn(
            "target namespaces",
            format!("{} not present yet", mt.join(", ")),
            "k8s.io appears once the CRI plugin (kubelet) uses it; imgbridge creates targets on the first replication",
        );
    }
    protected::check(config, &c, r).await;
}

async fn proxy_socket(config: &Config, r: &mut Report) {
    let path = &config.listen;
    let what = "proxy socket";
    let m = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            r.warn(
                what,
                format!("{} does not exist: imgbridge is not running", path.display()),
                "systemctl enable --now imgbridge.socket imgbridge.service (or run imgbridge serve)",
            );
            return;
        }
        Err(e) => {
            r.fail(
                what,
                format!("{}: {e}", path.display()),
                "check the path and its directory's permissions",
            );
            return;
        }
    };
    if !m.file_type().is_socket() {
        r.fail(
            what,
            format!("{} exists but is not a socket", path.display()),
            "remove it, or choose another listen path",
        );
        return;
    }
    let mode = m.mode() & 0o777;
    let owner = format!("owner {}:{} mode {mode:04o}", m.uid(), m.gid());
    if mode & 0o006 != 0 {
        r.warn(
            what,
            format!("{} is world-accessible ({owner}): any local user can drive containerd as root", path.display()),
            "set socket_mode = \"0660\" (SocketMode=0660 in imgbridge.socket) and grant access through socket_group",
        );
    } else {
        r.pass(what, format!("{} ({owner})", path.display()));
    }
    let c = Containerd::new(path);
    match timed(c.version()).await {
        Ok(v) => r.pass(
            "proxy",
            format!("answers on {} and relays to containerd {v}", path.display()),
        ),
        Err(e) => r.fail(
            "proxy",
            format!("{} does not answer: {e}", path.display()),
            "start imgbridge (it replaces a stale socket file), or see journalctl -u imgbridge",
        ),
    }
}

fn watched_dirs(config: &Config, r: &mut Report) {
    for d in &config.import.dirs {
        let p = &d.path;
        let what = "watched directory";
        match std::fs::metadata(p) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => r.warn(
                what,
                format!(
                    "{} does not exist yet (it is picked up once created)",
                    p.display()
                ),
                format!("mkdir -p {}", p.display()),
            ),
            Err(e) => r.fail(
                what,
                format!("{}: {e}", p.display()),
                "fix the path's permissions",
            ),
            Ok(m) if !m.is_dir() => r.fail(
                what,
                format!("{} is not a directory", p.display()),
                "point import.dirs at a directory",
            ),
            Ok(_) => match std::fs::read_dir(p) {
                Ok(entries) => r.pass(
                    what,
                    format!(
                        "{} readable, {} entries → {}",
                        p.display(),
                        entries.count(),
                        d.namespace
                    ),
                ),
                Err(e) => r.fail(
                    what,
                    format!("{} is not readable: {e}", p.display()),
                    "let imgbridge (root) read it, e.g. chmod o+rx or fix the ACL",
                ),
            },
        }
    }
    if !config.import.dirs.is_empty() {
        state_dir(&config.import.state_file, r);
    }
}

fn state_dir(state_file: &Path, r: &mut Report) {
    let Some(dir) = state_file.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return;
    };
    let what = "import state";
    match nix::unistd::access(dir, nix::unistd::AccessFlags::W_OK) {
        Ok(()) => r.pass(what, format!("{} writable", dir.display())),
        Err(nix::errno::Errno::ENOENT) => r.warn(
            what,
            format!("{} does not exist", dir.display()),
            format!(
                "mkdir -p {} (the packaged unit has StateDirectory=imgbridge)",
                dir.display()
            ),
        ),
        Err(e) => r.fail(
            what,
            format!("{} is not writable: {e}", dir.display()),
            "make it writable for imgbridge (ReadWritePaths= in the unit)",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_versions() {
        assert_eq!(parse_version("1.6.20~ds1"), Some((1, 6, 20)));
        assert_eq!(parse_version("v1.7.3"), Some((1, 7, 3)));
        assert_eq!(parse_version("2.0.0-rc.1"), Some((2, 0, 0)));
        assert_eq!(parse_version("1.7.27-k3s1"), Some((1, 7, 27)));
        assert_eq!(parse_version("1.7"), Some((1, 7, 0)));
        assert_eq!(parse_version("v2.4.2"), Some((2, 4, 2)));
        assert_eq!(parse_version("2.1.9~ds1"), Some((2, 1, 9)));
        assert_eq!(parse_version("2.1.9+unknown"), Some((2, 1, 9)));
        assert_eq!(parse_version("1.7.24~ds1-5"), Some((1, 7, 24)));
        assert_eq!(parse_version("2.4.0-beta+unknown"), Some((2, 4, 0)));
        assert_eq!(parse_version("dev"), None);
        assert_eq!(parse_version(""), None);
    }

    #[test]
    fn classifies_versions_against_the_tested_matrix() {
        let m = |v| matrix(parse_version(v).unwrap());
        for v in [
            "1.6.20~ds1",
            "1.6.39",
            "v1.7.24",
            "1.7.0",
            "2.1.9+unknown",
            "v2.4.2",
            "2.4.0",
        ] {
            assert_eq!(m(v), Matrix::Tested, "{v}");
        }
        for v in ["2.0.0", "2.2.1", "v2.3.4", "2.5.0", "3.0.0", "1.8.0"] {
            assert_eq!(m(v), Matrix::Untested, "{v}");
        }
        for v in ["1.5.18", "1.4.13", "1.0.0", "0.2.9"] {
            assert_eq!(m(v), Matrix::TooOld, "{v}");
        }
        // Each tested release belongs to its own line.
        for &(ma, mi, rel) in TESTED {
            let v = parse_version(rel).unwrap();
            assert_eq!((v.0, v.1), (ma, mi), "{rel}");
        }
        assert_eq!(tested_list(false), "1.6, 1.7, 2.1, 2.4");
        assert_eq!(tested_list(true), "1.6.20, 1.7.24, 2.1.9, 2.4.2");
    }

    fn lines(r: &Report) -> Vec<String> {
        r.checks.iter().map(|c| c.to_string()).collect()
    }

    #[test]
    fn version_lines() {
        let run = |v: &str| {
            let mut r = Report::default();
            version_matrix(v, parse_version(v), &mut r);
            lines(&r)
        };
        let l = run("1.6.20~ds1");
        assert_eq!(l.len(), 2, "{l:?}");
        assert!(l[0].starts_with("✓ containerd version: 1.6.20~ds1 is in imgbridge's tested matrix (1.6, 1.7, 2.1, 2.4; tested on 1.6.20)"), "{l:?}");
        assert!(
            l[1].starts_with("! containerd support: 1.6 is out of support upstream")
                && l[1].contains("fix: upgrade containerd to 1.7 or 2.x"),
            "{l:?}"
        );
        let l = run("v2.4.2");
        assert_eq!(l.len(), 1, "{l:?}");
        assert!(l[0].contains("tested on 2.4.2"), "{l:?}");
        let l = run("2.2.1");
        assert_eq!(l, vec!["! containerd version: 2.2.1 is not in imgbridge's tested matrix (1.6, 1.7, 2.1, 2.4); expected to work — fix: report issues with this output; tested releases: 1.6.20, 1.7.24, 2.1.9, 2.4.2".to_string()]);
        let l = run("1.5.18");
        assert!(
            l[0].starts_with("! containerd version: 1.5.18 predates")
                && l[0].contains("runtime.v1")
                && l[0].ends_with("fix: upgrade containerd to 1.7 or 2.x"),
            "{l:?}"
        );
        let l = run("dev");
        assert!(
            l[0].starts_with("! containerd version: cannot parse \"dev\""),
            "{l:?}"
        );
    }

    #[test]
    fn transfer_ships_from_1_7() {
        let s = |v| ships_transfer(parse_version(v).unwrap());
        assert!(!s("1.6.20~ds1"));
        assert!(s("1.7.0"));
        assert!(s("2.1.9"));
        assert!(s("v2.4.2"));
    }

    #[test]
    fn native_config_version_by_release() {
        let n = |v| native_config_version(parse_version(v).unwrap());
        assert_eq!(n("1.6.20~ds1"), Some(2));
        assert_eq!(n("1.7.24~ds1-5"), Some(2));
        assert_eq!(n("2.0.0"), Some(3));
        assert_eq!(n("2.1.9~ds1"), Some(3));
        assert_eq!(n("2.2.1"), Some(3));
        assert_eq!(n("2.3.0"), Some(4));
        assert_eq!(n("v2.4.2"), Some(4));
        assert_eq!(n("3.0.0"), None);
    }

    #[test]
    fn reads_the_config_file_version() {
        let v2 = "version = 2\nroot = \"/var/lib/containerd\"\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  snapshotter = \"overlayfs\"\n";
        assert_eq!(config_file_version(v2), Ok(2));
        let v3 = "# comment\nversion = 3\n[plugins.'io.containerd.cri.v1.images']\n  snapshotter = 'overlayfs'\n";
        assert_eq!(config_file_version(v3), Ok(3));
        assert_eq!(config_file_version("[plugins.cri]\n"), Ok(1));
        assert_eq!(config_file_version(""), Ok(1));
        // `version` inside a table is not the file's version.
        assert_eq!(config_file_version("[plugins.x]\nversion = 4\n"), Ok(1));
        assert!(config_file_version("version = \"2\"\n").is_err());
        let e = config_file_version("version = 2\n[plugins\n").unwrap_err();
        assert!(!e.contains('\n'), "{e}");
    }

    #[test]
    fn config_candidates_follow_the_upstream_socket() {
        let first = |s: &str| config_candidates(Path::new(s))[0].clone();
        assert_eq!(
            first("/run/containerd/containerd.sock"),
            PathBuf::from("/etc/containerd/config.toml")
        );
        assert_eq!(
            first("/run/k3s/containerd/containerd.sock"),
            PathBuf::from("/var/lib/rancher/k3s/agent/etc/containerd/config.toml")
        );
        assert_eq!(
            first("/run/k0s/containerd.sock"),
            PathBuf::from("/etc/k0s/containerd.toml")
        );
        assert_eq!(
            config_candidates(Path::new("/x.sock")).len(),
            CONFIG_PATHS.len()
        );
    }

    #[test]
    fn config_lines() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let v1 = file("v1.toml", "[plugins.cri]\n");
        let v2 = file("v2.toml", "version = 2\n");
        let v3 = file("v3.toml", "version = 3\n");
        let bad = file("bad.toml", "version = = 2\n");
        let missing = dir.path().join("missing.toml");
        let run = |v: &str, env: Option<&Path>, candidates: &[PathBuf]| {
            let mut r = Report::default();
            containerd_config(v, parse_version(v), env, candidates, &mut r);
            assert_eq!(r.checks.len(), 1);
            lines(&r).remove(0)
        };
        let l = run("1.6.20~ds1", None, std::slice::from_ref(&missing));
        assert!(
            l.starts_with("✓ containerd config: not found (tried ")
                && l.contains("missing.toml")
                && l.contains(CONFIG_ENV),
            "{l}"
        );
        let l = run("1.6.20~ds1", None, &[missing.clone(), v2.clone()]);
        assert!(
            l.starts_with("✓ containerd config: ")
                && l.contains("v2.toml has version = 2, which containerd 1.6.20~ds1 reads as is"),
            "{l}"
        );
        // The override wins over the candidates, and a wrong one is reported.
        let l = run("2.1.9~ds1", Some(&v3), std::slice::from_ref(&v2));
        assert!(
            l.starts_with("✓ containerd config: ") && l.contains("v3.toml has version = 3"),
            "{l}"
        );
        let l = run("2.1.9~ds1", Some(&missing), std::slice::from_ref(&v2));
        assert!(
            l.starts_with(&format!("! containerd config: {CONFIG_ENV}="))
                && l.contains("no such file"),
            "{l}"
        );
        let l = run("2.1.9~ds1", Some(&v2), &[]);
        assert!(l.starts_with("! containerd config: ") && l.contains("version = 2: containerd 2.1.9~ds1 migrates it to version 3 with a warning on every start — fix: containerd config migrate"), "{l}");
        let l = run("v2.4.2", Some(&v3), &[]);
        assert!(
            l.starts_with("! containerd config: ") && l.contains("migrates it to version 4"),
            "{l}"
        );
        let l = run("1.7.24~ds1-5", Some(&v3), &[]);
        assert!(
            l.starts_with("! containerd config: ")
                && l.contains("newer than containerd 1.7.24~ds1-5 reads (≤ 2)"),
            "{l}"
        );
        let l = run("1.7.24~ds1-5", Some(&v1), &[]);
        assert!(
            l.starts_with("! containerd config: ") && l.contains("version = 1 (deprecated)"),
            "{l}"
        );
        let l = run("1.7.24~ds1-5", Some(&bad), &[]);
        assert!(
            l.starts_with("! containerd config: ") && l.contains("does not parse"),
            "{l}"
        );
        let l = run("3.0.0", Some(&v3), &[]);
        assert!(
            l.starts_with("✓ containerd config: ") && l.contains("unknown"),
            "{l}"
        );
    }

    /// Trimmed from CRI `Status{verbose}` `info["config"]` on containerd 1.6.20.
    const STATUS_1_6: &str = r#"{"containerd":{"snapshotter":"overlayfs","defaultRuntimeName":"runc","defaultRuntime":{"runtimeType":""},"runtimes":{"runc":{"runtimeType":"io.containerd.runc.v2"}},"noPivot":false},"cni":{"binDir":"/opt/cni/bin"},"sandboxImage":"registry.k8s.io/pause:3.6","containerdRootDir":"/var/lib/containerd"}"#;

    #[test]
    fn cri_snapshotter_from_status_config() {
        assert_eq!(cri_snapshotter(STATUS_1_6).as_deref(), Some("overlayfs"));
        // 1.7+: the default runtime's own snapshotter wins.
        let per_runtime = STATUS_1_6.replace(
            r#""runtimeType":"io.containerd.runc.v2""#,
            r#""runtimeType":"io.containerd.runc.v2","snapshotter":"native""#,
        );
        assert_eq!(cri_snapshotter(&per_runtime).as_deref(), Some("native"));
        // 2.x: no global snapshotter here, an empty per-runtime one.
        let v2 = r#"{"containerd":{"defaultRuntimeName":"runc","runtimes":{"runc":{"runtimeType":"io.containerd.runc.v2","snapshotter":""}}},"containerdRootDir":"/var/lib/containerd"}"#;
        assert_eq!(cri_snapshotter(v2), None);
        assert_eq!(cri_snapshotter("not json"), None);
        assert_eq!(cri_snapshotter("{}"), None);
    }

    #[test]
    fn names_the_snapshotter_of_a_path() {
        let roots = vec![
            (
                "overlayfs".to_string(),
                "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs".to_string(),
            ),
            ("fuse".to_string(), "/data/fuse-root/".to_string()),
        ];
        assert_eq!(
            snapshotter_of_path(
                "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs",
                &roots
            )
            .as_deref(),
            Some("overlayfs")
        );
        assert_eq!(
            snapshotter_of_path("/data/fuse-root", &roots).as_deref(),
            Some("fuse")
        );
        assert_eq!(
            snapshotter_of_path("/x/io.containerd.snapshotter.v1.native/", &[]).as_deref(),
            Some("native")
        );
        assert_eq!(
            snapshotter_of_path("/x/io.containerd.snapshotter.v1.", &[]),
            None
        );
        assert_eq!(snapshotter_of_path("/x/elsewhere", &roots), None);
    }

    #[test]
    fn pinned_support_by_version() {
        let s = |v| pinned_support(parse_version(v).unwrap());
        assert_eq!(s("1.6.20~ds1"), PinnedSupport::No);
        assert_eq!(s("1.6.21"), PinnedSupport::No);
        assert_eq!(s("1.6.22"), PinnedSupport::Partial);
        assert_eq!(s("1.6.25"), PinnedSupport::Full);
        assert_eq!(s("1.7.2"), PinnedSupport::No);
        assert_eq!(s("1.7.3"), PinnedSupport::Partial);
        assert_eq!(s("1.7.10"), PinnedSupport::Full);
        assert_eq!(s("1.5.18"), PinnedSupport::No);
        assert_eq!(s("2.0.0"), PinnedSupport::Full);
        assert_eq!(s("2.2.1"), PinnedSupport::Full);
    }

    #[test]
    fn multi_line_errors_become_one_line() {
        let e = Config::from_toml("[replication]\npinn = true\n", Path::new("c.toml")).unwrap_err();
        let l = one_line(&e.to_string());
        assert!(!l.contains('\n'), "{l}");
        assert!(
            l.contains("pinn = true") && l.contains("unknown field `pinn`"),
            "{l}"
        );
        assert_eq!(one_line("1.6 is old\n2 | quoted\n"), "1.6 is old quoted");
    }

    #[test]
    fn renders_one_line_per_check() {
        let mut r = Report::default();
        r.pass("a", "fine");
        r.warn("b", "meh", "do x");
        assert!(!r.failed());
        r.fail("c", "broken", "do y");
        assert!(r.failed());
        let s = r.to_string();
        assert!(
            s.contains("✓ a: fine\n! b: meh — fix: do x\n✗ c: broken — fix: do y\n"),
            "{s}"
        );
        assert!(s.ends_with("1 ok, 1 warnings, 1 failed\n"));
    }

    #[tokio::test]
    async fn missing_upstream_fails() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            upstream: dir.path().join("none.sock"),
            listen: dir.path().join("ib.sock"),
            ..Config::default()
        };
        let r = run(&config, None).await;
        assert!(r.failed());
        let s = r.to_string();
        assert!(s.contains("✗ upstream:"), "{s}");
        assert!(s.contains("! proxy socket:"), "{s}");
    }
}
