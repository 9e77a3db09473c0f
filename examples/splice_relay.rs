//! The second benchmark floor: a byte relay that never copies the payload
//! through user space.
//!
//! Like `floor_relay` (which copies every byte through a 256 KiB buffer), it
//! relays between two Unix sockets without parsing anything, but each
//! direction moves its bytes with splice(2): socket → pipe → socket, the
//! pipe enlarged to [`PIPE_SIZE`]. So it does strictly less than any proxy
//! that has to look at HTTP/2 frames: what it costs is the price of one
//! extra process and two socket hops, nothing more. `scripts/bench.sh` runs
//! it next to the tokio relay and imgbridge.
//!
//! Usage: `splice_relay <listen.sock> <upstream.sock>`
//!
//! `SPLICE_RELAY_MODE` picks how a direction waits (not set by bench.sh):
//! - `threads` (the default): one blocking thread per direction of each
//!   connection, blocking sockets, plain splice calls;
//! - `tokio`: non-blocking sockets and `SPLICE_F_NONBLOCK`, one task per
//!   direction on a tokio runtime, readiness through `AsyncFd`.
//!
//! Side by side in one run (docs/performance.md, "Floors"), both modes and
//! the threads with a 1 MiB send buffer moved streams alike within this
//! machine's noise; the threads took the least CPU per GiB, so they are
//! the default.
//!
//! `SPLICE_SNDBUF=<bytes>` (not set by bench.sh) gives both sockets that
//! send buffer, as imgbridge asks for.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;

use nix::sys::socket::{setsockopt, sockopt};

/// Each direction's pipe (F_SETPIPE_SZ; the default is 64 KiB, the
/// unprivileged maximum `fs.pipe-max-size`, 1 MiB by default).
const PIPE_SIZE: usize = 1 << 20;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Threads,
    Tokio,
}

fn main() -> io::Result<()> {
    let mut args = std::env::args_os().skip(1);
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: splice_relay <listen.sock> <upstream.sock>");
        std::process::exit(2);
    };
    let mode = match std::env::var("SPLICE_RELAY_MODE").as_deref() {
        Ok("tokio") => Mode::Tokio,
        Ok("threads") | Err(_) => Mode::Threads,
        Ok(other) => {
            eprintln!("SPLICE_RELAY_MODE: threads or tokio, not {other}");
            std::process::exit(2);
        }
    };
    let sndbuf: Option<usize> = std::env::var("SPLICE_SNDBUF")
        .ok()
        .and_then(|v| v.parse().ok());
    let upstream = PathBuf::from(upstream);
    let _ = std::fs::remove_file(&listen);
    let listener = UnixListener::bind(&listen)?;
    match mode {
        Mode::Threads => threads::serve(listener, upstream, sndbuf),
        Mode::Tokio => tokio::runtime::Builder::new_multi_thread()
            .enable_io()
            .build()?
            .block_on(nonblocking::serve(listener, upstream, sndbuf)),
    }
}

/// A pipe whose both ends close on drop.
struct Pipe {
    rd: OwnedFd,
    wr: OwnedFd,
}

impl Pipe {
    fn new(nonblocking: bool) -> io::Result<Pipe> {
        let mut fds = [0 as RawFd; 2];
        let flags = libc::O_CLOEXEC | if nonblocking { libc::O_NONBLOCK } else { 0 };
        // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), flags) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both are fresh descriptors we own.
        let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: F_SETPIPE_SZ on a pipe we own; failure only leaves the
        // default size (64 KiB), which still relays.
        unsafe { libc::fcntl(wr.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_SIZE as libc::c_int) };
        Ok(Pipe { rd, wr })
    }
}

