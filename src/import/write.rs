//! The containerd side of an archive import: a [`BlobSink`] over
//! Content.Write, and writing a [`Plan`]'s metadata and image records.
//!
//! The sync reader runs on a blocking thread and hands each 1 MiB chunk to
//! an async task through a small bounded channel, so decompression and
//! hashing overlap with the gRPC writes while memory stays at a few chunks.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::runtime::Handle;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::archive::{
    self, BlobSink, BlobWrite, Compression, Format, Plan, PlannedImage, Progress, ReadOptions,
    SinkError, SmallBlob,
};
use super::heartbeat::Heartbeat;
use super::pin;
use super::ImportError;
use crate::containerd::content::{BlobRef, IngestStart, Linked};
use crate::containerd::{Containerd, Descriptor};
use crate::labels::GC_REF_CONTENT;

/// Chunks in flight between the reader thread and the writer task.
const PIPELINE: usize = 4;
/// Lease lifetime: long enough for a very large import, short enough that
/// a crash does not keep orphaned blobs for long.
const LEASE_TTL: Duration = Duration::from_secs(4 * 3600);
/// Progress is logged this often, or every [`PROGRESS_BYTES`].
const PROGRESS_EVERY: Duration = Duration::from_secs(10);
const PROGRESS_BYTES: u64 = 256 << 20;

/// Streams blobs into one namespace under one lease.
pub struct ContainerdSink {
    handle: Handle,
    c: Containerd,
    ns: String,
    lease: Option<String>,
    /// Cancelled when the import is dropped (shutdown, a stall): the reader
    /// thread and the blob's writer task stop, even mid-call.
    cancel: CancellationToken,
    hb: Heartbeat,
}

impl ContainerdSink {
    pub fn new(
        handle: Handle,
        c: Containerd,
        ns: &str,
        lease: Option<String>,
        hb: Heartbeat,
    ) -> Self {
        ContainerdSink {
            handle,
            c,
            ns: ns.into(),
            lease,
            cancel: CancellationToken::new(),
            hb,
        }
    }

    fn check(&self) -> Result<(), SinkError> {
        match self.cancel.is_cancelled() {
            true => Err(cancelled()),
            false => Ok(()),
        }
    }

    /// Runs `call` from the reader thread, giving up when the import is
    /// cancelled (a call that never answers must not keep the thread).
    fn wait<T, E>(&self, call: impl Future<Output = Result<T, E>>) -> Result<T, SinkError>
    where
        SinkError: From<E>,
    {
        self.handle.block_on(async {
            tokio::select! {
                r = call => r.map_err(SinkError::from),
                _ = self.cancel.cancelled() => Err(cancelled()),
            }
        })
    }
}

fn cancelled() -> SinkError {
    SinkError("import cancelled".into())
}

impl BlobSink for ContainerdSink {
    fn start(
        &mut self,
        expected: Option<&str>,
        size: u64,
    ) -> Result<Option<Box<dyn BlobWrite>>, SinkError> {
        self.check()?;
        let start =
            self.wait(
                self.c
                    .open_ingest(&self.ns, self.lease.as_deref(), expected, size as i64),
            )?;
        self.hb.beat("a blob's ingest opened");
        let ingest = match start {
            IngestStart::Present => return Ok(None),
            IngestStart::Open(i) => i,
        };
        if let (true, Some(d)) = (ingest.is_shared(), expected) {
            self.wait(ingest.commit(d, &HashMap::new()))?;
            return Ok(None);
        }
        let (tx, mut rx) = mpsc::channel::<Vec<u8>>(PIPELINE);
        let (done_tx, done_rx) = oneshot::channel::<String>();
        let (c, ns, lease) = (self.c.clone(), self.ns.clone(), self.lease.clone());
        // containerd answers a COMMIT of a digest it already has with
        // ALREADY_EXISTS and does not lease it; lease it ourselves.
        let lease_after = expected.is_none();
        let cancel = self.cancel.clone();
        let task = self.handle.spawn(async move {
            let write = async {
                let mut ingest = ingest;
                while let Some(chunk) = rx.recv().await {
                    ingest.write(chunk).await?;
                }
                let digest = done_rx
                    .await
                    .map_err(|_| crate::containerd::Error::Protocol("blob abandoned".into()))?;
                ingest.commit(&digest, &HashMap::new()).await?;
                if let (true, Some(l)) = (lease_after, lease) {
                    c.lease_content(&ns, &l, &digest).await?;
                }
                Ok(())
            };
            tokio::select! {
                r = write => r,
                _ = cancel.cancelled() => Err(crate::containerd::Error::Protocol("import cancelled".into())),
            }
        });
        Ok(Some(Box::new(ContainerdWrite {
            hb: self.hb.clone(),
            cancel: self.cancel.clone(),
            handle: self.handle.clone(),
            tx: Some(tx),
            done: Some(done_tx),
            task: Some(task),
        })))
    }
}

