//! Which entries of an index a pod on this node could run: containerd's
//! default platform matcher, as its CRI uses it.
//!
//! CRI resolves an image with `platforms.Default()`, on Linux
//! `platforms.Only(DefaultSpec())` (module `github.com/containerd/platforms`),
//! and `images.Manifest` takes, of the entries that matcher accepts or that
//! carry no platform, the first in the matcher's order (entries without a
//! platform last, ties to the earlier entry). A pull for this node's
//! platform (`ctr pull`, CRI, Transfer) fetches that same entry and none of
//! the others.
//!
//! Written by hand: no Rust crate implements containerd's matcher.
//! `oci-spec` has the `Platform` type only, and `oci-client`'s
//! `current_platform_resolver` compares os/arch exactly (no variants, no
//! `386` under `amd64`, no `arm/v7` under `arm64`). This follows
//! `platformVector`, `Normalize` and `matcher.Match` of that module
//! (v1.0.0-rc); on amd64 and arm64/v8 nodes every containerd of the tested
//! matrix (1.6 to 2.4) matches the same way.

use std::sync::OnceLock;

/// A platform in containerd's normalised form (`Normalize`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Platform {
    os: String,
    arch: String,
    variant: String,
}

impl Platform {
    /// Normalises as containerd does: `aarch64` is `arm64`, `arm64/v8` is
    /// `arm64`, `arm` alone is `arm/v7`, `x86_64` is `amd64`, an empty OS
    /// is `linux` (the only OS imgbridge runs on).
    pub fn new(os: &str, arch: &str, variant: &str) -> Platform {
        let os = match os.to_ascii_lowercase().as_str() {
            "" => "linux".to_string(),
            "macos" => "darwin".to_string(),
            o => o.to_string(),
        };
        let (arch, variant) = (arch.to_ascii_lowercase(), variant.to_ascii_lowercase());
        let (arch, variant) = match (arch.as_str(), variant.as_str()) {
            ("i386", _) => ("386", String::new()),
            ("x86_64" | "x86-64" | "amd64", "v1") => ("amd64", String::new()),
            ("x86_64" | "x86-64" | "amd64", _) => ("amd64", variant),
            ("aarch64" | "arm64", "8" | "v8" | "v8.0") => ("arm64", String::new()),
            ("aarch64" | "arm64", "9" | "9.0" | "v9.0") => ("arm64", "v9".to_string()),
            ("aarch64" | "arm64", _) => ("arm64", variant),
            ("armhf", _) => ("arm", "v7".to_string()),
            ("armel", _) => ("arm", "v6".to_string()),
            ("arm", "" | "7") => ("arm", "v7".to_string()),
            ("arm", "5" | "6" | "8") => ("arm", format!("v{variant}")),
            (a, _) => (a, variant),
        };
        Platform {
            os,
            arch: arch.to_string(),
            variant,
        }
    }

    /// This node's platform as containerd's `DefaultSpec()` gives it, if
    /// its architecture has a GOARCH name.
    fn node() -> Option<Platform> {
        let arch = go_arch()?;
        let variant = match arch {
            // containerd reads /proc/cpuinfo, which says `8` on every arm64.
            "arm64" => "v8".to_string(),
            "arm" => arm_variant(),
            _ => String::new(),
        };
        Some(Platform::new(std::env::consts::OS, arch, &variant))
    }
}

/// This host's architecture as containerd names it (Go's GOARCH), if known.
pub fn go_arch() -> Option<&'static str> {
    Some(match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "arm" => "arm",
        "powerpc64" if cfg!(target_endian = "little") => "ppc64le",
        "powerpc64" => "ppc64",
        "s390x" => "s390x",
        "riscv64" => "riscv64",
        "loongarch64" => "loong64",
        _ => return None,
    })
}

/// A 32-bit ARM CPU's variant as containerd's `getCPUVariant` reads it
/// (`CPU architecture` in /proc/cpuinfo); `v7` when unreadable, as
/// containerd's normalisation of an empty variant gives.
fn arm_variant() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = cpuinfo.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("CPU architecture")
            .then(|| v.trim().to_ascii_lowercase())
    });
    match field.as_deref() {
        Some("8" | "aarch64") => "v8",
        Some("6" | "6tej") => "v6",
        Some("5" | "5t" | "5te" | "5tej") => "v5",
        _ => "v7",
    }
    .to_string()
}

/// arm64 variants and the (major, minor) ranges each also runs
/// (`arm64variantToVersion`): v9.x runs v9.0..x and v8.0..x+5.
fn arm64_versions(variant: &str) -> Option<&'static [(u32, u32)]> {
    Some(match variant {
        "v8" | "v8.0" => &[(8, 0)],
        "v8.1" => &[(8, 1)],
        "v8.2" => &[(8, 2)],
        "v8.3" => &[(8, 3)],
        "v8.4" => &[(8, 4)],
        "v8.5" => &[(8, 5)],
        "v8.6" => &[(8, 6)],
        "v8.7" => &[(8, 7)],
        "v8.8" => &[(8, 8)],
        "v8.9" => &[(8, 9)],
        "v9" | "v9.0" => &[(9, 0), (8, 5)],
        "v9.1" => &[(9, 1), (8, 6)],
        "v9.2" => &[(9, 2), (8, 7)],
        "v9.3" => &[(9, 3), (8, 8)],
        "v9.4" => &[(9, 4), (8, 9)],
        "v9.5" => &[(9, 5), (8, 9)],
        "v9.6" => &[(9, 6), (8, 9)],
        "v9.7" => &[(9, 7), (8, 9)],
        _ => return None,
    })
}

