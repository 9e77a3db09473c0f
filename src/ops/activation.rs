//! systemd socket activation (`sd_listen_fds(3)`): when systemd started us
//! with `LISTEN_PID`/`LISTEN_FDS`, every passed socket is served: the ones
//! whose path ends in `.ttrpc` (or named `ttrpc` by `FileDescriptorName=`)
//! by the ttrpc relay, all others by the gRPC proxy. So the drop-in socket
//! swap adds containerd's default path beside `/run/imgbridge/containerd.sock`
//! and both stay live (docs/socket-swap.md).
//!
//! systemd owns these sockets: they stay bound (and queue connections) while
//! imgbridge restarts, and imgbridge must not remove their files on exit.

use std::os::fd::{BorrowedFd, FromRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;

use nix::sys::socket::{getsockname, getsockopt, sockopt, UnixAddr};

/// First passed descriptor (`SD_LISTEN_FDS_START`).
pub const LISTEN_FDS_START: RawFd = 3;

#[derive(Debug, thiserror::Error)]
pub enum ActivationError {
    #[error("LISTEN_FDS={0:?} is not a number")]
    BadCount(String),
    #[error("LISTEN_FDS=0: the socket unit passed no sockets")]
    NoSockets,
    #[error("systemd passed only ttrpc sockets ({0}); add a ListenStream= for the gRPC socket to imgbridge.socket")]
    NoGrpc(String),
    #[error("fd {fd} passed by systemd is not a listening Unix stream socket ({why}); use ListenStream=/path in imgbridge.socket")]
    NotUnixListener { fd: RawFd, why: String },
    #[error("fd {fd}: {source}")]
    Io { fd: RawFd, source: std::io::Error },
}

/// Which server a passed socket feeds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Grpc,
    Ttrpc,
}

/// One socket handed over by systemd.
#[derive(Debug)]
pub struct Passed {
    pub listener: UnixListener,
    /// Its path (`None` for an abstract or unnamed socket).
    pub path: Option<PathBuf>,
    pub role: Role,
}

/// Listeners handed over by systemd, at least one of them gRPC.
#[derive(Debug)]
pub struct Activated {
    pub sockets: Vec<Passed>,
}

impl Activated {
    /// Splits into the gRPC and the ttrpc listeners.
    pub fn split(self) -> (Vec<UnixListener>, Vec<UnixListener>) {
        let (g, t): (Vec<_>, Vec<_>) = self.sockets.into_iter().partition(|p| p.role == Role::Grpc);
        (
            g.into_iter().map(|p| p.listener).collect(),
            t.into_iter().map(|p| p.listener).collect(),
        )
    }
}

/// Takes the listeners systemd passed, if any, and unsets `LISTEN_PID`,
/// `LISTEN_FDS` and `LISTEN_FDNAMES` so children do not inherit them.
///
/// Returns `Ok(None)` when not socket-activated (variables absent, or meant
/// for another process). The listeners are non-blocking and close-on-exec.
/// Call it once, early in `main`, before any thread is started (it edits the
/// environment).
pub fn from_env() -> Result<Option<Activated>, ActivationError> {
    let pid = std::env::var("LISTEN_PID").ok();
    let fds = std::env::var("LISTEN_FDS").ok();
    let names = std::env::var("LISTEN_FDNAMES").ok();
    for v in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        std::env::remove_var(v);
    }
    let (Some(pid), Some(fds)) = (pid, fds) else {
        return Ok(None);
    };
    if pid.trim().parse::<u32>().ok() != Some(std::process::id()) {
        return Ok(None);
    }
    let n: RawFd = fds
        .trim()
        .parse()
        .map_err(|_| ActivationError::BadCount(fds.clone()))?;
    if n < 1 {
        return Err(ActivationError::NoSockets);
    }
    let names: Vec<&str> = names
        .as_deref()
        .map(|s| s.split(':').collect())
        .unwrap_or_default();
    let mut sockets = Vec::with_capacity(n as usize);
    for i in 0..n {
        let fd = LISTEN_FDS_START + i;
        let (listener, path) = take(fd)?;
        let name = names
            .get(i as usize)
            .copied()
            .filter(|_| names.len() == n as usize);
        let role = role(name, path.as_deref());
        sockets.push(Passed {
            listener,
            path,
            role,
        });
    }
    if !sockets.iter().any(|p| p.role == Role::Grpc) {
        let paths: Vec<String> = sockets
            .iter()
            .map(|p| {
                p.path
                    .as_deref()
                    .map_or("?".into(), |p| p.display().to_string())
            })
            .collect();
        return Err(ActivationError::NoGrpc(paths.join(", ")));
    }
    Ok(Some(Activated { sockets }))
}

