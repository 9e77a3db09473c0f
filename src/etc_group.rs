//! Group names from `/etc/group`, read directly.
//!
//! The release binary is static (musl, or glibc with `crt-static`), where
//! `getgrnam` cannot be relied on: static glibc cannot load NSS modules, and
//! an empty container root has no NSS configuration at all. `socket_group`
//! only ever needs the local group file, so it is parsed here.

use std::io;
use std::path::Path;

/// The gid of group `name` in `/etc/group`, `None` if no line names it.
pub fn gid_of(name: &str) -> io::Result<Option<u32>> {
    gid_in_file(Path::new("/etc/group"), name)
}

/// As [`gid_of`], for a group file at `path`; a missing file has no groups.
pub fn gid_in_file(path: &Path, name: &str) -> io::Result<Option<u32>> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(gid_in(&String::from_utf8_lossy(&bytes), name)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The gid of `name` in group-file text (`name:password:gid:members`, one
/// group a line). The first matching line wins, as with glibc's `files`
/// backend; comments, blank lines, NIS `+`/`-` entries and lines without a
/// numeric gid are skipped.
pub fn gid_in(text: &str, name: &str) -> Option<u32> {
    if name.is_empty() {
        return None;
    }
    text.lines().find_map(|line| {
        let line = line.trim_end_matches('\r');
        if line.starts_with('#') || line.starts_with('+') || line.starts_with('-') {
            return None;
        }
        let mut f = line.split(':');
        let (n, _pw, gid) = (f.next()?, f.next()?, f.next()?);
        if n != name {
            return None;
        }
        gid.trim().parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GROUP: &str = "\
root:x:0:
# a comment:x:5:
docker:x:998:alice,bob
+nisgroup:x:77:

containerd:x:1001:
broken:x:notanumber:
containerd:x:2002:
crlf:x:42:\r
";

    #[test]
    fn finds_names_and_first_wins() {
        assert_eq!(gid_in(GROUP, "root"), Some(0));
        assert_eq!(gid_in(GROUP, "docker"), Some(998));
        assert_eq!(gid_in(GROUP, "containerd"), Some(1001));
        assert_eq!(gid_in(GROUP, "crlf"), Some(42));
    }

    #[test]
    fn skips_comments_nis_bad_gids_and_partial_names() {
        assert_eq!(gid_in(GROUP, "# a comment"), None);
        assert_eq!(gid_in(GROUP, "nisgroup"), None);
        assert_eq!(gid_in(GROUP, "+nisgroup"), None);
        assert_eq!(gid_in(GROUP, "broken"), None);
        assert_eq!(gid_in(GROUP, "dock"), None);
        assert_eq!(gid_in(GROUP, "x"), None);
        assert_eq!(gid_in(GROUP, ""), None);
        assert_eq!(gid_in("", "root"), None);
        assert_eq!(gid_in("short:x", "short"), None);
    }

    #[test]
    fn reads_a_file_and_a_missing_file_has_no_groups() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("group");
        std::fs::write(&p, GROUP).unwrap();
        assert_eq!(gid_in_file(&p, "docker").unwrap(), Some(998));
        assert_eq!(
            gid_in_file(&dir.path().join("none"), "docker").unwrap(),
            None
        );
        // A directory where the file should be is an error, not "no group".
        assert!(gid_in_file(dir.path(), "docker").is_err());
    }
}
