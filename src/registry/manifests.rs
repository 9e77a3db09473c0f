//! Manifests and indexes (`/v2/<name>/manifests/<reference>`).
//!
//! A PUT stores the manifest as a content blob carrying containerd's GC
//! labels (`containerd.io/gc.ref.content.config`, `.l.<i>`, `.m.<i>`, as
//! containerd's own pull writes them), so its children live as long as it
//! does; then writes the image record, then (for an image pushed by tag)
//! holds the reply until the replicator has made it usable in every target
//! and CRI resolves it. Only then does the client get its 201.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::Value;

use crate::containerd::content::IngestStart;
use crate::containerd::{Descriptor, Image};
use crate::labels::{
    media_type, MediaType, GC_REF_CONTENT, REGISTRY_MEDIA_TYPE, REGISTRY_REPOSITORY,
    REGISTRY_SUBJECT, REPLICATE, REPLICATE_NO,
};

use super::errors::{Code, Error, Result};
use super::names::{Digest, Reference};
use super::{answer, full, Body, Registry};

/// How long the lease that covers a manifest between its commit and its
/// record may live (it is released as soon as the record is written).
const MANIFEST_LEASE: Duration = Duration::from_secs(600);

/// A child a manifest names.
struct Child {
    digest: String,
    /// Its GC label key (`containerd.io/gc.ref.content.l.0`).
    gc_key: String,
    /// Must be in the store (not a non-distributable layer).
    required: bool,
}

/// What a PUT manifest holds that matters here.
struct Parsed {
    media_type: String,
    children: Vec<Child>,
    subject: Option<String>,
    /// An image CRI can run (else an artefact: stored, never replicated).
    image: bool,
}

fn is_manifest_type(t: &str) -> bool {
    media_type::is_manifest(t) || media_type::is_index(t)
}

/// An image config CRI understands (OCI or Docker).
fn is_image_config(t: &str) -> bool {
    t == MediaType::ImageConfig.as_ref() || t == media_type::DOCKER_CONFIG
}

fn nondistributable(d: &Value) -> bool {
    let t = d["mediaType"].as_str().unwrap_or("");
    t.contains("nondistributable")
        || t.contains(".foreign.")
        || d["urls"].as_array().is_some_and(|u| !u.is_empty())
}

fn parse(doc: &Value, media_type: &str) -> Result<Parsed> {
    let bad = |m: &str| Error::new(Code::ManifestInvalid, m.to_string());
    let desc_digest = |d: &Value| -> Result<String> {
        let s = d["digest"]
            .as_str()
            .ok_or_else(|| bad("a descriptor has no digest"))?;
        Ok(Digest::parse(s)?.to_string())
    };
    let mut children = Vec::new();
    let artifact_type = doc["artifactType"].as_str().filter(|t| !t.is_empty());
    let subject = match &doc["subject"] {
        Value::Null => None,
        s => Some(desc_digest(s)?),
    };
    let image = if media_type::is_index(media_type) {
        let ms = doc["manifests"]
            .as_array()
            .ok_or_else(|| bad("an index without \"manifests\""))?;
        for (i, m) in ms.iter().enumerate() {
            children.push(Child {
                digest: desc_digest(m)?,
                gc_key: format!("{GC_REF_CONTENT}.m.{i}"),
                required: true,
            });
        }
        artifact_type.is_none()
            && subject.is_none()
            && !ms.is_empty()
            && ms
                .iter()
                .all(|m| is_manifest_type(m["mediaType"].as_str().unwrap_or("")))
    } else {
        let config = &doc["config"];
        if config.is_null() {
            return Err(bad("a manifest without \"config\""));
        }
        children.push(Child {
            digest: desc_digest(config)?,
            gc_key: format!("{GC_REF_CONTENT}.config"),
            required: true,
        });
        let layers = doc["layers"].as_array().map_or(&[][..], Vec::as_slice);
        for (i, l) in layers.iter().enumerate() {
            children.push(Child {
                digest: desc_digest(l)?,
                gc_key: format!("{GC_REF_CONTENT}.l.{i}"),
                required: !nondistributable(l),
            });
        }
        artifact_type.is_none()
            && subject.is_none()
            && !layers.is_empty()
            && is_image_config(config["mediaType"].as_str().unwrap_or(""))
    };
    Ok(Parsed {
        media_type: media_type.to_string(),
        children,
        subject,
        image,
    })
}

