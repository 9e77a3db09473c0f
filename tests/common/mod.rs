//! Shared integration-test harness: private containerd daemons, a loopback
//! registry, offline-built test images, the imgbridge launcher, `ctr`
//! wrappers and async containerd / CRI gRPC helpers.
//!
//! Use it from a test binary with `mod common;`.
//!
//! # Process hygiene
//!
//! * Every daemon (containerd, docker-registry, imgbridge) is spawned from a
//!   single long-lived "spawner" thread with `PR_SET_PDEATHSIG = SIGKILL`.
//!   (The death signal fires when the *thread* that forked the child exits;
//!   spawning from short-lived test threads would kill a daemon as soon as the
//!   test thread that started it ends.)
//! * Every daemon pid is recorded in a global registry until it is reaped. A
//!   `libc::atexit` handler (registered once) SIGKILLs and reaps whatever is
//!   still registered, kills the containerd shims of registered containerds,
//!   unmounts leftovers and removes the per-process scratch directory, so
//!   nothing survives even when statics are never dropped.
//! * Each daemon struct stops its own process on `Drop` (SIGTERM, wait with a
//!   deadline, then SIGKILL) and unregisters it. `Containerd`'s `Drop`
//!   additionally kills the runc shims (and their container processes) that it
//!   started for *its* socket, and detaches mounts under its temp dir.
//! * Only processes started here (or by a containerd started here, identified
//!   by `-address <our socket>` on the shim command line) are ever signalled.
//!
//! All temporary files live under one per-process scratch dir
//! (`$TMPDIR/imgbridge-test-<pid>-XXXXXX`; dirs of SIGKILLed test processes are
//! swept when the next test process starts). Set `IMGBRIDGE_TEST_KEEP=1` to keep it
//! for post-mortem inspection (its path is printed once).
//!
//! # Waiting
//!
//! Nothing sleeps as a way of waiting: everything polls a condition with short
//! sleeps until a deadline ([`poll`], [`poll_async`]) and panics with the tail
//! of the relevant daemon log when the deadline passes.

#![allow(dead_code)]

pub mod front;
pub mod peers;

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, Once, OnceLock};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hyper_util::rt::TokioIo;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tempfile::TempDir;
use tonic::transport::{Channel, Endpoint};

/// Name under which the pause image is imported into `k8s.io`; it is also the
/// configured CRI `sandbox_image`.
pub const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.6";
/// Max gRPC message size for clients built here (16 MiB).
pub const MAX_MSG: usize = 16 << 20;
/// Deadline for a daemon to become ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// Deadline for a CRI container to print its expected output.
pub const POD_TIMEOUT: Duration = Duration::from_secs(20);
/// Deadline for one invocation of a helper tool (ctr, skopeo, umoci).
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(180);
/// Grace period between SIGTERM and SIGKILL when stopping a daemon.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------
// Process registry, spawner thread, atexit cleanup
// ---------------------------------------------------------------------------

struct Registered {
    pid: i32,
}

static REGISTRY: Mutex<Vec<Registered>> = Mutex::new(Vec::new());
/// gRPC addresses of containerds started here and not yet dropped; their
/// shims are killed at exit (even if the containerd was already reaped).
static SHIM_ADDRESSES: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static ATEXIT: Once = Once::new();
static OWNER_PID: AtomicU32 = AtomicU32::new(0);
static SCRATCH: OnceLock<PathBuf> = OnceLock::new();

fn registry() -> MutexGuard<'static, Vec<Registered>> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

fn keep_tmp() -> bool {
    std::env::var_os("IMGBRIDGE_TEST_KEEP").is_some_and(|v| v != "0" && !v.is_empty())
}

fn ensure_atexit() {
    ATEXIT.call_once(|| {
        OWNER_PID.store(std::process::id(), Ordering::SeqCst);
        // SAFETY: registering a plain extern "C" fn without arguments.
        let rc = unsafe { libc::atexit(cleanup_at_exit) };
        assert_eq!(rc, 0, "atexit registration failed");
    });
}

extern "C" fn cleanup_at_exit() {
    // Never unwind across the FFI boundary.
    let _ = std::panic::catch_unwind(|| {
        if std::process::id() != OWNER_PID.load(Ordering::SeqCst) {
            return;
        }
        let entries: Vec<Registered> = std::mem::take(&mut *registry());
        for e in &entries {
            // SAFETY: plain syscalls on pids we spawned and have not reaped yet
            // (a pid stays registered until it is reaped, so it cannot have
            // been reused).
            unsafe {
                libc::kill(e.pid, libc::SIGKILL);
                libc::waitpid(e.pid, std::ptr::null_mut(), 0);
            }
        }
        let addresses =
            std::mem::take(&mut *SHIM_ADDRESSES.lock().unwrap_or_else(|e| e.into_inner()));
        for addr in &addresses {
            kill_shims(addr);
        }
        if let Some(root) = SCRATCH.get() {
            if keep_tmp() {
                return;
            }
            if unmount_under(root) == 0 {
                let _ = fs::remove_dir_all(root);
            }
        }
    });
}

type SpawnRequest = (Command, mpsc::Sender<io::Result<Child>>);

fn spawner() -> &'static mpsc::Sender<SpawnRequest> {
    static TX: OnceLock<mpsc::Sender<SpawnRequest>> = OnceLock::new();
    TX.get_or_init(|| {
        ensure_atexit();
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        thread::Builder::new()
            .name("daemon-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    // Hold the registry lock across spawn+register so the
                    // atexit handler can never miss a live child.
                    let mut reg = registry();
                    let res = cmd.spawn();
                    if let Ok(child) = &res {
                        reg.push(Registered {
                            pid: child.id() as i32,
                        });
                    }
                    drop(reg);
                    let _ = reply.send(res);
                }
            })
            .expect("cannot start daemon spawner thread");
        tx
    })
}

/// Spawns `cmd` as a daemon: death signal SIGKILL (tied to the long-lived
/// spawner thread, i.e. to this process), pid recorded in the registry.
fn spawn_daemon(mut cmd: Command) -> io::Result<Child> {
    // SAFETY: only async-signal-safe calls (prctl, getppid) between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let (tx, rx) = mpsc::channel();
    spawner()
        .send((cmd, tx))
        .expect("daemon spawner thread is gone");
    rx.recv().expect("daemon spawner thread is gone")
}

/// One spawned daemon process. Reaping always happens under the registry lock
/// and removes the pid from the registry at the same time.
struct Daemon {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Daemon {
    fn spawn(name: &str, mut cmd: Command, log: &Path) -> Daemon {
        let file = File::options()
            .create(true)
            .append(true)
            .open(log)
            .unwrap_or_else(|e| panic!("cannot open log {}: {e}", log.display()));
        let err = file.try_clone().expect("dup log fd");
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(file))
            .stderr(Stdio::from(err));
        let program = format!("{:?}", cmd.get_program());
        let child =
            spawn_daemon(cmd).unwrap_or_else(|e| panic!("cannot spawn {name} ({program}): {e}"));
        Daemon {
            name: name.to_string(),
            child: Some(child),
            log: log.to_path_buf(),
        }
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn running(&self) -> bool {
        self.child.is_some()
    }

    /// Non-blocking: returns the exit status if the process has exited (and
    /// reaps/unregisters it).
    fn try_reap(&mut self) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        let pid = child.id() as i32;
        let mut reg = registry();
        match child.try_wait() {
            Ok(Some(status)) => {
                reg.retain(|r| r.pid != pid);
                drop(reg);
                self.child = None;
                Some(status)
            }
            Ok(None) => None,
            Err(e) => {
                // Not ours to wait for any more (e.g. reaped by the atexit
                // handler): treat as gone.
                eprintln!("warning: waitpid({pid}) for {} failed: {e}", self.name);
                reg.retain(|r| r.pid != pid);
                drop(reg);
                self.child = None;
                Some(std::os::unix::process::ExitStatusExt::from_raw(0))
            }
        }
    }

    fn signal(&self, sig: Signal) {
        if let Some(pid) = self.pid() {
            let _ = kill(Pid::from_raw(pid as i32), sig);
        }
    }

    /// SIGKILL and reap.
    fn kill9(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        let pid = child.id() as i32;
        let mut reg = registry();
        let _ = child.kill();
        let status = child.wait().ok();
        reg.retain(|r| r.pid != pid);
        status
    }

    /// Sends `sig`, waits up to `grace` for exit. Returns `Ok(status)` if it
    /// exited in time, `Err(())` if it had to be SIGKILLed. `Ok(None)` if it
    /// was not running.
    fn terminate_with(&mut self, sig: Signal, grace: Duration) -> Result<Option<ExitStatus>, ()> {
        if !self.running() {
            return Ok(None);
        }
        if let Some(status) = self.try_reap() {
            return Ok(Some(status));
        }
        self.signal(sig);
        if let Some(status) = poll(grace, || self.try_reap()) {
            return Ok(Some(status));
        }
        self.kill9();
        Err(())
    }

