//! Globs over normalised image names, for `replication.protect` and
//! `replication.overwrite` ([docs/protected-names.md](../docs/protected-names.md)):
//! their own home because both the config's validation and the replicator's
//! protection check use them.

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};

/// Compiled globs over normalised image names: `*` stays within a path
/// segment, `**` (a whole segment) crosses them.
#[derive(Clone, Debug, Default)]
pub struct Globs {
    patterns: Vec<String>,
    set: GlobSet,
}

impl Globs {
    pub fn new(patterns: &[String]) -> Result<Globs, globset::Error> {
        let mut b = GlobSetBuilder::new();
        for p in patterns {
            b.add(GlobBuilder::new(p).literal_separator(true).build()?);
        }
        Ok(Globs {
            patterns: patterns.to_vec(),
            set: b.build()?,
        })
    }

    /// The first pattern (in the order written) that matches `name`.
    pub fn first_match(&self, name: &str) -> Option<&str> {
        if self.patterns.is_empty() {
            return None;
        }
        let hits = self.set.matches(name);
        hits.iter().min().map(|&i| self.patterns[i].as_str())
    }

    pub fn patterns(&self) -> &[String] {
        &self.patterns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn globs(p: &[&str]) -> Vec<String> {
        p.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn globs_match_segments_as_documented() {
        let g = Globs::new(&globs(&[
            "registry.k8s.io/**",
            "docker.io/rancher/mirrored-*",
        ]))
        .unwrap();
        for hit in [
            "registry.k8s.io/pause:3.6",
            "registry.k8s.io/sig-storage/csi-provisioner:v5",
        ] {
            assert_eq!(g.first_match(hit), Some("registry.k8s.io/**"), "{hit}");
        }
        assert_eq!(
            g.first_match("docker.io/rancher/mirrored-pause:3.6"),
            Some("docker.io/rancher/mirrored-*")
        );
        for miss in [
            "docker.io/rancher/mirrored/pause:3.6",
            "docker.io/library/app:dev",
            "registry.k8s.io.evil/pause:1",
        ] {
            assert_eq!(g.first_match(miss), None, "{miss}");
        }
        assert!(Globs::new(&globs(&["registry.k8s.io/[pause"])).is_err());
        assert_eq!(Globs::default().first_match("anything"), None);
    }
}
