//! OCI image layout: `index.json` names images; each manifest or index is
//! checked down to its blobs, keeping only platforms present in the archive.

use std::collections::{BTreeMap, HashMap};

use serde::Deserialize;

use super::blobs::{push_retained, Blob, Walker};
use super::{
    Descriptor, PlannedImage, Resolved, SmallBlob, ANN_CONTAINERD_NAME, ANN_OCI_REF_NAME, GC_REF,
    MAX_DEPTH, MT_DOCKER_LIST, MT_DOCKER_MANIFEST, MT_OCI_INDEX, MT_OCI_MANIFEST,
};
use crate::reference;

impl Walker<'_> {
    pub(super) fn resolve_oci(&self, index: &Meta, r: &mut Resolved) {
        let mut by_digest: BTreeMap<String, (Vec<String>, OciDesc)> = BTreeMap::new();
        for d in index.manifests.iter().flatten() {
            let Some(name) = oci_name(d, &mut r.warnings) else {
                r.warnings.push(format!(
                    "index.json entry {} has no usable name annotation; not imported",
                    d.digest
                ));
                continue;
            };
            let e = by_digest
                .entry(d.digest.clone())
                .or_insert_with(|| (Vec::new(), d.clone()));
            if !e.0.contains(&name) {
                e.0.push(name);
            }
        }
        for (digest, (names, desc)) in by_digest {
            match self.walk_desc(&desc, 0, &mut r.warnings) {
                Ok((target, blobs)) => r.images.push(PlannedImage {
                    names,
                    target,
                    blobs,
                }),
                Err(e) => r
                    .failures
                    .push(format!("{} ({digest}): {}", names.join(", "), e.msg())),
            }
        }
    }

    /// Checks a manifest or index and everything below it; returns the
    /// descriptor to record and the metadata blobs to write, children first.
    pub(super) fn walk_desc(
        &self,
        d: &OciDesc,
        depth: usize,
        warnings: &mut Vec<String>,
    ) -> Result<(Descriptor, Vec<SmallBlob>), WalkError> {
        if depth > MAX_DEPTH {
            return Err(WalkError::Bad(format!(
                "indexes nested deeper than {MAX_DEPTH}"
            )));
        }
        let blob = self.present(d)?;
        let Some(data) = &blob.data else {
            return Err(WalkError::Bad(format!(
                "{} is not JSON metadata of at most {} bytes",
                d.digest, self.limits.metadata
            )));
        };
        let m: Meta = serde_json::from_slice(data).map_err(|e| {
            WalkError::Bad(format!(
                "{}: invalid JSON: {}",
                d.digest,
                super::json_reason(&e)
            ))
        })?;
        let media_type = media_type_of(d, &m);
        let desc = Descriptor {
            media_type: media_type.clone(),
            digest: d.digest.clone(),
            size: blob.size as i64,
        };
        let (labels, mut out) = if media_type == MT_OCI_INDEX || media_type == MT_DOCKER_LIST {
            self.walk_index(d, &m, depth, warnings)?
        } else if m.config.is_some()
            || media_type == MT_OCI_MANIFEST
            || media_type == MT_DOCKER_MANIFEST
        {
            self.walk_manifest(d, &m)?
        } else {
            return Err(WalkError::Bad(format!(
                "{} has unsupported media type {media_type:?}",
                d.digest
            )));
        };
        out.push(SmallBlob {
            desc: desc.clone(),
            data: data.clone(),
            labels,
        });
        Ok((desc, out))
    }

    /// An index's children: the ones present, at least one of them.
    fn walk_index(
        &self,
        d: &OciDesc,
        m: &Meta,
        depth: usize,
        warnings: &mut Vec<String>,
    ) -> Result<Below, WalkError> {
        let mut out = Vec::new();
        let mut labels = BTreeMap::new();
        let mut problems = Vec::new();
        for (i, c) in m.manifests.iter().flatten().enumerate() {
            match self.walk_desc(c, depth + 1, warnings) {
                Ok((_, blobs)) => {
                    labels.insert(format!("{GC_REF}.m.{i}"), c.digest.clone());
                    out.extend(blobs);
                }
                // Another platform's manifest, left out of the archive.
                Err(WalkError::Missing(_)) => {}
                Err(e) => {
                    let p = format!("{} {}: {}", platform(c), c.digest, e.msg());
                    warnings.push(format!("skipping {p}"));
                    problems.push(p);
                }
            }
        }
        if labels.is_empty() {
            return Err(WalkError::Bad(if problems.is_empty() {
                format!("index {} has no manifest present in the archive", d.digest)
            } else {
                format!(
                    "index {} has no complete manifest: {}",
                    d.digest,
                    problems.join("; ")
                )
            }));
        }
        Ok((labels, out))
    }

    /// A manifest's config and layers, every one of them present.
    fn walk_manifest(&self, d: &OciDesc, m: &Meta) -> Result<Below, WalkError> {
        let mut out = Vec::new();
        let mut labels = BTreeMap::new();
        let Some(cfg) = &m.config else {
            return Err(WalkError::Bad(format!(
                "manifest {} has no config",
                d.digest
            )));
        };
        let children = std::iter::once(("config", cfg, "config".to_string())).chain(
            m.layers
                .iter()
                .flatten()
                .enumerate()
                .map(|(i, l)| ("layer", l, format!("l.{i}"))),
        );
        for (kind, c, key) in children {
            let b = self.present(c).map_err(|e| {
                WalkError::Bad(format!(
                    "manifest {} names {kind} {}: {}",
                    d.digest,
                    c.digest,
                    e.msg()
                ))
            })?;
            push_retained(&mut out, &c.descriptor(), b, BTreeMap::new());
            labels.insert(format!("{GC_REF}.{key}"), c.digest.clone());
        }
        Ok((labels, out))
    }

    pub(super) fn present(&self, d: &OciDesc) -> Result<&Blob, WalkError> {
        if !reference::valid_digest(&d.digest) {
            return Err(WalkError::Bad(format!("invalid digest {:?}", d.digest)));
        }
        let Some(b) = self.blobs.get(&d.digest) else {
            return Err(WalkError::Missing(format!(
                "{} is not in the archive",
                d.digest
            )));
        };
        if d.size != b.size as i64 {
            return Err(WalkError::Bad(format!(
                "{} is {} bytes in the archive, descriptor says {}",
                d.digest, b.size, d.size
            )));
        }
        Ok(b)
    }
}