/// Reads at most `max` bytes of `body`; `None` past that.
async fn read_limited(mut body: Incoming, max: u64) -> Result<Option<Bytes>> {
    let mut buf = Vec::new();
    while let Some(f) = body.frame().await {
        let f =
            f.map_err(|e| Error::new(Code::ManifestInvalid, format!("reading the manifest: {e}")))?;
        if let Ok(d) = f.into_data() {
            if (buf.len() + d.len()) as u64 > max {
                return Ok(None);
            }
            buf.extend_from_slice(&d);
        }
    }
    Ok(Some(buf.into()))
}

/// The manifest's media type: its own `mediaType`, else the request's
/// Content-Type; the two must agree, and it must be a manifest or index.
fn manifest_media_type(doc: &Value, content_type: Option<String>) -> Result<String> {
    let declared_type = doc["mediaType"].as_str().filter(|t| !t.is_empty());
    let media_type = match (declared_type, &content_type) {
        (Some(d), Some(c)) if d != c => {
            return Err(Error::new(
                Code::ManifestInvalid,
                format!("Content-Type {c} but the manifest says mediaType {d}"),
            ))
        }
        (Some(d), _) => d.to_string(),
        (None, Some(c)) => c.clone(),
        (None, None) => {
            return Err(Error::new(
                Code::ManifestInvalid,
                "no manifest media type (neither Content-Type nor mediaType)",
            ))
        }
    };
    if !is_manifest_type(&media_type) {
        return Err(Error::new(
            Code::ManifestInvalid,
            format!("unsupported manifest media type {media_type}"),
        ));
    }
    Ok(media_type)
}

/// The body's digest; a PUT by digest must name the body's own.
fn manifest_digest(reference: &Reference, body: &[u8]) -> Result<Digest> {
    match reference {
        Reference::Digest(d) => {
            let got = Digest::of(d.algorithm(), body);
            if &got != d {
                return Err(Error::new(
                    Code::DigestInvalid,
                    format!("manifest PUT as {d} but its digest is {got}"),
                ));
            }
            Ok(got)
        }
        Reference::Tag(_) => Ok(Digest::of("sha256", body)),
    }
}

impl Registry {
    pub(super) async fn put_manifest(
        self: &Arc<Self>,
        name: &str,
        r: &str,
        req: Request<Incoming>,
    ) -> Result<Response<Body>> {
        let reference = Reference::parse(r)?;
        let host = self.push_host(&req)?;
        let (body, content_type) = self.read_manifest(req).await?;
        let doc: Value = serde_json::from_slice(&body)
            .map_err(|e| Error::new(Code::ManifestInvalid, format!("manifest is not JSON: {e}")))?;
        let media_type = manifest_media_type(&doc, content_type)?;
        let digest = manifest_digest(&reference, &body)?;
        let parsed = parse(&doc, &media_type)?;
        self.check_children(&parsed).await?;
        // The manifest, under a lease until its record holds it.
        let lease = self.c.create_lease(self.ns(), MANIFEST_LEASE).await?;
        let stored = self
            .store_manifest(name, &reference, &host, &body, &digest, &parsed, &lease)
            .await;
        let mut release = vec![lease];
        let record = match stored {
            Ok(record) => record,
            Err(e) => {
                super::session::release(&self.c, self.ns(), release).await;
                return Err(e);
            }
        };
        let children: Vec<String> = parsed.children.iter().map(|c| c.digest.clone()).collect();
        release.extend(self.held.take(&children));
        super::session::release(&self.c, self.ns(), release).await;
        if parsed.image && matches!(reference, Reference::Tag(_)) {
            self.replicate_pushed(&record).await?;
        }
        let mut headers = vec![
            ("location", format!("/v2/{name}/manifests/{digest}")),
            ("docker-content-digest", digest.to_string()),
        ];
        if let Some(s) = &parsed.subject {
            headers.push(("oci-subject", s.clone()));
        }
        Ok(answer(StatusCode::CREATED, &headers))
    }

