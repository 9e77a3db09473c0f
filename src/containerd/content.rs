//! Content: reading blobs, and making a blob visible in another namespace.
//!
//! In `shared` mode a blob already in the backend is linked with a data-less
//! ingest (STAT, then COMMIT at `offset = total`): no bytes move. In
//! `isolated` mode, or when the backend lacks it, bytes are streamed with
//! bounded memory. Where this is in a replication:
//! [docs/design.md](../../docs/design.md#replication), step 2. The messages
//! themselves: [`Containerd::link_shared`] (the COMMIT alone, one round trip)
//! and [`Containerd::link_or_copy`] (STAT, then COMMIT, or WRITEs and COMMIT).

use std::collections::HashMap;

use bytes::Bytes;
use containerd_client::services::v1::{
    AbortRequest, Info, InfoRequest, ReadContentRequest, WriteAction, WriteContentRequest,
};
use futures_util::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::{request, Containerd, Error, Result};

/// Chunk size of streamed writes, as the Go client uses.
const CHUNK: usize = 1 << 20;
/// WRITE messages sent ahead of their acknowledgement: waiting for each ack
/// would idle both sides once per chunk; a bounded window keeps memory
/// constant (acks are ~100 bytes, far below any HTTP/2 window).
const WINDOW: usize = 8;
/// WRITE messages queued for tonic's encoder. The window's other WRITEs are
/// in containerd's hands; each one queued here is a chunk more of memory
/// per ingest (a 10-layer push's peak RSS: 34-35 MiB with 4, 28-29 with 1,
/// as fast), and the encoder takes the next as soon as HTTP/2 lets it.
const QUEUED: usize = 1;

/// How a blob reached the target namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Linked {
    /// It was already there (labels untouched).
    Present,
    /// Shared content: only metadata was written.
    Shared,
    /// Bytes were streamed.
    Copied,
}

/// Identity of a blob to write.
#[derive(Clone, Debug)]
pub struct BlobRef<'a> {
    pub digest: &'a str,
    pub size: i64,
    pub labels: &'a HashMap<String, String>,
}

impl Containerd {
    /// `Content.Info` in `ns`; `None` if the blob is not visible there.
    pub async fn content_info(&self, ns: &str, digest: &str) -> Result<Option<Info>> {
        match self
            .content()
            .info(request(
                ns,
                None,
                InfoRequest {
                    digest: digest.into(),
                },
            ))
            .await
        {
            Ok(r) => Ok(r.into_inner().info),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(s) => Err(Error::Status {
                op: format!("Content.Info {digest} in {ns}"),
                status: s,
            }),
        }
    }

