//! The proxy process under test.

use std::fs;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

use nix::sys::signal::Signal;
use tempfile::TempDir;

use crate::daemon::{Daemon, NotReady};
use crate::repo::imgbridge_bin;
use crate::scenario::config_file;
use crate::util::{poll, tempdir, READY_TIMEOUT, STOP_GRACE};

/// What a test's imgbridge logs: its own debug lines, everyone's info.
const DEBUG_LOG: &str = "imgbridge=debug,info";

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
        Self::start_in(dir, sock, upstream_sock, extra_args, DEBUG_LOG)
    }

    /// [`Imgbridge::start`] with `--config` of a file holding `toml`.
    pub fn with_config(upstream_sock: &Path, toml: &str) -> Imgbridge {
        let cfg = config_file(toml);
        Self::start(upstream_sock, &["--config", &cfg.display().to_string()])
    }

    /// Like [`Imgbridge::start`] but listening on `sock` (e.g. over a stale
    /// socket file).
    pub fn start_at(sock: &Path, upstream_sock: &Path, extra_args: &[&str]) -> Imgbridge {
        Self::start_at_logging(sock, upstream_sock, extra_args, DEBUG_LOG)
    }

    /// [`Imgbridge::start_at`] logging with `RUST_LOG=<filter>`: a run
    /// of an hour logs at `info`, as a node does.
    pub fn start_at_logging(
        sock: &Path,
        upstream_sock: &Path,
        extra_args: &[&str],
        filter: &str,
    ) -> Imgbridge {
        Self::start_in(
            tempdir("imgbridge-"),
            sock.to_path_buf(),
            upstream_sock,
            extra_args,
            filter,
        )
    }

    fn start_in(
        dir: TempDir,
        sock: PathBuf,
        upstream_sock: &Path,
        extra_args: &[&str],
        filter: &str,
    ) -> Imgbridge {
        let log = dir.path().join("imgbridge.log");
        let mut cmd = Command::new(imgbridge_bin());
        cmd.arg("serve")
            .arg("--listen")
            .arg(&sock)
            .arg("--upstream")
            .arg(upstream_sock)
            .args(extra_args)
            .env("RUST_LOG", filter)
            .env("RUST_BACKTRACE", "1");
        // The config the harness wrote next to its containerd's socket is
        // the one that containerd runs with (what doctor and the 2.x sandbox
        // image read); never the host's /etc/containerd/config.toml.
        match upstream_sock.with_file_name("config.toml") {
            f if f.exists() => cmd.env("IMGBRIDGE_CONTAINERD_CONFIG", f),
            _ => cmd.env_remove("IMGBRIDGE_CONTAINERD_CONFIG"),
        };
        let daemon = Daemon::spawn("imgbridge", cmd, &log);
        let mut b = Imgbridge {
            daemon,
            sock,
            log,
            dir,
        };
        let ready = b
            .daemon
            .wait_ready(|| StdUnixStream::connect(&b.sock).is_ok());
        match ready {
            Ok(()) => b,
            Err(NotReady::Exited(st)) => {
                panic!("imgbridge exited during startup ({st}); log:\n{}", b.log())
            }
            Err(NotReady::TimedOut) => panic!(
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

    /// Polls the log until it shows `text`; panics with `why` and the log
    /// tail if it does not within `within`.
    pub fn wait_for_log(&self, text: &str, within: Duration, why: &str) {
        let seen = poll(within, || self.log().contains(text).then_some(()));
        assert!(seen.is_some(), "{why}:\n{}", self.log_tail());
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