    /// The PUT's body, refused past `registry.max_manifest_bytes` (by its
    /// Content-Length before reading any of it), and its manifest
    /// Content-Type if it names one.
    async fn read_manifest(&self, req: Request<Incoming>) -> Result<(Bytes, Option<String>)> {
        let too_big = || {
            Error::new(
                Code::ManifestInvalid,
                format!(
                    "manifest larger than {} bytes (registry.max_manifest_bytes)",
                    self.s.max_manifest
                ),
            )
            .with_status(StatusCode::PAYLOAD_TOO_LARGE)
        };
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|n| n > self.s.max_manifest) {
            return Err(too_big());
        }
        let content_type = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or("").trim().to_string())
            .filter(|v| is_manifest_type(v));
        let body = read_limited(req.into_body(), self.s.max_manifest)
            .await?
            .ok_or_else(too_big)?;
        Ok((body, content_type))
    }

    /// Every child the manifest needs must have been pushed first.
    async fn check_children(&self, parsed: &Parsed) -> Result<()> {
        for c in parsed.children.iter().filter(|c| c.required) {
            let d = Digest::parse(&c.digest)?;
            if self.blob_size(&d).await?.is_none() {
                return Err(Error::new(
                    Code::ManifestBlobUnknown,
                    format!("the manifest names {d}, which was not pushed"),
                ));
            }
        }
        Ok(())
    }

    /// Holds the reply until the replicator has made the pushed image
    /// usable; its refusal is the client's error.
    async fn replicate_pushed(&self, record: &Image) -> Result<()> {
        let root = record.target.clone();
        self.replicator
            .on_write("registry PUT manifest", self.ns(), &record.name, root)
            .await
            .map_err(|st| {
                let code = match st.code() {
                    tonic::Code::FailedPrecondition => Code::Denied,
                    _ => Code::Unknown,
                };
                Error::new(code, st.message().to_string())
            })
    }

    /// Writes the manifest blob (with its GC labels) and its record.
    #[allow(clippy::too_many_arguments)]
    async fn store_manifest(
        &self,
        name: &str,
        reference: &Reference,
        host: &str,
        body: &Bytes,
        digest: &Digest,
        parsed: &Parsed,
        lease: &str,
    ) -> Result<Image> {
        let mut labels: HashMap<String, String> = parsed
            .children
            .iter()
            .map(|c| (c.gc_key.clone(), c.digest.clone()))
            .collect();
        labels.insert(REGISTRY_MEDIA_TYPE.into(), parsed.media_type.clone());
        let size = body.len() as i64;
        match self
            .c
            .open_ingest(self.ns(), Some(lease), Some(digest.as_str()), size)
            .await?
        {
            IngestStart::Present => {
                self.c
                    .update_content_labels(self.ns(), digest.as_str(), &labels)
                    .await?;
            }
            IngestStart::Open(mut i) => {
                if !i.is_shared() {
                    i.write(body.to_vec()).await?;
                }
                i.commit(digest.as_str(), &labels)
                    .await
                    .map_err(|e| match e.code() {
                        Some(tonic::Code::FailedPrecondition) => Error::new(
                            Code::DigestInvalid,
                            super::upload::digest_refused(digest, &e),
                        ),
                        _ => Error::containerd(e),
                    })?;
            }
        }
        self.tombstones.lift(digest.as_str());
        let record_name = match reference {
            Reference::Tag(t) => format!("{host}/{name}:{t}"),
            Reference::Digest(d) => format!("{host}/{name}@{d}"),
        };
        let mut record_labels =
            HashMap::from([(REGISTRY_REPOSITORY.to_string(), name.to_string())]);
        if let Some(s) = &parsed.subject {
            record_labels.insert(REGISTRY_SUBJECT.into(), s.clone());
        }
        if !(parsed.image && matches!(reference, Reference::Tag(_))) {
            record_labels.insert(REPLICATE.into(), REPLICATE_NO.into());
        }
        let image = Image {
            name: record_name,
            labels: record_labels,
            target: Some(Descriptor {
                media_type: parsed.media_type.clone(),
                digest: digest.to_string(),
                size,
                annotations: HashMap::new(),
            }),
            ..Default::default()
        };
        Ok(self.c.put_image(self.ns(), image).await?)
    }

    /// The descriptor `reference` names in `name`, from its records.
    async fn resolve(
        &self,
        name: &str,
        reference: &Reference,
        host: &str,
    ) -> Result<Option<Descriptor>> {
        Ok(match reference {
            Reference::Tag(t) => self.tag_record(name, t, host).await?.and_then(|i| i.target),
            Reference::Digest(d) => self
                .records(name, &[])
                .await?
                .into_iter()
                .filter_map(|i| i.target)
                .find(|t| t.digest == d.as_str()),
        })
    }

    pub(super) async fn get_manifest(
        &self,
        name: &str,
        r: &str,
        req: &Request<Incoming>,
        head: bool,
    ) -> Result<Response<Body>> {
        let reference = Reference::parse(r)?;
        let unknown = || Error::new(Code::ManifestUnknown, format!("{name}: no manifest {r}"));
        let desc = self
            .resolve(name, &reference, &self.host(req))
            .await?
            .ok_or_else(unknown)?;
        let headers = [
            ("content-type", desc.media_type.clone()),
            ("content-length", desc.size.to_string()),
            ("docker-content-digest", desc.digest.clone()),
        ];
        let mut resp = answer(StatusCode::OK, &headers);
        if head {
            return Ok(resp);
        }
        let limit = (self.s.max_manifest as usize).max(desc.size.max(0) as usize);
        let body = match self.c.read_small(self.ns(), &desc.digest, limit).await {
            Ok(b) => b,
            Err(e) if e.is(tonic::Code::NotFound) => return Err(unknown()),
            Err(e) => return Err(e.into()),
        };
        *resp.body_mut() = full(body);
        Ok(resp)
    }

    /// DELETE by tag drops that tag; by digest, every record of the
    /// repository naming that manifest. containerd's GC then collects what
    /// no record holds; replicas follow `delete_policy`.
    pub(super) async fn delete_manifest(&self, name: &str, r: &str) -> Result<Response<Body>> {
        let reference = Reference::parse(r)?;
        let doomed: Vec<Image> = self
            .records(name, &[])
            .await?
            .into_iter()
            .filter(|i| match &reference {
                Reference::Tag(t) => super::records::tag_of(&i.name, name) == Some(t.as_str()),
                Reference::Digest(d) => i.target.as_ref().is_some_and(|x| x.digest == d.as_str()),
            })
            .collect();
        if doomed.is_empty() {
            return Err(Error::new(
                Code::ManifestUnknown,
                format!("{name}: no manifest {r}"),
            ));
        }
        for i in doomed {
            self.c.delete_image(self.ns(), &i.name, false).await?;
            // What an `Images.Delete` through the proxy gets: the replicas
            // follow `delete_policy` before the reply. The record is gone
            // either way; a failure is the catch-up pass's to finish.
            if let Err(e) = self.replicator.on_delete(self.ns(), &i.name).await {
                tracing::warn!(image = %i.name, error = %e, "applying delete_policy failed; the next catch-up pass retries");
            }
        }
        Ok(answer(StatusCode::ACCEPTED, &[]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(c: char) -> String {
        format!("sha256:{}", c.to_string().repeat(64))
    }

    #[test]
    fn images_and_artefacts() {
        let image = serde_json::json!({
            "schemaVersion": 2,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": d('a'), "size": 1},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d('b'), "size": 1}]
        });
        let p = parse(&image, MediaType::ImageManifest.as_ref()).unwrap();
        assert!(p.image);
        assert_eq!(p.children.len(), 2);
        assert_eq!(p.children[0].gc_key, "containerd.io/gc.ref.content.config");
        assert_eq!(p.children[1].gc_key, "containerd.io/gc.ref.content.l.0");
        let chart = serde_json::json!({
            "schemaVersion": 2,
            "config": {"mediaType": "application/vnd.cncf.helm.config.v1+json", "digest": d('a'), "size": 1},
            "layers": [{"mediaType": "application/vnd.cncf.helm.chart.content.v1.tar+gzip", "digest": d('b'), "size": 1}]
        });
        assert!(
            !parse(&chart, MediaType::ImageManifest.as_ref())
                .unwrap()
                .image
        );
        let mut referrer = image.clone();
        referrer["subject"] = serde_json::json!({"mediaType": "x", "digest": d('c'), "size": 1});
        let p = parse(&referrer, MediaType::ImageManifest.as_ref()).unwrap();
        assert!(!p.image);
        assert_eq!(p.subject, Some(d('c')));
        let index = serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": d('e'), "size": 1}]
        });
        let p = parse(&index, MediaType::ImageIndex.as_ref()).unwrap();
        assert!(p.image);
        assert_eq!(p.children[0].gc_key, "containerd.io/gc.ref.content.m.0");
        let bad = serde_json::json!({"schemaVersion": 2, "config": {"digest": "sha256:zz"}});
        assert!(parse(&bad, MediaType::ImageManifest.as_ref()).is_err());
    }
}
