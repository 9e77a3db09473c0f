//! OCI image layout: `index.json` names images; each manifest or index is
//! checked down to its blobs ([`Manifest`], the house's one model of
//! them), keeping only platforms present in the archive.

use std::collections::BTreeMap;

use super::blobs::{push_retained, Blob, Walker};
use super::{
    ArchiveError, Descriptor, PlannedImage, Resolved, SmallBlob, ANN_CONTAINERD_NAME,
    ANN_OCI_REF_NAME, MAX_DEPTH,
};
use crate::labels::media_type;
use crate::oci::manifest::{gc_key_entry, gc_key_manifest};
use crate::oci::{reference, Child, Entry, Manifest, ManifestError};

impl Walker<'_> {
    pub(super) fn resolve_oci(&self, index: &Manifest, r: &mut Resolved) {
        let mut by_digest: BTreeMap<String, (Vec<String>, Child)> = BTreeMap::new();
        for e in &index.manifests {
            let Some(name) = oci_name(e, &mut r.warnings) else {
                r.warnings.push(format!(
                    "index.json entry {} has no usable name annotation; not imported",
                    e.child.digest
                ));
                continue;
            };
            let v = by_digest
                .entry(e.child.digest.to_string())
                .or_insert_with(|| (Vec::new(), e.child.clone()));
            if !v.0.contains(&name) {
                v.0.push(name);
            }
        }
        for (digest, (names, child)) in by_digest {
            match self.walk_desc(&child, 0, &mut r.warnings) {
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
        d: &Child,
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
        let m = Manifest::parse(data)
            .map_err(|e| WalkError::Bad(format!("{}: {}", d.digest, reason(&e))))?;
        let desc = descriptor(d);
        let (labels, mut out) = if media_type::is_index(&d.media_type) {
            self.walk_index(d, &m, depth, warnings)?
        } else if m.config.is_some() || media_type::is_manifest(&d.media_type) {
            self.walk_manifest(d, &m)?
        } else {
            return Err(WalkError::Bad(format!(
                "{} has unsupported media type {:?}",
                d.digest, d.media_type
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
        d: &Child,
        m: &Manifest,
        depth: usize,
        warnings: &mut Vec<String>,
    ) -> Result<Below, WalkError> {
        let mut out = Vec::new();
        let mut labels = BTreeMap::new();
        let mut problems = Vec::new();
        for (i, e) in m.manifests.iter().enumerate() {
            match self.walk_desc(&e.child, depth + 1, warnings) {
                Ok((_, blobs)) => {
                    labels.insert(gc_key_entry(i), e.child.digest.to_string());
                    out.extend(blobs);
                }
                // Another platform's manifest, left out of the archive.
                Err(WalkError::Missing(_)) => {}
                Err(err) => {
                    let p = format!("{} {}: {}", platform(e), e.child.digest, err.msg());
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
    fn walk_manifest(&self, d: &Child, m: &Manifest) -> Result<Below, WalkError> {
        let mut out = Vec::new();
        let mut labels = BTreeMap::new();
        let Some(cfg) = &m.config else {
            return Err(WalkError::Bad(format!(
                "manifest {} has no config",
                d.digest
            )));
        };
        let children = std::iter::once(("config", cfg, gc_key_manifest(None))).chain(
            m.layers
                .iter()
                .enumerate()
                .map(|(i, l)| ("layer", l, gc_key_manifest(Some(i)))),
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
            push_retained(&mut out, &descriptor(c), b, BTreeMap::new());
            labels.insert(key, c.digest.to_string());
        }
        Ok((labels, out))
    }

    pub(super) fn present(&self, d: &Child) -> Result<&Blob, WalkError> {
        let Some(b) = self.blobs.get(d.digest.as_str()) else {
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

fn descriptor(c: &Child) -> Descriptor {
    Descriptor {
        media_type: c.media_type.clone(),
        digest: c.digest.to_string(),
        size: c.size,
    }
}

/// Why a document is not an index or manifest, without quoting it.
pub(super) fn reason(e: &ManifestError) -> String {
    match e {
        ManifestError::Json(j) => format!("invalid JSON: {}", super::json_reason(j)),
        ManifestError::Invalid(m) => m.clone(),
    }
}

/// `index.json`, as an index.
pub(super) fn index(bytes: &[u8]) -> Result<Manifest, ArchiveError> {
    Manifest::parse(bytes).map_err(|e| ArchiveError::Index(reason(&e)))
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

pub(super) fn platform(e: &Entry) -> String {
    match &e.platform {
        Some(p) => {
            let mut s = format!("platform {}/{}", p.os(), p.architecture());
            if let Some(v) = p.variant() {
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
pub(super) fn oci_name(e: &Entry, warnings: &mut Vec<String>) -> Option<String> {
    let a = e.annotations.as_ref()?;
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
        assert_eq!(img.target.media_type, OCI_INDEX);
        let top = img.blobs.last().unwrap();
        // Only the present platform (index position 1) is referenced.
        assert_eq!(top.labels.len(), 1);
        assert_eq!(
            top.labels[&format!("{GC_REF_CONTENT}.m.1")],
            sha256_hex(&amd)
        );
        let m = img
            .blobs
            .iter()
            .find(|b| b.desc.digest == sha256_hex(&amd))
            .unwrap();
        assert_eq!(
            m.labels[&format!("{GC_REF_CONTENT}.config")],
            sha256_hex(CONFIG)
        );
        assert!(m.labels.contains_key(&format!("{GC_REF_CONTENT}.l.0")));
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
                OCI_MANIFEST,
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
