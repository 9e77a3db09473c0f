//! systemd socket activation (`sd_listen_fds(3)`): when systemd started us
//! with `LISTEN_PID`/`LISTEN_FDS`, the proxy socket is fd 3 and, if the socket
//! unit declares a second `ListenStream=`, the ttrpc socket is fd 4.
//!
//! systemd owns these sockets: they stay bound (and queue connections) while
//! imgbridge restarts, and imgbridge must not remove their files on exit.

use std::os::fd::{BorrowedFd, FromRawFd, RawFd};
use std::os::unix::net::UnixListener;

use nix::sys::socket::{getsockname, getsockopt, sockopt, UnixAddr};

/// First passed descriptor (`SD_LISTEN_FDS_START`).
pub const LISTEN_FDS_START: RawFd = 3;

#[derive(Debug, thiserror::Error)]
pub enum ActivationError {
    #[error("LISTEN_FDS={0:?} is not a number")]
    BadCount(String),
    #[error("LISTEN_FDS=0: the socket unit passed no sockets")]
    NoSockets,
    #[error("fd {fd} passed by systemd is not a listening Unix stream socket ({why}); use ListenStream=/path in imgbridge.socket")]
    NotUnixListener { fd: RawFd, why: String },
    #[error("fd {fd}: {source}")]
    Io { fd: RawFd, source: std::io::Error },
}

/// Listeners handed over by systemd.
#[derive(Debug)]
pub struct Activated {
    /// The gRPC proxy socket (fd 3).
    pub grpc: UnixListener,
    /// The ttrpc relay socket (fd 4), when the unit passes two sockets.
    pub ttrpc: Option<UnixListener>,
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
    let (grpc_fd, ttrpc_fd) = assign(n, names.as_deref());
    let grpc = take(grpc_fd)?;
    let ttrpc = ttrpc_fd.map(take).transpose()?;
    Ok(Some(Activated { grpc, ttrpc }))
}

/// Which passed fd is which: by `FileDescriptorName=` when one is named
/// `ttrpc`, else by order (first gRPC, second ttrpc). Extra fds are ignored.
fn assign(n: RawFd, names: Option<&str>) -> (RawFd, Option<RawFd>) {
    let names: Vec<&str> = names.map(|s| s.split(':').collect()).unwrap_or_default();
    if names.len() == n as usize {
        if let Some(t) = names.iter().position(|&x| x == "ttrpc") {
            let g = (0..n as usize).find(|&i| i != t);
            if let Some(g) = g {
                return (
                    LISTEN_FDS_START + g as RawFd,
                    Some(LISTEN_FDS_START + t as RawFd),
                );
            }
        }
    }
    (LISTEN_FDS_START, (n >= 2).then_some(LISTEN_FDS_START + 1))
}

fn take(fd: RawFd) -> Result<UnixListener, ActivationError> {
    // SAFETY: systemd passed `fd` to this process and owns nothing else here;
    // it is only borrowed for the checks below.
    let b = unsafe { BorrowedFd::borrow_raw(fd) };
    let not = |why: String| ActivationError::NotUnixListener { fd, why };
    getsockname::<UnixAddr>(fd).map_err(|e| not(format!("getsockname: {e}")))?;
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
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assigns_by_name_then_order() {
        assert_eq!(assign(1, None), (3, None));
        assert_eq!(assign(2, None), (3, Some(4)));
        assert_eq!(
            assign(2, Some("imgbridge.socket:imgbridge.socket")),
            (3, Some(4))
        );
        assert_eq!(assign(2, Some("ttrpc:grpc")), (4, Some(3)));
        assert_eq!(assign(3, Some("a:b")), (3, Some(4)));
    }
}
