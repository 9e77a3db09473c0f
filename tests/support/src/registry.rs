//! A loopback docker-registry for pull tests.

use std::fs;
use std::path::Path;
use std::process::Command;

use tempfile::TempDir;

use crate::daemon::{Daemon, NotReady};
use crate::util::{free_port, http_status, tempdir, READY_TIMEOUT};

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
            let ready = daemon.wait_ready(|| http_status(&addr, "/v2/") == Some(200));
            match ready {
                Ok(()) => return Registry { daemon, port, dir },
                Err(NotReady::Exited(st)) => {
                    // Most likely the port was taken meanwhile; retry.
                    last_err = format!("registry exited ({st}); log:\n{}", daemon.log_tail(30));
                }
                Err(NotReady::TimedOut) => panic!(
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
