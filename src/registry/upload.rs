//! Blob uploads (`/v2/<name>/blobs/uploads/`): POST opens a session (or
//! mounts a blob containerd has, or takes a monolithic upload with
//! `?digest=`), PATCH appends a chunk at the offset `Content-Range` names,
//! PUT `?digest=` appends the rest and commits, GET reports the offset,
//! DELETE cancels. Bytes go to containerd as they arrive, 1 MiB at a time:
//! memory per upload is constant whatever the blob's size, and the digest
//! is checked by containerd's commit (`expected`), not by us.

use std::collections::HashMap;
use std::time::Instant;

use http::{header, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::containerd::content::IngestStart;
use crate::containerd::leases::Lease;
use crate::oci::{Digest, Repository};

use super::errors::{Code, Error, Result};
use super::session::{Session, State};
use super::{answer, Body, Registry};

/// Bytes gathered before one WRITE to containerd (its own chunk size).
const CHUNK: usize = 1 << 20;

/// The value of `key` in a query string, percent-decoded.
pub fn query_param(query: Option<&str>, key: &str) -> Option<String> {
    query?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (k == key).then(|| {
            percent_encoding::percent_decode_str(&v.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned()
        })
    })
}

fn range(offset: u64) -> String {
    format!("0-{}", offset.saturating_sub(1))
}

fn location(name: &str, id: &str) -> String {
    format!("/v2/{name}/blobs/uploads/{id}")
}

/// Why containerd refused to commit as `d`. containerd before 2.3 hashes
/// every ingest with sha256 only, so it refuses any sha512 digest.
pub fn digest_refused(d: &Digest, e: &crate::containerd::Error) -> String {
    if d.algorithm() != "sha256" && e.to_string().contains("unexpected commit digest sha256:") {
        format!("{d}: this containerd verifies only sha256 digests (sha512 needs containerd 2.3 or later); push with sha256")
    } else {
        format!("the uploaded bytes are not {d}: {e}")
    }
}

/// A chunk must start where the upload stands (`Content-Range: a-b`);
/// else 416 with the current range, the session unchanged.
fn check_range(req: &Request<Incoming>, offset: u64, name: &str, id: &str) -> Result<()> {
    let Some(cr) = req.headers().get(header::CONTENT_RANGE) else {
        return Ok(());
    };
    let start = cr
        .to_str()
        .ok()
        .map(|v| {
            v.trim()
                .trim_start_matches("bytes")
                .trim_start_matches([' ', '='])
        })
        .and_then(|v| v.split_once('-'))
        .and_then(|(a, _)| a.trim().parse::<u64>().ok());
    if start == Some(offset) {
        return Ok(());
    }
    Err(Error::new(
        Code::BlobUploadInvalid,
        format!("chunk at {cr:?} but the upload has {offset} bytes: chunks must come in order"),
    )
    .with_status(StatusCode::RANGE_NOT_SATISFIABLE)
    .with_header(header::LOCATION, location(name, id))
    .with_header(header::RANGE, range(offset)))
}

impl Registry {
    /// A lease for an upload (or a mounted blob): it outlives the session by
    /// the time an uploaded blob waits for its manifest.
    pub(super) async fn upload_lease(&self) -> Result<Lease> {
        Ok(self
            .c
            .lease(
                self.ns(),
                self.s.upload_expiry * 2 + std::time::Duration::from_secs(60),
            )
            .await?)
    }

    /// Keeps `digest` under `lease` until a manifest names it.
    pub(super) fn hold(&self, digest: &str, lease: Lease) {
        self.tombstones.lift(digest);
        self.held
            .add(digest, lease, Instant::now() + self.s.upload_expiry);
    }

    pub(super) async fn start_upload(
        &self,
        name: &Repository,
        req: Request<Incoming>,
    ) -> Result<Response<Body>> {
        let q = req.uri().query().map(str::to_owned);
        let q = q.as_deref();
        if let Some(m) = query_param(q, "mount") {
            if let Ok(d) = Digest::parse(&m) {
                if let Some(r) = self.mount(name, &d).await? {
                    return Ok(r);
                }
            }
            // Not here: the client uploads it (spec: 202 and a session).
        }
        let lease = self.upload_lease().await?;
        let session = Session {
            repo: name.clone(),
            state: State::Empty,
            lease,
        };
        if let Some(d) = query_param(q, "digest") {
            // Monolithic upload in the POST itself.
            let d = Digest::parse(&d)?;
            return self.finish(name, session, req.into_body(), &d).await;
        }
        let id = match self.sessions.open(session, self.s.max_uploads) {
            Some(id) => id,
            None => {
                return Err(Error::new(
                    Code::TooManyRequests,
                    format!(
                        "{} uploads are open (registry.max_uploads); finish or cancel some, or wait for idle ones to expire",
                        self.s.max_uploads
                    ),
                ));
            }
        };
        Ok(answer(
            StatusCode::ACCEPTED,
            &[
                ("location", location(name, &id)),
                ("range", range(0)),
                ("docker-upload-uuid", id),
            ],
        ))
    }