    fn stop(&mut self) {
        let _ = self.terminate_with(Signal::SIGTERM, STOP_GRACE);
    }

    fn log_tail(&self, lines: usize) -> String {
        tail_file(&self.log, lines)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---------------------------------------------------------------------------
// Small utilities
// ---------------------------------------------------------------------------

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
fn sweep_stale_scratch_dirs() {
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

fn run_ok(cmd: Command) -> Output {
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

pub fn free_port() -> u16 {
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
fn http_request(addr: &str, path: &str, limit: usize) -> Option<String> {
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
fn block_on_thread<F>(fut: F) -> F::Output
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

// ---------------------------------------------------------------------------
// Mounts and shims (cleanup of what our containerds leave behind)
// ---------------------------------------------------------------------------

fn unescape_mountinfo(s: &str) -> PathBuf {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(OsStr::from_bytes(&out))
}

fn mounts_under(root: &Path) -> Vec<PathBuf> {
    let Ok(info) = fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mountinfo)
        .filter(|p| p.starts_with(root))
        .collect();
    // Deepest first.
    v.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    v.dedup();
    v
}

/// Lazily unmounts everything mounted at or below `root` (container rootfs
/// overlays left by killed shims). Returns how many mounts remain.
fn unmount_under(root: &Path) -> usize {
    for _ in 0..5 {
        let mounts = mounts_under(root);
        if mounts.is_empty() {
            return 0;
        }
        for m in mounts {
            if let Ok(c) = std::ffi::CString::new(m.as_os_str().as_bytes()) {
                // SAFETY: valid NUL-terminated path.
                unsafe {
                    libc::umount2(c.as_ptr(), libc::MNT_DETACH);
                }
            }
        }
    }
    mounts_under(root).len()
}

fn proc_pids() -> Vec<i32> {
    fs::read_dir("/proc")
        .map(|rd| {
            rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn ppid_of(pid: i32) -> Option<i32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ..."; comm may contain spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

struct Shim {
    pid: i32,
    namespace: String,
    id: String,
}

/// containerd shims started for the containerd listening on `address`
/// (matched by `-address <address>` on the shim command line).
fn shims_of(address: &Path) -> Vec<Shim> {
    let want = address.as_os_str().as_bytes();
    proc_pids()
        .into_iter()
        .filter_map(|pid| {
            let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            let a0 = Path::new(OsStr::from_bytes(args.first()?));
            if !a0.file_name()?.as_bytes().starts_with(b"containerd-shim") {
                return None;
            }
            let flag = |name: &[u8]| {
                args.windows(2)
                    .find(|w| w[0] == name)
                    .map(|w| String::from_utf8_lossy(w[1]).into_owned())
            };
            (flag(b"-address")?.as_bytes() == want).then(|| Shim {
                pid,
                namespace: flag(b"-namespace").unwrap_or_default(),
                id: flag(b"-id").unwrap_or_default(),
            })
        })
        .collect()
}

fn is_container_id(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Cgroup directories of `pid` whose leaf is a container id (runc creates
/// them per container; they outlive a SIGKILLed shim).
fn container_cgroup_dirs(pid: i32) -> Vec<PathBuf> {
    let Ok(text) = fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
        return Vec::new();
    };
    let mounts: Vec<PathBuf> = fs::read_dir("/sys/fs/cgroup")
        .map(|rd| rd.filter_map(|e| Some(e.ok()?.path())).collect())
        .unwrap_or_default();
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(path) = line.splitn(3, ':').nth(2) else {
            continue;
        };
        let rel = path.trim_start_matches('/');
        let leaf_ok = Path::new(rel)
            .file_name()
            .and_then(OsStr::to_str)
            .is_some_and(is_container_id);
        if !leaf_ok {
            continue;
        }
        for m in mounts
            .iter()
            .map(PathBuf::as_path)
            .chain([Path::new("/sys/fs/cgroup")])
        {
            let d = m.join(rel);
            if d.is_dir() && !out.contains(&d) {
                out.push(d);
            }
        }
    }
    out
}

/// Kills the shims of the containerd at `address` together with all their
/// descendants (the container processes), then removes what runc and the
/// shims leave behind when killed: empty per-container cgroup dirs, the
/// shim sockets in /run/containerd/s and runc state dirs that belong to
/// containers of this containerd. These are all things started by a
/// containerd that this harness started; nothing else is touched.
///
/// This is the fallback used when the containerd itself is dead (atexit, or
/// `Drop` after `kill9`); a live containerd deletes its tasks cleanly first
/// (see `Containerd::delete_all_tasks`).
fn kill_shims(address: &Path) {
    let shims = shims_of(address);
    if shims.is_empty() {
        return;
    }
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for pid in proc_pids() {
        if let Some(pp) = ppid_of(pid) {
            children.entry(pp).or_default().push(pid);
        }
    }
    let mut cgroups = Vec::new();
    let mut container_ids = Vec::new();
    for shim in &shims {
        let mut stack = vec![shim.pid];
        let mut victims = Vec::new();
        while let Some(p) = stack.pop() {
            if let Some(c) = children.get(&p) {
                stack.extend(c.iter().copied());
                victims.extend(c.iter().copied());
            }
        }
        for v in &victims {
            for d in container_cgroup_dirs(*v) {
                if let Some(id) = d.file_name().and_then(OsStr::to_str) {
                    let key = (shim.namespace.clone(), id.to_string());
                    if !container_ids.contains(&key) {
                        container_ids.push(key);
                    }
                }
                if !cgroups.contains(&d) {
                    cgroups.push(d);
                }
            }
            let _ = kill(Pid::from_raw(*v), Signal::SIGKILL);
        }
        let _ = kill(Pid::from_raw(shim.pid), Signal::SIGKILL);
    }
    // Empty cgroups can be removed once their processes are gone.
    let _ = poll(Duration::from_secs(3), || {
        cgroups.retain(|d| match fs::remove_dir(d) {
            Ok(()) => false,
            Err(e) => e.kind() != io::ErrorKind::NotFound,
        });
        cgroups.is_empty().then_some(())
    });
    // Shim sockets: /run/containerd/s/<sha256("<address>/<ns>/<id>")>.
    for shim in &shims {
        use sha2::Digest;
        let key = format!("{}/{}/{}", address.display(), shim.namespace, shim.id);
        let sock = format!(
            "/run/containerd/s/{}",
            hex::encode(sha2::Sha256::digest(key))
        );
        let _ = fs::remove_file(&sock);
        let _ = fs::remove_file(format!("{sock}.debug"));
    }
    // runc state of containers not configured with a private runc root.
    if let Some(dir) = address.parent().and_then(Path::to_str) {
        for (ns, id) in container_ids {
            let state = PathBuf::from(format!("/run/containerd/runc/{ns}/{id}"));
            let ours = fs::read_to_string(state.join("state.json")).is_ok_and(|s| s.contains(dir));
            if ours {
                let _ = fs::remove_dir_all(&state);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Snapshotter detection
// ---------------------------------------------------------------------------

fn overlay_works() -> bool {
    let d = tempdir("overlay-probe-");
    let p = |s: &str| d.path().join(s);
    for s in ["lower", "upper", "work", "merged"] {
        if fs::create_dir(p(s)).is_err() {
            return false;
        }
    }
    if fs::write(p("lower/probe"), b"ok").is_err() {
        return false;
    }
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        p("lower").display(),
        p("upper").display(),
        p("work").display()
    );
    let c = |s: &[u8]| std::ffi::CString::new(s).expect("no NUL");
    let target = c(p("merged").as_os_str().as_bytes());
    let (src, fstype, data) = (c(b"overlay"), c(b"overlay"), c(opts.as_bytes()));
    // SAFETY: all pointers are valid NUL-terminated strings.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return false;
    }
    let ok = fs::read(p("merged/probe")).is_ok_and(|b| b == b"ok");
    // SAFETY: as above.
    unsafe {
        libc::umount2(target.as_ptr(), libc::MNT_DETACH);
    }
    ok
}

/// The snapshotter used by our containerds and by `ctr` (overlayfs when an
/// overlay mount works in the scratch dir, else native). Override with
/// `IMGBRIDGE_TEST_SNAPSHOTTER`.
pub fn snapshotter() -> &'static str {
    static S: OnceLock<String> = OnceLock::new();
    S.get_or_init(|| match std::env::var("IMGBRIDGE_TEST_SNAPSHOTTER") {
        Ok(s) if !s.is_empty() => s,
        _ if overlay_works() => "overlayfs".to_string(),
        _ => "native".to_string(),
    })
}

// ---------------------------------------------------------------------------
// ctr
// ---------------------------------------------------------------------------

/// Runs `ctr -a <sock> -n <ns> <args...>` (with `CONTAINERD_SNAPSHOTTER` set
/// to [`snapshotter`]) and returns its output. Panics only if ctr cannot be
/// run or hangs for [`TOOL_TIMEOUT`].
pub fn ctr<I, S>(sock: &Path, ns: &str, args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    output_with_timeout(ctr_command(sock, ns, args), TOOL_TIMEOUT)
}

fn ctr_command<I, S>(sock: &Path, ns: &str, args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = flavor().command("ctr");
    cmd.arg("-a")
        .arg(sock)
        .arg("-n")
        .arg(ns)
        .args(args)
        .env("CONTAINERD_SNAPSHOTTER", snapshotter())
        .env_remove("CONTAINERD_ADDRESS")
        .env_remove("CONTAINERD_NAMESPACE");
    cmd
}

/// Like [`ctr`] but panics (with stdout, stderr and the logs next to `sock`)
/// unless it succeeds; returns stdout.
/// `ctr run --rm` of `image` running `cmd` through `sock`; returns what
/// `cmd` printed. The output goes to a bind-mounted file rather than ctr's
/// stdout: ctr cancels its FIFO copy as soon as the exit status arrives, so
/// a short-lived container's stdout is sometimes lost (a ctr race, seen
/// under load, with or without imgbridge).
pub fn ctr_run(sock: &Path, ns: &str, image: &str, cmd: &[&str]) -> String {
    let out = tempdir("run-");
    let mount = format!(
        "type=bind,src={},dst=/out,options=rbind:rw",
        out.path().display()
    );
    let id = unique_name("ctr-run");
    let mut args = vec!["run", "--rm", "--mount", &mount, image, &id];
    args.extend([
        "/bin/busybox",
        "sh",
        "-c",
        "exec \"$@\" > /out/stdout",
        "sh",
    ]);
    args.extend(cmd);
    ctr_ok(sock, ns, &args);
    std::fs::read_to_string(out.path().join("stdout"))
        .unwrap_or_else(|e| panic!("ctr run of {image} wrote no output: {e}"))
}

pub fn ctr_ok<I, S>(sock: &Path, ns: &str, args: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
    let out = ctr(sock, ns, &args);
    if !out.status.success() {
        panic!(
            "ctr -a {} -n {ns} {:?} failed ({}):\n--- stdout ---\n{}\n--- stderr ---\n{}{}",
            sock.display(),
            args,
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            logs_near(sock)
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

// ---------------------------------------------------------------------------
// The containerd under test
// ---------------------------------------------------------------------------

/// The containerd version every test of this process runs against.
///
/// `IMGBRIDGE_CONTAINERD` picks it: a label of `scripts/containerd-matrix.sh`
/// (`1.6`, `1.7`, `2.1`, `2.4`), whose binaries that script fetches or builds
/// into its cache, or a directory holding `containerd`, `ctr` and
/// `containerd-shim-runc-v2`. Unset, the `containerd` on PATH is used (the
/// Debian package `scripts/test.sh` installs). That version's bin dir comes
/// first on PATH for containerd (so it starts its own shim) and for ctr.
pub struct Flavor {
    /// What `IMGBRIDGE_CONTAINERD` said (`system` when unset).
    pub label: String,
    /// The bin dir put first on PATH; `None` for the system's.
    pub bin_dir: Option<PathBuf>,
    /// As `containerd --version` prints it (`1.7.24~ds1`, `v2.4.2`).
    pub version: String,
    /// (major, minor, patch) parsed from `version`.
    pub semver: (u64, u64, u64),
}

impl Flavor {
    /// 2.x: `version = 3` configs, Transfer by default in ctr, CRI split
    /// into `io.containerd.cri.v1.images` / `.runtime`.
    pub fn is_v2(&self) -> bool {
        self.semver.0 >= 2
    }

    /// The config version this containerd reads natively (older ones are
    /// migrated with a warning at every start), as doctor expects it.
    pub fn config_version(&self) -> i64 {
        imgbridge::ops::doctor::native_config_version(self.semver).unwrap_or(4)
    }

    /// Has the Transfer service, as doctor says (1.7+): the tests that use
    /// it then check that claim against the real containerd.
    pub fn has_transfer(&self) -> bool {
        imgbridge::ops::doctor::ships_transfer(self.semver)
    }

    /// CRI reports a pin on a named record, as doctor says (1.6.25+,
    /// 1.7.10+, 2.x): the pin tests then check that claim against CRI.
    pub fn honours_pinned(&self) -> bool {
        use imgbridge::ops::doctor::{pinned_support, PinnedSupport};
        pinned_support(self.semver) == PinnedSupport::Full
    }

    /// PATH with this version's bin dir first.
    pub fn path_env(&self) -> std::ffi::OsString {
        let old = std::env::var_os("PATH").unwrap_or_default();
        match &self.bin_dir {
            Some(d) => {
                let mut p = d.as_os_str().to_owned();
                p.push(":");
                p.push(old);
                p
            }
            None => old,
        }
    }

    /// A command for one of this version's binaries (`containerd`, `ctr`).
    pub fn command(&self, bin: &str) -> Command {
        let mut cmd = match &self.bin_dir {
            Some(d) => Command::new(d.join(bin)),
            None => Command::new(bin),
        };
        cmd.env("PATH", self.path_env());
        cmd
    }
}

/// Parses `1.7.24~ds1-5`, `v2.4.2`, `2.1.9+unknown` into (major, minor,
/// patch), as `imgbridge doctor` does.
pub fn parse_semver(v: &str) -> Option<(u64, u64, u64)> {
    imgbridge::ops::doctor::parse_version(v)
}

pub fn flavor() -> &'static Flavor {
    static F: OnceLock<Flavor> = OnceLock::new();
    F.get_or_init(|| {
        let label = std::env::var("IMGBRIDGE_CONTAINERD").unwrap_or_default();
        let bin_dir = if label.is_empty() || label == "system" {
            None
        } else if label.contains('/') {
            Some(PathBuf::from(&label))
        } else {
            Some(matrix_bin_dir(&label))
        };
        let mut f = Flavor {
            label: if label.is_empty() {
                "system".into()
            } else {
                label
            },
            bin_dir,
            version: String::new(),
            semver: (0, 0, 0),
        };
        let out = f
            .command("containerd")
            .arg("--version")
            .output()
            .unwrap_or_else(|e| panic!("containerd ({}) cannot run: {e}", f.label));
        // "containerd github.com/containerd/containerd/v2 v2.4.2 <commit>"
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        f.version = text
            .split_whitespace()
            .nth(2)
            .unwrap_or_else(|| panic!("unexpected `containerd --version` output: {text}"))
            .to_string();
        f.semver = parse_semver(&f.version)
            .unwrap_or_else(|| panic!("cannot parse containerd version {:?}", f.version));
        eprintln!(
            "harness: containerd {} ({}, {})",
            f.version,
            f.label,
            f.bin_dir
                .as_deref()
                .map_or("PATH".into(), |d| d.display().to_string())
        );
        f
    })
}

/// The bin dir `scripts/containerd-matrix.sh` gives for `label` (fetched or
/// built on first use, cached after).
fn matrix_bin_dir(label: &str) -> PathBuf {
    fetched("containerd-matrix.sh", &["fetch", label])
        .into_iter()
        .find(|[l, _, _]| l == label)
        .map(|[_, _, dir]| PathBuf::from(dir))
        .unwrap_or_else(|| panic!("scripts/containerd-matrix.sh gave no bin dir for {label}"))
}

/// Runs `scripts/<script> <args>`, whose stdout is one `<name> <version>
/// <bin dir>` line per item it fetched or built; panics if it fails.
pub fn fetched(script: &str, args: &[&str]) -> Vec<[String; 3]> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts")
        .join(script);
    let out = Command::new(&script)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{} {args:?} failed ({}): {text}",
        script.display(),
        out.status
    );
    text.lines()
        .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            [a, b, c] => Some([a.to_string(), b.to_string(), c.to_string()]),
            _ => None,
        })
        .collect()
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

// ---------------------------------------------------------------------------
// containerd
// ---------------------------------------------------------------------------

/// Options for [`Containerd::start`].
#[derive(Clone, Debug, Default)]
pub struct ContainerdOpts {
    /// Enable the CRI plugin (and import [`PAUSE_IMAGE`] into `k8s.io`).
    pub cri: bool,
    /// `content_sharing_policy = "isolated"` for the bolt metadata plugin.
    pub isolated: bool,
    /// With `cri`: a registry `host:port` that CRI pulls from over plain http.
    pub registry_mirror: Option<String>,
}

/// A private containerd (the [`flavor`] under test) on sockets in its own temp dir.
pub struct Containerd {
    opts: ContainerdOpts,
    daemon: Daemon,
    config: PathBuf,
    sock: PathBuf,
    ttrpc: PathBuf,
    dir: TempDir,
}

impl Containerd {
    /// Writes a config, starts containerd and waits until `ctr version`
    /// succeeds (and, with `cri`, until CRI resolves the imported pause image).
    pub fn start(opts: ContainerdOpts) -> Containerd {
        let dir = tempdir("containerd-");
        let d = dir.path();
        let sock = d.join("containerd.sock");
        let ttrpc = d.join("containerd.sock.ttrpc");
        let config = d.join("config.toml");
        fs::write(&config, containerd_config(d, &opts)).expect("write containerd config");
        let daemon = Self::spawn(&config, &sock, d);
        let mut c = Containerd {
            opts,
            daemon,
            config,
            sock,
            ttrpc,
            dir,
        };
        c.wait_ready();
        if c.opts.cri {
            let archive = pause_image().docker_archive();
            c.ctr_ok(
                "k8s.io",
                [
                    OsStr::new("images"),
                    OsStr::new("import"),
                    archive.as_os_str(),
                ],
            );
            c.wait_cri_ready();
        }
        c
    }

    fn spawn(config: &Path, sock: &Path, dir: &Path) -> Daemon {
        let mut cmd = flavor().command("containerd");
        cmd.arg("--config").arg(config);
        // Keep containerd away from any system-wide client settings.
        cmd.env_remove("CONTAINERD_ADDRESS")
            .env_remove("CONTAINERD_NAMESPACE");
        let mut addrs = SHIM_ADDRESSES.lock().unwrap_or_else(|e| e.into_inner());
        if !addrs.iter().any(|a| a == sock) {
            addrs.push(sock.to_path_buf());
        }
        drop(addrs);
        Daemon::spawn("containerd", cmd, &dir.join("containerd.log"))
    }

    fn wait_ready(&mut self) {
        let start = Instant::now();
        let sock = self.sock.clone();
        let ready = poll(READY_TIMEOUT, || {
            if let Some(status) = self.daemon.try_reap() {
                return Some(Err(status));
            }
            if StdUnixStream::connect(&sock).is_err() {
                return None;
            }
            ctr(&sock, "default", ["version"])
                .status
                .success()
                .then_some(Ok(()))
        });
        match ready {
            Some(Ok(())) => {}
            Some(Err(status)) => panic!(
                "containerd exited during startup ({status}); log tail:\n{}",
                self.log_tail()
            ),
            None => panic!(
                "containerd not ready after {:?} (socket {}); log tail:\n{}",
                start.elapsed(),
                self.sock.display(),
                self.log_tail()
            ),
        }
    }

    fn wait_cri_ready(&mut self) {
        let sock = self.sock.clone();
        let found = block_on_thread(async move {
            poll_async(READY_TIMEOUT, || {
                let sock = sock.clone();
                async move {
                    match try_cri_image_status(&sock, PAUSE_IMAGE).await {
                        Ok(Some(_)) => Some(()),
                        _ => None,
                    }
                }
            })
            .await
        });
        if found.is_none() {
            panic!(
                "CRI did not resolve {PAUSE_IMAGE} within {READY_TIMEOUT:?}; log tail:\n{}",
                self.log_tail()
            );
        }
    }

    /// gRPC socket.
    pub fn socket(&self) -> &Path {
        &self.sock
    }

    /// ttrpc socket.
    pub fn ttrpc_socket(&self) -> &Path {
        &self.ttrpc
    }

    /// Temp dir holding config, root, state, sockets and log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Root directory (`root = ...` in the config).
    pub fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    pub fn config_path(&self) -> &Path {
        &self.config
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("containerd.log")
    }

    pub fn opts(&self) -> ContainerdOpts {
        self.opts.clone()
    }

    /// Pid of the running containerd. Panics if it is stopped.
    pub fn pid(&self) -> u32 {
        self.daemon.pid().expect("containerd is not running")
    }

    /// Last 60 lines of the containerd log (accumulates across restarts).
    pub fn log_tail(&self) -> String {
        self.daemon.log_tail(60)
    }

    /// Panics, with the log tail (where a Go panic shows), unless the
    /// containerd that had `pid` is still the one running: imgbridge must
    /// never take the runtime down.
    pub fn assert_still_running(&mut self, pid: u32) {
        if let Some(st) = self.daemon.try_reap() {
            panic!(
                "containerd {} (pid {pid}) died ({st}); log tail:\n{}",
                flavor().version,
                self.log_tail()
            );
        }
        assert_eq!(self.pid(), pid, "containerd was restarted");
        assert!(
            !fs::read_to_string(self.log_path())
                .unwrap_or_default()
                .contains("panic:"),
            "containerd logged a panic; log tail:\n{}",
            self.log_tail()
        );
    }

    /// SIGKILL containerd (its shims keep running, as in a real crash).
    pub fn kill9(&mut self) {
        self.daemon.kill9();
    }

    /// Graceful stop: SIGTERM, wait up to [`STOP_GRACE`], then SIGKILL.
    pub fn stop(&mut self) {
        self.daemon.stop();
    }

    /// Starts containerd again with the same config/root/state (stopping it
    /// first if it is still running) and waits until it serves again.
    pub fn restart(&mut self) {
        if self.daemon.running() {
            self.stop();
        }
        self.daemon = Self::spawn(&self.config, &self.sock, self.dir.path());
        self.wait_ready();
        if self.opts.cri {
            self.wait_cri_ready();
        }
    }

    /// [`ctr`] against this containerd.
    pub fn ctr<I, S>(&self, ns: &str, args: I) -> Output
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        ctr(&self.sock, ns, args)
    }

    /// [`ctr_ok`] against this containerd.
    pub fn ctr_ok<I, S>(&self, ns: &str, args: I) -> String
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        ctr_ok(&self.sock, ns, args)
    }
}

impl Containerd {
    /// Best effort, never panics: force-deletes every task in every namespace
    /// through the live containerd, so runc removes cgroups, mounts and state
    /// and the shims exit cleanly.
    fn delete_all_tasks(&self) {
        let run = |ns: &str, args: &[&str]| -> Option<String> {
            let out =
                try_output_with_timeout(ctr_command(&self.sock, ns, args), Duration::from_secs(30))
                    .ok()?;
            out.status
                .success()
                .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
        };
        let Some(namespaces) = run("default", &["namespaces", "ls", "-q"]) else {
            return;
        };
        for ns in namespaces.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let Some(tasks) = run(ns, &["tasks", "ls", "-q"]) else {
                continue;
            };
            let ids: Vec<&str> = tasks
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            if !ids.is_empty() {
                let mut args = vec!["tasks", "delete", "--force"];
                args.extend(ids);
                let _ = run(ns, &args);
            }
        }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if self.daemon.running() && !shims_of(&self.sock).is_empty() {
            self.delete_all_tasks();
        }
        self.daemon.stop();
        kill_shims(&self.sock);
        SHIM_ADDRESSES
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|a| a != &self.sock);
        if keep_tmp() {
            return;
        }
        let left = unmount_under(self.dir.path());
        if left > 0 {
            eprintln!(
                "warning: {left} mounts remain under {}; leaving it in place",
                self.dir.path().display()
            );
            self.dir.disable_cleanup(true);
        }
    }
}

fn containerd_config(d: &Path, opts: &ContainerdOpts) -> String {
    let p = |s: &str| d.join(s).display().to_string();
    let policy = if opts.isolated { "isolated" } else { "shared" };
    let v2 = flavor().is_v2();
    // 2.x's CRI is split into images and runtime plugins.
    let cri_plugins = if v2 {
        r#""io.containerd.grpc.v1.cri", "io.containerd.cri.v1.images", "io.containerd.cri.v1.runtime""#
    } else {
        r#""io.containerd.grpc.v1.cri""#
    };
    // Sockets: top-level sections up to config version 3; from 4 (2.3+)
    // the servers are plugins like everything else.
    let (sock, ttrpc) = (p("containerd.sock"), p("containerd.sock.ttrpc"));
    let version = flavor().config_version();
    let (servers, server_plugins) = if version >= 4 {
        (
            String::new(),
            format!(
                r#"  [plugins."io.containerd.server.v1.grpc"]
    address = "{sock}"
  [plugins."io.containerd.server.v1.ttrpc"]
    address = "{ttrpc}"
  [plugins."io.containerd.server.v1.debug"]
    address = ""
  [plugins."io.containerd.server.v1.metrics"]
    address = ""
"#
            ),
        )
    } else {
        (
            format!(
                r#"[grpc]
  address = "{sock}"

[ttrpc]
  address = "{ttrpc}"

[debug]
  address = ""

[metrics]
  address = ""
"#
            ),
            String::new(),
        )
    };
    let mut cfg = format!(
        r#"version = {version}
root = "{root}"
state = "{state}"
disabled_plugins = [{disabled}]

{servers}
[plugins]
{server_plugins}  [plugins."io.containerd.internal.v1.opt"]
    path = "{opt}"
  [plugins."io.containerd.metadata.v1.bolt"]
    content_sharing_policy = "{policy}"
  # Tests stand in for buildkit with `ctr content ingest`, which (unlike
  # buildkit) leaves the blob unreferenced until the test labels it or names
  # an image after it. containerd's defaults collect 100 ms after start and
  # at once after any deletion (a lease released anywhere), which made that
  # window a race. GC here runs only when asked for (Images.Delete sync, as
  # the GC-safety test does).
  [plugins."io.containerd.gc.v1.scheduler"]
    startup_delay = "0s"
    deletion_threshold = 1000000
    mutation_threshold = 1000000
"#,
        root = p("root"),
        state = p("state"),
        opt = p("opt"),
        disabled = if opts.cri { "" } else { cri_plugins },
    );
    if !opts.cri {
        return cfg;
    }
    let snap = snapshotter();
    let runc_root = p("runc");
    let (cni_bin, cni_conf) = (p("cni/bin"), p("cni/net.d"));
    if v2 {
        let certs = d.join("certs.d");
        if let Some(mirror) = &opts.registry_mirror {
            // 2.x dropped the `mirrors` table: hosts.toml under config_path.
            let host_dir = certs.join(mirror);
            fs::create_dir_all(&host_dir).expect("create certs.d");
            fs::write(
                host_dir.join("hosts.toml"),
                format!(
                    "server = \"http://{mirror}\"\n[host.\"http://{mirror}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
                ),
            )
            .expect("write hosts.toml");
        }
        cfg.push_str(&format!(
            r#"  # NRI is on by default in 2.x; its socket would be shared by
  # every containerd of the test process.
  [plugins."io.containerd.nri.v1.nri"]
    socket_path = "{nri}"
  [plugins."io.containerd.grpc.v1.cri"]
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
  [plugins."io.containerd.cri.v1.images"]
    snapshotter = "{snap}"
    [plugins."io.containerd.cri.v1.images".pinned_images]
      sandbox = "{PAUSE_IMAGE}"
    [plugins."io.containerd.cri.v1.images".registry]
      config_path = "{certs}"
  [plugins."io.containerd.cri.v1.runtime"]
    disable_apparmor = true
    restrict_oom_score_adj = true
    [plugins."io.containerd.cri.v1.runtime".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
          # runc state in our temp dir instead of /run/containerd/runc
          Root = "{runc_root}"
    [plugins."io.containerd.cri.v1.runtime".cni]
      bin_dirs = ["{cni_bin}"]
      conf_dir = "{cni_conf}"
"#,
            certs = certs.display(),
            nri = p("nri.sock"),
        ));
        return cfg;
    }
    cfg.push_str(&format!(
        r#"  [plugins."io.containerd.grpc.v1.cri"]
    disable_apparmor = true
    restrict_oom_score_adj = true
    sandbox_image = "{PAUSE_IMAGE}"
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "{snap}"
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          # runc state in our temp dir instead of /run/containerd/runc
          Root = "{runc_root}"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "{cni_bin}"
      conf_dir = "{cni_conf}"
"#
    ));
    if let Some(mirror) = &opts.registry_mirror {
        cfg.push_str(&format!(
            r#"    [plugins."io.containerd.grpc.v1.cri".registry.mirrors."{mirror}"]
      endpoint = ["http://{mirror}"]
"#
        ));
    }
    cfg
}

// ---------------------------------------------------------------------------
// Test images
// ---------------------------------------------------------------------------

fn umoci<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new("umoci");
    cmd.args(args);
    run_ok(cmd)
}

fn skopeo<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new("skopeo");
    cmd.arg("--insecure-policy").args(args);
    run_ok(cmd)
}

/// OCI layout with one layer holding the static busybox (+ sh, echo, sleep,
/// cat symlinks) under tag `base`; built once per process.
fn base_layout() -> &'static Path {
    static BASE: OnceLock<PathBuf> = OnceLock::new();
    BASE.get_or_init(|| {
        let dir = tempdir("base-image-").keep();
        let layout = dir.join("oci");
        let bundle = dir.join("bundle");
        let image = format!("{}:base", layout.display());
        umoci([
            OsStr::new("init"),
            OsStr::new("--layout"),
            layout.as_os_str(),
        ]);
        umoci(["new", "--image", &image]);
        let mut unpack = vec!["unpack".to_string()];
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            unpack.push("--rootless".into());
        }
        unpack.extend([
            "--image".into(),
            image.clone(),
            bundle.display().to_string(),
        ]);
        umoci(&unpack);
        let bin = bundle.join("rootfs/bin");
        fs::create_dir_all(&bin).expect("mkdir rootfs/bin");
        fs::copy("/bin/busybox", bin.join("busybox"))
            .expect("copy /bin/busybox (install busybox-static)");
        for l in ["sh", "echo", "sleep", "cat"] {
            std::os::unix::fs::symlink("busybox", bin.join(l)).expect("symlink");
        }
        umoci([
            OsStr::new("repack"),
            OsStr::new("--image"),
            OsStr::new(&image),
            bundle.as_os_str(),
        ]);
        umoci([
            "config",
            "--image",
            &image,
            "--config.env",
            "PATH=/bin",
            "--config.workingdir",
            "/",
        ]);
        let _ = fs::remove_dir_all(&bundle);
        layout
    })
}

/// Splits `name[:tag]` (a `:` after the last `/`) into name and tag (default
/// `latest`).
pub fn split_name_tag(name_tag: &str) -> (String, String) {
    match name_tag.rfind(':') {
        Some(i) if !name_tag[i..].contains('/') => {
            (name_tag[..i].to_string(), name_tag[i + 1..].to_string())
        }
        _ => (name_tag.to_string(), "latest".to_string()),
    }
}

/// Docker-style normalisation of a `name[:tag]` reference:
/// `foo:1` → `docker.io/library/foo:1`, `a/b` → `docker.io/a/b:latest`,
/// `registry.k8s.io/pause:3.6` unchanged.
pub fn normalize_ref(name_tag: &str) -> String {
    let (name, tag) = split_name_tag(name_tag);
    let full = match name.split_once('/') {
        Some((first, _)) if first.contains('.') || first.contains(':') || first == "localhost" => {
            name
        }
        Some(_) => format!("docker.io/{name}"),
        None => format!("docker.io/library/{name}"),
    };
    format!("{full}:{tag}")
}

/// Output of images built with [`TestImage::hello`]: `hello-from-<name_tag>`
/// with `/` and `:` replaced by `-`.
pub fn hello_text(name_tag: &str) -> String {
    format!("hello-from-{}", name_tag.replace(['/', ':'], "-"))
}

/// An offline-built image: an OCI layout dir with one tag.
pub struct TestImage {
    /// Repository name as given (e.g. `foo`, `registry.k8s.io/pause`).
    pub name: String,
    /// Tag (also the tag inside the OCI layout).
    pub tag: String,
    layout: PathBuf,
    dir: TempDir,
    docker_archive: OnceLock<PathBuf>,
    oci_archive: OnceLock<PathBuf>,
}

impl TestImage {
    /// Builds `name_tag` from the busybox base: `1 + layers` layers in total,
    /// extra layer `N` (1-based) holding `/layerN.txt` (distinct text) plus,
    /// if `extra_layer_bytes > 0`, `/layerN.bin` with that many random bytes.
    /// `cmd` becomes the image CMD (empty: no CMD).
    pub fn build(
        name_tag: &str,
        layers: usize,
        cmd: &[&str],
        extra_layer_bytes: usize,
    ) -> TestImage {
        let (name, tag) = split_name_tag(name_tag);
        let dir = tempdir("image-");
        let layout = dir.path().join("oci");
        let mut cp = Command::new("cp");
        cp.arg("-a").arg(base_layout()).arg(&layout);
        run_ok(cp);
        let base_ref = format!("{}:base", layout.display());
        let image = format!("{}:{tag}", layout.display());
        if tag != "base" {
            umoci(["tag", "--image", &base_ref, &tag]);
            umoci(["rm", "--image", &base_ref]);
        }
        for n in 1..=layers {
            let stage = dir.path().join(format!("stage-{n}"));
            fs::create_dir(&stage).expect("mkdir stage");
            fs::set_permissions(&stage, fs::Permissions::from_mode(0o755)).expect("chmod stage");
            fs::write(
                stage.join(format!("layer{n}.txt")),
                format!("layer {n} of {name_tag}\n"),
            )
            .expect("write layer file");
            if extra_layer_bytes > 0 {
                let mut f = File::create(stage.join(format!("layer{n}.bin"))).expect("create bin");
                let mut rng = rand::rng();
                let mut buf = vec![0u8; 1 << 20];
                let mut left = extra_layer_bytes;
                while left > 0 {
                    let k = left.min(buf.len());
                    rand::RngCore::fill_bytes(&mut rng, &mut buf[..k]);
                    f.write_all(&buf[..k]).expect("write random data");
                    left -= k;
                }
            }
            umoci([
                OsStr::new("insert"),
                OsStr::new("--image"),
                OsStr::new(&image),
                stage.as_os_str(),
                OsStr::new("/"),
            ]);
            let _ = fs::remove_dir_all(&stage);
        }
        if !cmd.is_empty() {
            let mut args = vec!["config", "--image", &image];
            for c in cmd {
                args.push("--config.cmd");
                args.push(c);
            }
            umoci(&args);
        }
        umoci([OsStr::new("gc"), OsStr::new("--layout"), layout.as_os_str()]);
        TestImage {
            name,
            tag,
            layout,
            dir,
            docker_archive: OnceLock::new(),
            oci_archive: OnceLock::new(),
        }
    }

