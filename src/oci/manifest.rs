//! One model of an index or manifest, OCI or Docker schema 2 (the same
//! shape): its children with their GC labels, its subject and artifact
//! type. The registry reads a pushed document with it, replication walks
//! trees with it, and an archive's OCI layout is checked with it.
//!
//! Parsed with `oci-spec`'s types, so descriptors need a `mediaType`, a
//! well-formed digest and a non-negative size, and a manifest its `config`
//! and `layers` (the tests list what is refused). Cost, measured (release
//! build, 50 000 parses each, against a serde struct reading only the
//! children): a 1.2 KiB buildkit index 5.8 µs against 1.0 µs, a 2.2 KiB
//! manifest with 12 layers 9.2 µs against 2.4 µs. A document is parsed once
//! per digest and costs gRPC round trips per blob besides, so the
//! difference does not show.

use std::collections::HashMap;

use oci_spec::image::{Descriptor, ImageIndex, ImageManifest, MediaType, Platform};

use super::digest::Digest;
use crate::labels::{media_type, GC_REF_CONTENT};

/// Largest index or manifest imgbridge reads from containerd (real ones
/// are a few KiB).
pub const MAX_MANIFEST: usize = 4 << 20;

/// A blob a document names, as containerd's API describes it (signed size).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Child {
    pub media_type: String,
    pub digest: Digest,
    pub size: i64,
    /// A non-distributable layer: its bytes come from its `urls` (or
    /// nowhere), so a store need not hold it.
    pub external: bool,
}

impl Child {
    /// A child that a store must hold.
    pub fn new(media_type: impl Into<String>, digest: Digest, size: i64) -> Child {
        Child {
            media_type: media_type.into(),
            digest,
            size,
            external: false,
        }
    }
}

/// An entry of an index: the manifest (or index) it names, for which
/// platform, and its annotations (an OCI layout's `index.json` names its
/// images there).
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub child: Child,
    pub platform: Option<Platform>,
    pub annotations: Option<HashMap<String, String>>,
}

impl TryFrom<&Descriptor> for Entry {
    type Error = ManifestError;

    fn try_from(d: &Descriptor) -> Result<Entry, ManifestError> {
        Ok(Entry {
            child: Child::try_from(d)?,
            platform: d.platform().clone(),
            annotations: d.annotations().clone(),
        })
    }
}

/// Why bytes are not an index or manifest.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("not an OCI or Docker index or manifest: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{0}")]
    Invalid(String),
}

impl TryFrom<&Descriptor> for Child {
    type Error = ManifestError;

    fn try_from(d: &Descriptor) -> Result<Child, ManifestError> {
        let media_type = d.media_type().to_string();
        let external = media_type.contains("nondistributable")
            || media_type.contains(".foreign.")
            || d.urls().as_ref().is_some_and(|u| !u.is_empty());
        Ok(Child {
            digest: Digest::parse(d.digest().as_ref())
                .map_err(|e| ManifestError::Invalid(e.to_string()))?,
            size: i64::try_from(d.size()).map_err(|_| {
                ManifestError::Invalid(format!(
                    "blob {} is larger than containerd can describe",
                    d.digest()
                ))
            })?,
            media_type,
            external,
        })
    }
}

/// An index (`manifests`) or a manifest (`config`, `layers`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Manifest {
    /// The document's own `mediaType`, if it states one.
    pub media_type: Option<String>,
    pub artifact_type: Option<String>,
    /// The manifest this one refers to (a signature, an SBOM).
    pub subject: Option<Child>,
    pub annotations: Option<HashMap<String, String>>,
    /// Of an index: its entries (all platforms, attestations included).
    pub manifests: Vec<Entry>,
    /// Of a manifest.
    pub config: Option<Child>,
    pub layers: Vec<Child>,
}

/// True for media types whose blob lists children.
pub fn is_parent(media_type: &str) -> bool {
    media_type::is_index(media_type) || media_type::is_manifest(media_type)
}

/// An image config CRI understands (OCI or Docker).
fn is_image_config(t: &str) -> bool {
    t == MediaType::ImageConfig.as_ref() || t == media_type::DOCKER_CONFIG
}

fn text(t: &Option<MediaType>) -> Option<String> {
    t.as_ref().map(|t| t.to_string()).filter(|t| !t.is_empty())
}