    /// Streams a blob's bytes from `ns` (containerd sends ≤1 MiB chunks).
    pub async fn read_stream(
        &self,
        ns: &str,
        digest: &str,
    ) -> Result<impl Stream<Item = Result<Bytes>> + Send + 'static> {
        self.read_range(ns, digest, 0, 0).await
    }

    /// [`Self::read_stream`] of `size` bytes from `offset` (`size` 0: to
    /// the end).
    pub async fn read_range(
        &self,
        ns: &str,
        digest: &str,
        offset: i64,
        size: i64,
    ) -> Result<impl Stream<Item = Result<Bytes>> + Send + 'static> {
        let op = format!("Content.Read {digest} in {ns}");
        let s = self
            .bulk_content()
            .read(request(
                ns,
                None,
                ReadContentRequest {
                    digest: digest.into(),
                    offset,
                    size,
                },
            ))
            .await
            .map_err(Error::status(op.clone()))?
            .into_inner();
        Ok(s.map(move |r| {
            r.map(|m| Bytes::from(m.data))
                .map_err(|status| Error::Status {
                    op: op.clone(),
                    status,
                })
        }))
    }

    /// Reads a whole small blob (manifests, indexes, configs), refusing more
    /// than `limit` bytes so a hostile tree cannot exhaust memory.
    pub async fn read_small(&self, ns: &str, digest: &str, limit: usize) -> Result<Bytes> {
        let mut s = Box::pin(self.read_stream(ns, digest).await?);
        let mut buf = Vec::new();
        while let Some(chunk) = s.next().await {
            let chunk = chunk?;
            if buf.len() + chunk.len() > limit {
                return Err(Error::Protocol(format!(
                    "blob {digest} in {ns} is larger than {limit} bytes; refusing to parse it"
                )));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(buf.into())
    }

    /// Makes `blob` visible in `target` under `lease` with its labels,
    /// reading bytes from `source` only if containerd cannot share them.
    pub async fn link_or_copy(
        &self,
        source: &str,
        target: &str,
        lease: Option<&str>,
        blob: BlobRef<'_>,
    ) -> Result<Linked> {
        let digest = blob.digest;
        let op = format!("Content.Write {digest} in {target}");
        let call = self.write_with(target, lease, blob, || self.read_stream(source, digest));
        self.guarded(&op, target, digest, call).await
    }

    /// Shared content in ONE round trip: a first message that is already the
    /// COMMIT (`offset = total`, labels included). `Ok(None)` when containerd
    /// cannot share the bytes (isolated mode, or the backend lacks them):
    /// the ingest is aborted and the caller must stream them.
    pub async fn link_shared(
        &self,
        ns: &str,
        lease: Option<&str>,
        blob: BlobRef<'_>,
    ) -> Result<Option<Linked>> {
        let digest = blob.digest;
        let op = format!("Content.Write {digest} in {ns}");
        self.guarded(&op, ns, digest, self.commit_shared(ns, lease, blob))
            .await
    }

    async fn commit_shared(
        &self,
        ns: &str,
        lease: Option<&str>,
        blob: BlobRef<'_>,
    ) -> Result<Option<Linked>> {
        let reference = format!("imgbridge-{}-{}", super::leases::unique(), blob.digest);
        let op = format!("Content.Write {} in {ns}", blob.digest);
        let msg = WriteContentRequest {
            action: WriteAction::Commit as i32,
            r#ref: reference.clone(),
            total: blob.size,
            offset: blob.size,
            expected: blob.digest.into(),
            labels: blob.labels.clone(),
            ..Default::default()
        };
        // Aborts the ingest if this future is dropped mid-call.
        let mut guard = AbortOnDrop {
            c: self.clone(),
            ns: ns.into(),
            lease: lease.map(str::to_owned),
            reference: Some(reference),
        };
        // Keep our side open until the reply: the server then sends its
        // reply before it sees the end of the stream.
        let (tx, rx) = mpsc::channel(1);
        tx.send(msg)
            .await
            .map_err(|_| Error::Protocol("write channel closed".into()))?;
        let res = match self
            .content()
            .write(request(ns, lease, ReceiverStream::new(rx)))
            .await
        {
            Ok(r) => r.into_inner().message().await.map(|m| m.is_some()),
            Err(s) => Err(s),
        };
        drop(tx);
        match res {
            Ok(true) => {
                guard.reference = None;
                Ok(Some(Linked::Shared))
            }
            Ok(false) => Err(Error::Protocol(format!(
                "{op}: stream ended before COMMIT reply"
            ))),
            Err(s) if s.code() == tonic::Code::AlreadyExists => {
                guard.reference = None;
                Ok(Some(Linked::Present))
            }
            // "write @N must occur at current offset 0": nothing to share.
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::OutOfRange | tonic::Code::FailedPrecondition
                ) =>
            {
                if let Some(r) = guard.reference.take() {
                    self.abort_ingest(ns, lease, &r).await;
                }
                Ok(None)
            }
            Err(status) => Err(Error::Status { op, status }),
        }
    }

    /// Best effort: a failed ingest otherwise lingers until it expires.
    pub(crate) async fn abort_ingest(&self, ns: &str, lease: Option<&str>, reference: &str) {
        let _ = self
            .content()
            .abort(request(
                ns,
                lease,
                AbortRequest {
                    r#ref: reference.into(),
                },
            ))
            .await;
    }

    /// Writes a blob from a byte stream into `ns` (digest verified by
    /// containerd at commit). Already present counts as success.
    pub async fn write_blob<S>(
        &self,
        ns: &str,
        lease: Option<&str>,
        blob: BlobRef<'_>,
        data: S,
    ) -> Result<Linked>
    where
        S: Stream<Item = Result<Bytes>> + Send + Unpin,
    {
        self.write_with(ns, lease, blob, || async { Ok(data) })
            .await
    }

    /// Opens an ingest of `blob` in `ns` and asks `data` for the bytes only
    /// if containerd has neither the blob nor shared bytes for it.
    async fn write_with<S, F, Fut>(
        &self,
        ns: &str,
        lease: Option<&str>,
        blob: BlobRef<'_>,
        data: F,
    ) -> Result<Linked>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<S>>,
        S: Stream<Item = Result<Bytes>> + Send + Unpin,
    {
        let mut w = match self.open_writer(ns, lease, &blob).await? {
            Opened::Present => return Ok(Linked::Present),
            Opened::Writer(w) => w,
        };
        if w.offset == blob.size {
            w.commit(&blob).await?;
            return Ok(Linked::Shared);
        }
        w.write_all(data().await?, &blob).await?;
        Ok(Linked::Copied)
    }

    async fn open_writer(
        &self,
        ns: &str,
        lease: Option<&str>,
        blob: &BlobRef<'_>,
    ) -> Result<Opened> {
        let (tx, rx) = mpsc::channel(QUEUED);
        let reference = format!("imgbridge-{}-{}", super::leases::unique(), blob.digest);
        let op = format!("Content.Write {} in {ns}", blob.digest);
        tx.send(WriteContentRequest {
            action: WriteAction::Stat as i32,
            r#ref: reference.clone(),
            total: blob.size,
            expected: blob.digest.into(),
            ..Default::default()
        })
        .await
        .map_err(|_| Error::Protocol("write channel closed".into()))?;
        let mut replies = match self
            .content()
            .write(request(ns, lease, ReceiverStream::new(rx)))
            .await
        {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == tonic::Code::AlreadyExists => return Ok(Opened::Present),
            Err(status) => return Err(Error::Status { op, status }),
        };
        let stat = match replies.message().await {
            Ok(Some(m)) => m,
            Ok(None) => {
                return Err(Error::Protocol(format!(
                    "{op}: stream ended before STAT reply"
                )))
            }
            Err(s) if s.code() == tonic::Code::AlreadyExists => return Ok(Opened::Present),
            Err(status) => return Err(Error::Status { op, status }),
        };
        Ok(Opened::Writer(Writer {
            containerd: self.clone(),
            ns: ns.into(),
            lease: lease.map(str::to_owned),
            reference,
            offset: stat.offset,
            tx: Some(tx),
            replies,
            unacked: 0,
            op,
            done: false,
        }))
    }
}