    /// Like [`TestImage::build`] but memoised per process on all arguments.
    pub fn cached(
        name_tag: &str,
        layers: usize,
        cmd: &[&str],
        extra_layer_bytes: usize,
    ) -> Arc<TestImage> {
        type Key = (String, usize, Vec<String>, usize);
        static CACHE: OnceLock<Mutex<HashMap<Key, Arc<TestImage>>>> = OnceLock::new();
        let key = (
            name_tag.to_string(),
            layers,
            cmd.iter().map(|s| s.to_string()).collect(),
            extra_layer_bytes,
        );
        let mut cache = CACHE
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        cache
            .entry(key)
            .or_insert_with(|| Arc::new(TestImage::build(name_tag, layers, cmd, extra_layer_bytes)))
            .clone()
    }

    /// Cached image with one extra layer whose CMD prints [`hello_text`]`(name_tag)`.
    pub fn hello(name_tag: &str) -> Arc<TestImage> {
        let text = hello_text(name_tag);
        TestImage::cached(name_tag, 1, &["/bin/busybox", "echo", &text], 0)
    }

    /// `name:tag` as given.
    pub fn name_tag(&self) -> String {
        format!("{}:{}", self.name, self.tag)
    }

    /// Normalised reference, e.g. `docker.io/library/foo:1`: the name that
    /// `ctr images import` of [`TestImage::docker_archive`] creates and that
    /// CRI resolves.
    pub fn normalized(&self) -> String {
        normalize_ref(&self.name_tag())
    }

