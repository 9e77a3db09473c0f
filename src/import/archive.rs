//! Streaming reader for image archives: `.tar`, gzip or zstd (detected from
//! the bytes, not the name), holding a docker-archive (`docker save`,
//! skopeo) or an OCI image layout, with one or many images.
//!
//! This module is synchronous and knows nothing about containerd: every
//! blob-like tar entry is handed to a [`BlobSink`] as it comes (layers may
//! precede `manifest.json`), hashed while it streams, and images are
//! resolved at the end into a [`Plan`]. Only small JSON (manifests, indexes,
//! configs; each ≤ [`Limits::metadata`]) is held in memory, so memory stays
//! constant whatever the archive size. The separation lets the fuzz target
//! and unit tests run the whole parser with an in-memory sink.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Component, Path};
use std::rc::Rc;
use std::sync::Arc;

use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use crate::reference;

/// Bytes read from a tar entry per step (and per chunk handed to a sink).
pub const CHUNK: usize = 1 << 20;
/// Default cap for one metadata document (manifest.json, index, config).
pub const METADATA_LIMIT: usize = 4 << 20;
/// Default cap for all metadata held for one archive.
pub const METADATA_BUDGET: usize = 32 << 20;
/// zstd window cap (2^27 = 128 MiB, zstd's own default decoder limit).
const ZSTD_WINDOW_LOG_MAX: u32 = 27;
/// Nesting depth of indexes we follow before calling the archive hostile.
const MAX_DEPTH: usize = 8;
/// Cap on a tar header plus its GNU long-name / PAX extension entries,
/// which the tar crate holds in memory (real ones are well under 64 KiB).
const HEADER_LIMIT: u64 = 1 << 20;
/// Symlink hops followed when resolving a docker-archive path.
const MAX_LINK_HOPS: usize = 16;

pub const MT_DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const MT_DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const MT_DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
pub const MT_DOCKER_LAYER: &str = "application/vnd.docker.image.rootfs.diff.tar";
pub const MT_DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
pub const MT_DOCKER_LAYER_ZSTD: &str = "application/vnd.docker.image.rootfs.diff.tar.zstd";
pub const MT_OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const MT_OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";

/// GC reference label prefix: children of a blob stay alive only through it.
pub const GC_REF: &str = "containerd.io/gc.ref.content";
const ANN_CONTAINERD_NAME: &str = "io.containerd.image.name";
const ANN_OCI_REF_NAME: &str = "org.opencontainers.image.ref.name";

