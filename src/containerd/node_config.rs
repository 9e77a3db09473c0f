//! containerd's own config file on this node. It is not visible over the
//! API, so the parts imgbridge needs from it (doctor's checks, CRI's sandbox
//! image on 2.x) are read from the file: `$IMGBRIDGE_CONTAINERD_CONFIG`
//! ([`CONFIG_ENV`]) if set, else the first of [`CONFIG_PATHS`] that exists.

use std::path::{Path, PathBuf};

/// Environment variable naming containerd's config file, for nodes where it
/// is not at one of [`CONFIG_PATHS`].
pub const CONFIG_ENV: &str = "IMGBRIDGE_CONTAINERD_CONFIG";

/// Where containerd's config file usually is: stock packages, k3s, k0s.
pub const CONFIG_PATHS: &[&str] = &[
    "/etc/containerd/config.toml",
    "/var/lib/rancher/k3s/agent/etc/containerd/config.toml",
    "/etc/k0s/containerd.toml",
];

/// Where to look for containerd's config: [`CONFIG_PATHS`], with the one
/// matching the upstream socket's distribution (k3s, k0s) first.
pub fn candidates(upstream: &Path) -> Vec<PathBuf> {
    let up = upstream.to_string_lossy();
    let mut paths: Vec<&str> = CONFIG_PATHS.to_vec();
    for hint in ["k3s", "k0s"] {
        if up.contains(hint) {
            paths.sort_by_key(|p| !p.contains(hint));
        }
    }
    paths.into_iter().map(PathBuf::from).collect()
}

/// The config file to read: `env` if set, else the first candidate that
/// exists.
pub fn locate(env: Option<&Path>, candidates: &[PathBuf]) -> Option<PathBuf> {
    match env {
        Some(p) => Some(p.to_path_buf()),
        None => candidates.iter().find(|p| p.exists()).cloned(),
    }
}

/// [`locate`] with [`CONFIG_ENV`] from the environment.
pub fn locate_for(upstream: &Path) -> Option<PathBuf> {
    let env = std::env::var_os(CONFIG_ENV).map(PathBuf::from);
    locate(env.as_deref(), &candidates(upstream))
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