/// Says what socket activation overrides: `socket_mode`/`socket_group`
/// that differ from the socket systemd passed (systemd's `SocketMode=` and
/// `SocketGroup=` decide), and a `listen` path systemd does not pass. A WARN
/// each, naming the drop-in setting to change instead; silence hid it.
pub fn check_settings(a: &Activated, listen: &std::path::Path, want: crate::listener::SocketPerms) {
    use std::os::unix::fs::MetadataExt;
    for p in &a.sockets {
        let Some(path) = &p.path else { continue };
        let Ok(m) = std::fs::metadata(path) else {
            continue;
        };
        let (mode, gid) = (m.mode() & 0o7777, m.gid());
        let want_gid = want.gid.unwrap_or(0);
        if mode != want.mode || gid != want_gid {
            tracing::warn!(
                socket = %path.display(),
                "socket_mode = \"{:04o}\" / socket_group (gid {want_gid}) are not applied under socket activation: systemd created this socket {mode:04o} with gid {gid}; set SocketMode=/SocketGroup= in a drop-in for imgbridge.socket (systemctl edit imgbridge.socket) instead",
                want.mode
            );
        }
    }
    if !a.sockets.iter().any(|p| p.path.as_deref() == Some(listen)) {
        let paths: Vec<String> = a
            .sockets
            .iter()
            .filter_map(|p| p.path.as_ref().map(|p| p.display().to_string()))
            .collect();
        tracing::warn!(
            listen = %listen.display(),
            passed = %paths.join(", "),
            "listen is not applied under socket activation: systemd passed other sockets; change ListenStream= in imgbridge.socket instead"
        );
    }
}

/// A socket named `ttrpc` or `grpc` by `FileDescriptorName=` is that; else
/// a path ending in `.ttrpc` (containerd's own naming) is the ttrpc relay's.
fn role(name: Option<&str>, path: Option<&std::path::Path>) -> Role {
    match name {
        Some("ttrpc") => Role::Ttrpc,
        Some("grpc") => Role::Grpc,
        _ if path.is_some_and(|p| p.extension().is_some_and(|e| e == "ttrpc")) => Role::Ttrpc,
        _ => Role::Grpc,
    }
}

fn take(fd: RawFd) -> Result<(UnixListener, Option<PathBuf>), ActivationError> {
    // SAFETY: systemd passed `fd` to this process and owns nothing else here;
    // it is only borrowed for the checks below.
    let b = unsafe { BorrowedFd::borrow_raw(fd) };
    let not = |why: String| ActivationError::NotUnixListener { fd, why };
    let addr = getsockname::<UnixAddr>(fd).map_err(|e| not(format!("getsockname: {e}")))?;
    let path = addr.path().map(|p| p.to_path_buf());
    match getsockopt(&b, sockopt::SockType) {
        Ok(nix::sys::socket::SockType::Stream) => {}
        Ok(t) => return Err(not(format!("socket type {t:?}"))),
        Err(e) => return Err(not(e.to_string())),
    }
    if !getsockopt(&b, sockopt::AcceptConn).map_err(|e| not(e.to_string()))? {
        return Err(not("not listening".into()));
    }
    nix::fcntl::fcntl(
        fd,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )
    .map_err(|e| ActivationError::Io {
        fd,
        source: e.into(),
    })?;
    // SAFETY: the fd is a listening Unix socket passed to us; from_env()
    // consumed the variables, so it is taken over exactly once.
    let l = unsafe { UnixListener::from_raw_fd(fd) };
    l.set_nonblocking(true)
        .map_err(|source| ActivationError::Io { fd, source })?;
    Ok((l, path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn every_socket_has_a_role_by_name_then_path() {
        let p = |s: &'static str| Some(Path::new(s));
        assert_eq!(role(None, p("/run/imgbridge/containerd.sock")), Role::Grpc);
        assert_eq!(
            role(None, p("/run/imgbridge/containerd.sock.ttrpc")),
            Role::Ttrpc
        );
        assert_eq!(role(None, p("/run/containerd/containerd.sock")), Role::Grpc);
        assert_eq!(
            role(
                Some("imgbridge.socket"),
                p("/run/containerd/containerd.sock.ttrpc")
            ),
            Role::Ttrpc
        );
        assert_eq!(role(Some("ttrpc"), p("/run/x.sock")), Role::Ttrpc);
        assert_eq!(role(Some("grpc"), p("/run/x.sock.ttrpc")), Role::Grpc);
        assert_eq!(role(None, None), Role::Grpc);
    }
}
