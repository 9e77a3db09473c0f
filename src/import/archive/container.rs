//! Container detection and decompression: which compression the bytes
//! say, counting raw and decompressed bytes, and the caps that stop
//! decompression bombs and oversized tar headers below the tar parser.

use std::cell::Cell;
use std::io::{self, Read};
use std::rc::Rc;

use sha2::{Digest as _, Sha256};

use super::{ArchiveError, HEADER_LIMIT, RATIO_FLOOR};

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

/// Shared counters and the fault seen below the tar parser, so a tar error
/// caused by a bad gzip stream or the size cap is reported as such.
#[derive(Default)]
pub(super) struct Stream {
    pub(super) raw: Cell<u64>,
    pub(super) decompressed: Cell<u64>,
    pub(super) fault: Cell<Option<Fault>>,
    pub(super) hash: std::cell::RefCell<Option<Sha256>>,
    /// Whether the walker (not the tar crate) is reading entry data.
    pub(super) in_data: Cell<bool>,
    /// Bytes the tar crate read for the current header and its extensions.
    pub(super) header_bytes: Cell<u64>,
}

#[derive(Clone, Copy)]
pub(super) enum Fault {
    Decompress,
    Cap,
    Ratio,
    Header,
}

pub(super) struct RawReader<R> {
    pub(super) inner: R,
    pub(super) st: Rc<Stream>,
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
pub(super) struct Capped<R> {
    pub(super) inner: R,
    pub(super) st: Rc<Stream>,
    pub(super) cap: u64,
    pub(super) max_ratio: u64,
    pub(super) compressed: bool,
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
        if self.compressed
            && self.max_ratio > 0
            && total > RATIO_FLOOR
            && total > self.st.raw.get().saturating_mul(self.max_ratio)
        {
            self.st.fault.set(Some(Fault::Ratio));
            return Err(io::Error::other("decompression ratio cap exceeded"));
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

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::*;

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
            matches!(e, ArchiveError::Truncated(_) | ArchiveError::Corrupt { .. }),
            "{e}"
        );
        // Garbage.
        let e = read(&[7u8; 3000], Limits::default()).0.unwrap_err();
        assert!(
            matches!(e, ArchiveError::Corrupt { .. } | ArchiveError::NotImage),
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
            matches!(
                e,
                ArchiveError::Decompress(..) | ArchiveError::Corrupt { .. }
            ),
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
        // The same bomb, bigger, under the default caps: stopped by the
        // ratio long before the absolute cap, saying why.
        let bomb = gz(&vec![0u8; 96 << 20]);
        let e = read(&bomb, Limits::default()).0.unwrap_err();
        assert!(matches!(e, ArchiveError::Ratio { ratio: 100, .. }), "{e}");
        assert!(
            e.to_string().contains("import.max_decompression_ratio"),
            "{e}"
        );
        let off = Limits {
            max_ratio: 0,
            ..Limits::default()
        };
        let e = read(&bomb, off).0.unwrap_err();
        assert!(!matches!(e, ArchiveError::Ratio { .. }), "{e}");
        // A file's bytes never reach an error: a text file read as a tar.
        let secret = b"root:SECRET-hunter2:19000:0:99999:7:::\n".repeat(40);
        let e = read(&secret, Limits::default()).0.unwrap_err().to_string();
        assert!(!e.contains("hunter2"), "{e}");
        let bad_json = T::new()
            .file("manifest.json", br#""hunter2-secret""#)
            .done();
        let e = read(&bad_json, Limits::default())
            .0
            .unwrap_err()
            .to_string();
        assert!(!e.contains("hunter2") && e.contains("line 1"), "{e}");
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
}