/// Resource caps for one archive.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Decompressed bytes read from the archive (decompression bombs).
    pub max_decompressed: u64,
    /// One metadata document.
    pub metadata: usize,
    /// All metadata documents held at once.
    pub metadata_budget: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_decompressed: 64 << 30,
            metadata: METADATA_LIMIT,
            metadata_budget: METADATA_BUDGET,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("corrupt or unreadable tar: {0}")]
    Tar(#[source] io::Error),
    #[error("{0} stream is corrupt or truncated: {1}")]
    Decompress(Compression, #[source] io::Error),
    #[error("decompressed size exceeds the cap of {0} bytes (import.max_decompressed_bytes)")]
    TooLarge(u64),
    #[error("entry {0:?} escapes the archive (absolute path or '..')")]
    UnsafePath(String),
    #[error("link {0:?} -> {1:?} points outside the archive")]
    UnsafeLink(String, String),
    #[error("{what} is {size} bytes, over the {limit}-byte limit for metadata")]
    Oversized {
        what: String,
        size: u64,
        limit: usize,
    },
    #[error("a tar header with its long-name/PAX extensions exceeds {0} bytes")]
    HeaderTooLarge(u64),
    #[error("more than {0} bytes of JSON metadata in one archive; refusing to hold it")]
    MetadataBudget(usize),
    #[error("{0}: invalid JSON: {1}")]
    Json(String, #[source] serde_json::Error),
    #[error("blob {path:?} hashes to {actual}, not the digest its name claims")]
    DigestMismatch { path: String, actual: String },
    #[error("entry {0:?} is shorter than its header says (truncated archive)")]
    Truncated(String),
    #[error("{0} compression is not supported (use gzip, zstd or none)")]
    Unsupported(&'static str),
    #[error("not an image archive: neither manifest.json nor index.json found")]
    NotImage,
    #[error("unsupported oci-layout version {0:?}")]
    LayoutVersion(String),
    #[error("writing blob {path:?}: {msg}")]
    Sink { path: String, msg: String },
}

/// Error from a [`BlobSink`], carried into [`ArchiveError::Sink`].
#[derive(Debug)]
pub struct SinkError(pub String);

impl<E: std::fmt::Display> From<E> for SinkError {
    fn from(e: E) -> Self {
        SinkError(e.to_string())
    }
}

/// Receives streamed blobs. Implemented over containerd's Content.Write by
/// the importer, and in memory by tests and the fuzz target.
pub trait BlobSink {
    /// Starts a blob of `size` bytes. `expected` is set when the archive
    /// names the digest (OCI `blobs/sha256/<hex>`). `Ok(None)` means the sink
    /// already has it; the reader then only verifies the bytes.
    fn start(
        &mut self,
        expected: Option<&str>,
        size: u64,
    ) -> Result<Option<Box<dyn BlobWrite>>, SinkError>;
}

/// One blob being written. Dropping it without [`BlobWrite::finish`] aborts.
pub trait BlobWrite {
    fn write(&mut self, chunk: Vec<u8>) -> Result<(), SinkError>;
    /// All bytes were written; `digest` is what the reader computed.
    fn finish(self: Box<Self>, digest: &str) -> Result<(), SinkError>;
}

/// Discards everything (fuzzing, dry runs).
#[derive(Default, Debug)]
pub struct DiscardSink {
    pub blobs: usize,
    pub bytes: u64,
}

impl BlobSink for DiscardSink {
    fn start(
        &mut self,
        _: Option<&str>,
        size: u64,
    ) -> Result<Option<Box<dyn BlobWrite>>, SinkError> {
        self.blobs += 1;
        self.bytes += size;
        Ok(Some(Box::new(Discard)))
    }
}

struct Discard;

impl BlobWrite for Discard {
    fn write(&mut self, _: Vec<u8>) -> Result<(), SinkError> {
        Ok(())
    }
    fn finish(self: Box<Self>, _: &str) -> Result<(), SinkError> {
        Ok(())
    }
}

/// Keeps blobs in memory by digest (unit tests).
#[derive(Default, Debug, Clone)]
pub struct MemorySink {
    pub blobs: Rc<std::cell::RefCell<HashMap<String, Vec<u8>>>>,
}

impl BlobSink for MemorySink {
    fn start(
        &mut self,
        expected: Option<&str>,
        _: u64,
    ) -> Result<Option<Box<dyn BlobWrite>>, SinkError> {
        if expected.is_some_and(|d| self.blobs.borrow().contains_key(d)) {
            return Ok(None);
        }
        Ok(Some(Box::new(MemoryWrite {
            buf: Vec::new(),
            blobs: self.blobs.clone(),
        })))
    }
}

struct MemoryWrite {
    buf: Vec<u8>,
    blobs: Rc<std::cell::RefCell<HashMap<String, Vec<u8>>>>,
}

impl BlobWrite for MemoryWrite {
    fn write(&mut self, chunk: Vec<u8>) -> Result<(), SinkError> {
        self.buf.extend_from_slice(&chunk);
        Ok(())
    }
    fn finish(self: Box<Self>, digest: &str) -> Result<(), SinkError> {
        self.blobs.borrow_mut().insert(digest.into(), self.buf);
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Compression::None => "tar",
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
        })
    }
}

impl Compression {
    /// From the first bytes of the file; names lie, magic numbers don't.
    pub fn sniff(head: &[u8]) -> Result<Compression, ArchiveError> {
        Ok(match head {
            [0x1f, 0x8b, ..] => Compression::Gzip,
            [0x28, 0xb5, 0x2f, 0xfd, ..] => Compression::Zstd,
            [b'B', b'Z', b'h', ..] => return Err(ArchiveError::Unsupported("bzip2")),
            [0xfd, b'7', b'z', b'X', b'Z', 0, ..] => return Err(ArchiveError::Unsupported("xz")),
            [0x04, 0x22, 0x4d, 0x18, ..] => return Err(ArchiveError::Unsupported("lz4")),
            _ => Compression::None,
        })
    }
}

/// An OCI descriptor as written into containerd (image target, blobs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Descriptor {
    pub media_type: String,
    pub digest: String,
    pub size: i64,
}

/// A metadata blob to write after the streamed ones, with its GC labels.
#[derive(Clone, Debug)]
pub struct SmallBlob {
    pub desc: Descriptor,
    pub data: Arc<Vec<u8>>,
    pub labels: BTreeMap<String, String>,
}

/// One image to record: write `blobs` (children first), then the records.
#[derive(Clone, Debug)]
pub struct PlannedImage {
    pub names: Vec<String>,
    pub target: Descriptor,
    pub blobs: Vec<SmallBlob>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Docker,
    Oci,
}

/// What an archive holds, once every streamed blob is in the sink.
#[derive(Debug)]
pub struct Plan {
    pub format: Format,
    pub compression: Compression,
    pub images: Vec<PlannedImage>,
    /// Images that cannot be imported (missing blobs, bad names…).
    pub failures: Vec<String>,
    /// Harmless oddities (skipped platforms, unnamed images).
    pub warnings: Vec<String>,
    /// Bytes read from the file.
    pub raw_bytes: u64,
    pub decompressed_bytes: u64,
    pub blobs_streamed: usize,
    /// sha256 of the raw file, when asked for.
    pub raw_sha256: Option<String>,
}

/// Counters handed to the progress callback after each chunk.
#[derive(Clone, Copy, Debug, Default)]
pub struct Progress {
    pub raw_bytes: u64,
    pub decompressed_bytes: u64,
}

/// What the archive's bytes told us about a blob.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Gzip,
    Zstd,
    Json,
    Other,
}

impl Kind {
    fn sniff(b: &[u8]) -> Kind {
        match b {
            [0x1f, 0x8b, ..] => Kind::Gzip,
            [0x28, 0xb5, 0x2f, 0xfd, ..] => Kind::Zstd,
            _ if b.iter().find(|c| !c.is_ascii_whitespace()) == Some(&b'{') => Kind::Json,
            _ => Kind::Other,
        }
    }
}

struct Blob {
    size: u64,
    kind: Kind,
    data: Option<Arc<Vec<u8>>>,
}

/// Shared counters and the fault seen below the tar parser, so a tar error
/// caused by a bad gzip stream or the size cap is reported as such.
#[derive(Default)]
struct Stream {
    raw: Cell<u64>,
    decompressed: Cell<u64>,
    fault: Cell<Option<Fault>>,
    hash: std::cell::RefCell<Option<Sha256>>,
    /// Whether the walker (not the tar crate) is reading entry data.
    in_data: Cell<bool>,
    /// Bytes the tar crate read for the current header and its extensions.
    header_bytes: Cell<u64>,
}