/// What a manifest or index holds below it: its GC labels, and the
/// metadata blobs to write (children first).
type Below = (BTreeMap<String, String>, Vec<SmallBlob>);

/// The descriptor's media type, else the document's own, else guessed from
/// its shape.
fn media_type_of(d: &OciDesc, m: &Meta) -> String {
    [d.media_type.as_deref(), m.media_type.as_deref()]
        .into_iter()
        .flatten()
        .find(|s| !s.is_empty())
        .map(str::to_owned)
        .unwrap_or_else(|| {
            if m.manifests.is_some() {
                MT_OCI_INDEX.into()
            } else {
                MT_OCI_MANIFEST.into()
            }
        })
}

pub(super) enum WalkError {
    /// The blob is absent: for an index child, just another platform.
    Missing(String),
    Bad(String),
}

impl WalkError {
    fn msg(&self) -> &str {
        match self {
            WalkError::Missing(m) | WalkError::Bad(m) => m,
        }
    }
}

/// The fields of an index, manifest or config we care about.
#[derive(Deserialize, Default)]
pub(super) struct Meta {
    #[serde(rename = "mediaType", default)]
    pub(super) media_type: Option<String>,
    #[serde(default)]
    pub(super) manifests: Option<Vec<OciDesc>>,
    #[serde(default)]
    pub(super) config: Option<OciDesc>,
    #[serde(default)]
    pub(super) layers: Option<Vec<OciDesc>>,
}

#[derive(Deserialize, Clone, Debug)]
pub(super) struct OciDesc {
    #[serde(rename = "mediaType", default)]
    pub(super) media_type: Option<String>,
    pub(super) digest: String,
    pub(super) size: i64,
    #[serde(default)]
    pub(super) annotations: Option<HashMap<String, String>>,
    #[serde(default)]
    pub(super) platform: Option<Platform>,
}

#[derive(Deserialize, Clone, Debug)]
pub(super) struct Platform {
    #[serde(default)]
    pub(super) os: String,
    #[serde(default)]
    pub(super) architecture: String,
    #[serde(default)]
    pub(super) variant: Option<String>,
}

impl OciDesc {
    fn descriptor(&self) -> Descriptor {
        Descriptor {
            media_type: self.media_type.clone().unwrap_or_default(),
            digest: self.digest.clone(),
            size: self.size,
        }
    }
}

