//! Content: reading blobs, and making a blob visible in another namespace.
//!
//! In `shared` mode a blob already in the backend is linked with a data-less
//! ingest (STAT, then COMMIT at `offset = total`): no bytes move. In
//! `isolated` mode, or when the backend lacks it, bytes are streamed with
//! bounded memory. See reference §1 for the exact wire sequence.

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
        let op = format!("Content.Read {digest} in {ns}");
        let s = self
            .content()
            .read(request(
                ns,
                None,
                ReadContentRequest {
                    digest: digest.into(),
                    offset: 0,
                    size: 0,
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
        let mut w = match self.open_writer(target, lease, &blob).await? {
            Opened::Present => return Ok(Linked::Present),
            Opened::Writer(w) => w,
        };
        if w.offset == blob.size {
            w.commit(&blob).await?;
            return Ok(Linked::Shared);
        }
        let data = self.read_stream(source, blob.digest).await?;
        w.write_all(data, &blob).await?;
        Ok(Linked::Copied)
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
        let mut w = match self.open_writer(ns, lease, &blob).await? {
            Opened::Present => return Ok(Linked::Present),
            Opened::Writer(w) => w,
        };
        if w.offset == blob.size {
            w.commit(&blob).await?;
            return Ok(Linked::Shared);
        }
        w.write_all(data, &blob).await?;
        Ok(Linked::Copied)
    }

    async fn open_writer(
        &self,
        ns: &str,
        lease: Option<&str>,
        blob: &BlobRef<'_>,
    ) -> Result<Opened> {
        let (tx, rx) = mpsc::channel(4);
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
            op,
            done: false,
        }))
    }
}

// Lives briefly on the stack while a write is opened; boxing buys nothing.
#[allow(clippy::large_enum_variant)]
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

    /// Streams all bytes from offset 0 and commits.
    async fn write_all<S>(&mut self, mut data: S, blob: &BlobRef<'_>) -> Result<()>
    where
        S: Stream<Item = Result<Bytes>> + Send + Unpin,
    {
        let mut offset = 0i64;
        let mut pending = bytes::BytesMut::new();
        loop {
            let next = data.next().await.transpose()?;
            if let Some(b) = &next {
                pending.extend_from_slice(b);
            }
            while pending.len() >= CHUNK || (next.is_none() && !pending.is_empty()) {
                let n = pending.len().min(CHUNK);
                let chunk = pending.split_to(n).freeze();
                self.send(WriteContentRequest {
                    action: WriteAction::Write as i32,
                    offset,
                    data: chunk.to_vec(),
                    ..Default::default()
                })
                .await?;
                offset += n as i64;
                // Drain WRITE acks as we go so the reply side never backs up.
                self.ack().await?;
            }
            if next.is_none() {
                break;
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

    async fn ack(&mut self) -> Result<()> {
        match self.replies.message().await {
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err(self.closed()),
            Err(status) => Err(Error::Status {
                op: self.op.clone(),
                status,
            }),
        }
    }

    /// COMMIT with `offset = total` (offset 0 would truncate a shared ingest).
    async fn commit(&mut self, blob: &BlobRef<'_>) -> Result<()> {
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
