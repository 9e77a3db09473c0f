//! File writes that never leave half a file behind (import state, the
//! socket swap's files): containerd, systemd or the next imgbridge may read
//! these files at any moment (a crash, a reboot, a concurrent
//! `daemon-reload`). A temp file beside the target is written, fsynced and
//! renamed over it, then the directory is fsynced so the rename survives a
//! power cut. An existing file keeps its mode and owner (containerd's config
//! may be 0600, or owned by whoever manages it).

use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Replaces `path`'s content with `bytes`; a new file gets `mode`. A
/// symlink is followed, so the file it names is replaced, not the link.
pub fn write(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let target = match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => fs::canonicalize(path)?,
        _ => path.to_path_buf(),
    };
    let existing = match fs::metadata(&target) {
        Ok(m) => Some(m),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(e),
    };
    let (dir, tmp) = temp_beside(&target)?;
    let _ = fs::remove_file(&tmp);
    let written = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(bytes)?;
        if let Some(m) = &existing {
            let own = f.metadata()?;
            if (own.uid(), own.gid()) != (m.uid(), m.gid()) {
                std::os::unix::fs::fchown(&f, Some(m.uid()), Some(m.gid()))?;
            }
        }
        // After chown, which clears set-id bits.
        let mode = existing.as_ref().map_or(mode, |m| m.mode() & 0o7777);
        f.set_permissions(Permissions::from_mode(mode))?;
        f.sync_all()?;
        fs::rename(&tmp, &target)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written?;
    sync_dir(&dir)
}

/// Removes `path`; `false` if it was not there.
pub fn remove(path: &Path) -> io::Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => {
            if let Some(dir) = path.parent() {
                sync_dir(dir)?;
            }
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

fn temp_beside(target: &Path) -> io::Result<(PathBuf, PathBuf)> {
    let invalid = || {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: not a file path", target.display()),
        )
    };
    let dir = target.parent().ok_or_else(invalid)?.to_path_buf();
    let name = target.file_name().ok_or_else(invalid)?.to_string_lossy();
    let tmp = dir.join(format!(".{name}.imgbridge-{}.tmp", std::process::id()));
    Ok((dir, tmp))
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_keeping_mode_and_follows_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("config.toml");
        write(&f, b"one", 0o644).unwrap();
        assert_eq!(fs::metadata(&f).unwrap().mode() & 0o7777, 0o644);
        fs::set_permissions(&f, Permissions::from_mode(0o600)).unwrap();
        write(&f, b"two", 0o644).unwrap();
        assert_eq!(fs::read(&f).unwrap(), b"two");
        assert_eq!(fs::metadata(&f).unwrap().mode() & 0o7777, 0o600);

        let link = dir.path().join("link.toml");
        std::os::unix::fs::symlink(&f, &link).unwrap();
        write(&link, b"three", 0o644).unwrap();
        assert!(fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(fs::read(&f).unwrap(), b"three");
        // No temp file left behind.
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");

        assert!(remove(&f).unwrap());
        assert!(!remove(&f).unwrap());
    }
}