pub(super) fn platform(d: &OciDesc) -> String {
    match &d.platform {
        Some(p) => {
            let mut s = format!("platform {}/{}", p.os, p.architecture);
            if let Some(v) = &p.variant {
                s.push('/');
                s.push_str(v);
            }
            s
        }
        None => "manifest".into(),
    }
}

/// The image name of an index.json entry: `io.containerd.image.name`, or
/// `org.opencontainers.image.ref.name` when it is a full reference (a bare
/// tag such as `latest` names no repository; containerd skips those too).
pub(super) fn oci_name(d: &OciDesc, warnings: &mut Vec<String>) -> Option<String> {
    let a = d.annotations.as_ref()?;
    let candidate = a.get(ANN_CONTAINERD_NAME).or_else(|| {
        a.get(ANN_OCI_REF_NAME)
            .filter(|r| r.contains(['/', ':', '@']))
    })?;
    match reference::normalize(candidate) {
        Ok(n) => Some(n),
        Err(e) => {
            warnings.push(e.to_string());
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::*;

    #[test]
    fn oci_index_keeps_present_platform() {
        let (a, idx, amd) = oci_multi(r#""io.containerd.image.name":"foo/bar""#);
        let (plan, _) = read(&a, Limits::default());
        let plan = plan.unwrap();
        assert_eq!(plan.format, Format::Oci);
        assert!(plan.failures.is_empty(), "{:?}", plan.failures);
        let img = &plan.images[0];
        assert_eq!(img.names, ["docker.io/foo/bar:latest"]);
        assert_eq!(img.target.digest, sha256_hex(&idx));
        assert_eq!(img.target.media_type, MT_OCI_INDEX);
        let top = img.blobs.last().unwrap();
        // Only the present platform (index position 1) is referenced.
        assert_eq!(top.labels.len(), 1);
        assert_eq!(top.labels[&format!("{GC_REF}.m.1")], sha256_hex(&amd));
        let m = img
            .blobs
            .iter()
            .find(|b| b.desc.digest == sha256_hex(&amd))
            .unwrap();
        assert_eq!(m.labels[&format!("{GC_REF}.config")], sha256_hex(CONFIG));
        assert!(m.labels.contains_key(&format!("{GC_REF}.l.0")));
        // Children come before parents.
        let pos = |d: &str| img.blobs.iter().position(|b| b.desc.digest == d).unwrap();
        assert!(pos(&sha256_hex(CONFIG)) < pos(&sha256_hex(&amd)));
        assert!(pos(&sha256_hex(&amd)) < pos(&sha256_hex(&idx)));
    }

    #[test]
    fn oci_ref_name_rules() {
        let (a, _, _) = oci_multi(r#""org.opencontainers.image.ref.name":"app:dev""#);
        let plan = read(&a, Limits::default()).0.unwrap();
        assert_eq!(plan.images[0].names, ["docker.io/library/app:dev"]);
        // A bare tag names no repository.
        let (a, _, _) = oci_multi(r#""org.opencontainers.image.ref.name":"latest""#);
        let plan = read(&a, Limits::default()).0.unwrap();
        assert!(plan.images.is_empty());
        assert_eq!(plan.failures.len(), 1);
    }

    #[test]
    fn oci_manifest_missing_layer_fails() {
        let l = gz(&layer(5));
        let m = manifest(&[&l]);
        let top = format!(
            r#"{{"manifests":[{}]}}"#,
            desc(
                MT_OCI_MANIFEST,
                &m,
                r#","annotations":{"io.containerd.image.name":"x:1"}"#
            )
        );
        let a = blob(blob(T::new(), CONFIG), &m)
            .file("index.json", top.as_bytes())
            .done();
        let plan = read(&a, Limits::default()).0.unwrap();
        assert!(plan.images.is_empty());
        assert!(
            plan.failures[0].contains("names layer"),
            "{:?}",
            plan.failures
        );
    }

    #[test]
    fn oci_digest_mismatch_is_fatal() {
        let a = T::new()
            .file(&format!("blobs/sha256/{}", hex(b"other")), &layer(9))
            .done();
        assert!(matches!(
            read(&a, Limits::default()).0,
            Err(ArchiveError::DigestMismatch { .. })
        ));
    }
}
