//! The distribution-source content label on a replica's blobs: registry
//! mirrors that serve what a node holds (spegel, k3s's embedded mirror)
//! advertise a blob only under the repositories this label names, so a
//! replica built locally (no pull ever wrote the label) would be served by
//! tag but none of its blobs (spegel-org/spegel#1096, k3s-io/k3s#13222).

use crate::labels::DISTRIBUTION_SOURCE;
use crate::reference::Reference;

/// `(containerd.io/distribution.source.<host>, <repository>)` for `image`;
/// `None` for a name that is no reference.
pub(super) fn source(image: &str) -> Option<(String, String)> {
    let r = Reference::parse(image).ok()?;
    Some((format!("{DISTRIBUTION_SOURCE}.{}", r.domain), r.path))
}

/// `a` and `b` (comma-separated repository lists) as one sorted list without
/// duplicates, as containerd writes the label.
pub(super) fn merge(a: &str, b: &str) -> String {
    let mut all: Vec<&str> = a
        .split(',')
        .chain(b.split(','))
        .filter(|r| !r.is_empty())
        .collect();
    all.sort_unstable();
    all.dedup();
    all.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_of_a_normalised_name() {
        let k = |s: &str| source(s).unwrap();
        assert_eq!(
            k("app:dev"),
            (
                "containerd.io/distribution.source.docker.io".into(),
                "library/app".into()
            )
        );
        assert_eq!(
            k("127.0.0.1:5000/team/app@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"),
            (
                "containerd.io/distribution.source.127.0.0.1:5000".into(),
                "team/app".into()
            )
        );
        assert_eq!(source("Not A Name"), None);
    }

    #[test]
    fn repositories_merge_sorted_once() {
        assert_eq!(
            merge("library/b,library/a", "library/a"),
            "library/a,library/b"
        );
        assert_eq!(merge("", "library/a"), "library/a");
    }
}