/// A blob written chunk by chunk by a caller that learns its digest only
/// at the end (docker-archive layers are named by their v1 id, not their
/// digest): open with the digest if known, push chunks, commit with the
/// digest the caller computed. containerd verifies it at commit. Aborted on
/// drop unless committed.
pub struct Ingest {
    writer: Writer,
    size: i64,
}

/// What [`Containerd::open_ingest`] found.
#[allow(clippy::large_enum_variant)] // short-lived, never stored in bulk
pub enum IngestStart {
    /// The expected digest is already in the namespace (and now in the lease).
    Present,
    /// Write the bytes (or commit straight away when [`Ingest::is_shared`]).
    Open(Ingest),
}

impl Containerd {
    /// Starts an ingest of `size` bytes in `ns`; `expected` lets containerd
    /// answer "already present" or share the backend's bytes without a copy.
    pub async fn open_ingest(
        &self,
        ns: &str,
        lease: Option<&str>,
        expected: Option<&str>,
        size: i64,
    ) -> Result<IngestStart> {
        let labels = HashMap::new();
        let blob = BlobRef {
            digest: expected.unwrap_or(""),
            size,
            labels: &labels,
        };
        Ok(match self.open_writer(ns, lease, &blob).await? {
            Opened::Present => IngestStart::Present,
            Opened::Writer(writer) => IngestStart::Open(Ingest { writer, size }),
        })
    }