type WriteTask = JoinHandle<Result<(), crate::containerd::Error>>;

struct ContainerdWrite {
    hb: Heartbeat,
    cancel: CancellationToken,
    handle: Handle,
    tx: Option<mpsc::Sender<Vec<u8>>>,
    done: Option<oneshot::Sender<String>>,
    task: Option<WriteTask>,
}

impl ContainerdWrite {
    fn outcome(&mut self) -> Result<(), SinkError> {
        let Some(task) = self.task.take() else {
            return Err(SinkError("writer already finished".into()));
        };
        match self.handle.block_on(task) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.into()),
            Err(e) => Err(e.into()),
        }
    }
}

impl BlobWrite for ContainerdWrite {
    fn write(&mut self, chunk: Vec<u8>) -> Result<(), SinkError> {
        if self.cancel.is_cancelled() {
            return Err(cancelled());
        }
        let sent = match &self.tx {
            Some(tx) => tx.blocking_send(chunk).is_ok(),
            None => false,
        };
        if sent {
            self.hb.beat("a chunk handed to containerd");
            return Ok(());
        }
        // The task stopped early: report why.
        self.tx = None;
        self.done = None;
        match self.outcome() {
            Ok(()) => Err(SinkError("containerd writer stopped early".into())),
            Err(e) => Err(e),
        }
    }

    fn finish(mut self: Box<Self>, digest: &str) -> Result<(), SinkError> {
        self.tx = None;
        if let Some(d) = self.done.take() {
            let _ = d.send(digest.to_string());
        }
        self.hb.beat("a blob read; its commit awaited");
        self.outcome()?;
        self.hb.beat("a blob committed");
        Ok(())
    }
}

/// Result of importing one archive.
#[derive(Debug, Default)]
pub struct ArchiveOutcome {
    /// Image name → target digest, for every record written.
    pub images: Vec<(String, String)>,
    /// Records this import pinned (for its file).
    pub pinned: u64,
    pub failures: Vec<String>,
    pub warnings: Vec<String>,
    pub raw_bytes: u64,
    pub decompressed_bytes: u64,
    pub raw_sha256: Option<String>,
    pub compression: Option<Compression>,
    pub format: Option<Format>,
}

/// Imports the archive at `path` into `ns`: blobs stream under a lease,
/// metadata and then image records are written last, so no image ever
/// points at content that is not there. `source` pins the images. Each
/// step beats `hb` (the caller cancels an import whose heart stops).
pub async fn import_archive(
    c: &Containerd,
    ns: &str,
    path: &Path,
    opts: ReadOptions,
    source: Option<&str>,
    hb: &Heartbeat,
) -> Result<ArchiveOutcome, ImportError> {
    let lease = c.lease(ns, LEASE_TTL).await?;
    hb.beat("the import's lease made");
    let res = import_leased(c, ns, path, opts, source, lease.id(), hb).await;
    lease.release().await;
    res
}

async fn import_leased(
    c: &Containerd,
    ns: &str,
    path: &Path,
    opts: ReadOptions,
    source: Option<&str>,
    lease: &str,
    hb: &Heartbeat,
) -> Result<ArchiveOutcome, ImportError> {
    let handle = Handle::current();
    let sink = ContainerdSink::new(handle, c.clone(), ns, Some(lease.to_string()), hb.clone());
    // Dropped with the import (shutdown, a stall): the reader stops.
    let _cancel = sink.cancel.clone().drop_guard();
    let file: PathBuf = path.into();
    let plan = tokio::task::spawn_blocking(move || read_file(&file, &opts, sink))
        .await
        .map_err(|e| ImportError::Panic(e.to_string()))??;
    hb.beat("the archive read");
    let mut out = ArchiveOutcome {
        failures: plan.failures.clone(),
        warnings: plan.warnings.clone(),
        raw_bytes: plan.raw_bytes,
        decompressed_bytes: plan.decompressed_bytes,
        raw_sha256: plan.raw_sha256.clone(),
        compression: Some(plan.compression),
        format: Some(plan.format),
        ..Default::default()
    };
    write_plan(c, ns, lease, &plan, source, &mut out, hb).await?;
    Ok(out)
}

fn read_file(
    path: &Path,
    opts: &ReadOptions,
    mut sink: ContainerdSink,
) -> Result<Plan, ImportError> {
    let io = |source| ImportError::Io {
        path: path.into(),
        source,
    };
    let f = super::open::open_regular(path).map_err(io)?;
    let total = f.metadata().map_err(io)?.len();
    let started = Instant::now();
    let (mut last_t, mut last_b) = (started, 0u64);
    let mut progress = |p: Progress| {
        if last_t.elapsed() >= PROGRESS_EVERY || p.raw_bytes >= last_b + PROGRESS_BYTES {
            tracing::info!(
                file = %super::esc(path.display()),
                read_mib = p.raw_bytes >> 20,
                size_mib = total >> 20,
                decompressed_mib = p.decompressed_bytes >> 20,
                secs = started.elapsed().as_secs(),
                "import in progress"
            );
            (last_t, last_b) = (Instant::now(), p.raw_bytes);
        }
    };
    Ok(archive::read_archive(f, opts, &mut sink, &mut progress)?)
}

