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
//!
//! By stage: [`container`] (compression detection, decompression, caps),
//! [`blobs`] (tar walking, path checks, blob streaming and hashing),
//! [`docker`] (docker-archive `manifest.json`) and [`oci`] (OCI layout).

mod blobs;
mod container;
mod docker;
mod oci;
#[cfg(test)]
mod testkit;

use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufRead, BufReader, Read};
use std::rc::Rc;
use std::sync::Arc;

use serde::Deserialize;
use sha2::{Digest as _, Sha256};

pub use blobs::sha256_hex;
use blobs::{hex_digest, Walker};
pub use container::Compression;
use container::{Capped, Fault, RawReader, Stream};
use docker::DockerEntry;
use oci::oci_name;

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
/// Decompressed bytes before [`Limits::max_ratio`] applies: small archives
/// (an almost empty image is mostly tar padding) compress far better than
/// 100:1 and are harmless.
const RATIO_FLOOR: u64 = 64 << 20;
/// Symlink hops followed when resolving a docker-archive path.
const MAX_LINK_HOPS: usize = 16;

use crate::labels::media_type::{
    DOCKER_CONFIG, DOCKER_LAYER, DOCKER_LAYER_GZIP, DOCKER_LAYER_ZSTD, DOCKER_MANIFEST,
};
#[cfg(test)]
use crate::labels::media_type::{OCI_INDEX, OCI_MANIFEST};
use crate::labels::GC_REF_CONTENT;
const ANN_CONTAINERD_NAME: &str = "io.containerd.image.name";
const ANN_OCI_REF_NAME: &str = "org.opencontainers.image.ref.name";

/// Resource caps for one archive.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Decompressed bytes read from the archive (decompression bombs).
    pub max_decompressed: u64,
    /// Decompressed bytes per raw byte, checked past [`RATIO_FLOOR`] (0 = off).
    pub max_ratio: u64,
    /// One metadata document.
    pub metadata: usize,
    /// All metadata documents held at once.
    pub metadata_budget: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_decompressed: 64 << 30,
            max_ratio: 100,
            metadata: METADATA_LIMIT,
            metadata_budget: METADATA_BUDGET,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    /// Only the reason's kind is shown: the tar crate's messages quote
    /// header bytes, i.e. the file's content.
    #[error("corrupt or unreadable tar: {}", safe_io(.0))]
    Tar(#[source] io::Error),
    #[error("corrupt or unreadable tar at byte {offset} of the tar stream: {reason}")]
    Corrupt { offset: u64, reason: String },
    #[error("{0} stream is corrupt or truncated: {1}")]
    Decompress(Compression, #[source] io::Error),
    #[error("decompressed size exceeds the cap of {0} bytes (import.max_decompressed_bytes)")]
    TooLarge(u64),
    #[error("decompressed size passed {ratio}x the {raw} compressed bytes read (import.max_decompression_ratio); a decompression bomb?")]
    Ratio { ratio: u64, raw: u64 },
    #[error("entry {0:?} escapes the archive (absolute path or '..')")]
    UnsafePath(String),
    #[error("link {0:?} -> {1:?} points outside the archive")]
    UnsafeLink(String, String),
    #[error("entry {what:?} is {size} bytes, over the {limit}-byte limit for metadata")]
    Oversized {
        what: String,
        size: u64,
        limit: usize,
    },
    #[error("a tar header with its long-name/PAX extensions exceeds {0} bytes")]
    HeaderTooLarge(u64),
    #[error("more than {0} bytes of JSON metadata in one archive; refusing to hold it")]
    MetadataBudget(usize),
    #[error("{}: invalid JSON: {}", .0, json_reason(.1))]
    Json(String, #[source] serde_json::Error),
    #[error("index.json: {0}")]
    Index(String),
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

/// An I/O error's description without its message when that may quote
/// file content (anything but an OS error).
fn safe_io(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(_) => e.to_string(),
        None => format!(
            "{} ({})",
            e.kind(),
            "details withheld: they may quote the file"
        ),
    }
}

/// serde_json's position and category, not its message (which may quote
/// the document).
pub(super) fn json_reason(e: &serde_json::Error) -> String {
    let what = match e.classify() {
        serde_json::error::Category::Io => "read error",
        serde_json::error::Category::Syntax => "syntax error",
        serde_json::error::Category::Data => "unexpected structure or type",
        serde_json::error::Category::Eof => "ends early",
    };
    format!("{what} at line {}, column {}", e.line(), e.column())
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
    let decoder = decoder(buffered, compression)?;
    let capped = Capped {
        inner: decoder,
        st: st.clone(),
        cap: opts.limits.max_decompressed,
        max_ratio: opts.limits.max_ratio,
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
    let fault = |e: ArchiveError| stream_fault(&st, &opts.limits, compression, e);
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

/// The decompressor `compression` calls for, over the raw stream.
fn decoder<'r>(
    buffered: BufReader<impl Read + 'r>,
    compression: Compression,
) -> Result<Box<dyn Read + 'r>, ArchiveError> {
    Ok(match compression {
        Compression::None => Box::new(buffered),
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(buffered)),
        Compression::Zstd => {
            let mut d = zstd::stream::read::Decoder::with_buffer(buffered)
                .map_err(|e| ArchiveError::Decompress(compression, e))?;
            d.window_log_max(ZSTD_WINDOW_LOG_MAX)
                .map_err(|e| ArchiveError::Decompress(compression, e))?;
            Box::new(d)
        }
    })
}

/// What an error reading the stream really was: a cap the stream hit or
/// the decompressor failing surface to the tar crate as plain I/O errors.
fn stream_fault(
    st: &Stream,
    limits: &Limits,
    compression: Compression,
    e: ArchiveError,
) -> ArchiveError {
    match st.fault.get() {
        Some(Fault::Cap) => ArchiveError::TooLarge(limits.max_decompressed),
        Some(Fault::Ratio) => ArchiveError::Ratio {
            ratio: limits.max_ratio,
            raw: st.raw.get(),
        },
        Some(Fault::Header) => ArchiveError::HeaderTooLarge(HEADER_LIMIT),
        Some(Fault::Decompress) => match e {
            ArchiveError::Tar(io) => ArchiveError::Decompress(compression, io),
            ArchiveError::Truncated(_) => ArchiveError::Decompress(
                compression,
                io::Error::new(io::ErrorKind::UnexpectedEof, "stream ended early"),
            ),
            other => other,
        },
        None => match e {
            ArchiveError::Tar(io) => ArchiveError::Corrupt {
                offset: st.decompressed.get(),
                reason: safe_io(&io),
            },
            other => other,
        },
    }
}

impl Walker<'_> {
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
            Some(b) => Some(oci::index(b)?),
            None => None,
        };
        let named_oci = index.as_ref().is_some_and(|i| {
            i.manifests
                .iter()
                .any(|e| oci_name(e, &mut Vec::new()).is_some())
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
}

#[derive(Default)]
struct Resolved {
    images: Vec<PlannedImage>,
    failures: Vec<String>,
    warnings: Vec<String>,
}