#[derive(Clone, Copy)]
enum Fault {
    Decompress,
    Cap,
    Header,
}

struct RawReader<R> {
    inner: R,
    st: Rc<Stream>,
}

impl<R: Read> Read for RawReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.st.raw.set(self.st.raw.get() + n as u64);
        if let Some(h) = self.st.hash.borrow_mut().as_mut() {
            h.update(&buf[..n]);
        }
        Ok(n)
    }
}

/// Marks errors from the decompressor, and counts and caps its output.
struct Capped<R> {
    inner: R,
    st: Rc<Stream>,
    cap: u64,
    compressed: bool,
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf).inspect_err(|_| {
            if self.compressed {
                self.st.fault.set(Some(Fault::Decompress));
            }
        })?;
        let total = self.st.decompressed.get() + n as u64;
        self.st.decompressed.set(total);
        if total > self.cap {
            self.st.fault.set(Some(Fault::Cap));
            return Err(io::Error::other("decompressed size cap exceeded"));
        }
        if !self.st.in_data.get() {
            let h = self.st.header_bytes.get() + n as u64;
            self.st.header_bytes.set(h);
            if h > HEADER_LIMIT {
                self.st.fault.set(Some(Fault::Header));
                return Err(io::Error::other("tar header extensions too large"));
            }
        }
        Ok(n)
    }
}

/// Options for [`read_archive`].
#[derive(Clone, Debug, Default)]
pub struct ReadOptions {
    pub limits: Limits,
    /// Also compute the sha256 of the raw file (for the state file).
    pub hash_input: bool,
}

/// Reads one archive from `input`, streaming blobs into `sink`.
///
/// Returns an error for anything that makes the whole file untrustworthy
/// (corrupt or truncated stream, unsafe paths, digest mismatches, caps);
/// per-image problems (a manifest naming an absent layer) are listed in
/// [`Plan::failures`] and the other images still come out.
pub fn read_archive<R: Read>(
    input: R,
    opts: &ReadOptions,
    sink: &mut dyn BlobSink,
    progress: &mut dyn FnMut(Progress),
) -> Result<Plan, ArchiveError> {
    let st = Rc::new(Stream::default());
    *st.hash.borrow_mut() = opts.hash_input.then(Sha256::new);
    let raw = RawReader {
        inner: input,
        st: st.clone(),
    };
    let mut buffered = BufReader::with_capacity(256 << 10, raw);
    let compression = Compression::sniff(buffered.fill_buf().map_err(ArchiveError::Tar)?)?;
    let decoder: Box<dyn Read> = match compression {
        Compression::None => Box::new(buffered),
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(buffered)),
        Compression::Zstd => {
            let mut d = zstd::stream::read::Decoder::with_buffer(buffered)
                .map_err(|e| ArchiveError::Decompress(compression, e))?;
            d.window_log_max(ZSTD_WINDOW_LOG_MAX)
                .map_err(|e| ArchiveError::Decompress(compression, e))?;
            Box::new(d)
        }
    };
    let capped = Capped {
        inner: decoder,
        st: st.clone(),
        cap: opts.limits.max_decompressed,
        compressed: compression != Compression::None,
    };
    let mut walker = Walker {
        limits: &opts.limits,
        sink,
        progress,
        st: st.clone(),
        blobs: HashMap::new(),
        paths: HashMap::new(),
        links: HashMap::new(),
        meta: HashMap::new(),
        retained: 0,
        streamed: 0,
    };
    let mut tar = tar::Archive::new(capped);
    let fault = |e: ArchiveError| -> ArchiveError {
        match st.fault.get() {
            Some(Fault::Cap) => ArchiveError::TooLarge(opts.limits.max_decompressed),
            Some(Fault::Header) => ArchiveError::HeaderTooLarge(HEADER_LIMIT),
            Some(Fault::Decompress) => match e {
                ArchiveError::Tar(io) => ArchiveError::Decompress(compression, io),
                ArchiveError::Truncated(_) => ArchiveError::Decompress(
                    compression,
                    io::Error::new(io::ErrorKind::UnexpectedEof, "stream ended early"),
                ),
                other => other,
            },
            None => e,
        }
    };
    walker.walk(&mut tar).map_err(fault)?;
    // Read to the end so a truncated or corrupt compressed tail (checksum,
    // trailer) is noticed even after tar's end-of-archive blocks.
    let mut rest = tar.into_inner();
    io::copy(&mut rest, &mut io::sink()).map_err(|e| fault(ArchiveError::Tar(e)))?;
    drop(rest);
    let (images, failures, warnings, format) = walker.resolve()?;
    let raw_sha256 = st.hash.borrow_mut().take().map(hex_digest);
    Ok(Plan {
        format,
        compression,
        images,
        failures,
        warnings,
        raw_bytes: st.raw.get(),
        decompressed_bytes: st.decompressed.get(),
        blobs_streamed: walker.streamed,
        raw_sha256,
    })
}

struct Walker<'a> {
    limits: &'a Limits,
    sink: &'a mut dyn BlobSink,
    progress: &'a mut dyn FnMut(Progress),
    st: Rc<Stream>,
    /// digest → what we know about it.
    blobs: HashMap<String, Blob>,
    /// archive path → digest of the regular file there.
    paths: HashMap<String, String>,
    /// archive path → link target (normalised, archive-relative).
    links: HashMap<String, String>,
    /// manifest.json, index.json, oci-layout, repositories.
    meta: HashMap<&'static str, Vec<u8>>,
    retained: usize,
    streamed: usize,
}

