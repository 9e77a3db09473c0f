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

use crate::containerd::content::IngestStart;
use crate::containerd::{Descriptor, Image};
use crate::labels::{
    media_type, REGISTRY_MEDIA_TYPE, REGISTRY_REPOSITORY, REGISTRY_SUBJECT, REPLICATE, REPLICATE_NO,
};
use crate::oci::manifest::is_parent;
use crate::oci::{Digest, Manifest, ManifestRef, Repository};

use super::errors::{Code, Error, Result};
use super::{answer, full, Body, Registry};

/// How long the lease that covers a manifest between its commit and its
/// record may live (it is released as soon as the record is written).
const MANIFEST_LEASE: Duration = Duration::from_secs(600);

/// A manifest PUT, read and checked: what is stored and recorded.
struct Push {
    name: Repository,
    reference: ManifestRef,
    /// The host the record is named with.
    host: String,
    body: Bytes,
    digest: Digest,
    media_type: String,
    doc: Manifest,
}

impl Push {
    /// An image pushed by tag: replicated before the reply. Artefacts and
    /// manifests pushed by digest only are stored, never given to CRI.
    fn replicated(&self) -> bool {
        self.doc.runnable() && matches!(self.reference, ManifestRef::Tag(_))
    }

    fn record_name(&self) -> String {
        let (host, name) = (&self.host, &self.name);
        match &self.reference {
            ManifestRef::Tag(t) => format!("{host}/{name}:{t}"),
            ManifestRef::Digest(d) => format!("{host}/{name}@{d}"),
        }
    }