    /// A blob containerd has (here or, linked, in another namespace) is
    /// mounted without moving bytes: leased until a manifest names it.
    async fn mount(&self, name: &Repository, d: &Digest) -> Result<Option<Response<Body>>> {
        let Some(_) = self.blob_size(d).await? else {
            return Ok(None);
        };
        let lease = self.upload_lease().await?;
        if let Err(e) = self
            .c
            .lease_content(self.ns(), lease.id(), d.as_str())
            .await
        {
            lease.release().await;
            return Err(e.into());
        }
        self.hold(d.as_str(), lease);
        Ok(Some(answer(
            StatusCode::CREATED,
            &[
                ("location", format!("/v2/{name}/blobs/{d}")),
                ("docker-content-digest", d.to_string()),
            ],
        )))
    }

    /// The session `id` of `name`, locked; `Err` if unknown.
    async fn session(
        &self,
        name: &Repository,
        id: &str,
    ) -> Result<tokio::sync::OwnedMutexGuard<Option<Session>>> {
        let unknown = || {
            Error::new(
                Code::BlobUploadUnknown,
                format!("no upload {id:?} in {name}"),
            )
        };
        let slot = self.sessions.get(id).ok_or_else(unknown)?;
        let g = slot.lock_owned().await;
        match &*g {
            Some(s) if s.repo == *name => Ok(g),
            _ => Err(unknown()),
        }
    }

    /// Ends a session whose upload failed: its ingest is aborted (on drop)
    /// and its lease released.
    async fn fail(&self, id: &str, s: Option<Session>) {
        self.sessions.remove(id);
        if let Some(s) = s {
            s.end().await;
        }
    }

    pub(super) async fn patch_upload(
        &self,
        name: &Repository,
        id: &str,
        req: Request<Incoming>,
    ) -> Result<Response<Body>> {
        let mut g = self.session(name, id).await?;
        let s = g.as_mut().expect("checked by session()");
        check_range(&req, s.offset(), name, id)?;
        if let Err(e) = self.feed(s, req.into_body()).await {
            let s = g.take();
            self.fail(id, s).await;
            return Err(e);
        }
        let offset = s.offset();
        Ok(answer(
            StatusCode::ACCEPTED,
            &[
                ("location", location(name, id)),
                ("range", range(offset)),
                ("docker-upload-uuid", id.to_string()),
            ],
        ))
    }

    pub(super) async fn put_upload(
        &self,
        name: &Repository,
        id: &str,
        req: Request<Incoming>,
    ) -> Result<Response<Body>> {
        let d = super::upload::query_param(req.uri().query(), "digest")
            .ok_or_else(|| Error::new(Code::DigestInvalid, "PUT without ?digest="))?;
        let d = Digest::parse(&d)?;
        let mut g = self.session(name, id).await?;
        let offset = g.as_ref().map_or(0, Session::offset);
        // Out of order: the session stays as it was (the client recovers
        // with a GET of its status).
        check_range(&req, offset, name, id)?;
        let s = g.take().expect("checked by session()");
        self.sessions.remove(id);
        drop(g);
        self.finish(name, s, req.into_body(), &d).await
    }

    /// Appends `body` and commits as `d`; the session is over either way.
    async fn finish(
        &self,
        name: &Repository,
        mut s: Session,
        body: Incoming,
        d: &Digest,
    ) -> Result<Response<Body>> {
        if let Err(e) = self.feed_and_commit(&mut s, body, d).await {
            s.end().await;
            return Err(e);
        }
        // Committed: the lease now holds the blob until a manifest names it.
        self.hold(d.as_str(), s.lease);
        Ok(answer(
            StatusCode::CREATED,
            &[
                ("location", format!("/v2/{name}/blobs/{d}")),
                ("docker-content-digest", d.to_string()),
            ],
        ))
    }

