//! CRI's registry settings, as the running containerd reports them or its
//! config file sets them, and the `hosts.toml` files they point at: pure
//! parsing, checked against captured and hand-written inputs.

use std::path::{Path, PathBuf};

use crate::ops::doctor::report::one_line;

/// 2.2+'s `config_path` when the file sets none (and no `mirrors`).
const DEFAULT_CONFIG_PATH_2_2: &str = "/etc/containerd/certs.d:/etc/docker/certs.d";

/// How CRI pulls images, which decides how it reads `config_path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PullPath {
    /// The client pull (1.x, 2.0, or 2.1+ with `use_local_image_pull` or a
    /// setting that forces it): `config_path` is a `:`-separated list.
    Local(String),
    /// 2.1+'s default: the Transfer service, which takes `config_path` as
    /// one directory (<https://github.com/containerd/containerd/issues/12415>).
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
    pub(super) fn config_path_line(&self, dir: &str) -> String {
        if self.v1_layout {
            format!("[plugins.\"io.containerd.grpc.v1.cri\".registry] config_path = \"{dir}\"")
        } else {
            format!("[plugins.\"io.containerd.cri.v1.images\".registry] config_path = \"{dir}\"")
        }
    }

    pub(super) fn discard_line(&self) -> &'static str {
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
    let t: toml::Table = toml::from_str(text).map_err(|e| one_line(&e.to_string()))?;
    let file_version = t.get("version").and_then(|v| v.as_integer()).unwrap_or(1);
    let images = migrated_images(&t, file_version);
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

/// `io.containerd.cri.v1.images` as containerd sees it: from a version 1/2
/// file, with the keys it migrates from `io.containerd.grpc.v1.cri`.
fn migrated_images(t: &toml::Table, file_version: i64) -> toml::Table {
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
    images
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
    let t: toml::Table = toml::from_str(text).map_err(|e| one_line(&e.to_string()))?;
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

/// The config file's non-empty `imports = [...]`, as written.
pub(super) fn imports(text: &str) -> Option<String> {
    let t: toml::Table = toml::from_str(text).ok()?;
    let list: Vec<&str> = t
        .get("imports")?
        .as_array()?
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    (!list.is_empty()).then(|| list.join(", "))
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
}
