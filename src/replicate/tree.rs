//! The image tree: which blobs an index or manifest points to, and the GC
//! labels that keep those children alive in a namespace.

use std::collections::HashMap;

use serde::Deserialize;

/// Largest index/manifest imgbridge parses (real ones are a few KiB).
pub const MAX_MANIFEST: usize = 4 << 20;

pub const GC_REF_PREFIX: &str = "containerd.io/gc.ref.content";

/// A child blob.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Child {
    #[serde(rename = "mediaType", default)]
    pub media_type: String,
    pub digest: String,
    pub size: i64,
}

/// The parsed part of an index or manifest that replication needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Node {
    /// Manifests of an index (all platforms, attestations included).
    pub manifests: Vec<Child>,
    /// Config of a manifest.
    pub config: Option<Child>,
    pub layers: Vec<Child>,
}

#[derive(Deserialize)]
struct Raw {
    #[serde(default)]
    manifests: Vec<Child>,
    config: Option<Child>,
    #[serde(default)]
    layers: Vec<Child>,
}

/// True for media types whose blob lists children.
pub fn is_parent(media_type: &str) -> bool {
    matches!(
        media_type,
        "application/vnd.oci.image.index.v1+json"
            | "application/vnd.docker.distribution.manifest.list.v2+json"
            | "application/vnd.oci.image.manifest.v1+json"
            | "application/vnd.docker.distribution.manifest.v2+json"
    )
}

/// Parses an index or manifest blob.
pub fn parse(bytes: &[u8]) -> Result<Node, serde_json::Error> {
    let r: Raw = serde_json::from_slice(bytes)?;
    Ok(Node {
        manifests: r.manifests,
        config: r.config,
        layers: r.layers,
    })
}

impl Node {
    /// All children, configs before layers, in document order.
    pub fn children(&self) -> impl Iterator<Item = &Child> {
        self.manifests
            .iter()
            .chain(self.config.iter())
            .chain(self.layers.iter())
    }

    /// The GC labels containerd's own clients put on this blob
    /// (`images.ChildGCLabels`): `m.<i>`, `config`, `l.<i>`.
    pub fn gc_labels(&self) -> HashMap<String, String> {
        let mut l = HashMap::new();
        for (i, m) in self.manifests.iter().enumerate() {
            l.insert(format!("{GC_REF_PREFIX}.m.{i}"), m.digest.clone());
        }
        if let Some(c) = &self.config {
            l.insert(format!("{GC_REF_PREFIX}.config"), c.digest.clone());
        }
        for (i, c) in self.layers.iter().enumerate() {
            l.insert(format!("{GC_REF_PREFIX}.l.{i}"), c.digest.clone());
        }
        l
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_index_and_manifest() {
        let idx = br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json",
          "manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:a","size":1,
          "platform":{"architecture":"amd64","os":"linux"}},
          {"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:b","size":2,
           "annotations":{"vnd.docker.reference.type":"attestation-manifest"}}]}"#;
        let n = parse(idx).unwrap();
        assert_eq!(n.children().count(), 2);
        assert_eq!(
            n.gc_labels()["containerd.io/gc.ref.content.m.1"],
            "sha256:b"
        );
        let m = br#"{"schemaVersion":2,"config":{"mediaType":"x","digest":"sha256:c","size":3},
          "layers":[{"mediaType":"y","digest":"sha256:d","size":4}]}"#;
        let n = parse(m).unwrap();
        let l = n.gc_labels();
        assert_eq!(l["containerd.io/gc.ref.content.config"], "sha256:c");
        assert_eq!(l["containerd.io/gc.ref.content.l.0"], "sha256:d");
        assert!(parse(b"not json").is_err());
    }
}
