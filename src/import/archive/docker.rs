//! docker-archive (`docker save`, skopeo): `manifest.json` entries become
//! docker v2 manifests built from the streamed config and layers.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Deserialize;

use super::blobs::{push_retained, sha256_hex, Kind, Walker};
use super::{
    Descriptor, PlannedImage, Resolved, SmallBlob, DOCKER_CONFIG, DOCKER_LAYER, DOCKER_LAYER_GZIP,
    DOCKER_LAYER_ZSTD, DOCKER_MANIFEST, GC_REF_CONTENT,
};
use crate::oci::reference;

impl Walker<'_> {
    pub(super) fn resolve_docker(&self, entries: &[DockerEntry], r: &mut Resolved) {
        for (i, e) in entries.iter().enumerate() {
            let what = format!(
                "image {} of manifest.json ({})",
                i,
                e.repo_tags.as_deref().unwrap_or_default().join(", ")
            );
            let (target, blobs) = match self.docker_image(e, &what) {
                Ok(built) => built,
                Err(failure) => {
                    r.failures.push(failure);
                    continue;
                }
            };
            let names = docker_names(e, &what, &mut r.warnings);
            if names.is_empty() {
                r.warnings
                    .push(format!("{what} has no usable RepoTags; not imported"));
                continue;
            }
            r.images.push(PlannedImage {
                names,
                target,
                blobs,
            });
        }
    }

    /// Builds the entry's docker v2 manifest from its streamed config and
    /// layers; returns it and the metadata blobs to write, or the failure.
    fn docker_image(
        &self,
        e: &DockerEntry,
        what: &str,
    ) -> Result<(Descriptor, Vec<SmallBlob>), String> {
        let mut blobs = Vec::new();
        let Some(cfg) = self.lookup(&e.config) else {
            return Err(format!(
                "{what}: config {:?} is not in the archive",
                e.config
            ));
        };
        let cfg_blob = &self.blobs[cfg];
        let config = Descriptor {
            media_type: DOCKER_CONFIG.into(),
            digest: cfg.clone(),
            size: cfg_blob.size as i64,
        };
        push_retained(&mut blobs, &config, cfg_blob, BTreeMap::new());
        let mut labels = BTreeMap::new();
        labels.insert(format!("{GC_REF_CONTENT}.config"), cfg.clone());
        let mut layers = Vec::new();
        for (li, l) in e.layers.iter().enumerate() {
            let Some(d) = self.lookup(l) else {
                return Err(format!(
                    "{what}: names layer {l:?}, which is not in the archive"
                ));
            };
            let b = &self.blobs[d];
            let media_type = match b.kind {
                Kind::Gzip => DOCKER_LAYER_GZIP,
                Kind::Zstd => DOCKER_LAYER_ZSTD,
                _ => DOCKER_LAYER,
            };
            let desc = Descriptor {
                media_type: media_type.into(),
                digest: d.clone(),
                size: b.size as i64,
            };
            push_retained(&mut blobs, &desc, b, BTreeMap::new());
            labels.insert(format!("{GC_REF_CONTENT}.l.{li}"), d.clone());
            layers.push(desc);
        }
        let manifest = manifest_blob(&config, &layers, labels);
        let target = manifest.desc.clone();
        blobs.push(manifest);
        Ok((target, blobs))
    }
}

/// The docker v2 manifest naming `config` and `layers`, as a blob to write.
fn manifest_blob(
    config: &Descriptor,
    layers: &[Descriptor],
    labels: BTreeMap<String, String>,
) -> SmallBlob {
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": DOCKER_MANIFEST,
        "config": desc_json(config),
        "layers": layers.iter().map(desc_json).collect::<Vec<_>>(),
    });
    let bytes = serde_json::to_vec(&manifest).unwrap_or_default();
    SmallBlob {
        desc: Descriptor {
            media_type: DOCKER_MANIFEST.into(),
            digest: sha256_hex(&bytes),
            size: bytes.len() as i64,
        },
        data: Arc::new(bytes),
        labels,
    }
}

