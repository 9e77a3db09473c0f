//! Small utilities: scratch dirs, unique names, polling with a deadline,
//! running tools with a timeout, a minimal HTTP/1.1 client.

use std::ffi::OsStr;
use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tempfile::TempDir;

use crate::daemon::{ensure_atexit, keep_tmp, SCRATCH};
use crate::shims::unmount_under;

/// Deadline for a daemon to become ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// Deadline for a CRI container to print its expected output.
pub const POD_TIMEOUT: Duration = Duration::from_secs(20);
/// Deadline for one invocation of a helper tool (ctr, skopeo, umoci).
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(180);
/// Grace period between SIGTERM and SIGKILL when stopping a daemon.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

/// Per-process scratch directory; everything temporary lives below it.
pub fn scratch_root() -> &'static Path {
    SCRATCH.get_or_init(|| {
        ensure_atexit();
        sweep_stale_scratch_dirs();
        let dir = tempfile::Builder::new()
            .prefix(&format!("imgbridge-test-{}-", std::process::id()))
            .tempdir()
            .expect("cannot create scratch dir")
            .keep();
        if keep_tmp() {
            // The marker stops later test processes from sweeping it.
            let _ = fs::write(dir.join("KEEP"), b"IMGBRIDGE_TEST_KEEP was set\n");
            eprintln!("imgbridge test scratch dir (kept): {}", dir.display());
        }
        dir
    })
}

/// Removes `$TMPDIR/imgbridge-test-<pid>-*` dirs left by test processes that
/// were SIGKILLed (their pid no longer exists), after detaching any mounts.
/// Dirs kept on purpose (`IMGBRIDGE_TEST_KEEP`, marker file `KEEP`) stay.
pub(crate) fn sweep_stale_scratch_dirs() {
    let Ok(rd) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(rest) = name
            .to_str()
            .and_then(|n| n.strip_prefix("imgbridge-test-"))
        else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() || e.path().join("KEEP").exists() {
            continue;
        }
        let path = e.path();
        if unmount_under(&path) == 0 {
            let _ = fs::remove_dir_all(&path);
        }
    }
}

/// A fresh temp dir below [`scratch_root`].
pub fn tempdir(prefix: &str) -> TempDir {
    tempfile::Builder::new()
        .prefix(prefix)
        .disable_cleanup(keep_tmp())
        .tempdir_in(scratch_root())
        .unwrap_or_else(|e| panic!("cannot create temp dir {prefix}: {e}"))
}

/// A name unique within this machine run: `<prefix>-<pid>-<counter>-<nanos>`.
pub fn unique_name(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::SeqCst);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{prefix}-{}-{n}-{nanos:x}", std::process::id())
}