/// One splice(2) call between two descriptors, neither offset given.
fn splice(from: BorrowedFd<'_>, to: BorrowedFd<'_>, len: usize, flags: u32) -> io::Result<usize> {
    // SAFETY: both descriptors are open for the borrow; null offsets mean
    // the files' own positions (required for pipes and sockets).
    let n = unsafe {
        libc::splice(
            from.as_raw_fd(),
            std::ptr::null_mut(),
            to.as_raw_fd(),
            std::ptr::null_mut(),
            len,
            flags,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

fn tune(s: &UnixStream, sndbuf: Option<usize>) {
    if let Some(n) = sndbuf {
        let _ = setsockopt(s, sockopt::SndBuf, &n);
    }
}

mod threads {
    use super::*;

    pub fn serve(
        listener: UnixListener,
        upstream: PathBuf,
        sndbuf: Option<usize>,
    ) -> io::Result<()> {
        loop {
            let (down, _) = listener.accept()?;
            let Ok(up) = UnixStream::connect(&upstream) else {
                continue;
            };
            tune(&down, sndbuf);
            tune(&up, sndbuf);
            let (down, up) = (Arc::new(down), Arc::new(up));
            for (from, to) in [(down.clone(), up.clone()), (up, down)] {
                std::thread::spawn(move || {
                    let _ = relay(&from, &to);
                    // Pass the end of stream on (or unblock the other
                    // direction after an error).
                    let _ = to.shutdown(std::net::Shutdown::Write);
                    let _ = from.shutdown(std::net::Shutdown::Read);
                });
            }
        }
    }

    /// `from` → pipe → `to` until `from` ends.
    fn relay(from: &UnixStream, to: &UnixStream) -> io::Result<()> {
        let pipe = Pipe::new(false)?;
        let flags = libc::SPLICE_F_MOVE;
        loop {
            let mut n = match splice(from.as_fd(), pipe.wr.as_fd(), PIPE_SIZE, flags) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            while n > 0 {
                match splice(pipe.rd.as_fd(), to.as_fd(), n, flags) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(m) => n -= m,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
}

mod nonblocking {
    use super::*;
    use tokio::io::unix::AsyncFd;
    use tokio::io::Interest;

    pub async fn serve(
        listener: UnixListener,
        upstream: PathBuf,
        sndbuf: Option<usize>,
    ) -> io::Result<()> {
        listener.set_nonblocking(true)?;
        let listener = tokio::net::UnixListener::from_std(listener)?;
        let upstream = Arc::new(upstream);
        loop {
            let (down, _) = listener.accept().await?;
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(up) = tokio::net::UnixStream::connect(&*upstream).await else {
                    return;
                };
                let (Ok(down), Ok(up)) = (register(down, sndbuf), register(up, sndbuf)) else {
                    return;
                };
                for (from, to) in [(down.clone(), up.clone()), (up, down)] {
                    tokio::spawn(async move {
                        let _ = relay(&from, &to).await;
                        let _ = to.get_ref().shutdown(std::net::Shutdown::Write);
                        let _ = from.get_ref().shutdown(std::net::Shutdown::Read);
                    });
                }
            });
        }
    }

    /// One registration per socket, for both directions: the task reading
    /// it waits for readability, the task writing to it for writability.
    fn register(
        s: tokio::net::UnixStream,
        sndbuf: Option<usize>,
    ) -> io::Result<Arc<AsyncFd<UnixStream>>> {
        let s = s.into_std()?; // stays non-blocking
        tune(&s, sndbuf);
        let interest = Interest::READABLE | Interest::WRITABLE;
        // SAFETY: the `UnixStream` owns its descriptor and keeps it open,
        // and the same, until the `AsyncFd` drops it (`get_mut` is not used).
        let fd = unsafe { AsyncFd::register_with_interest(s, interest) };
        Ok(Arc::new(fd.map_err(|e| e.into_parts().1)?))
    }

    /// `from` → pipe → `to` until `from` ends. The pipe is empty whenever
    /// the socket is read, so EAGAIN there means the socket had nothing;
    /// EAGAIN on the write means `to` is full.
    async fn relay(from: &AsyncFd<UnixStream>, to: &AsyncFd<UnixStream>) -> io::Result<()> {
        let pipe = Pipe::new(true)?;
        let flags = libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK;
        loop {
            let mut n = loop {
                let mut guard = from.readable().await?;
                match splice(from.get_ref().as_fd(), pipe.wr.as_fd(), PIPE_SIZE, flags) {
                    Ok(0) => return Ok(()),
                    Ok(n) => break n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => guard.clear_ready(),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            };
            while n > 0 {
                // Try first: a socket with room needs no wake-up.
                match splice(pipe.rd.as_fd(), to.get_ref().as_fd(), n, flags) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(m) => n -= m,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        to.writable().await?.clear_ready();
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
}