/// The entry's RepoTags, normalised; the unusable ones become warnings.
fn docker_names(e: &DockerEntry, what: &str, warnings: &mut Vec<String>) -> Vec<String> {
    let mut names = Vec::new();
    for t in e.repo_tags.iter().flatten() {
        match reference::normalize(t) {
            Ok(n) => names.push(n),
            Err(err) => warnings.push(format!("{what}: {err}")),
        }
    }
    names
}

#[derive(Deserialize)]
pub(super) struct DockerEntry {
    #[serde(rename = "Config")]
    pub(super) config: String,
    #[serde(rename = "RepoTags", default)]
    pub(super) repo_tags: Option<Vec<String>>,
    #[serde(rename = "Layers", default)]
    pub(super) layers: Vec<String>,
}

pub(super) fn desc_json(d: &Descriptor) -> serde_json::Value {
    serde_json::json!({ "mediaType": d.media_type, "size": d.size, "digest": d.digest })
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::*;

    #[test]
    fn docker_archive_streams_layers_and_builds_manifest() {
        let a = docker_archive(r#"["app:dev","reg:5000/x/y:1"]"#, true);
        for (bytes, comp) in [
            (a.clone(), Compression::None),
            (gz(&a), Compression::Gzip),
            (zst(&a), Compression::Zstd),
        ] {
            let (plan, sink) = read(&bytes, Limits::default());
            let plan = plan.unwrap();
            assert_eq!(plan.compression, comp);
            assert_eq!(plan.format, Format::Docker);
            assert!(plan.failures.is_empty(), "{:?}", plan.failures);
            assert_eq!(
                plan.raw_sha256.as_deref(),
                Some(sha256_hex(&bytes).as_str())
            );
            assert_eq!(plan.images.len(), 1);
            let img = &plan.images[0];
            assert_eq!(img.names, ["docker.io/library/app:dev", "reg:5000/x/y:1"]);
            assert_eq!(img.target.media_type, DOCKER_MANIFEST);
            // Both layers went to the sink, verified by content.
            let blobs = sink.blobs.borrow();
            assert!(blobs.contains_key(&sha256_hex(&layer(1))));
            assert!(blobs.contains_key(&sha256_hex(&gz(&layer(2)))));
            let m = img.blobs.last().unwrap();
            assert_eq!(m.desc, img.target);
            assert_eq!(sha256_hex(&m.data), img.target.digest);
            let v: serde_json::Value = serde_json::from_slice(&m.data).unwrap();
            assert_eq!(v["config"]["mediaType"], DOCKER_CONFIG);
            assert_eq!(v["layers"][0]["mediaType"], DOCKER_LAYER);
            assert_eq!(v["layers"][1]["mediaType"], DOCKER_LAYER_GZIP);
            assert_eq!(
                m.labels[&format!("{GC_REF_CONTENT}.config")],
                sha256_hex(CONFIG)
            );
            assert_eq!(
                m.labels[&format!("{GC_REF_CONTENT}.l.0")],
                sha256_hex(&layer(1))
            );
            assert_eq!(
                m.labels[&format!("{GC_REF_CONTENT}.l.1")],
                sha256_hex(&gz(&layer(2)))
            );
            // The config was small JSON: kept and written from the plan.
            assert_eq!(img.blobs[0].desc.digest, sha256_hex(CONFIG));
        }
    }

    #[test]
    fn missing_layer_fails_the_image_only() {
        let (plan, _) = read(&docker_archive(r#"["app:dev"]"#, false), Limits::default());
        let plan = plan.unwrap();
        assert!(plan.images.is_empty());
        assert_eq!(plan.failures.len(), 1);
        assert!(
            plan.failures[0].contains("abc/layer.tar"),
            "{:?}",
            plan.failures
        );
    }

    #[test]
    fn untagged_image_is_not_an_import() {
        let (plan, _) = read(&docker_archive("null", true), Limits::default());
        let plan = plan.unwrap();
        assert!(plan.images.is_empty());
        assert!(
            plan.failures[0].contains("no named image"),
            "{:?}",
            plan.failures
        );
    }
}