/// `platforms.Only(host)`: the platforms it accepts, most preferred first.
#[derive(Clone, Debug)]
pub struct Matcher {
    vector: Vec<Platform>,
}

impl Matcher {
    /// The matcher for `host` (`platformVector`).
    pub fn only(host: Platform) -> Matcher {
        Matcher {
            vector: vector(host),
        }
    }

    /// The matcher for this node, or `None` on an architecture without a
    /// GOARCH name (then every entry counts as needed).
    pub fn node() -> Option<&'static Matcher> {
        static NODE: OnceLock<Option<Matcher>> = OnceLock::new();
        NODE.get_or_init(|| Platform::node().map(Matcher::only))
            .as_ref()
    }

    /// Where `p` stands in the preference order; `None`: not accepted.
    /// `os.version` counts on Windows only; `os.features` (which no Linux
    /// image carries, and `oci-spec` 0.10 does not read) is not compared.
    pub fn rank(&self, p: &oci_spec::image::Platform) -> Option<usize> {
        let p = Platform::new(
            &p.os().to_string(),
            &p.architecture().to_string(),
            p.variant().as_deref().unwrap_or(""),
        );
        self.vector.iter().position(|v| *v == p)
    }

    /// The entry of an index (given by its platforms) that containerd's
    /// `images.Manifest` resolves with this matcher: the best-ranked match,
    /// entries without a platform after every match, ties to the earlier.
    pub fn select(&self, entries: &[Option<&oci_spec::image::Platform>]) -> Option<usize> {
        entries
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match p {
                None => Some((self.vector.len(), i)),
                Some(p) => self.rank(p).map(|r| (r, i)),
            })
            .min()
            .map(|(_, i)| i)
    }
}