const META_FILES: [&str; 4] = ["manifest.json", "index.json", "oci-layout", "repositories"];

impl Walker<'_> {
    fn walk<R: Read>(&mut self, tar: &mut tar::Archive<R>) -> Result<(), ArchiveError> {
        let mut entries = tar.entries().map_err(ArchiveError::Tar)?;
        loop {
            // What the tar crate reads on its own (headers, GNU long names,
            // PAX records) it keeps in memory: that is capped per entry.
            self.st.in_data.set(false);
            self.st.header_bytes.set(0);
            let Some(entry) = entries.next() else { break };
            let mut entry = entry.map_err(ArchiveError::Tar)?;
            self.st.in_data.set(true);
            self.entry(&mut entry)?;
            // Drain what we did not read, so the crate never skips data itself.
            io::copy(&mut entry, &mut io::sink()).map_err(ArchiveError::Tar)?;
        }
        self.st.in_data.set(true);
        Ok(())
    }

    fn entry(&mut self, entry: &mut tar::Entry<'_, impl Read>) -> Result<(), ArchiveError> {
        let raw_path = entry.path_bytes().into_owned();
        let Some(path) = clean_path(&raw_path)? else {
            return Ok(());
        };
        let et = entry.header().entry_type();
        if et.is_symlink() || et.is_hard_link() {
            let target = entry
                .link_name_bytes()
                .map(|b| b.into_owned())
                .unwrap_or_default();
            let resolved = resolve_link(&path, &target, et.is_hard_link())?;
            self.links.insert(path, resolved);
            return Ok(());
        }
        if !(et.is_file() || et == tar::EntryType::Continuous) {
            return Ok(());
        }
        let size = entry.size();
        if let Some(name) = META_FILES.iter().find(|m| **m == path) {
            let data = self.read_meta(entry, &path, size)?;
            self.meta.insert(name, data);
            return Ok(());
        }
        if is_legacy_v1(&path) {
            return Ok(());
        }
        self.blob(entry, path, size)
    }

    fn report(&mut self) {
        (self.progress)(Progress {
            raw_bytes: self.st.raw.get(),
            decompressed_bytes: self.st.decompressed.get(),
        });
    }

    fn read_meta(
        &mut self,
        r: &mut impl Read,
        path: &str,
        size: u64,
    ) -> Result<Vec<u8>, ArchiveError> {
        if size > self.limits.metadata as u64 {
            return Err(ArchiveError::Oversized {
                what: path.into(),
                size,
                limit: self.limits.metadata,
            });
        }
        let mut data = vec![0; size as usize];
        read_full(r, &mut data, path)?;
        Ok(data)
    }

    /// Streams one blob-like entry into the sink (or keeps it when it is
    /// small JSON), hashing as it goes.
    fn blob(&mut self, r: &mut impl Read, path: String, size: u64) -> Result<(), ArchiveError> {
        let expected = oci_blob_digest(&path);
        let mut hasher = Sha256::new();
        let first_len = (size as usize).min(CHUNK);
        let mut first = vec![0; first_len];
        read_full(r, &mut first, &path)?;
        hasher.update(&first);
        let kind = Kind::sniff(&first);
        let keep = kind == Kind::Json && size <= self.limits.metadata as u64;
        if keep && self.retained + size as usize > self.limits.metadata_budget {
            return Err(ArchiveError::MetadataBudget(self.limits.metadata_budget));
        }
        let digest;
        let mut data = None;
        if keep {
            let mut all = first;
            all.resize(size as usize, 0);
            read_full(r, &mut all[first_len..], &path)?;
            hasher.update(&all[first_len..]);
            digest = hex_digest(hasher);
            self.retained += all.len();
            data = Some(Arc::new(all));
        } else {
            let sink_err = |msg: SinkError| ArchiveError::Sink {
                path: path.clone(),
                msg: msg.0,
            };
            let mut w = self
                .sink
                .start(expected.as_deref(), size)
                .map_err(sink_err)?;
            self.streamed += 1;
            let mut done = first_len as u64;
            if let Some(w) = &mut w {
                w.write(first).map_err(sink_err)?;
            }
            self.report();
            while done < size {
                let n = ((size - done) as usize).min(CHUNK);
                let mut buf = vec![0; n];
                read_full(r, &mut buf, &path)?;
                hasher.update(&buf);
                if let Some(w) = &mut w {
                    w.write(buf).map_err(sink_err)?;
                }
                done += n as u64;
                self.report();
            }
            digest = hex_digest(hasher);
            if expected.as_ref().is_some_and(|e| *e != digest) {
                return Err(ArchiveError::DigestMismatch {
                    path,
                    actual: digest,
                });
            }
            if let Some(w) = w {
                w.finish(&digest).map_err(sink_err)?;
            }
        }
        if expected.as_ref().is_some_and(|e| *e != digest) {
            return Err(ArchiveError::DigestMismatch {
                path,
                actual: digest,
            });
        }
        self.blobs
            .entry(digest.clone())
            .and_modify(|b| {
                if b.data.is_none() {
                    b.data = data.clone();
                }
            })
            .or_insert(Blob { size, kind, data });
        self.paths.insert(path, digest);
        Ok(())
    }

    /// Follows links from an archive path to the digest of a regular file.
    fn lookup(&self, path: &str) -> Option<&String> {
        let mut p = clean_path(path.as_bytes()).ok()??;
        for _ in 0..MAX_LINK_HOPS {
            if let Some(d) = self.paths.get(&p) {
                return Some(d);
            }
            p = self.links.get(&p)?.clone();
        }
        None
    }

    #[allow(clippy::type_complexity)]
    fn resolve(
        &mut self,
    ) -> Result<(Vec<PlannedImage>, Vec<String>, Vec<String>, Format), ArchiveError> {
        let mut r = Resolved::default();
        if let Some(layout) = self.meta.get("oci-layout") {
            #[derive(Deserialize)]
            struct Layout {
                #[serde(rename = "imageLayoutVersion")]
                version: String,
            }
            let l: Layout = serde_json::from_slice(layout)
                .map_err(|e| ArchiveError::Json("oci-layout".into(), e))?;
            if !l.version.starts_with("1.") {
                return Err(ArchiveError::LayoutVersion(l.version));
            }
        }
        let index = match self.meta.get("index.json") {
            Some(b) => Some(
                serde_json::from_slice::<Meta>(b)
                    .map_err(|e| ArchiveError::Json("index.json".into(), e))?,
            ),
            None => None,
        };
        let named_oci = index.as_ref().is_some_and(|i| {
            i.manifests
                .iter()
                .flatten()
                .any(|d| oci_name(d, &mut Vec::new()).is_some())
        });
        let format = if named_oci || !self.meta.contains_key("manifest.json") {
            let Some(index) = index else {
                return Err(ArchiveError::NotImage);
            };
            self.resolve_oci(&index, &mut r);
            Format::Oci
        } else {
            let m: Vec<DockerEntry> = serde_json::from_slice(&self.meta["manifest.json"])
                .map_err(|e| ArchiveError::Json("manifest.json".into(), e))?;
            self.resolve_docker(&m, &mut r);
            Format::Docker
        };
        if r.images.is_empty() && r.failures.is_empty() {
            r.failures.push(match r.warnings.first() {
                Some(w) => format!("no named image in the archive ({w})"),
                None => "no image in the archive".into(),
            });
        }
        Ok((r.images, r.failures, r.warnings, format))
    }

    fn resolve_docker(&self, entries: &[DockerEntry], r: &mut Resolved) {
        'images: for (i, e) in entries.iter().enumerate() {
            let what = format!(
                "image {} of manifest.json ({})",
                i,
                e.repo_tags.as_deref().unwrap_or_default().join(", ")
            );
            let mut blobs = Vec::new();
            let Some(cfg) = self.lookup(&e.config) else {
                r.failures.push(format!(
                    "{what}: config {:?} is not in the archive",
                    e.config
                ));
                continue;
            };
            let cfg_blob = &self.blobs[cfg];
            let config = Descriptor {
                media_type: MT_DOCKER_CONFIG.into(),
                digest: cfg.clone(),
                size: cfg_blob.size as i64,
            };
            push_retained(&mut blobs, &config, cfg_blob, BTreeMap::new());
            let mut labels = BTreeMap::new();
            labels.insert(format!("{GC_REF}.config"), cfg.clone());
            let mut layers = Vec::new();
            for (li, l) in e.layers.iter().enumerate() {
                let Some(d) = self.lookup(l) else {
                    r.failures.push(format!(
                        "{what}: names layer {l:?}, which is not in the archive"
                    ));
                    continue 'images;
                };
                let b = &self.blobs[d];
                let media_type = match b.kind {
                    Kind::Gzip => MT_DOCKER_LAYER_GZIP,
                    Kind::Zstd => MT_DOCKER_LAYER_ZSTD,
                    _ => MT_DOCKER_LAYER,
                };
                let desc = Descriptor {
                    media_type: media_type.into(),
                    digest: d.clone(),
                    size: b.size as i64,
                };
                push_retained(&mut blobs, &desc, b, BTreeMap::new());
                labels.insert(format!("{GC_REF}.l.{li}"), d.clone());
                layers.push(desc);
            }
            let manifest = serde_json::json!({
                "schemaVersion": 2,
                "mediaType": MT_DOCKER_MANIFEST,
                "config": desc_json(&config),
                "layers": layers.iter().map(desc_json).collect::<Vec<_>>(),
            });
            let bytes = serde_json::to_vec(&manifest).unwrap_or_default();
            let target = Descriptor {
                media_type: MT_DOCKER_MANIFEST.into(),
                digest: sha256_hex(&bytes),
                size: bytes.len() as i64,
            };
            blobs.push(SmallBlob {
                desc: target.clone(),
                data: Arc::new(bytes),
                labels,
            });
            let mut names = Vec::new();
            for t in e.repo_tags.iter().flatten() {
                match reference::normalize(t) {
                    Ok(n) => names.push(n),
                    Err(err) => r.warnings.push(format!("{what}: {err}")),
                }
            }
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

    fn resolve_oci(&self, index: &Meta, r: &mut Resolved) {
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
    fn walk_desc(
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
        let m: Meta = serde_json::from_slice(data)
            .map_err(|e| WalkError::Bad(format!("{}: invalid JSON: {e}", d.digest)))?;
        let media_type = [d.media_type.as_deref(), m.media_type.as_deref()]
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
            });
        let desc = Descriptor {
            media_type: media_type.clone(),
            digest: d.digest.clone(),
            size: blob.size as i64,
        };
        let mut out = Vec::new();
        let mut labels = BTreeMap::new();
        if media_type == MT_OCI_INDEX || media_type == MT_DOCKER_LIST {
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
        } else if m.config.is_some()
            || media_type == MT_OCI_MANIFEST
            || media_type == MT_DOCKER_MANIFEST
        {
            let Some(cfg) = &m.config else {
                return Err(WalkError::Bad(format!(
                    "manifest {} has no config",
                    d.digest
                )));
            };
            let cb = self.present(cfg).map_err(|e| {
                WalkError::Bad(format!(
                    "manifest {} names config {}: {}",
                    d.digest,
                    cfg.digest,
                    e.msg()
                ))
            })?;
            push_retained(&mut out, &cfg.descriptor(), cb, BTreeMap::new());
            labels.insert(format!("{GC_REF}.config"), cfg.digest.clone());
            for (i, l) in m.layers.iter().flatten().enumerate() {
                let lb = self.present(l).map_err(|e| {
                    WalkError::Bad(format!(
                        "manifest {} names layer {}: {}",
                        d.digest,
                        l.digest,
                        e.msg()
                    ))
                })?;
                push_retained(&mut out, &l.descriptor(), lb, BTreeMap::new());
                labels.insert(format!("{GC_REF}.l.{i}"), l.digest.clone());
            }
        } else {
            return Err(WalkError::Bad(format!(
                "{} has unsupported media type {media_type:?}",
                d.digest
            )));
        }
        out.push(SmallBlob {
            desc: desc.clone(),
            data: data.clone(),
            labels,
        });
        Ok((desc, out))
    }

    fn present(&self, d: &OciDesc) -> Result<&Blob, WalkError> {
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

#[derive(Default)]
struct Resolved {
    images: Vec<PlannedImage>,
    failures: Vec<String>,
    warnings: Vec<String>,
}

enum WalkError {
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

/// Blobs kept in memory (small JSON) were not streamed; write them from the plan.
fn push_retained(
    out: &mut Vec<SmallBlob>,
    desc: &Descriptor,
    b: &Blob,
    labels: BTreeMap<String, String>,
) {
    if let Some(data) = &b.data {
        out.push(SmallBlob {
            desc: desc.clone(),
            data: data.clone(),
            labels,
        });
    }
}

#[derive(Deserialize)]
struct DockerEntry {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "RepoTags", default)]
    repo_tags: Option<Vec<String>>,
    #[serde(rename = "Layers", default)]
    layers: Vec<String>,
}