    /// The OCI layout directory.
    pub fn layout(&self) -> &Path {
        &self.layout
    }

    /// `oci:<layout>:<tag>` for skopeo.
    pub fn oci_ref(&self) -> String {
        format!("oci:{}:{}", self.layout.display(), self.tag)
    }

    /// Digest of the image manifest in the OCI layout (a docker-archive
    /// export gets a different, converted manifest).
    pub fn manifest_digest(&self) -> String {
        let index: serde_json::Value = serde_json::from_slice(
            &fs::read(self.layout.join("index.json")).expect("read index.json"),
        )
        .expect("parse index.json");
        index["manifests"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == self.tag.as_str())
            .and_then(|m| m["digest"].as_str())
            .expect("tag in index.json")
            .to_string()
    }

    /// Config digest (the CRI image id is `sha256:<this>` after import).
    pub fn config_digest(&self) -> String {
        let m = self.manifest_digest();
        let (alg, hex) = m.split_once(':').expect("digest");
        let manifest: serde_json::Value = serde_json::from_slice(
            &fs::read(self.layout.join("blobs").join(alg).join(hex)).expect("read manifest"),
        )
        .expect("parse manifest");
        manifest["config"]["digest"]
            .as_str()
            .expect("config digest")
            .to_string()
    }

    /// `docker-archive` tarball tagged `name:tag` (cached).
    pub fn docker_archive(&self) -> PathBuf {
        self.docker_archive
            .get_or_init(|| {
                let f = self.dir.path().join("docker-archive.tar");
                self.export_docker_archive(&f, &self.name_tag());
                f
            })
            .clone()
    }

