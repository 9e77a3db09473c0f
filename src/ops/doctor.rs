//! `imgbridge doctor`: checks a node and says what to fix, one line per
//! check: `✓` fine, `!` works but worth fixing, `✗` broken (exit status 1).

use std::fmt::{self, Display};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::time::Duration;

use crate::config::Config;
use crate::containerd::Containerd;

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
            l.trim()
                .trim_start_matches(|c: char| c.is_ascii_digit())
                .trim_start_matches([' ', '|'])
                .trim()
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

/// `(major, minor, patch)` from containerd version strings such as
/// `1.6.20~ds1`, `v1.7.3`, `2.0.0-rc.1` or `1.7.27-k3s1`.
pub fn parse_version(v: &str) -> Option<(u64, u64, u64)> {
    let v = v.trim().trim_start_matches('v');
    let end = v
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(v.len());
    let mut it = v[..end].split('.').filter(|s| !s.is_empty());
    let major = it.next()?.parse().ok()?;
    let minor = it.next()?.parse().ok()?;
    let patch = it.next().map_or(Some(0), |p| p.parse().ok())?;
    Some((major, minor, patch))
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
    pinned(config, &version, r);
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
    match timed(c.has_cri()).await {
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
    true
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
        assert_eq!(parse_version("dev"), None);
        assert_eq!(parse_version(""), None);
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