/// The fields of an index, manifest or config we care about.
#[derive(Deserialize, Default)]
struct Meta {
    #[serde(rename = "mediaType", default)]
    media_type: Option<String>,
    #[serde(default)]
    manifests: Option<Vec<OciDesc>>,
    #[serde(default)]
    config: Option<OciDesc>,
    #[serde(default)]
    layers: Option<Vec<OciDesc>>,
}

#[derive(Deserialize, Clone, Debug)]
struct OciDesc {
    #[serde(rename = "mediaType", default)]
    media_type: Option<String>,
    digest: String,
    size: i64,
    #[serde(default)]
    annotations: Option<HashMap<String, String>>,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Deserialize, Clone, Debug)]
struct Platform {
    #[serde(default)]
    os: String,
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    variant: Option<String>,
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

fn platform(d: &OciDesc) -> String {
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
fn oci_name(d: &OciDesc, warnings: &mut Vec<String>) -> Option<String> {
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

fn desc_json(d: &Descriptor) -> serde_json::Value {
    serde_json::json!({ "mediaType": d.media_type, "size": d.size, "digest": d.digest })
}

/// Normalises an entry path: strips `./`, refuses absolute paths and `..`.
/// `Ok(None)` for the archive root itself.
fn clean_path(raw: &[u8]) -> Result<Option<String>, ArchiveError> {
    let s = String::from_utf8_lossy(raw);
    let mut parts = Vec::new();
    for c in Path::new(s.as_ref()).components() {
        match c {
            Component::Normal(p) => parts.push(p.to_string_lossy().into_owned()),
            Component::CurDir => {}
            _ => return Err(ArchiveError::UnsafePath(s.into_owned())),
        }
    }
    Ok((!parts.is_empty()).then(|| parts.join("/")))
}

/// Resolves a link target to an archive-relative path; symlinks are
/// relative to their directory, hard links to the archive root.
fn resolve_link(path: &str, target: &[u8], hard: bool) -> Result<String, ArchiveError> {
    let t = String::from_utf8_lossy(target);
    let bad = || ArchiveError::UnsafeLink(path.into(), t.clone().into_owned());
    let mut parts: Vec<String> = if hard {
        Vec::new()
    } else {
        let mut p: Vec<String> = path.split('/').map(str::to_owned).collect();
        p.pop();
        p
    };
    for c in Path::new(t.as_ref()).components() {
        match c {
            Component::Normal(p) => parts.push(p.to_string_lossy().into_owned()),
            Component::CurDir => {}
            Component::ParentDir => {
                parts.pop().ok_or_else(bad)?;
            }
            _ => return Err(bad()),
        }
    }
    if parts.is_empty() {
        return Err(bad());
    }
    Ok(parts.join("/"))
}

/// `blobs/sha256/<hex>` names its digest; anything else is computed.
fn oci_blob_digest(path: &str) -> Option<String> {
    let rest = path.strip_prefix("blobs/")?;
    let (alg, hex) = rest.split_once('/')?;
    let d = format!("{alg}:{hex}");
    (alg == "sha256" && reference::valid_digest(&d)).then_some(d)
}

/// docker save's v1 leftovers (`<id>/json`, `<id>/VERSION`): never referenced.
fn is_legacy_v1(path: &str) -> bool {
    matches!(path.split_once('/'), Some((_, "json" | "VERSION")))
}

fn read_full(r: &mut impl Read, buf: &mut [u8], path: &str) -> Result<(), ArchiveError> {
    let mut off = 0;
    while off < buf.len() {
        match r.read(&mut buf[off..]) {
            Ok(0) => return Err(ArchiveError::Truncated(path.into())),
            Ok(n) => off += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ArchiveError::Tar(e)),
        }
    }
    Ok(())
}

fn hex_digest(h: Sha256) -> String {
    format!("sha256:{}", hex::encode(h.finalize()))
}

pub fn sha256_hex(b: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(b)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// Test archive builder: entries written raw, so hostile names are possible.
    struct T(tar::Builder<Vec<u8>>);

    impl T {
        fn new() -> T {
            T(tar::Builder::new(Vec::new()))
        }
        fn file(mut self, name: &str, data: &[u8]) -> T {
            let mut h = tar::Header::new_old();
            h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
            h.set_size(data.len() as u64);
            h.set_entry_type(tar::EntryType::Regular);
            h.set_mode(0o644);
            h.set_cksum();
            self.0.append(&h, data).unwrap();
            self
        }
        fn symlink(mut self, name: &str, target: &str) -> T {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Symlink);
            h.set_size(0);
            self.0.append_link(&mut h, name, target).unwrap();
            self
        }
        fn done(self) -> Vec<u8> {
            self.0.into_inner().unwrap()
        }
    }

    fn layer(seed: u8) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        let data = vec![seed; 5000];
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, format!("file{seed}"), &data[..])
            .unwrap();
        b.into_inner().unwrap()
    }

    fn gz(b: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(b).unwrap();
        e.finish().unwrap()
    }

    fn zst(b: &[u8]) -> Vec<u8> {
        zstd::encode_all(b, 3).unwrap()
    }

    fn hex(b: &[u8]) -> String {
        sha256_hex(b).trim_start_matches("sha256:").to_string()
    }

    const CONFIG: &[u8] =
        br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#;

    /// A skopeo-style docker-archive: layers first, v1 symlink, manifest.json last.
    fn docker_archive(tags: &str, with_layer: bool) -> Vec<u8> {
        let l0 = layer(1);
        let l1 = gz(&layer(2));
        let mut t = T::new();
        if with_layer {
            t = t.file(&format!("{}.tar", hex(&l0)), &l0);
        }
        t = t
            .symlink("abc/layer.tar", &format!("../{}.tar", hex(&l0)))
            .file("abc/VERSION", b"1.0")
            .file("abc/json", b"{}")
            .file(&format!("{}.tar", hex(&l1)), &l1)
            .file(&format!("{}.json", hex(CONFIG)), CONFIG);
        let m = format!(
            r#"[{{"Config":"{}.json","RepoTags":{tags},"Layers":["abc/layer.tar","{}.tar"]}}]"#,
            hex(CONFIG),
            hex(&l1)
        );
        t.file("manifest.json", m.as_bytes()).done()
    }

    fn read(b: &[u8], limits: Limits) -> (Result<Plan, ArchiveError>, MemorySink) {
        let mut sink = MemorySink::default();
        let opts = ReadOptions {
            limits,
            hash_input: true,
        };
        let r = read_archive(b, &opts, &mut sink, &mut |_| {});
        (r, sink)
    }

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
            assert_eq!(img.target.media_type, MT_DOCKER_MANIFEST);
            // Both layers went to the sink, verified by content.
            let blobs = sink.blobs.borrow();
            assert!(blobs.contains_key(&sha256_hex(&layer(1))));
            assert!(blobs.contains_key(&sha256_hex(&gz(&layer(2)))));
            let m = img.blobs.last().unwrap();
            assert_eq!(m.desc, img.target);
            assert_eq!(sha256_hex(&m.data), img.target.digest);
            let v: serde_json::Value = serde_json::from_slice(&m.data).unwrap();
            assert_eq!(v["config"]["mediaType"], MT_DOCKER_CONFIG);
            assert_eq!(v["layers"][0]["mediaType"], MT_DOCKER_LAYER);
            assert_eq!(v["layers"][1]["mediaType"], MT_DOCKER_LAYER_GZIP);
            assert_eq!(m.labels[&format!("{GC_REF}.config")], sha256_hex(CONFIG));
            assert_eq!(m.labels[&format!("{GC_REF}.l.0")], sha256_hex(&layer(1)));
            assert_eq!(
                m.labels[&format!("{GC_REF}.l.1")],
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

    fn desc(mt: &str, b: &[u8], extra: &str) -> String {
        format!(
            r#"{{"mediaType":"{mt}","digest":"{}","size":{}{extra}}}"#,
            sha256_hex(b),
            b.len()
        )
    }

    fn manifest(layers: &[&[u8]]) -> Vec<u8> {
        let ls: Vec<String> = layers
            .iter()
            .map(|l| desc("application/vnd.oci.image.layer.v1.tar+gzip", l, ""))
            .collect();
        format!(
            r#"{{"schemaVersion":2,"mediaType":"{MT_OCI_MANIFEST}","config":{},"layers":[{}]}}"#,
            desc("application/vnd.oci.image.config.v1+json", CONFIG, ""),
            ls.join(",")
        )
        .into_bytes()
    }

    fn blob(t: T, b: &[u8]) -> T {
        t.file(&format!("blobs/sha256/{}", hex(b)), b)
    }

    /// An OCI layout whose index lists amd64 (present) and arm64 (absent).
    fn oci_multi(name_ann: &str) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let l = gz(&layer(3));
        let amd = manifest(&[&l]);
        let arm = manifest(&[&gz(&layer(4))]);
        let idx = format!(
            r#"{{"schemaVersion":2,"mediaType":"{MT_OCI_INDEX}","manifests":[{},{}]}}"#,
            desc(
                MT_OCI_MANIFEST,
                &arm,
                r#","platform":{"os":"linux","architecture":"arm64"}"#
            ),
            desc(
                MT_OCI_MANIFEST,
                &amd,
                r#","platform":{"os":"linux","architecture":"amd64"}"#
            ),
        )
        .into_bytes();
        let top = format!(
            r#"{{"schemaVersion":2,"manifests":[{}]}}"#,
            desc(
                MT_OCI_INDEX,
                &idx,
                &format!(r#","annotations":{{{name_ann}}}"#)
            )
        );
        let mut t = T::new();
        t = blob(t, &l);
        t = blob(t, CONFIG);
        t = blob(t, &amd);
        t = blob(t, &idx);
        let a = t
            .file("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)
            .file("index.json", top.as_bytes())
            .done();
        (a, idx, amd)
    }

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

    #[test]
    fn bad_input() {
        let a = docker_archive(r#"["app:dev"]"#, true);
        let half = |b: &[u8]| b[..b.len() / 2].to_vec();
        let e = read(&half(&gz(&a)), Limits::default()).0.unwrap_err();
        assert!(
            matches!(e, ArchiveError::Decompress(Compression::Gzip, _)),
            "{e}"
        );
        let e = read(&half(&zst(&a)), Limits::default()).0.unwrap_err();
        assert!(
            matches!(e, ArchiveError::Decompress(Compression::Zstd, _)),
            "{e}"
        );
        // Truncated plain tar (mid-entry).
        let e = read(&a[..a.len() - 3000], Limits::default()).0.unwrap_err();
        assert!(
            matches!(e, ArchiveError::Truncated(_) | ArchiveError::Tar(_)),
            "{e}"
        );
        // Garbage.
        let e = read(&[7u8; 3000], Limits::default()).0.unwrap_err();
        assert!(
            matches!(e, ArchiveError::Tar(_) | ArchiveError::NotImage),
            "{e}"
        );
        // Corrupt gzip body (flipped bytes in the middle).
        let mut g = gz(&a);
        let mid = g.len() / 2;
        for b in &mut g[mid..mid + 64] {
            *b ^= 0x55;
        }
        let e = read(&g, Limits::default()).0.unwrap_err();
        assert!(
            matches!(e, ArchiveError::Decompress(..) | ArchiveError::Tar(_)),
            "{e}"
        );
        // Unsafe paths.
        for name in ["../evil", "/abs/path", "a/../../b"] {
            let t = T::new().file(name, b"x").done();
            let e = read(&t, Limits::default()).0.unwrap_err();
            assert!(matches!(e, ArchiveError::UnsafePath(_)), "{name}: {e}");
        }
        let t = T::new().symlink("x", "../../etc/passwd").done();
        assert!(matches!(
            read(&t, Limits::default()).0,
            Err(ArchiveError::UnsafeLink(..))
        ));
        // Decompression bomb: a small cap.
        let bomb = gz(&vec![0u8; 8 << 20]);
        let limits = Limits {
            max_decompressed: 1 << 20,
            ..Limits::default()
        };
        let e = read(&bomb, limits).0.unwrap_err();
        assert!(matches!(e, ArchiveError::TooLarge(_)), "{e}");
        // Oversized manifest.json.
        let big = T::new().file("manifest.json", &vec![b' '; 5 << 20]).done();
        assert!(matches!(
            read(&big, Limits::default()).0,
            Err(ArchiveError::Oversized { .. })
        ));
        // Unsupported compression named as such.
        assert!(matches!(
            read(b"BZh91AY&SY", Limits::default()).0,
            Err(ArchiveError::Unsupported("bzip2"))
        ));
        // Not an image.
        let t = T::new().file("hello.txt", b"hi").done();
        assert!(matches!(
            read(&t, Limits::default()).0,
            Err(ArchiveError::NotImage)
        ));
    }

    #[test]
    fn huge_long_name_is_refused() {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::GNULongName);
        h.set_size(2 << 20);
        h.set_cksum();
        b.append_data(&mut h, "././@LongLink", &vec![b'a'; 2 << 20][..])
            .unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_size(1);
        h.set_cksum();
        b.append_data(&mut h, "x", &b"y"[..]).unwrap();
        let t = b.into_inner().unwrap();
        let e = read(&t, Limits::default()).0.unwrap_err();
        assert!(matches!(e, ArchiveError::HeaderTooLarge(_)), "{e}");
        // Ordinary long names still work.
        let long = format!("{}/manifest.json", "d".repeat(300));
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(2);
        h.set_cksum();
        b.append_data(&mut h, &long, &b"{}"[..]).unwrap();
        let e = read(&b.into_inner().unwrap(), Limits::default())
            .0
            .unwrap_err();
        assert!(matches!(e, ArchiveError::NotImage), "{e}");
    }

    #[test]
    fn metadata_budget_is_enforced() {
        let mut t = T::new();
        for i in 0..5 {
            t = t.file(
                &format!("m{i}.json"),
                format!("{{\"p\":\"{}\"}}", "x".repeat(300_000 + i)).as_bytes(),
            );
        }
        let limits = Limits {
            metadata_budget: 1 << 20,
            ..Limits::default()
        };
        assert!(matches!(
            read(&t.done(), limits).0,
            Err(ArchiveError::MetadataBudget(_))
        ));
    }
}