    /// Writes a `docker-archive` to `dest` tagged `ref_name` (e.g. a
    /// different name than the image's own).
    pub fn export_docker_archive(&self, dest: &Path, ref_name: &str) {
        let _ = fs::remove_file(dest);
        skopeo([
            "copy".to_string(),
            "--quiet".into(),
            self.oci_ref(),
            format!("docker-archive:{}:{ref_name}", dest.display()),
        ]);
    }

    /// `oci-archive` tarball (cached) whose `org.opencontainers.image.ref.name`
    /// is the normalised name; import it with
    /// `ctr images import --base-name docker.io/library/<name> FILE`
    /// (`ctr` 1.6 otherwise prefixes/filters the ref name).
    pub fn oci_archive(&self) -> PathBuf {
        self.oci_archive
            .get_or_init(|| {
                let f = self.dir.path().join("oci-archive.tar");
                skopeo([
                    "copy".to_string(),
                    "--quiet".into(),
                    self.oci_ref(),
                    format!("oci-archive:{}:{}", f.display(), self.normalized()),
                ]);
                f
            })
            .clone()
    }

    /// Pushes to the plain-HTTP registry at `registry_addr` (`host:port`) as
    /// `<addr>/<name without registry domain>:<tag>`; returns that reference.
    pub fn push(&self, registry_addr: &str) -> String {
        let repo = normalize_ref(&self.name_tag());
        let (repo, _) = split_name_tag(&repo);
        let path = repo.split_once('/').map(|(_, p)| p).unwrap_or(&repo);
        let path = path.strip_prefix("library/").unwrap_or(path);
        let dest = format!("{registry_addr}/{path}:{}", self.tag);
        skopeo([
            "copy".to_string(),
            "--quiet".into(),
            "--dest-tls-verify=false".into(),
            self.oci_ref(),
            format!("docker://{dest}"),
        ]);
        dest
    }
}

/// The pause image ([`PAUSE_IMAGE`], CMD `busybox sleep 86400`), built once.
pub fn pause_image() -> &'static TestImage {
    static PAUSE: OnceLock<TestImage> = OnceLock::new();
    PAUSE.get_or_init(|| TestImage::build(PAUSE_IMAGE, 0, &["/bin/busybox", "sleep", "86400"], 0))
}