    /// Deletes a blob from `ns`; `false` if it was not there.
    pub async fn delete_content(&self, ns: &str, digest: &str) -> Result<bool> {
        let op = format!("Content.Delete {digest} in {ns}");
        let call = async {
            match self
                .content()
                .delete(request(
                    ns,
                    None,
                    containerd_client::services::v1::DeleteContentRequest {
                        digest: digest.into(),
                    },
                ))
                .await
            {
                Ok(_) => Ok(true),
                Err(s) if s.code() == tonic::Code::NotFound => Ok(false),
                Err(status) => Err(Error::Status {
                    op: op.clone(),
                    status,
                }),
            }
        };
        self.guarded(&op, ns, digest, call).await
    }

    /// Sets labels on a blob already in `ns` (mask `labels.<key>` for each).
    pub async fn update_content_labels(
        &self,
        ns: &str,
        digest: &str,
        labels: &HashMap<String, String>,
    ) -> Result<()> {
        let paths = labels.keys().map(|k| format!("labels.{k}")).collect();
        let op = format!("Content.Update {digest} in {ns}");
        // Only the digest and the masked labels are read by every version
        // (timestamps and size may be absent: converted as zero, not
        // dereferenced).
        let call = async {
            self.content()
                .update(request(
                    ns,
                    None,
                    containerd_client::services::v1::UpdateRequest {
                        info: Some(Info {
                            digest: digest.into(),
                            labels: labels.clone(),
                            ..Default::default()
                        }),
                        update_mask: Some(prost_types::FieldMask { paths }),
                    },
                ))
                .await
                .map_err(Error::status(op.clone()))
        };
        self.guarded(&op, ns, digest, call).await?;
        Ok(())
    }
}

impl Ingest {
    /// containerd already has these bytes (shared content): commit without data.
    pub fn is_shared(&self) -> bool {
        self.writer.offset == self.size
    }

    /// Sends `data` at the current offset without waiting for its reply
    /// (up to [`WINDOW`] WRITEs are in flight). Owned, so a chunk of at
    /// most [`CHUNK`] goes out as it is; a larger one is cut into chunks,
    /// each byte copied once. A caller gathering a stream should hand over
    /// exactly `CHUNK` at a time: every WRITE costs containerd a round.
    pub async fn write(&mut self, data: Vec<u8>) -> Result<()> {
        if data.len() <= CHUNK {
            return self.write_chunk(data).await;
        }
        for c in data.chunks(CHUNK) {
            self.write_chunk(c.to_vec()).await?;
        }
        Ok(())
    }

    async fn write_chunk(&mut self, data: Vec<u8>) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let offset = self.writer.offset;
        self.writer.offset += data.len() as i64;
        self.writer.write_at(offset, data).await
    }

    /// Bytes sent so far.
    pub fn written(&self) -> i64 {
        self.writer.offset
    }

    /// Commits what was written as `digest`, for an ingest opened with an
    /// unknown size (0): a chunked registry upload learns its size and
    /// digest only at the end. containerd checks the digest.
    pub async fn commit_written(
        mut self,
        digest: &str,
        labels: &HashMap<String, String>,
    ) -> Result<()> {
        self.size = self.writer.offset;
        self.commit(digest, labels).await
    }

    /// Commits as `digest` with `labels`; containerd checks size and digest.
    pub async fn commit(mut self, digest: &str, labels: &HashMap<String, String>) -> Result<()> {
        if self.writer.offset != self.size {
            return Err(Error::Protocol(format!(
                "{}: wrote {} bytes, expected {}",
                self.writer.op, self.writer.offset, self.size
            )));
        }
        let blob = BlobRef {
            digest,
            size: self.size,
            labels,
        };
        self.writer.commit(&blob).await
    }
}

#[allow(clippy::large_enum_variant)] // short-lived, never stored in bulk
enum Opened {
    Present,
    Writer(Writer),
}

