//! The distribution-source content label on a replica's blobs: registry
//! mirrors that serve what a node holds (spegel, k3s's embedded mirror)
//! advertise a blob only if it names a registry, so a replica built locally
//! (no pull ever wrote the label) would be served by tag but none of its
//! blobs (spegel-org/spegel#1096, k3s-io/k3s#13222).
//!
//! One repository per registry is enough: spegel advertises the digest
//! (the repository only feeds its registry filters). So a label already
//! there (a pull's, or another replica's) is kept, never extended: a blob
//! shared by many names would otherwise outgrow containerd's 4096-byte
//! label limit (200 tags of one image did), and two names replicated at
//! once would keep rewriting it.

use crate::labels::DISTRIBUTION_SOURCE;
use crate::oci::Reference;

/// `(containerd.io/distribution.source.<host>, <repository>)` for `image`;
/// `None` for a name that is no reference.
pub(crate) fn source(image: &str) -> Option<(String, String)> {
    Reference::parse(image).ok().map(|r| label(&r))
}

/// [`source`] of a name already parsed.
pub(crate) fn label(r: &Reference) -> (String, String) {
    (
        format!("{DISTRIBUTION_SOURCE}.{}", r.domain),
        r.path.clone(),
    )
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
}
