//! Creating imgbridge's listening sockets: the proxy's Unix socket and the
//! operations endpoint's (`ops::http`) alike, and the TCP ports of the
//! operations and registry endpoints.
//!
//! The socket is as powerful as containerd's own, so it is created 0660
//! root:root unless configured otherwise. A stale socket file is replaced; a
//! live one (someone answers) makes start-up fail instead of stealing it,
//! unless a handover was configured ([`bind_or_take_over`],
//! docs/daemonset.md "Upgrades").

use std::os::unix::fs::{chown, PermissionsExt};
use std::path::{Path, PathBuf};

use tokio::net::UnixListener;

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error(
        "{0} is in use: another process (another imgbridge?) answers on it; stop it or choose another --listen path"
    )]
    InUse(PathBuf),
    #[error("{0} exists and is not a socket (a {1}); imgbridge replaces only a stale socket: move it away or choose another --listen path")]
    NotSocket(PathBuf, &'static str),
    #[error("cannot remove stale socket {path}: {source}")]
    Stale {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot create directory for {path}: {source}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot bind {path}: {source}")]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot set mode/owner of {path}: {source}")]
    Perms {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Ownership and mode for a created socket.
#[derive(Clone, Copy, Debug)]
pub struct SocketPerms {
    pub mode: u32,
    /// Group id; `None` keeps root's group (gid 0).
    pub gid: Option<u32>,
}

impl Default for SocketPerms {
    fn default() -> Self {
        SocketPerms {
            mode: 0o660,
            gid: None,
        }
    }
}

/// What is at a socket path before a bind.
enum AtPath {
    Nothing,
    /// A socket nobody answers on: replaced.
    Stale,
    /// A socket someone answers on: refused, or taken over.
    Live,
}

/// What is at `path`: anything but a socket is an error (never replaced).
fn probe(path: &Path) -> Result<AtPath, ListenError> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(AtPath::Nothing);
    };
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if !t.is_socket() {
        let what = match () {
            _ if t.is_symlink() => "symlink",
            _ if t.is_dir() => "directory",
            _ if t.is_file() => "regular file",
            _ => "special file",
        };
        return Err(ListenError::NotSocket(path.into(), what));
    }
    Ok(match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => AtPath::Live,
        Err(_) => AtPath::Stale,
    })
}

/// Binds `path`, replacing a stale socket and refusing a live one.
pub fn bind(path: &Path, perms: SocketPerms) -> Result<UnixListener, ListenError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| ListenError::Dir {
            path: path.into(),
            source,
        })?;
    }
    match probe(path)? {
        AtPath::Nothing => {}
        AtPath::Live => return Err(ListenError::InUse(path.into())),
        AtPath::Stale => {
            std::fs::remove_file(path).map_err(|source| ListenError::Stale {
                path: path.into(),
                source,
            })?;
            tracing::info!(socket = %path.display(), "replaced stale socket file");
        }
    }
    let listener = bind_narrow(path, perms.mode).map_err(|source| ListenError::Bind {
        path: path.into(),
        source,
    })?;
    apply_perms(path, perms)?;
    Ok(listener)
}