impl Manifest {
    /// Parses an index or manifest. Which one it is comes from its shape
    /// (an index lists `manifests`), not from its optional `mediaType`.
    pub fn parse(bytes: &[u8]) -> Result<Manifest, ManifestError> {
        let mut doc: serde_json::Value = serde_json::from_slice(bytes)?;
        // containerd's Go decoder reads a document without
        // `schemaVersion` (an OCI layout's index.json by hand, say) as 0
        // and goes on; so does this, rather than refuse what it imports.
        if let Some(o) = doc.as_object_mut() {
            o.entry("schemaVersion").or_insert(2.into());
        }
        let children = |ds: &[Descriptor]| -> Result<Vec<Child>, ManifestError> {
            ds.iter().map(Child::try_from).collect()
        };
        let subject = |s: &Option<Descriptor>| s.as_ref().map(Child::try_from).transpose();
        if doc.get("manifests").is_some() {
            let index: ImageIndex = serde_json::from_value(doc)?;
            Ok(Manifest {
                media_type: text(index.media_type()),
                artifact_type: text(index.artifact_type()),
                subject: subject(index.subject())?,
                annotations: index.annotations().clone(),
                manifests: index
                    .manifests()
                    .iter()
                    .map(Entry::try_from)
                    .collect::<Result<_, _>>()?,
                ..Manifest::default()
            })
        } else {
            let manifest: ImageManifest = serde_json::from_value(doc)?;
            Ok(Manifest {
                media_type: text(manifest.media_type()),
                artifact_type: text(manifest.artifact_type()),
                subject: subject(manifest.subject())?,
                annotations: manifest.annotations().clone(),
                config: Some(Child::try_from(manifest.config())?),
                layers: children(manifest.layers())?,
                ..Manifest::default()
            })
        }
    }

    pub fn is_index(&self) -> bool {
        self.config.is_none()
    }

    /// All children, configs before layers, in document order.
    pub fn children(&self) -> impl Iterator<Item = &Child> {
        self.manifests
            .iter()
            .map(|e| &e.child)
            .chain(self.config.iter())
            .chain(self.layers.iter())
    }

    /// The GC labels containerd's own clients put on this blob
    /// (`images.ChildGCLabels`): `m.<i>`, `config`, `l.<i>`.
    pub fn gc_labels(&self) -> HashMap<String, String> {
        let mut l = HashMap::new();
        for (i, m) in self.manifests.iter().enumerate() {
            l.insert(gc_key_entry(i), m.child.digest.to_string());
        }
        if let Some(c) = &self.config {
            l.insert(format!("{GC_REF_CONTENT}.config"), c.digest.to_string());
        }
        for (i, c) in self.layers.iter().enumerate() {
            l.insert(format!("{GC_REF_CONTENT}.l.{i}"), c.digest.to_string());
        }
        l
    }

    /// An image CRI can run, rather than an artefact (a chart, a
    /// signature): an index of manifests, or a manifest of an image config
    /// and layers, with neither an artifact type nor a subject.
    pub fn runnable(&self) -> bool {
        if self.artifact_type.is_some() || self.subject.is_some() {
            return false;
        }
        match &self.config {
            None => {
                !self.manifests.is_empty()
                    && self
                        .manifests
                        .iter()
                        .all(|m| is_parent(&m.child.media_type))
            }
            Some(c) => !self.layers.is_empty() && is_image_config(&c.media_type),
        }
    }

    /// What a referrers listing files it under: its `artifactType`, else
    /// its config's media type.
    pub fn listed_artifact_type(&self) -> Option<&str> {
        self.artifact_type
            .as_deref()
            .or(self.config.as_ref().map(|c| c.media_type.as_str()))
            .filter(|t| !t.is_empty())
    }
}

/// The GC label key of an index's entry `i`.
pub fn gc_key_entry(i: usize) -> String {
    format!("{GC_REF_CONTENT}.m.{i}")
}