/// `platformVector` of a normalised `host`, each element normalised as
/// `NewMatcher` does.
fn vector(host: Platform) -> Vec<Platform> {
    let same = |arch: &str, variant: &str| Platform::new(&host.os, arch, variant);
    let level = |variant: &str| {
        variant
            .strip_prefix('v')
            .and_then(|n| n.parse::<u32>().ok())
    };
    match host.arch.as_str() {
        "amd64" => {
            let mut v = vec![host.clone()];
            if let Some(n) = level(&host.variant).filter(|n| *n > 1) {
                v.extend((1..n).rev().map(|k| same("amd64", &format!("v{k}"))));
            }
            v.push(same("386", ""));
            v
        }
        "arm" => {
            let mut v = vec![host.clone()];
            if let Some(n) = level(&host.variant).filter(|n| *n > 5) {
                v.extend((5..n).rev().map(|k| same("arm", &format!("v{k}"))));
            }
            v
        }
        "arm64" => {
            let variant = match host.variant.as_str() {
                "" => "v8",
                v => v,
            };
            let mut v = Vec::new();
            for &(major, top) in arm64_versions(variant).unwrap_or(&[]) {
                for minor in (0..=top).rev() {
                    let name = match minor {
                        0 => format!("v{major}"),
                        m => format!("v{major}.{m}"),
                    };
                    v.push(same("arm64", &name));
                }
            }
            // Every arm64 v8.x and v9.x also runs arm/v8 and below.
            let arm = if variant.starts_with("v8") || variant.starts_with("v9") {
                "v8"
            } else {
                variant
            };
            v.extend(vector(same("arm", arm)));
            v
        }
        _ => vec![host],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(s: &str) -> oci_spec::image::Platform {
        let mut parts = s.split('/');
        let (os, arch) = (parts.next().unwrap(), parts.next().unwrap());
        let mut p = serde_json::json!({"os": os, "architecture": arch});
        if let Some(v) = parts.next() {
            p["variant"] = v.into();
        }
        serde_json::from_value(p).unwrap()
    }

    fn only(s: &str) -> Matcher {
        let mut parts = s.split('/');
        let (os, arch) = (parts.next().unwrap(), parts.next().unwrap());
        Matcher::only(Platform::new(os, arch, parts.next().unwrap_or("")))
    }

    /// containerd's own `TestOnly` table (compare_test.go), Linux rows.
    #[test]
    fn only_matches_as_containerd() {
        let table: &[(&str, &[&str], &[&str])] = &[
            (
                "linux/amd64",
                &["linux/amd64", "linux/386", "linux/x86_64", "linux/amd64/v1"],
                &[
                    "linux/amd64/v2",
                    "linux/arm/v7",
                    "linux/arm64",
                    "windows/amd64",
                    "windows/arm",
                ],
            ),
            (
                "linux/amd64/v2",
                &[
                    "linux/amd64",
                    "linux/amd64/v1",
                    "linux/amd64/v2",
                    "linux/386",
                ],
                &["linux/amd64/v3", "linux/amd64/v4", "linux/arm64"],
            ),
            (
                "linux/386",
                &["linux/386"],
                &["linux/amd64", "linux/arm/v7", "linux/arm64"],
            ),
            (
                "linux/arm/v8",
                &[
                    "linux/arm",
                    "linux/arm/v5",
                    "linux/arm/v6",
                    "linux/arm/v7",
                    "linux/arm/v8",
                ],
                &["linux/amd64", "linux/arm/v4", "linux/arm64", "windows/arm"],
            ),
            (
                "linux/arm/v7",
                &["linux/arm", "linux/arm/v5", "linux/arm/v6", "linux/arm/v7"],
                &["linux/arm/v4", "linux/arm/v8", "linux/arm64"],
            ),
            (
                "linux/arm/v6",
                &["linux/arm/v5", "linux/arm/v6"],
                &["linux/arm", "linux/arm/v7", "linux/arm/v8"],
            ),
            (
                "linux/arm/v5",
                &["linux/arm/v5"],
                &["linux/arm", "linux/arm/v4", "linux/arm/v6"],
            ),
            (
                "linux/arm64",
                &[
                    "linux/arm",
                    "linux/arm/v5",
                    "linux/arm/v6",
                    "linux/arm/v7",
                    "linux/arm/v8",
                    "linux/arm64",
                    "linux/arm64/v8",
                    "linux/aarch64",
                ],
                &[
                    "linux/amd64",
                    "linux/arm/v4",
                    "linux/arm/v9",
                    "linux/arm64/v9",
                    "linux/arm64/v8.1",
                    "windows/arm64",
                ],
            ),
            (
                "linux/arm64/v8.1",
                &[
                    "linux/arm",
                    "linux/arm/v8",
                    "linux/arm64",
                    "linux/arm64/v8.1",
                ],
                &["linux/arm/v9", "linux/arm64/v9", "linux/arm64/v8.2"],
            ),
            (
                "linux/arm64/v9",
                &[
                    "linux/arm/v8",
                    "linux/arm64",
                    "linux/arm64/v8.5",
                    "linux/arm64/v9",
                    "linux/arm64/v9.0",
                ],
                &["linux/arm64/v8.6", "linux/arm64/v9.1", "linux/amd64"],
            ),
            (
                "linux/arm64/v9.6",
                &["linux/arm/v5", "linux/arm64/v8.9", "linux/arm64/v9.6"],
                &["linux/arm/v4", "linux/arm64/v8.10", "linux/arm64/v9.7"],
            ),
            (
                "linux/s390x",
                &["linux/s390x"],
                &["linux/amd64", "linux/arm64", "windows/s390x"],
            ),
        ];
        for (host, yes, no) in table {
            let m = only(host);
            for p in *yes {
                assert!(m.rank(&spec(p)).is_some(), "Only({host}) matches {p}");
            }
            for p in *no {
                assert!(m.rank(&spec(p)).is_none(), "Only({host}) rejects {p}");
            }
        }
    }

    /// The entry CRI resolves: best match first, no platform after every
    /// match, the earlier of equals; none when nothing could run.
    #[test]
    fn select_takes_what_cri_resolves() {
        let sel = |host: &str, entries: &[Option<&str>]| {
            let specs: Vec<_> = entries.iter().map(|e| e.map(spec)).collect();
            let refs: Vec<_> = specs.iter().map(Option::as_ref).collect();
            only(host).select(&refs)
        };
        let amd = Some("linux/amd64");
        let (i386, arm64, s390x) = (Some("linux/386"), Some("linux/arm64"), Some("linux/s390x"));
        let attestation = Some("unknown/unknown");
        assert_eq!(sel("linux/amd64", &[arm64, amd, s390x]), Some(1));
        assert_eq!(
            sel("linux/amd64", &[i386, amd]),
            Some(1),
            "386 only as fallback"
        );
        assert_eq!(sel("linux/amd64", &[arm64, i386]), Some(1));
        assert_eq!(sel("linux/amd64", &[amd, attestation]), Some(0));
        assert_eq!(
            sel("linux/amd64", &[None, amd]),
            Some(1),
            "no platform last"
        );
        assert_eq!(sel("linux/amd64", &[arm64, None]), Some(1));
        assert_eq!(sel("linux/amd64", &[arm64, s390x, attestation]), None);
        assert_eq!(
            sel("linux/amd64", &[amd, amd]),
            Some(0),
            "the earlier of equals"
        );
        assert_eq!(
            sel("linux/amd64", &[Some("linux/amd64/v3"), amd]),
            Some(1),
            "amd64/v3 does not run on a v1 node"
        );
        let arm7 = Some("linux/arm/v7");
        assert_eq!(sel("linux/arm64", &[arm7, Some("linux/arm64/v8")]), Some(1));
        assert_eq!(sel("linux/arm64", &[arm7, Some("linux/arm/v6")]), Some(0));
        assert_eq!(sel("linux/arm/v7", &[Some("linux/arm/v6"), arm7]), Some(1));
    }
}