    async fn feed_and_commit(&self, s: &mut Session, body: Incoming, d: &Digest) -> Result<()> {
        self.feed(s, body).await?;
        let labels = HashMap::new();
        let ingest = match std::mem::replace(&mut s.state, State::Empty) {
            State::Writing { ingest, .. } => *ingest,
            // No byte came: a zero-length blob, or one containerd has.
            State::Empty => {
                match self
                    .c
                    .open_ingest(self.ns(), Some(s.lease.id()), Some(d.as_str()), 0)
                    .await?
                {
                    IngestStart::Present => return Ok(()),
                    IngestStart::Open(i) => i,
                }
            }
        };
        ingest
            .commit_written(d.as_str(), &labels)
            .await
            .map_err(|e| match e.code() {
                Some(tonic::Code::FailedPrecondition | tonic::Code::InvalidArgument) => {
                    Error::new(Code::DigestInvalid, digest_refused(d, &e))
                }
                _ => Error::containerd(e),
            })
    }

    /// Streams `body` into the session's ingest in WRITEs of exactly
    /// [`CHUNK`] (a request's last one may be shorter). The body's frames
    /// (hyper's reads, 8-500 KiB) are cut at chunk boundaries and gathered
    /// into a buffer allocated once at full size: every WRITE costs
    /// containerd a round of its handler, so a frame that overshoots the
    /// chunk is not sent as a WRITE of its own. Sending waits for no reply
    /// (the ingest keeps a bounded window of them in flight), so the next
    /// bytes are read while containerd writes these; memory stays one chunk
    /// plus that window whatever the blob's size.
    async fn feed(&self, s: &mut Session, mut body: Incoming) -> Result<()> {
        let mut buf: Vec<u8> = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                Error::new(
                    Code::BlobUploadInvalid,
                    format!("reading the request body: {e}"),
                )
            })?;
            let Ok(mut data) = frame.into_data() else {
                continue;
            };
            let total = s.offset() + (buf.len() + data.len()) as u64;
            if self.s.max_blob > 0 && total > self.s.max_blob {
                return Err(Error::new(
                    Code::SizeInvalid,
                    format!(
                        "blob larger than registry.max_blob_bytes ({})",
                        self.s.max_blob
                    ),
                )
                .with_status(StatusCode::PAYLOAD_TOO_LARGE));
            }
            while !data.is_empty() {
                if buf.capacity() == 0 {
                    buf.reserve_exact(CHUNK);
                }
                let n = data.len().min(CHUNK - buf.len());
                buf.extend_from_slice(&data[..n]);
                bytes::Buf::advance(&mut data, n);
                if buf.len() == CHUNK {
                    self.send(s, std::mem::take(&mut buf)).await?;
                }
            }
        }
        if !buf.is_empty() {
            self.send(s, buf).await?;
        }
        Ok(())
    }

    async fn send(&self, s: &mut Session, data: Vec<u8>) -> Result<()> {
        if let State::Empty = s.state {
            match self
                .c
                .open_ingest(self.ns(), Some(s.lease.id()), None, 0)
                .await?
            {
                IngestStart::Open(ingest) => {
                    s.state = State::Writing {
                        ingest: Box::new(ingest),
                        offset: 0,
                    }
                }
                IngestStart::Present => {
                    return Err(Error::new(
                        Code::Unknown,
                        "containerd reported an ingest without digest as present",
                    ))
                }
            }
        }
        let State::Writing { ingest, offset } = &mut s.state else {
            unreachable!("opened above")
        };
        let n = data.len() as u64;
        ingest.write(data).await?;
        *offset += n;
        if let Some(o) = &self.observer {
            o.blob_bytes(n);
        }
        Ok(())
    }

    pub(super) async fn upload_status(
        &self,
        name: &Repository,
        id: &str,
    ) -> Result<Response<Body>> {
        let g = self.session(name, id).await?;
        let offset = g.as_ref().map_or(0, Session::offset);
        Ok(answer(
            StatusCode::NO_CONTENT,
            &[
                ("location", location(name, id)),
                ("range", range(offset)),
                ("docker-upload-uuid", id.to_string()),
            ],
        ))
    }

    pub(super) async fn cancel_upload(
        &self,
        name: &Repository,
        id: &str,
    ) -> Result<Response<Body>> {
        let mut g = self.session(name, id).await?;
        let s = g.take();
        drop(g);
        self.fail(id, s).await;
        Ok(answer(StatusCode::NO_CONTENT, &[]))
    }
}