    fn record(&self) -> Image {
        let mut labels = HashMap::from([(REGISTRY_REPOSITORY.to_string(), self.name.to_string())]);
        if let Some(s) = &self.doc.subject {
            labels.insert(REGISTRY_SUBJECT.into(), s.digest.to_string());
        }
        if !self.replicated() {
            labels.insert(REPLICATE.into(), REPLICATE_NO.into());
        }
        Image {
            name: self.record_name(),
            labels,
            target: Some(Descriptor {
                media_type: self.media_type.clone(),
                digest: self.digest.to_string(),
                size: self.body.len() as i64,
                annotations: HashMap::new(),
            }),
            ..Default::default()
        }
    }
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
fn manifest_media_type(doc: &Manifest, content_type: Option<String>) -> Result<String> {
    let media_type = match (&doc.media_type, content_type) {
        (Some(d), Some(c)) if *d != c => {
            return Err(Error::new(
                Code::ManifestInvalid,
                format!("Content-Type {c} but the manifest says mediaType {d}"),
            ))
        }
        (Some(d), _) => d.clone(),
        (None, Some(c)) => c,
        (None, None) => {
            return Err(Error::new(
                Code::ManifestInvalid,
                "no manifest media type (neither Content-Type nor mediaType)",
            ))
        }
    };
    if !is_parent(&media_type) {
        return Err(Error::new(
            Code::ManifestInvalid,
            format!("unsupported manifest media type {media_type}"),
        ));
    }
    // An index's shape under a manifest's type, or the reverse.
    if media_type::is_index(&media_type) != doc.is_index() {
        return Err(Error::new(
            Code::ManifestInvalid,
            format!("the document's shape does not match its media type {media_type}"),
        ));
    }
    Ok(media_type)
}

/// The body's digest; a PUT by digest must name the body's own.
fn manifest_digest(reference: &ManifestRef, body: &[u8]) -> Result<Digest> {
    match reference {
        ManifestRef::Digest(d) => {
            let got = Digest::of(d.algorithm(), body);
            if &got != d {
                return Err(Error::new(
                    Code::DigestInvalid,
                    format!("manifest PUT as {d} but its digest is {got}"),
                ));
            }
            Ok(got)
        }
        ManifestRef::Tag(_) => Ok(Digest::sha256(body)),
    }
}

impl Registry {
    pub(super) async fn put_manifest(
        self: &Arc<Self>,
        name: &Repository,
        reference: &ManifestRef,
        req: Request<Incoming>,
    ) -> Result<Response<Body>> {
        let host = self.push_host(&req)?;
        let (body, content_type) = self.read_manifest(req).await?;
        let doc =
            Manifest::parse(&body).map_err(|e| Error::new(Code::ManifestInvalid, e.to_string()))?;
        let push = Push {
            name: name.clone(),
            reference: reference.clone(),
            host,
            media_type: manifest_media_type(&doc, content_type)?,
            digest: manifest_digest(reference, &body)?,
            body,
            doc,
        };
        self.check_children(&push.doc).await?;
        // The manifest, under a lease until its record holds it.
        let lease = self.c.lease(self.ns(), MANIFEST_LEASE).await?;
        let record = self.store_manifest(&push, lease.id()).await?;
        lease.release().await;
        // Its children's upload leases: the record keeps them now.
        for l in self
            .held
            .take(push.doc.children().map(|c| c.digest.as_str()))
        {
            l.release().await;
        }
        if push.replicated() {
            self.replicate_pushed(&record).await?;
        }
        let mut headers = vec![
            ("location", format!("/v2/{name}/manifests/{}", push.digest)),
            ("docker-content-digest", push.digest.to_string()),
        ];
        if let Some(s) = &push.doc.subject {
            headers.push(("oci-subject", s.digest.to_string()));
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
            .filter(|v| is_parent(v));
        let body = read_limited(req.into_body(), self.s.max_manifest)
            .await?
            .ok_or_else(too_big)?;
        Ok((body, content_type))
    }

    /// Every child the manifest needs must have been pushed first (a
    /// non-distributable layer need not: its bytes come from its URLs).
    async fn check_children(&self, doc: &Manifest) -> Result<()> {
        for c in doc.children().filter(|c| !c.external) {
            if self.blob_size(&c.digest).await?.is_none() {
                return Err(Error::new(
                    Code::ManifestBlobUnknown,
                    format!("the manifest names {}, which was not pushed", c.digest),
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

    /// Writes the manifest blob (with its GC labels) under `lease`, then
    /// its record.
    async fn store_manifest(&self, p: &Push, lease: &str) -> Result<Image> {
        let mut labels = p.doc.gc_labels();
        labels.insert(REGISTRY_MEDIA_TYPE.into(), p.media_type.clone());
        let size = p.body.len() as i64;
        match self
            .c
            .open_ingest(self.ns(), Some(lease), Some(p.digest.as_str()), size)
            .await?
        {
            IngestStart::Present => {
                self.c
                    .update_content_labels(self.ns(), p.digest.as_str(), &labels)
                    .await?;
            }
            IngestStart::Open(mut i) => {
                if !i.is_shared() {
                    i.write(p.body.to_vec()).await?;
                }
                i.commit(p.digest.as_str(), &labels)
                    .await
                    .map_err(|e| match e.code() {
                        Some(tonic::Code::FailedPrecondition) => Error::new(
                            Code::DigestInvalid,
                            super::upload::digest_refused(&p.digest, &e),
                        ),
                        _ => Error::containerd(e),
                    })?;
            }
        }
        self.tombstones.lift(p.digest.as_str());
        Ok(self.c.put_image(self.ns(), p.record()).await?)
    }

    /// The descriptor `reference` names in `name`, from its records.
    async fn resolve(
        &self,
        name: &Repository,
        reference: &ManifestRef,
        host: &str,
    ) -> Result<Option<Descriptor>> {
        Ok(match reference {
            ManifestRef::Tag(t) => self.tag_record(name, t, host).await?.and_then(|i| i.target),
            ManifestRef::Digest(d) => self
                .records(name, &[])
                .await?
                .into_iter()
                .filter_map(|i| i.target)
                .find(|t| t.digest == d.as_str()),
        })
    }

    pub(super) async fn get_manifest(
        &self,
        name: &Repository,
        reference: &ManifestRef,
        req: &Request<Incoming>,
        head: bool,
    ) -> Result<Response<Body>> {
        let unknown = || {
            Error::new(
                Code::ManifestUnknown,
                format!("{name}: no manifest {reference}"),
            )
        };
        let desc = self
            .resolve(name, reference, &self.host(req))
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
    pub(super) async fn delete_manifest(
        &self,
        name: &Repository,
        reference: &ManifestRef,
    ) -> Result<Response<Body>> {
        let doomed: Vec<Image> = self
            .records(name, &[])
            .await?
            .into_iter()
            .filter(|i| match reference {
                ManifestRef::Tag(t) => super::records::tag_of(&i.name, name) == Some(t.as_str()),
                ManifestRef::Digest(d) => i.target.as_ref().is_some_and(|x| x.digest == d.as_str()),
            })
            .collect();
        if doomed.is_empty() {
            return Err(Error::new(
                Code::ManifestUnknown,
                format!("{name}: no manifest {reference}"),
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
