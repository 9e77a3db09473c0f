//! Tar walking and blob streaming: path and link checks, small JSON kept
//! in memory, everything else hashed while it streams into the sink.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read};
use std::path::{Component, Path};
use std::rc::Rc;
use std::sync::Arc;

use sha2::{Digest as _, Sha256};

use super::container::Stream;
use super::{
    ArchiveError, BlobSink, Descriptor, Limits, Progress, SinkError, SmallBlob, CHUNK,
    MAX_LINK_HOPS,
};
use crate::oci::Digest;

/// What the archive's bytes told us about a blob.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
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

pub(super) struct Blob {
    pub(super) size: u64,
    pub(super) kind: Kind,
    pub(super) data: Option<Arc<Vec<u8>>>,
}

pub(super) struct Walker<'a> {
    pub(super) limits: &'a Limits,
    pub(super) sink: &'a mut dyn BlobSink,
    pub(super) progress: &'a mut dyn FnMut(Progress),
    pub(super) st: Rc<Stream>,
    /// digest → what we know about it.
    pub(super) blobs: HashMap<String, Blob>,
    /// archive path → digest of the regular file there.
    pub(super) paths: HashMap<String, String>,
    /// archive path → link target (normalised, archive-relative).
    pub(super) links: HashMap<String, String>,
    /// manifest.json, index.json, oci-layout, repositories.
    pub(super) meta: HashMap<&'static str, Vec<u8>>,
    pub(super) retained: usize,
    pub(super) streamed: usize,
}

const META_FILES: [&str; 4] = ["manifest.json", "index.json", "oci-layout", "repositories"];

impl Walker<'_> {
    pub(super) fn walk<R: Read>(&mut self, tar: &mut tar::Archive<R>) -> Result<(), ArchiveError> {
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

    pub(super) fn entry(
        &mut self,
        entry: &mut tar::Entry<'_, impl Read>,
    ) -> Result<(), ArchiveError> {
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

    pub(super) fn report(&mut self) {
        (self.progress)(Progress {
            raw_bytes: self.st.raw.get(),
            decompressed_bytes: self.st.decompressed.get(),
        });
    }

    pub(super) fn read_meta(
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
    pub(super) fn blob(
        &mut self,
        r: &mut impl Read,
        path: String,
        size: u64,
    ) -> Result<(), ArchiveError> {
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
        let (digest, data) = if keep {
            let mut all = first;
            all.resize(size as usize, 0);
            read_full(r, &mut all[first_len..], &path)?;
            hasher.update(&all[first_len..]);
            let digest = hex_digest(hasher);
            self.retained += all.len();
            (digest, Some(Arc::new(all)))
        } else {
            let digest = self.stream_blob(r, &path, size, first, hasher, expected.as_deref())?;
            (digest, None)
        };
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

    /// Streams the rest of a blob into the sink after its `first` chunk,
    /// reporting progress per chunk; returns its digest, checked against
    /// `expected` before the sink commits it.
    fn stream_blob(
        &mut self,
        r: &mut impl Read,
        path: &str,
        size: u64,
        first: Vec<u8>,
        mut hasher: Sha256,
        expected: Option<&str>,
    ) -> Result<String, ArchiveError> {
        let sink_err = |msg: SinkError| ArchiveError::Sink {
            path: path.to_string(),
            msg: msg.0,
        };
        let mut w = self.sink.start(expected, size).map_err(sink_err)?;
        self.streamed += 1;
        let mut done = first.len() as u64;
        if let Some(w) = &mut w {
            w.write(first).map_err(sink_err)?;
        }
        self.report();
        while done < size {
            let n = ((size - done) as usize).min(CHUNK);
            let mut buf = vec![0; n];
            read_full(r, &mut buf, path)?;
            hasher.update(&buf);
            if let Some(w) = &mut w {
                w.write(buf).map_err(sink_err)?;
            }
            done += n as u64;
            self.report();
        }
        let digest = hex_digest(hasher);
        if expected.is_some_and(|e| e != digest) {
            return Err(ArchiveError::DigestMismatch {
                path: path.to_string(),
                actual: digest,
            });
        }
        if let Some(w) = w {
            w.finish(&digest).map_err(sink_err)?;
        }
        Ok(digest)
    }

    /// Follows links from an archive path to the digest of a regular file.
    pub(super) fn lookup(&self, path: &str) -> Option<&String> {
        let mut p = clean_path(path.as_bytes()).ok()??;
        for _ in 0..MAX_LINK_HOPS {
            if let Some(d) = self.paths.get(&p) {
                return Some(d);
            }
            p = self.links.get(&p)?.clone();
        }
        None
    }
}

/// Blobs kept in memory (small JSON) were not streamed; write them from the plan.
pub(super) fn push_retained(
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

/// Normalises an entry path: strips `./`, refuses absolute paths and `..`.
/// `Ok(None)` for the archive root itself.
pub(super) fn clean_path(raw: &[u8]) -> Result<Option<String>, ArchiveError> {
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
pub(super) fn resolve_link(path: &str, target: &[u8], hard: bool) -> Result<String, ArchiveError> {
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
pub(super) fn oci_blob_digest(path: &str) -> Option<String> {
    let rest = path.strip_prefix("blobs/")?;
    let (alg, hex) = rest.split_once('/')?;
    let d = format!("{alg}:{hex}");
    // The reader hashes with sha256 only.
    (alg == "sha256" && Digest::parse(&d).is_ok()).then_some(d)
}

/// docker save's v1 leftovers (`<id>/json`, `<id>/VERSION`): never referenced.
pub(super) fn is_legacy_v1(path: &str) -> bool {
    matches!(path.split_once('/'), Some((_, "json" | "VERSION")))
}

pub(super) fn read_full(r: &mut impl Read, buf: &mut [u8], path: &str) -> Result<(), ArchiveError> {
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

pub(super) fn hex_digest(h: Sha256) -> String {
    format!("sha256:{}", hex::encode(h.finalize()))
}

pub fn sha256_hex(b: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(b)))
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::*;

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