/// Binds `path` like [`bind`], but a live socket there is taken over
/// rather than refused: the new socket is bound beside it, in the same
/// directory, and renamed over it, an atomic replacement. Every connect
/// from then on reaches this instance; the one before keeps the
/// connections it has (its listener, no longer reachable by any path,
/// gets no new ones) until it drains, and its [`SocketFile`] leaves this
/// file alone. So a DaemonSet's surge pod upgrades a node with no moment
/// without a socket (`socket_handover`, docs/daemonset.md "Upgrades").
pub fn bind_or_take_over(path: &Path, perms: SocketPerms) -> Result<UnixListener, ListenError> {
    if !matches!(probe(path)?, AtPath::Live) {
        return bind(path, perms);
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let beside = path.with_file_name(format!(".{name}.{}.handover", std::process::id()));
    // A file left by an instance of this pid that died in between.
    let _ = std::fs::remove_file(&beside);
    let placed = bind_narrow(&beside, perms.mode)
        .map_err(|source| ListenError::Bind {
            path: path.into(),
            source,
        })
        .and_then(|l| apply_perms(&beside, perms).map(|()| l))
        .and_then(|l| {
            std::fs::rename(&beside, path)
                .map(|()| l)
                .map_err(|source| ListenError::Bind {
                    path: path.into(),
                    source,
                })
        });
    if placed.is_err() {
        let _ = std::fs::remove_file(&beside);
    }
    let listener = placed?;
    tracing::info!(socket = %path.display(), "took the socket over from the instance serving it (handover): it keeps its connections, new ones come here");
    Ok(listener)
}

/// Binds TCP `addr` (`host:port`). With `shared`, `SO_REUSEPORT`: the
/// instance before a handover still holds the port while its successor
/// starts beside it (both must set it; the kernel spreads new connections
/// over both until the old one closes). `[::]` on a kernel without IPv6
/// falls back to `0.0.0.0`, every IPv4 address, as the wildcard it is.
pub async fn bind_tcp(addr: &str, shared: bool) -> std::io::Result<tokio::net::TcpListener> {
    // Each address the name resolves to in turn, as TcpListener::bind does.
    let mut last = std::io::Error::new(std::io::ErrorKind::InvalidInput, "no address");
    for sa in tokio::net::lookup_host(addr).await? {
        match bind_tcp_at(sa, shared) {
            Ok(l) => return Ok(l),
            Err(e) if sa.ip() == std::net::Ipv6Addr::UNSPECIFIED => {
                tracing::info!(listen = addr, error = %e, "no IPv6 here: listening on 0.0.0.0 instead");
                return bind_tcp_at((std::net::Ipv4Addr::UNSPECIFIED, sa.port()).into(), shared);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn bind_tcp_at(sa: std::net::SocketAddr, shared: bool) -> std::io::Result<tokio::net::TcpListener> {
    let socket = tcp_socket(sa)?;
    // As tokio's TcpListener::bind: a port in TIME_WAIT is bindable.
    socket.set_reuseaddr(true)?;
    if shared {
        socket.set_reuseport(true)?;
    }
    socket.bind(sa)?;
    socket.listen(1024)
}

fn tcp_socket(sa: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpSocket> {
    match sa {
        std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    }
}

/// Binds and listens with the socket file born no wider than `mode`: the
/// socket's own inode gets `mode` before `bind`, which creates the file with
/// it (less the umask, which only narrows). A plain `bind` creates it
/// `0777 & !umask` and the mode is set only after, so a client could connect
/// in between (with umask 0, anyone). `apply_perms` then sets the exact mode
/// and group; until then the file is at most `mode`, owned by root's group.
fn bind_narrow(path: &Path, mode: u32) -> std::io::Result<UnixListener> {
    use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};
    use nix::sys::stat::{fchmod, Mode};
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    fchmod(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        Mode::from_bits_truncate(mode),
    )?;
    socket::bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &UnixAddr::new(path)?)?;
    // SOMAXCONN, as std's and tokio's bind use.
    socket::listen(&fd, socket::Backlog::MAXCONN)?;
    UnixListener::from_std(std::os::unix::net::UnixListener::from(fd))
}

/// The file of a socket this process bound, removed when dropped: every way
/// out of `serve`, a later bind failing included, leaves no file behind.
///
/// Dropped as soon as shutdown starts, so that the next instance can bind
/// the path while this one drains. It removes only the file it bound: once
/// the path names another socket (the next instance's), it is left alone.
/// Drop it while the listener is still open: a bound socket keeps its inode
/// from being reused, which is what makes the comparison exact.
pub struct SocketFile {
    path: PathBuf,
    /// Device and inode of the bound socket file.
    id: Option<(u64, u64)>,
}

impl SocketFile {
    /// Takes charge of `path`, which this process has just bound.
    pub fn new(path: &Path) -> SocketFile {
        SocketFile {
            path: path.to_path_buf(),
            id: file_id(path),
        }
    }
}

fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path).ok()?;
    Some((m.dev(), m.ino()))
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if self.id.is_some() && file_id(&self.path) == self.id {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn apply_perms(path: &Path, perms: SocketPerms) -> Result<(), ListenError> {
    let err = |source| ListenError::Perms {
        path: path.into(),
        source,
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(perms.mode)).map_err(err)?;
    // Only root can give a socket away; an unprivileged developer run keeps
    // its own uid, which is no wider than the socket it was started on.
    if nix::unistd::geteuid().is_root() {
        chown(path, Some(0), Some(perms.gid.unwrap_or(0))).map_err(err)?;
    } else if let Some(gid) = perms.gid {
        chown(path, None, Some(gid)).map_err(err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[tokio::test]
    async fn a_file_that_is_not_a_socket_is_never_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("imgbridge.sock");
        std::fs::write(&p, b"precious").unwrap();
        let e = bind(&p, SocketPerms::default()).unwrap_err();
        assert!(
            matches!(e, ListenError::NotSocket(_, "regular file")),
            "{e}"
        );
        assert_eq!(std::fs::read(&p).unwrap(), b"precious");
        let d = dir.path().join("d");
        std::fs::create_dir(&d).unwrap();
        assert!(matches!(
            bind(&d, SocketPerms::default()),
            Err(ListenError::NotSocket(_, "directory"))
        ));
    }

    #[tokio::test]
    async fn stale_replaced_live_refused_mode_set() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/s.sock");
        let l = bind(&p, SocketPerms::default()).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o660);
        assert!(matches!(
            bind(&p, SocketPerms::default()),
            Err(ListenError::InUse(_))
        ));
        drop(l); // the file stays behind: stale
        assert!(p.exists());
        let _l = bind(
            &p,
            SocketPerms {
                mode: 0o600,
                gid: None,
            },
        )
        .unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o600);
    }

    /// The file exists no wider than the configured mode from the moment
    /// it is bound (before, `bind` made it `0777 & !umask` first).
    #[tokio::test]
    async fn the_socket_file_is_born_with_its_mode() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.sock");
        let _l = bind_narrow(&p, 0o660).unwrap();
        // Read, not set: umask(2) is process-wide and tests run in threads.
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let umask = status
            .lines()
            .find_map(|l| l.strip_prefix("Umask:"))
            .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
            .expect("Umask in /proc/self/status");
        let mode = std::fs::metadata(&p).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o660 & !umask, "umask {umask:03o}");
        assert_eq!(mode & 0o007, 0, "never open to others, even for a moment");
    }

    #[tokio::test]
    async fn socket_file_removes_only_the_socket_it_bound() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.sock");
        let _l = bind(&p, SocketPerms::default()).unwrap();
        let mine = SocketFile::new(&p);
        drop(mine);
        assert!(!p.exists(), "its own file is removed");

        let old = bind(&p, SocketPerms::default()).unwrap();
        let old_file = SocketFile::new(&p);
        // The next instance took the path over (the file was replaced).
        std::fs::remove_file(&p).unwrap();
        let _new = bind(&p, SocketPerms::default()).unwrap();
        drop(old_file);
        drop(old);
        assert!(p.exists(), "the next instance's socket stays");
    }

    /// A handover: the successor binds over the live socket; the old
    /// instance's connection keeps working, every new connect reaches the
    /// successor, and the old instance's file cleanup leaves the new file.
    #[tokio::test]
    async fn a_live_socket_is_taken_over_without_a_gap() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.sock");
        let old = bind(&p, SocketPerms::default()).unwrap();
        let old_file = SocketFile::new(&p);
        let mut before = tokio::net::UnixStream::connect(&p).await.unwrap();
        let (mut served, _) = old.accept().await.unwrap();

        // Refused without a handover, taken over with one.
        assert!(matches!(
            bind(&p, SocketPerms::default()),
            Err(ListenError::InUse(_))
        ));
        let new = bind_or_take_over(
            &p,
            SocketPerms {
                mode: 0o600,
                gid: None,
            },
        )
        .unwrap();
        let new_file = SocketFile::new(&p);
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o600);
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            leftovers,
            vec![std::ffi::OsString::from("s.sock")],
            "only the socket"
        );

        let _after = tokio::net::UnixStream::connect(&p).await.unwrap();
        let accepted = tokio::time::timeout(std::time::Duration::from_secs(5), new.accept()).await;
        assert!(accepted.is_ok(), "a new connect reaches the successor");
        before.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        served.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping", "the old connection still works");

        drop(old_file);
        drop(old);
        assert!(p.exists(), "the old instance left the successor's socket");
        drop(new_file);
        assert!(!p.exists());
        drop(new);
    }

    #[tokio::test]
    async fn a_shared_tcp_port_binds_twice_only_when_both_share() {
        let a = bind_tcp("127.0.0.1:0", true).await.unwrap();
        let port = a.local_addr().unwrap().port();
        assert!(bind_tcp(&format!("127.0.0.1:{port}"), false).await.is_err());
        assert!(bind_tcp(&format!("127.0.0.1:{port}"), true).await.is_ok());
        let b = bind_tcp("127.0.0.1:0", false).await.unwrap();
        let port = b.local_addr().unwrap().port();
        assert!(bind_tcp(&format!("127.0.0.1:{port}"), true).await.is_err());
    }
}
