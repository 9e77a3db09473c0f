//! containerd's config file: its `version` against what the running
//! release reads natively. The file is not visible over the API, so it is
//! read from disk ([`CONFIG_ENV`], else the first of the candidates).

use std::path::{Path, PathBuf};

use crate::ops::doctor::report::{one_line, Report};
use crate::ops::doctor::versions::Version;
use crate::ops::doctor::CONFIG_ENV;

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

/// The config file's `version` against what this containerd reads natively.
/// The file is not visible over the API: `env` (from [`CONFIG_ENV`]) names
/// it, else the first of `candidates` that exists; none found is not a fault.
pub(in crate::ops::doctor) fn containerd_config(
    version: &str,
    parsed: Option<Version>,
    env: Option<&Path>,
    candidates: &[PathBuf],
    r: &mut Report,
) {
    let what = "containerd config";
    let Some((path, file)) = read_version(env, candidates, r) else {
        return;
    };
    let Some(native) = parsed.and_then(Version::native_config_version) else {
        r.pass(
            what,
            format!(
                "{} has version = {file}; which version containerd {version} expects is unknown",
                path.display()
            ),
        );
        return;
    };
    compare(&path, file, native, version, parsed, r);
}

/// The config file and its `version`; `None` (reported) when there is no
/// file to read or it does not parse.
fn read_version(
    env: Option<&Path>,
    candidates: &[PathBuf],
    r: &mut Report,
) -> Option<(PathBuf, i64)> {
    let what = "containerd config";
    let path = match env {
        Some(p) if !p.exists() => {
            r.warn(
                what,
                format!("{CONFIG_ENV}={}: no such file", p.display()),
                format!("point {CONFIG_ENV} at the file containerd runs with (its --config)"),
            );
            return None;
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
                return None;
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
            return None;
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
            return None;
        }
    };
    Some((path, file))
}

/// The file's `version` against the `native` one of this containerd.
fn compare(
    path: &Path,
    file: i64,
    native: i64,
    version: &str,
    parsed: Option<Version>,
    r: &mut Report,
) {
    let what = "containerd config";
    let p = path.display();
    let major = parsed.map_or(0, |v| v.major);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::doctor::{config_candidates, CONFIG_PATHS};

    fn lines(r: &Report) -> Vec<String> {
        r.checks.iter().map(|c| c.to_string()).collect()
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
            containerd_config(v, Version::parse(v), env, candidates, &mut r);
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
}