/// Polls `f` (short sleeps, growing from 5 ms to 100 ms) until it returns
/// `Some` or `timeout` passes. `f` is always tried at least once, and once more
/// at the deadline.
#[must_use = "a poll that timed out returns None"]
pub fn poll<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(5);
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// Async version of [`poll`] (uses `tokio::time::sleep`).
#[must_use = "a poll that timed out returns None"]
pub async fn poll_async<T, F, Fut>(timeout: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(5);
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        tokio::time::sleep(pause.min(deadline - now)).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// Last `lines` lines of a text file (empty string if unreadable).
pub fn tail_file(path: &Path, lines: usize) -> String {
    let Ok(bytes) = fs::read(path) else {
        return format!("<cannot read {}>", path.display());
    };
    let text = String::from_utf8_lossy(&bytes);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Tails of every `*.log` in the directory of `sock` (containerd and imgbridge
/// keep their logs next to their sockets), for panic messages.
pub fn logs_near(sock: &Path) -> String {
    let Some(dir) = sock.parent() else {
        return String::new();
    };
    let mut out = String::new();
    if let Ok(rd) = fs::read_dir(dir) {
        let mut logs: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension() == Some(OsStr::new("log")))
            .collect();
        logs.sort();
        for log in logs {
            out.push_str(&format!(
                "\n--- tail of {} ---\n{}\n",
                log.display(),
                tail_file(&log, 40)
            ));
        }
    }
    out
}

/// Runs `cmd` to completion with a deadline, capturing stdout/stderr. `Err`
/// if it cannot be spawned or does not finish in time (it is then killed).
pub fn try_output_with_timeout(mut cmd: Command, timeout: Duration) -> Result<Output, String> {
    let desc = format!("{cmd:?}");
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot spawn {desc}: {e}"))?;
    let mut out = child.stdout.take().expect("stdout pipe");
    let mut err = child.stderr.take().expect("stderr pipe");
    let t_out = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let t_err = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let status = poll(timeout, || child.try_wait().ok().flatten());
    let Some(status) = status else {
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!("{desc} did not finish within {timeout:?}"));
    };
    Ok(Output {
        status,
        stdout: t_out.join().unwrap_or_default(),
        stderr: t_err.join().unwrap_or_default(),
    })
}

/// [`try_output_with_timeout`], panicking on spawn failure or timeout.
pub fn output_with_timeout(cmd: Command, timeout: Duration) -> Output {
    try_output_with_timeout(cmd, timeout).unwrap_or_else(|e| panic!("{e}"))
}

/// Runs `cmd` with [`TOOL_TIMEOUT`]; panics with its stdout and stderr
/// unless it succeeds.
pub fn run_ok(cmd: Command) -> Output {
    let desc = format!("{cmd:?}");
    let out = output_with_timeout(cmd, TOOL_TIMEOUT);
    if !out.status.success() {
        panic!(
            "{desc} failed ({}):\n--- stdout ---\n{}\n--- stderr ---\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

/// A TCP port free on loopback for a daemon to listen on, below the
/// kernel's ephemeral range: a port `bind(0)` hands out is from that range,
/// so between this call and the daemon's bind any outgoing connection (a
/// control plane makes hundreds) could take it as its source port.
pub fn free_port() -> u16 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(32768);
    let (from, to) = (10_000u64, low.max(10_001));
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos() as u64)
        .unwrap_or(0)
        ^ (std::process::id() as u64).wrapping_mul(0x9e37_79b9);
    for _ in 0..1000 {
        let n = NEXT.fetch_add(7919, Ordering::Relaxed).wrapping_add(seed);
        let port = (from + n % (to - from)) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("cannot find a free TCP port")
}

/// Minimal HTTP/1.1 GET on `addr` (host:port); returns the status code.
pub fn http_status(addr: &str, path: &str) -> Option<u16> {
    let head = http_request(addr, path, 64)?;
    head.split_whitespace().nth(1)?.parse().ok()
}

/// `GET path` on `addr`: the whole response body (up to 1 MiB).
pub fn http_get(addr: &str, path: &str) -> Option<String> {
    let r = http_request(addr, path, 1 << 20)?;
    r.split_once("\r\n\r\n").map(|(_, body)| body.to_string())
}

/// One HTTP/1.1 request with `Connection: close`; the first `limit` bytes
/// of the response (the status line, at least).
pub(crate) fn http_request(addr: &str, path: &str, limit: usize) -> Option<String> {
    let sa = addr.parse().ok()?;
    let mut s = TcpStream::connect_timeout(&sa, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.set_write_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = vec![0u8; limit];
    let mut n = 0;
    while n < buf.len() {
        match s.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => {
                n += k;
                // The status line is all a status check needs.
                if limit <= 64 && buf[..n].contains(&b'\n') {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// Runs `fut` to completion on a fresh current-thread runtime in a helper
/// thread, so sync code can use async helpers whether or not it is itself
/// running inside a tokio runtime.
pub fn block_on_thread<F>(fut: F) -> F::Output
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime")
            .block_on(fut)
    })
    .join()
    .unwrap_or_else(|e| std::panic::resume_unwind(e))
}

/// Writes `n` in decimal into `buf`, NUL-terminated, without allocating
/// (for `LISTEN_PID` between fork and exec).
pub fn itoa(mut n: u32, buf: &mut [u8; 24]) -> &[u8] {
    let mut i = buf.len() - 1;
    buf[i] = 0;
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[i..]
}
