//! Daemons started by the tests: one spawner thread, a pid registry and an
//! atexit sweep, so that nothing a test started outlives the test process.

use std::fs::{self, File};
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Mutex, MutexGuard, Once, OnceLock};
use std::thread;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::shims::{kill_shims, unmount_under};
use crate::util::{poll, tail_file, READY_TIMEOUT, STOP_GRACE};

pub(crate) struct Registered {
    pid: i32,
}

pub(crate) static REGISTRY: Mutex<Vec<Registered>> = Mutex::new(Vec::new());
/// gRPC addresses of containerds started here and not yet dropped; their
/// shims are killed at exit (even if the containerd was already reaped).
pub(crate) static SHIM_ADDRESSES: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
pub(crate) static ATEXIT: Once = Once::new();
pub(crate) static OWNER_PID: AtomicU32 = AtomicU32::new(0);
pub(crate) static SCRATCH: OnceLock<PathBuf> = OnceLock::new();

pub(crate) fn registry() -> MutexGuard<'static, Vec<Registered>> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn keep_tmp() -> bool {
    std::env::var_os("IMGBRIDGE_TEST_KEEP").is_some_and(|v| v != "0" && !v.is_empty())
}

pub(crate) fn ensure_atexit() {
    ATEXIT.call_once(|| {
        OWNER_PID.store(std::process::id(), Ordering::SeqCst);
        // SAFETY: registering a plain extern "C" fn without arguments.
        let rc = unsafe { libc::atexit(cleanup_at_exit) };
        assert_eq!(rc, 0, "atexit registration failed");
    });
}

pub(crate) extern "C" fn cleanup_at_exit() {
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

pub(crate) type SpawnRequest = (Command, mpsc::Sender<io::Result<Child>>);

pub(crate) fn spawner() -> &'static mpsc::Sender<SpawnRequest> {
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
pub(crate) fn spawn_daemon(mut cmd: Command) -> io::Result<Child> {
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
pub(crate) struct Daemon {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Daemon {
    pub(crate) fn spawn(name: &str, mut cmd: Command, log: &Path) -> Daemon {
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

    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub(crate) fn running(&self) -> bool {
        self.child.is_some()
    }

    /// Non-blocking: returns the exit status if the process has exited (and
    /// reaps/unregisters it).
    pub(crate) fn try_reap(&mut self) -> Option<ExitStatus> {
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

    pub(crate) fn signal(&self, sig: Signal) {
        if let Some(pid) = self.pid() {
            let _ = kill(Pid::from_raw(pid as i32), sig);
        }
    }

    /// SIGKILL and reap.
    pub(crate) fn kill9(&mut self) -> Option<ExitStatus> {
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
    pub(crate) fn terminate_with(
        &mut self,
        sig: Signal,
        grace: Duration,
    ) -> Result<Option<ExitStatus>, ()> {
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

    pub(crate) fn stop(&mut self) {
        let _ = self.terminate_with(Signal::SIGTERM, STOP_GRACE);
    }

    pub(crate) fn log_tail(&self, lines: usize) -> String {
        tail_file(&self.log, lines)
    }
}

/// Why a daemon did not become ready.
pub(crate) enum NotReady {
    /// It exited first.
    Exited(ExitStatus),
    /// It was still not ready at [`READY_TIMEOUT`].
    TimedOut,
}

impl Daemon {
    /// Polls `ready` until it holds, for up to [`READY_TIMEOUT`]; gives up
    /// at once when the process exits meanwhile (and reaps it).
    pub(crate) fn wait_ready(&mut self, ready: impl FnMut() -> bool) -> Result<(), NotReady> {
        self.wait_ready_within(READY_TIMEOUT, ready)
    }

    /// [`Self::wait_ready`] with a deadline of its own, for a daemon whose
    /// start does much more than open a socket.
    pub(crate) fn wait_ready_within(
        &mut self,
        deadline: std::time::Duration,
        mut ready: impl FnMut() -> bool,
    ) -> Result<(), NotReady> {
        let outcome = poll(deadline, || {
            if let Some(status) = self.try_reap() {
                return Some(Err(NotReady::Exited(status)));
            }
            ready().then_some(Ok(()))
        });
        outcome.unwrap_or(Err(NotReady::TimedOut))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}