// ---------------------------------------------------------------------------
// Registry
// ---------------------------------------------------------------------------

/// A `docker-registry` (distribution 2.8) on 127.0.0.1 with filesystem
/// storage in a temp dir.
pub struct Registry {
    daemon: Daemon,
    port: u16,
    dir: TempDir,
}

impl Registry {
    /// Starts the registry and waits until `GET /v2/` answers 200.
    pub fn start() -> Registry {
        let dir = tempdir("registry-");
        let mut last_err = String::new();
        for _attempt in 0..3 {
            let port = free_port();
            let config = dir.path().join("config.yml");
            fs::write(
                &config,
                format!(
                    "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n  secret: imgbridge-test\n",
                    dir.path().join("data").display()
                ),
            )
            .expect("write registry config");
            let mut cmd = Command::new("docker-registry");
            cmd.arg("serve").arg(&config);
            let mut daemon =
                Daemon::spawn("docker-registry", cmd, &dir.path().join("registry.log"));
            let addr = format!("127.0.0.1:{port}");
            let ready = poll(READY_TIMEOUT, || {
                if let Some(st) = daemon.try_reap() {
                    return Some(Err(st));
                }
                (http_status(&addr, "/v2/") == Some(200)).then_some(Ok(()))
            });
            match ready {
                Some(Ok(())) => return Registry { daemon, port, dir },
                Some(Err(st)) => {
                    // Most likely the port was taken meanwhile; retry.
                    last_err = format!("registry exited ({st}); log:\n{}", daemon.log_tail(30));
                }
                None => panic!(
                    "registry on {addr} not ready within {READY_TIMEOUT:?}; log:\n{}",
                    daemon.log_tail(30)
                ),
            }
        }
        panic!("registry failed to start: {last_err}");
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.daemon.pid().expect("registry is not running")
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn log_tail(&self) -> String {
        self.daemon.log_tail(60)
    }
}

// ---------------------------------------------------------------------------
// imgbridge
// ---------------------------------------------------------------------------

/// The proxy under test, listening on `<tmp>/imgbridge.sock`.
pub struct Imgbridge {
    daemon: Daemon,
    sock: PathBuf,
    log: PathBuf,
    dir: TempDir,
}

impl Imgbridge {
    /// Spawns `imgbridge serve --listen <tmp>/imgbridge.sock --upstream
    /// <upstream_sock> <extra_args...>` (RUST_LOG=imgbridge=debug,info) and
    /// waits until the listen socket accepts connections.
    pub fn start(upstream_sock: &Path, extra_args: &[&str]) -> Imgbridge {
        let dir = tempdir("imgbridge-");
        let sock = dir.path().join("imgbridge.sock");
        Self::start_in(dir, sock, upstream_sock, extra_args)
    }