/// One open ingest; aborted on drop unless committed.
struct Writer {
    containerd: Containerd,
    ns: String,
    lease: Option<String>,
    reference: String,
    offset: i64,
    tx: Option<mpsc::Sender<WriteContentRequest>>,
    replies: tonic::Streaming<containerd_client::services::v1::WriteContentResponse>,
    /// WRITE messages whose reply has not been read yet.
    unacked: usize,
    op: String,
    done: bool,
}

impl Writer {
    async fn send(&mut self, m: WriteContentRequest) -> Result<()> {
        match &self.tx {
            Some(tx) => tx.send(m).await.map_err(|_| self.closed()),
            None => Err(self.closed()),
        }
    }

    fn closed(&self) -> Error {
        Error::Protocol(format!("{}: containerd closed the write stream", self.op))
    }

    /// Streams all bytes from offset 0 and commits. Chunks of at most 1 MiB
    /// (containerd's Read chunks) are forwarded as they are, without a copy.
    async fn write_all<S>(&mut self, mut data: S, blob: &BlobRef<'_>) -> Result<()>
    where
        S: Stream<Item = Result<Bytes>> + Send + Unpin,
    {
        let mut offset = 0i64;
        while let Some(mut b) = data.next().await.transpose()? {
            while !b.is_empty() {
                let chunk = b.split_to(b.len().min(CHUNK));
                let n = chunk.len() as i64;
                // Zero-copy when the chunk owns its whole buffer.
                self.write_at(offset, Vec::from(chunk)).await?;
                offset += n;
            }
        }
        if offset != blob.size {
            return Err(Error::Protocol(format!(
                "{}: source gave {offset} bytes, expected {}",
                self.op, blob.size
            )));
        }
        self.offset = offset;
        self.commit(blob).await
    }

    /// Sends one WRITE, first reading replies while [`WINDOW`] are unread.
    async fn write_at(&mut self, offset: i64, data: Vec<u8>) -> Result<()> {
        while self.unacked >= WINDOW {
            self.ack().await?;
        }
        self.send(WriteContentRequest {
            action: WriteAction::Write as i32,
            offset,
            data,
            ..Default::default()
        })
        .await?;
        self.unacked += 1;
        Ok(())
    }

    async fn ack(&mut self) -> Result<()> {
        match self.replies.message().await {
            Ok(Some(_)) => {
                self.unacked = self.unacked.saturating_sub(1);
                Ok(())
            }
            Ok(None) => Err(self.closed()),
            Err(status) => Err(Error::Status {
                op: self.op.clone(),
                status,
            }),
        }
    }

    /// COMMIT with `offset = total` (offset 0 would truncate a shared ingest).
    async fn commit(&mut self, blob: &BlobRef<'_>) -> Result<()> {
        while self.unacked > 0 {
            self.ack().await?;
        }
        self.send(WriteContentRequest {
            action: WriteAction::Commit as i32,
            total: blob.size,
            offset: self.offset,
            expected: blob.digest.into(),
            labels: blob.labels.clone(),
            ..Default::default()
        })
        .await?;
        match self.ack().await {
            Ok(()) => {}
            Err(e) if e.is(tonic::Code::AlreadyExists) => {}
            Err(e) => return Err(e),
        }
        self.done = true;
        self.tx = None; // close our side; the server's duplicate reply is ignored
        Ok(())
    }
}

/// Aborts an ingest from a spawned task unless disarmed (`reference: None`).
struct AbortOnDrop {
    c: Containerd,
    ns: String,
    lease: Option<String>,
    reference: Option<String>,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        let Some(reference) = self.reference.take() else {
            return;
        };
        let (c, ns, lease) = (self.c.clone(), self.ns.clone(), self.lease.take());
        tokio::spawn(async move { c.abort_ingest(&ns, lease.as_deref(), &reference).await });
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let c = self.containerd.clone();
        let (ns, reference, lease) = (self.ns.clone(), self.reference.clone(), self.lease.clone());
        tokio::spawn(async move {
            let _ = c
                .content()
                .abort(request(
                    &ns,
                    lease.as_deref(),
                    AbortRequest { r#ref: reference },
                ))
                .await;
        });
    }
}