/// The GC label key of a manifest's config (`None`) or layer `i`.
pub fn gc_key_manifest(layer: Option<usize>) -> String {
    match layer {
        None => format!("{GC_REF_CONTENT}.config"),
        Some(i) => format!("{GC_REF_CONTENT}.l.{i}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(c: char) -> String {
        format!("sha256:{}", c.to_string().repeat(64))
    }

    #[test]
    fn parses_index_and_manifest() {
        let idx = format!(
            r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json",
          "manifests":[{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{}","size":1,
          "platform":{{"architecture":"amd64","os":"linux"}}}},
          {{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{}","size":2,
           "platform":{{"architecture":"unknown","os":"unknown"}},
           "annotations":{{"vnd.docker.reference.type":"attestation-manifest"}}}}]}}"#,
            d('a'),
            d('b')
        );
        let n = Manifest::parse(idx.as_bytes()).unwrap();
        assert!(n.is_index() && n.runnable());
        assert_eq!(n.children().count(), 2);
        assert!(n.manifests[1].annotations.is_some() && n.manifests[0].platform.is_some());
        assert_eq!(n.gc_labels()["containerd.io/gc.ref.content.m.1"], d('b'));
        let m = format!(
            r#"{{"schemaVersion":2,"config":{{"mediaType":"x","digest":"{}","size":3}},
          "layers":[{{"mediaType":"y","digest":"{}","size":4}}]}}"#,
            d('c'),
            d('d')
        );
        let n = Manifest::parse(m.as_bytes()).unwrap();
        let l = n.gc_labels();
        assert_eq!(l["containerd.io/gc.ref.content.config"], d('c'));
        assert_eq!(l["containerd.io/gc.ref.content.l.0"], d('d'));
        assert_eq!(n.layers[0].media_type, "y");
        // Config "x" is no image config: an artefact.
        assert!(!n.runnable());
        assert_eq!(n.listed_artifact_type(), Some("x"));
        assert!(Manifest::parse(b"not json").is_err());
    }

    #[test]
    fn docker_schema2_documents_parse() {
        let list = format!(
            r#"{{"schemaVersion":2,"mediaType":"{}","manifests":[{{"mediaType":"{}","digest":"{}","size":7,"platform":{{"architecture":"arm64","os":"linux","variant":"v8"}}}}]}}"#,
            media_type::DOCKER_MANIFEST_LIST,
            media_type::DOCKER_MANIFEST,
            d('e')
        );
        let n = Manifest::parse(list.as_bytes()).unwrap();
        assert_eq!(n.manifests[0].child.media_type, media_type::DOCKER_MANIFEST);
        assert_eq!(
            n.media_type.as_deref(),
            Some(media_type::DOCKER_MANIFEST_LIST)
        );
        assert!(is_parent(&n.manifests[0].child.media_type));
        let m = format!(
            r#"{{"schemaVersion":2,"mediaType":"{}","config":{{"mediaType":"{}","digest":"{}","size":1}},"layers":[{{"mediaType":"{}","digest":"{}","size":2}}]}}"#,
            media_type::DOCKER_MANIFEST,
            media_type::DOCKER_CONFIG,
            d('f'),
            media_type::DOCKER_LAYER_GZIP,
            d('0')
        );
        let n = Manifest::parse(m.as_bytes()).unwrap();
        assert_eq!(n.children().count(), 2);
        assert!(n.runnable());
        assert!(!is_parent(&n.layers[0].media_type));
    }

    #[test]
    fn images_and_artefacts() {
        let image = serde_json::json!({
            "schemaVersion": 2,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": d('a'), "size": 1},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d('b'), "size": 1}]
        });
        let parse = |v: &serde_json::Value| Manifest::parse(v.to_string().as_bytes());
        assert!(parse(&image).unwrap().runnable());
        let chart = serde_json::json!({
            "schemaVersion": 2,
            "config": {"mediaType": "application/vnd.cncf.helm.config.v1+json", "digest": d('a'), "size": 1},
            "layers": [{"mediaType": "application/vnd.cncf.helm.chart.content.v1.tar+gzip", "digest": d('b'), "size": 1}]
        });
        assert!(!parse(&chart).unwrap().runnable());
        let mut referrer = image.clone();
        referrer["subject"] = serde_json::json!({"mediaType": "x", "digest": d('c'), "size": 1});
        referrer["artifactType"] = serde_json::json!("application/vnd.example.sig");
        let p = parse(&referrer).unwrap();
        assert!(!p.runnable());
        assert_eq!(p.subject.as_ref().unwrap().digest, d('c'));
        assert_eq!(
            p.listed_artifact_type(),
            Some("application/vnd.example.sig")
        );
        let mut foreign = image.clone();
        foreign["layers"][0]["urls"] = serde_json::json!(["https://example.invalid/l"]);
        assert!(parse(&foreign).unwrap().layers[0].external);
        assert!(!parse(&image).unwrap().layers[0].external);
    }

    /// What the spec does not allow (a hand-written parser once accepted
    /// all of these and returned empty or bogus children).
    #[test]
    fn rejects_what_the_spec_does_not_allow() {
        let manifest =
            |config: &str| format!(r#"{{"schemaVersion":2,"config":{config},"layers":[]}}"#);
        for (why, doc) in [
            (
                "no mediaType",
                manifest(&format!(r#"{{"digest":"{}","size":1}}"#, d('a'))),
            ),
            (
                "bad digest",
                manifest(r#"{"mediaType":"x","digest":"sha256:a","size":1}"#),
            ),
            (
                "a digest containerd refuses",
                manifest(&format!(
                    r#"{{"mediaType":"x","digest":"md5:{}","size":1}}"#,
                    "0".repeat(32)
                )),
            ),
            (
                "negative size",
                manifest(&format!(
                    r#"{{"mediaType":"x","digest":"{}","size":-1}}"#,
                    d('a')
                )),
            ),
            ("neither index nor manifest", "{}".to_string()),
            ("not an object", "[]".to_string()),
            (
                "manifest without layers",
                format!(
                    r#"{{"schemaVersion":2,"config":{{"mediaType":"x","digest":"{}","size":1}}}}"#,
                    d('a')
                ),
            ),
        ] {
            assert!(Manifest::parse(doc.as_bytes()).is_err(), "{why}: {doc}");
        }
    }
}