    /// Like [`Imgbridge::start`] but listening on `sock` (e.g. over a stale
    /// socket file).
    pub fn start_at(sock: &Path, upstream_sock: &Path, extra_args: &[&str]) -> Imgbridge {
        Self::start_in(
            tempdir("imgbridge-"),
            sock.to_path_buf(),
            upstream_sock,
            extra_args,
        )
    }

    fn start_in(
        dir: TempDir,
        sock: PathBuf,
        upstream_sock: &Path,
        extra_args: &[&str],
    ) -> Imgbridge {
        let log = dir.path().join("imgbridge.log");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_imgbridge"));
        cmd.arg("serve")
            .arg("--listen")
            .arg(&sock)
            .arg("--upstream")
            .arg(upstream_sock)
            .args(extra_args)
            .env("RUST_LOG", "imgbridge=debug,info")
            .env("RUST_BACKTRACE", "1");
        let daemon = Daemon::spawn("imgbridge", cmd, &log);
        let mut b = Imgbridge {
            daemon,
            sock,
            log,
            dir,
        };
        let ready = poll(READY_TIMEOUT, || {
            if let Some(st) = b.daemon.try_reap() {
                return Some(Err(st));
            }
            StdUnixStream::connect(&b.sock).is_ok().then_some(Ok(()))
        });
        match ready {
            Some(Ok(())) => b,
            Some(Err(st)) => panic!("imgbridge exited during startup ({st}); log:\n{}", b.log()),
            None => panic!(
                "imgbridge did not accept on {} within {READY_TIMEOUT:?}; log:\n{}",
                b.sock.display(),
                b.log()
            ),
        }
    }