/// Writes each image's metadata blobs (children first) and then its
/// records. An image whose blobs fail is reported and skipped; the
/// others still go in.
async fn write_plan(
    c: &Containerd,
    ns: &str,
    lease: &str,
    plan: &Plan,
    source: Option<&str>,
    out: &mut ArchiveOutcome,
    hb: &Heartbeat,
) -> Result<(), ImportError> {
    let mut written = HashSet::new();
    'images: for img in &plan.images {
        let mirror = img
            .names
            .iter()
            .find_map(|n| crate::replicate::distribution::source(n));
        for b in &img.blobs {
            if written.contains(&b.desc.digest) {
                continue;
            }
            if let Err(e) = write_small(c, ns, lease, b, mirror.as_ref()).await {
                if e.unreachable() {
                    return Err(e.into());
                }
                out.failures.push(format!(
                    "{}: writing {}: {e}",
                    img.names.join(", "),
                    b.desc.digest
                ));
                continue 'images;
            }
            written.insert(b.desc.digest.clone());
            hb.beat("a metadata blob written");
        }
        if let Some(m) = &mirror {
            if let Err(e) = label_layers(c, ns, img, m).await {
                if e.unreachable() {
                    return Err(e.into());
                }
                out.warnings.push(format!(
                    "{}: labelling layers for registry mirrors: {e}",
                    img.names.join(", ")
                ));
            }
        }
        let target = Descriptor {
            media_type: img.target.media_type.clone(),
            digest: img.target.digest.clone(),
            size: img.target.size,
            annotations: HashMap::new(),
        };
        for name in &img.names {
            match pin::record(c, ns, name, &target, source).await {
                Ok((_, pinned)) => {
                    hb.beat("an image recorded");
                    out.images.push((name.clone(), target.digest.clone()));
                    out.pinned += u64::from(pinned);
                }
                Err(e) if e.unreachable() => return Err(e.into()),
                Err(e) => out.failures.push(format!("{name}: {e}")),
            }
        }
    }
    Ok(())
}

/// The layers of `img` (the children its metadata blobs reference) get the
/// distribution-source label `mirror` unless they name that registry
/// already: registry mirrors that serve what a node holds (spegel, k3s's
/// embedded mirror) skip blobs without one, so an imported image would be
/// served by tag and none of its layers (spegel-org/spegel#1096; k3s labels
/// its imports the same way). The layers were streamed before the archive's
/// names were known, hence a pass of its own.
async fn label_layers(
    c: &Containerd,
    ns: &str,
    img: &PlannedImage,
    (key, repo): &(String, String),
) -> Result<(), crate::containerd::Error> {
    let own: HashSet<&str> = img.blobs.iter().map(|b| b.desc.digest.as_str()).collect();
    let layers: HashSet<&str> = img
        .blobs
        .iter()
        .flat_map(|b| b.labels.iter())
        .filter(|(k, _)| k.starts_with(GC_REF_CONTENT))
        .map(|(_, v)| v.as_str())
        .filter(|d| !own.contains(d))
        .collect();
    for d in layers {
        let Some(info) = c.content_info(ns, d).await? else {
            continue;
        };
        if !info.labels.contains_key(key) {
            let label = HashMap::from([(key.clone(), repo.clone())]);
            c.update_content_labels(ns, d, &label).await?;
        }
    }
    Ok(())
}

async fn write_small(
    c: &Containerd,
    ns: &str,
    lease: &str,
    b: &SmallBlob,
    mirror: Option<&(String, String)>,
) -> Result<(), crate::containerd::Error> {
    let mut labels: HashMap<String, String> = b.labels.clone().into_iter().collect();
    if let Some((k, repo)) = mirror {
        labels.entry(k.clone()).or_insert_with(|| repo.clone());
    }
    let data = Bytes::from(b.data.as_ref().clone());
    let linked = c
        .write_blob(
            ns,
            Some(lease),
            BlobRef {
                digest: &b.desc.digest,
                size: b.desc.size,
                labels: &labels,
            },
            futures_util::stream::iter([Ok(data)]),
        )
        .await?;
    // A blob that was already there may lack our GC refs (written by an
    // older tool); without them GC would take its children.
    if linked == Linked::Present && !labels.is_empty() {
        c.update_content_labels(ns, &b.desc.digest, &labels).await?;
    }
    Ok(())
}