    pub fn socket(&self) -> &Path {
        &self.sock
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Whole log so far.
    pub fn log(&self) -> String {
        fs::read(&self.log)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    pub fn log_tail(&self) -> String {
        self.daemon.log_tail(60)
    }

    pub fn pid(&self) -> u32 {
        self.daemon.pid().expect("imgbridge is not running")
    }

    /// `Some(status)` if the process has exited (reaps it).
    pub fn try_exit_status(&mut self) -> Option<ExitStatus> {
        self.daemon.try_reap()
    }

    pub fn kill9(&mut self) {
        self.daemon.kill9();
    }

    /// SIGTERM and wait up to [`STOP_GRACE`] for exit; panics (after
    /// SIGKILL) with the log if it does not exit in time.
    pub fn sigterm(&mut self) -> ExitStatus {
        match self.daemon.terminate_with(Signal::SIGTERM, STOP_GRACE) {
            Ok(Some(st)) => st,
            Ok(None) => panic!("imgbridge was not running"),
            Err(()) => panic!(
                "imgbridge did not exit within {STOP_GRACE:?} of SIGTERM; log:\n{}",
                self.log_tail()
            ),
        }
    }
}

// ---------------------------------------------------------------------------
// gRPC helpers (containerd + CRI)
// ---------------------------------------------------------------------------

/// Connects a tonic channel to a unix socket (as `containerd_client::connect`).
pub async fn try_containerd_channel(sock: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = sock.to_path_buf();
    Endpoint::try_from("http://[::]")?
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await
}

/// A bare HTTP/2 client connection to `sock`: no gRPC layer and no timers
/// of its own, for exact wire behaviour.
pub async fn h2_connect<B>(sock: &Path) -> hyper::client::conn::http2::SendRequest<B>
where
    B: hyper::body::Body + Unpin + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let s = tokio::net::UnixStream::connect(sock).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(s),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    send
}

/// [`try_containerd_channel`], panicking with the nearby daemon logs on error.
pub async fn containerd_channel(sock: &Path) -> Channel {
    try_containerd_channel(sock).await.unwrap_or_else(|e| {
        panic!(
            "cannot connect to {}: {e:?}{}",
            sock.display(),
            logs_near(sock)
        )
    })
}

/// Wraps `req` in a `tonic::Request` with `containerd-namespace: <ns>`.
pub fn with_ns<T>(req: T, ns: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(req);
    r.metadata_mut().insert(
        "containerd-namespace",
        ns.parse().expect("namespace is valid metadata"),
    );
    r
}

/// Images client on a containerd (or proxy) socket.
pub async fn images_client(
    sock: &Path,
) -> containerd_client::services::v1::images_client::ImagesClient<Channel> {
    containerd_client::services::v1::images_client::ImagesClient::new(
        containerd_channel(sock).await,
    )
}

/// Content client on a containerd (or proxy) socket.
pub async fn content_client(
    sock: &Path,
) -> containerd_client::services::v1::content_client::ContentClient<Channel> {
    containerd_client::services::v1::content_client::ContentClient::new(
        containerd_channel(sock).await,
    )
}

/// The image record `name` in `ns`, or `None` when containerd says it is
/// absent. Other errors are retried for a while (containerd may be
/// restarting under the test), then fail the test: "absent" is never
/// inferred from a failed call.
pub async fn get_image(
    sock: &Path,
    ns: &str,
    name: &str,
) -> Option<containerd_client::services::v1::Image> {
    let c = imgbridge::containerd::Containerd::new(sock);
    definite(&format!("image {name} in {ns}"), || c.get_image(ns, name)).await
}

/// Retries `call` until containerd gives a definite answer (value or
/// NotFound, which the library maps to `None`), for up to 10 s.
async fn definite<T, F, Fut>(what: &str, call: F) -> Option<T>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, imgbridge::containerd::Error>>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match call().await {
            Ok(v) => return v,
            Err(e) if Instant::now() > deadline => panic!("asking containerd for {what}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// The target descriptor of image `name` in `ns`, panicking when it is absent.
pub async fn image_target(
    sock: &Path,
    ns: &str,
    name: &str,
) -> containerd_client::types::Descriptor {
    get_image(sock, ns, name)
        .await
        .unwrap_or_else(|| panic!("image {name} not found in {ns}"))
        .target
        .unwrap_or_else(|| panic!("image {name} in {ns} has no target"))
}

/// Content info of `digest` in `ns`, or `None` when containerd says it is
/// absent (errors as in [`get_image`]).
pub async fn content_info(
    sock: &Path,
    ns: &str,
    digest: &str,
) -> Option<containerd_client::services::v1::Info> {
    let c = imgbridge::containerd::Containerd::new(sock);
    definite(&format!("blob {digest} in {ns}"), || {
        c.content_info(ns, digest)
    })
    .await
}

/// An `Images/Create` request for `name` -> `target` in `ns`.
pub fn create_image_req(
    ns: &str,
    name: &str,
    target: &containerd_client::types::Descriptor,
) -> tonic::Request<containerd_client::services::v1::CreateImageRequest> {
    with_ns(
        containerd_client::services::v1::CreateImageRequest {
            image: Some(containerd_client::services::v1::Image {
                name: name.into(),
                target: Some(target.clone()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ns,
    )
}

/// Lower-case hex SHA-256 of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(data))
}

/// `sha256:<hex>` digest of `data`.
pub fn sha256_digest(data: &[u8]) -> String {
    format!("sha256:{}", sha256_hex(data))
}

/// Ingests `file` as blob `digest` into `ns` with `ctr content ingest`
/// (ingest ref `ingest-<12 hex>`, checking size and digest), panicking with
/// ctr's stderr on failure.
pub fn ctr_ingest(sock: &Path, ns: &str, digest: &str, file: &Path) {
    let size = fs::metadata(file)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .len();
    let sh = format!(
        "ctr -a {} -n {ns} content ingest --expected-size {size} --expected-digest {digest} ingest-{} < {}",
        sock.display(),
        &digest[7..19],
        file.display()
    );
    let out = Command::new("sh")
        .arg("-c")
        .arg(&sh)
        .env("PATH", flavor().path_env())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{sh}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
/// CRI RuntimeService client (16 MiB max message).
pub async fn cri_runtime_client(sock: &Path) -> RuntimeServiceClient<Channel> {
    RuntimeServiceClient::new(containerd_channel(sock).await)
        .max_decoding_message_size(MAX_MSG)
        .max_encoding_message_size(MAX_MSG)
}

/// CRI ImageService client (16 MiB max message).
pub async fn cri_image_client(sock: &Path) -> ImageServiceClient<Channel> {
    ImageServiceClient::new(containerd_channel(sock).await)
        .max_decoding_message_size(MAX_MSG)
        .max_encoding_message_size(MAX_MSG)
}

/// CRI `ImageStatus`; `Err` carries the connection or RPC error.
/// CRI's `ImageStatus` of `image_ref` on containerd's socket `sock`: what
/// kubelet would see, asked with crictl (over gRPC only when the peers are
/// skipped).
pub async fn try_cri_image_status(
    sock: &Path,
    image_ref: &str,
) -> Result<Option<k8s_cri::v1::Image>, String> {
    if let Some(crictl) = peers::Crictl::quiet(sock) {
        let name = image_ref.to_string();
        let status = tokio::task::spawn_blocking(move || crictl.inspecti(&name))
            .await
            .map_err(|e| e.to_string())??;
        return Ok(status.map(|s| image_from_json(&s)));
    }
    let ch = try_containerd_channel(sock)
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    let mut c = ImageServiceClient::new(ch).max_decoding_message_size(MAX_MSG);
    let resp = c
        .image_status(k8s_cri::v1::ImageStatusRequest {
            image: Some(k8s_cri::v1::ImageSpec {
                image: image_ref.to_string(),
                ..Default::default()
            }),
            verbose: false,
        })
        .await
        .map_err(|s| format!("ImageStatus: {s:?}"))?;
    Ok(resp.into_inner().image)
}

/// CRI `ImageStatus` for `image_ref`, `None` when CRI does not know it.
/// Panics on connection/RPC errors.
/// crictl's JSON image status as CRI's `Image`.
fn image_from_json(s: &serde_json::Value) -> k8s_cri::v1::Image {
    let strings = |k: &str| -> Vec<String> {
        s[k].as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    k8s_cri::v1::Image {
        id: s["id"].as_str().unwrap_or_default().to_string(),
        repo_tags: strings("repoTags"),
        repo_digests: strings("repoDigests"),
        size: s["size"]
            .as_str()
            .and_then(|v| v.parse().ok())
            .or_else(|| s["size"].as_u64())
            .unwrap_or_default(),
        pinned: s["pinned"].as_bool().unwrap_or_default(),
        ..Default::default()
    }
}

pub async fn cri_image_status(sock: &Path, image_ref: &str) -> Option<k8s_cri::v1::Image> {
    try_cri_image_status(sock, image_ref)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "CRI ImageStatus({image_ref}) on {}: {e}{}",
                sock.display(),
                logs_near(sock)
            )
        })
}

/// A pod sandbox with one started container (see [`run_pod`]).
pub struct PodRun {
    pub sock: PathBuf,
    pub name: String,
    pub pod_id: String,
    pub container_id: String,
    /// The container's log file.
    pub log_path: PathBuf,
    logs: TempDir,
}

impl PodRun {
    /// Current content of the container log (CRI format lines).
    pub fn log(&self) -> String {
        fs::read(&self.log_path)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// StopPodSandbox + RemovePodSandbox, retried for up to 30 s as kubelet
    /// does: containerd 1.6 can fail a stop with "ttrpc: closed" when the
    /// container's shim is exiting at that moment.
    pub async fn cleanup(self) {
        let mut rt = cri_runtime_client(&self.sock).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let Err(e) = self.try_cleanup(&mut rt).await else {
                return;
            };
            if Instant::now() >= deadline {
                panic!(
                    "pod {} cleanup failed for 30 s: {e}{}",
                    self.name,
                    logs_near(&self.sock)
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await; // retry interval
        }
    }

    async fn try_cleanup(
        &self,
        rt: &mut RuntimeServiceClient<Channel>,
    ) -> Result<(), tonic::Status> {
        use k8s_cri::v1::{RemovePodSandboxRequest, StopPodSandboxRequest};
        if self.pod_id.is_empty() {
            return Ok(());
        }
        rt.stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: self.pod_id.clone(),
        })
        .await?;
        rt.remove_pod_sandbox(RemovePodSandboxRequest {
            pod_sandbox_id: self.pod_id.clone(),
        })
        .await?;
        Ok(())
    }

    /// Best-effort removal of the pod, then panic with `msg` and logs.
    async fn fail(&self, rt: &mut RuntimeServiceClient<Channel>, msg: String) {
        let _ = self.try_cleanup(rt).await;
        panic!(
            "pod {} (image run failed): {msg}\n--- container log ---\n{}{}",
            self.name,
            self.log(),
            logs_near(&self.sock)
        );
    }
}

/// Kubelet-style run on the CRI at `sock`: RunPodSandbox (host network, pid
/// and ipc namespaces; log dir in a temp dir; unique name/uid),
/// CreateContainer (`image_ref`, `cmd`; empty `cmd` = the image's CMD),
/// StartContainer, then polls the container log for up to [`POD_TIMEOUT`]
/// until it contains `expect`. Panics (after removing the pod) otherwise.
/// Call [`PodRun::cleanup`] when done.
pub async fn run_pod(sock: &Path, image_ref: &str, cmd: &[&str], expect: &str) -> PodRun {
    use k8s_cri::v1::*;

    let name = unique_name("pod");
    let logs = tempdir("pod-logs-");
    let log_dir = logs.path().join(&name);
    fs::create_dir_all(&log_dir).expect("mkdir pod log dir");
    let ns_opts = NamespaceOption {
        network: NamespaceMode::Node as i32,
        pid: NamespaceMode::Node as i32,
        ipc: NamespaceMode::Node as i32,
        ..Default::default()
    };
    let pod_config = PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: name.clone(),
            uid: unique_name("uid"),
            namespace: "imgbridge-test".into(),
            attempt: 0,
        }),
        log_directory: log_dir.display().to_string(),
        linux: Some(LinuxPodSandboxConfig {
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: Some(ns_opts.clone()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut rt = cri_runtime_client(sock).await;
    let crictl = peers::Crictl::quiet(sock);
    let mut pod = PodRun {
        sock: sock.to_path_buf(),
        name: name.clone(),
        pod_id: String::new(),
        container_id: String::new(),
        log_path: log_dir.join("main.log"),
        logs,
    };
    if let Some(crictl) = crictl {
        // As kubelet would: crictl runp, create, start.
        let (name, image, dir) = (name.clone(), image_ref.to_string(), log_dir.clone());
        let cmd: Vec<String> = cmd.iter().map(|s| s.to_string()).collect();
        let (pod_id, started) = tokio::task::spawn_blocking(move || {
            let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();
            crictl.start_pod(&name, &image, &cmd, &dir)
        })
        .await
        .expect("crictl task");
        pod.pod_id = pod_id.unwrap_or_default();
        match started {
            Ok(cid) => pod.container_id = cid,
            Err(e) => pod.fail(&mut rt, e).await,
        }
        return pod.wait_for(&mut rt, expect).await;
    }
    match rt
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(pod_config.clone()),
            runtime_handler: String::new(),
        })
        .await
    {
        Ok(r) => pod.pod_id = r.into_inner().pod_sandbox_id,
        Err(e) => pod.fail(&mut rt, format!("RunPodSandbox: {e:?}")).await,
    }
    let container_config = ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: "main".into(),
            attempt: 0,
        }),
        image: Some(ImageSpec {
            image: image_ref.to_string(),
            ..Default::default()
        }),
        command: cmd.iter().map(|s| s.to_string()).collect(),
        log_path: "main.log".into(),
        linux: Some(LinuxContainerConfig {
            security_context: Some(LinuxContainerSecurityContext {
                namespace_options: Some(ns_opts),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    match rt
        .create_container(CreateContainerRequest {
            pod_sandbox_id: pod.pod_id.clone(),
            config: Some(container_config),
            sandbox_config: Some(pod_config),
        })
        .await
    {
        Ok(r) => pod.container_id = r.into_inner().container_id,
        Err(e) => {
            pod.fail(&mut rt, format!("CreateContainer({image_ref}): {e:?}"))
                .await
        }
    }
    if let Err(e) = rt
        .start_container(StartContainerRequest {
            container_id: pod.container_id.clone(),
        })
        .await
    {
        pod.fail(&mut rt, format!("StartContainer: {e:?}")).await;
    }

    pod.wait_for(&mut rt, expect).await
}

impl PodRun {
    /// Polls the log until it shows `expect`; fails fast if the container
    /// exited without it (allowing 2 s for the log to be flushed).
    async fn wait_for(mut self, rt: &mut RuntimeServiceClient<Channel>, expect: &str) -> PodRun {
        use k8s_cri::v1::*;
        let pod = &mut self;
        let deadline = Instant::now() + POD_TIMEOUT;
        let mut exited_at: Option<(Instant, ContainerStatus)> = None;
        loop {
            if pod.log().contains(expect) {
                return self;
            }
            if exited_at.is_none() {
                if let Ok(r) = rt
                    .container_status(ContainerStatusRequest {
                        container_id: pod.container_id.clone(),
                        verbose: false,
                    })
                    .await
                {
                    if let Some(st) = r.into_inner().status {
                        if st.state == ContainerState::ContainerExited as i32 {
                            exited_at = Some((Instant::now(), st));
                        }
                    }
                }
            }
            if let Some((t, st)) = &exited_at {
                if t.elapsed() > Duration::from_secs(2) {
                    let msg = format!(
                    "container exited (code {}, reason {:?}, message {:?}) without printing {expect:?}",
                    st.exit_code, st.reason, st.message
                );
                    pod.fail(rt, msg).await;
                }
            }
            if Instant::now() >= deadline {
                pod.fail(
                    rt,
                    format!("{expect:?} not in container log within {POD_TIMEOUT:?}"),
                )
                .await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
