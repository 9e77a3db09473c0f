//! What the swap asks of systemd and of the sockets: the `systemctl`
//! sequences (plain data, to change once measured) and the checks that a
//! swap or a rollback took effect.
//!
//! Why apply restarts containerd, then `imgbridge.socket`, as two calls
//! (measured under systemd 252 with containerd 1.6.20 in systemd-nspawn,
//! a socket unit standing in for imgbridge's):
//! - systemd does not bind the new `ListenStream=`s of a socket unit that is
//!   already listening: after `daemon-reload` it only logs "Socket unit
//!   configuration has changed while unit has been running … not fully
//!   functional until restarted" (src/core/socket.c, `socket_coldplug`).
//!   Restarting imgbridge.service does not bind them either (the sockets are
//!   systemd's): `restart containerd.service imgbridge.service` left the
//!   default path with no socket at all, in both runs.
//! - the socket may bind the default path only once containerd has let go
//!   of it: containerd's listener (Go's) unlinks its path when containerd
//!   stops, and systemd takes a path that is in use by unlinking it
//!   (src/shared/socket-label.c). Socket first, containerd's stop then
//!   removed the socket's node while systemd kept listening on it.
//! - one `systemctl restart a b c` is not one transaction: systemctl sends a
//!   job per unit (src/systemctl/systemctl-start-unit.c), and
//!   `restart imgbridge.socket containerd.service imgbridge.service` lost the
//!   node in 6 of 11 runs despite `Before=containerd.service`. Stopping
//!   containerd first is no better: a client on
//!   /run/imgbridge/containerd.sock activates imgbridge.service, which
//!   `Requires=` containerd, and systemd cancelled containerd's stop (in
//!   every run with a client).
//!
//! So: containerd first (imgbridge.service restarts with it through the
//! drop-in's `Requires=`; the socket keeps queueing on its own paths), then
//! the socket, which binds the default path containerd has just released
//! (imgbridge.service restarts with it, `Requires=imgbridge.socket`, and
//! gets every socket). 7 of 7 runs ended right; the default path was
//! missing for 0.12-0.29 s (a plain `systemctl restart containerd`: 0.07-0.11 s).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Each `systemctl` invocation of apply, in order (see the module doc).
pub(super) const APPLY: &[&[&str]] = &[
    &["daemon-reload"],
    &["restart", "containerd.service"],
    &["restart", "imgbridge.socket"],
];

/// Each `systemctl` invocation of rollback, in order, with the socket's
/// drop-in still in place: containerd comes back on the default path (it
/// unlinks the socket's node and binds its own, containerd's
/// pkg/sys/socket_unix.go) while imgbridge.socket still holds its
/// descriptor, so calls queued there are served by the restarted imgbridge
/// (its upstream the default path again) and none is refused. Reloading
/// with the socket's drop-in gone first closed the default path's
/// descriptor while its node stayed: 1 of 12 calls refused.
pub(super) const ROLLBACK: &[&[&str]] = &[
    &["daemon-reload"],
    &["restart", "containerd.service", "imgbridge.service"],
];

/// Then, the socket's drop-in removed: systemd closes its (now unreachable)
/// descriptor for the default path, and imgbridge restarts without it;
/// builders' calls wait in imgbridge.socket's backlog meanwhile.
pub(super) const ROLLBACK_SOCKET: &[&[&str]] =
    &[&["daemon-reload"], &["restart", "imgbridge.service"]];

/// How often a check is repeated while waiting, at most.
const POLL_MAX: Duration = Duration::from_millis(500);
/// The time one containerd `Version` call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// What apply and rollback need from the machine besides files. The real
/// one is [`Systemd`]; tests script one.
pub(super) trait Host {
    /// systemd runs as PID 1 (`/run/systemd/system` exists, sd_booted(3)).
    fn booted(&self) -> bool;
    /// Runs `systemctl args…`: its stdout, or why it failed.
    fn systemctl(&self, args: &[&str]) -> Result<String, String>;
    /// containerd's version as answered on `socket` (through imgbridge, if
    /// imgbridge listens there).
    fn version(&self, socket: &Path) -> Result<String, String>;
    /// The PID of the process that listens on `socket` (`SO_PEERCRED`):
    /// systemd's for a socket unit, containerd's for its own.
    fn listener_pid(&self, socket: &Path) -> Result<u32, String>;
}

/// The machine itself; every path joined under `root`.
pub(super) struct Systemd {
    pub root: PathBuf,
}

impl Systemd {
    fn under(&self, p: &Path) -> PathBuf {
        super::under(&self.root, p)
    }
}

impl Host for Systemd {
    fn booted(&self) -> bool {
        self.under(Path::new("/run/systemd/system")).is_dir()
    }

    fn systemctl(&self, args: &[&str]) -> Result<String, String> {
        let out = std::process::Command::new("systemctl")
            .args(args)
            .output()
            .map_err(|e| format!("cannot run systemctl: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            let err = String::from_utf8_lossy(&out.stderr);
            Err(format!(
                "`systemctl {}` failed ({}): {}",
                args.join(" "),
                out.status,
                err.trim()
            ))
        }
    }

    fn version(&self, socket: &Path) -> Result<String, String> {
        let socket = self.under(socket);
        // Its own thread and runtime: callers may or may not be in one.
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                let c = crate::containerd::Containerd::new(&socket);
                match tokio::time::timeout(CALL_TIMEOUT, c.version()).await {
                    Ok(r) => r.map_err(|e| e.to_string()),
                    Err(_) => Err(format!("no answer within {CALL_TIMEOUT:?}")),
                }
            })
        })
        .join()
        .map_err(|_| "the version check panicked".to_owned())?
    }

    fn listener_pid(&self, socket: &Path) -> Result<u32, String> {
        use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
        let s = std::os::unix::net::UnixStream::connect(self.under(socket))
            .map_err(|e| format!("connect: {e}"))?;
        let cred = getsockopt(&s, PeerCredentials).map_err(|e| format!("SO_PEERCRED: {e}"))?;
        u32::try_from(cred.pid()).map_err(|_| format!("bad pid {}", cred.pid()))
    }
}

/// Refuses nodes the swap is not for, saying what to do instead.
pub(super) fn preconditions(host: &dyn Host) -> Result<(), String> {
    const NOT_FOR: &str = "the swap is for containerd run by systemd as containerd.service \
        (k3s, rke2, k0s and microk8s manage containerd's config themselves: point builders \
        at /run/imgbridge/containerd.sock instead)";
    if !host.booted() {
        return Err(format!(
            "systemd is not running as PID 1 (no /run/systemd/system): {NOT_FOR}"
        ));
    }
    if host.systemctl(&["cat", "containerd.service"]).is_err() {
        return Err(format!("there is no containerd.service unit: {NOT_FOR}"));
    }
    if host.systemctl(&["cat", "imgbridge.socket"]).is_err() {
        return Err(
            "there is no imgbridge.socket unit: install imgbridge's package \
             (or its units from the tarball) first"
                .into(),
        );
    }
    // Not enabled, nothing would bind the default socket at the next boot,
    // with containerd on the real one.
    if host
        .systemctl(&["is-enabled", "--quiet", "imgbridge.socket"])
        .is_err()
    {
        return Err(
            "imgbridge.socket is not enabled: run `systemctl enable --now \
             imgbridge.socket imgbridge.service` first, so the default socket is bound at boot"
                .into(),
        );
    }
    Ok(())
}

/// Runs `steps`; each one run, as a line of the report.
pub(super) fn run(
    host: &dyn Host,
    steps: &[&[&str]],
    done: &mut Vec<String>,
) -> Result<(), String> {
    for args in steps {
        host.systemctl(args)?;
        done.push(format!("systemctl {}", args.join(" ")));
    }
    Ok(())
}

/// `steps` as shell commands: "`systemctl a`, then `systemctl b`".
pub(super) fn commands(steps: &[&[&str]]) -> String {
    let each: Vec<String> = steps
        .iter()
        .map(|a| format!("`systemctl {}`", a.join(" ")))
        .collect();
    each.join(", then ")
}

/// containerd.service's main PID, if systemd knows one.
fn containerd_pid(host: &dyn Host) -> Option<u32> {
    host.systemctl(&["show", "-p", "MainPID", "--value", "containerd.service"])
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .filter(|&p| p != 0)
}

/// The paths `systemctl show -p Listen` lists (`/path (Stream)` per line,
/// with or without `Listen=`).
fn listens(show: &str) -> Vec<&str> {
    show.lines()
        .map(|l| l.trim().trim_start_matches("Listen="))
        .filter_map(|l| l.split(" (").next())
        .filter(|l| !l.is_empty())
        .collect()
}

/// One look at whether the swap is live: containerd answers on the real
/// socket, imgbridge (not containerd) on the default one, and the socket
/// unit lists both default paths.
pub(super) fn check_applied(
    host: &dyn Host,
    real: &Path,
    default: &Path,
) -> Result<String, String> {
    let pid = containerd_pid(host);
    let version = host
        .version(real)
        .map_err(|e| format!("containerd does not answer on {}: {e}", real.display()))?;
    if let Some(pid) = pid {
        let on = host.listener_pid(real)?;
        if on != pid {
            return Err(format!(
                "{} is served by PID {on}, not containerd (PID {pid})",
                real.display()
            ));
        }
        if host.listener_pid(default).ok() == Some(pid) {
            return Err(format!(
                "containerd itself still listens on {}",
                default.display()
            ));
        }
    }
    host.version(default)
        .map_err(|e| format!("imgbridge does not answer on {}: {e}", default.display()))?;
    let show = host.systemctl(&["show", "-p", "Listen", "--value", "imgbridge.socket"])?;
    let listed = listens(&show);
    let ttrpc = format!("{}.ttrpc", default.display());
    for want in [default.display().to_string(), ttrpc] {
        if !listed.contains(&want.as_str()) {
            return Err(format!(
                "imgbridge.socket does not list {want} (it lists {})",
                listed.join(", ")
            ));
        }
    }
    Ok(format!(
        "containerd {version} answers on {} and through imgbridge on {}",
        real.display(),
        default.display()
    ))
}

/// One look at whether containerd is back on the default socket itself.
pub(super) fn check_rolled_back(host: &dyn Host, default: &Path) -> Result<String, String> {
    let version = host
        .version(default)
        .map_err(|e| format!("containerd does not answer on {}: {e}", default.display()))?;
    if let Some(pid) = containerd_pid(host) {
        let on = host.listener_pid(default)?;
        if on != pid {
            return Err(format!(
                "{} is served by PID {on}, not containerd (PID {pid})",
                default.display()
            ));
        }
    }
    Ok(format!(
        "containerd {version} answers on {} again",
        default.display()
    ))
}

/// Units whose `failed` state ends the wait for apply: containerd gave up
/// restarting, or the socket stopped after imgbridge.service hit its start
/// limit (imgbridge.service itself may be failed from before and still be
/// started by the socket).
const APPLY_WATCH: &[&str] = &["containerd.service", "imgbridge.socket"];
/// The same for rollback.
const ROLLBACK_WATCH: &[&str] = &["containerd.service"];

/// Which of `units` systemd reports `failed`, as a message; `None` if none
/// (or if systemctl cannot say).
pub(super) fn failed(host: &dyn Host, units: &[&str]) -> Option<String> {
    let mut args = vec!["show", "-p", "ActiveState", "--value"];
    args.extend_from_slice(units);
    let out = host.systemctl(&args).ok()?;
    let states = out.lines().map(str::trim).filter(|l| !l.is_empty());
    let failed: Vec<&str> = units
        .iter()
        .zip(states)
        .filter(|(_, state)| *state == "failed")
        .map(|(u, _)| *u)
        .collect();
    (!failed.is_empty()).then(|| {
        format!(
            "{} failed (journalctl -u {})",
            failed.join(", "),
            failed.join(" -u ")
        )
    })
}

/// Waits until the swap is live ([`check_applied`]), at most `deadline`.
pub(super) fn wait_applied(
    host: &dyn Host,
    real: &Path,
    default: &Path,
    deadline: Duration,
) -> Result<String, String> {
    wait(
        deadline,
        || check_applied(host, real, default),
        || failed(host, APPLY_WATCH),
    )
}

/// Waits until containerd is back on its default socket
/// ([`check_rolled_back`]), at most `deadline`.
pub(super) fn wait_rolled_back(
    host: &dyn Host,
    default: &Path,
    deadline: Duration,
) -> Result<String, String> {
    wait(
        deadline,
        || check_rolled_back(host, default),
        || failed(host, ROLLBACK_WATCH),
    )
}

/// Repeats `check` until it passes, `fatal` says waiting is pointless, or
/// `deadline` has passed.
fn wait(
    deadline: Duration,
    mut check: impl FnMut() -> Result<String, String>,
    mut fatal: impl FnMut() -> Option<String>,
) -> Result<String, String> {
    let end = Instant::now() + deadline;
    let mut pause = Duration::from_millis(50);
    loop {
        let last = match check() {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        if let Some(why) = fatal() {
            return Err(format!("{last}: {why}"));
        }
        let now = Instant::now();
        if now >= end {
            return Err(format!("{last} (still after {deadline:?})"));
        }
        std::thread::sleep(pause.min(end - now));
        pause = (pause * 2).min(POLL_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_systemctl_listen() {
        let show = "/run/imgbridge/containerd.sock (Stream)\n/run/imgbridge/containerd.sock.ttrpc (Stream)\n/run/containerd/containerd.sock (Stream)\n";
        assert_eq!(
            listens(show),
            [
                "/run/imgbridge/containerd.sock",
                "/run/imgbridge/containerd.sock.ttrpc",
                "/run/containerd/containerd.sock"
            ]
        );
        assert_eq!(
            listens("Listen=/a (Stream)\nListen=/b (Stream)"),
            ["/a", "/b"]
        );
        assert!(listens("").is_empty());
    }

    #[test]
    fn waits_until_the_deadline() {
        let mut n = 0;
        let r = wait(
            Duration::from_secs(5),
            || {
                n += 1;
                if n < 3 {
                    Err("not yet".into())
                } else {
                    Ok("up".into())
                }
            },
            || None,
        );
        assert_eq!(r.unwrap(), "up");
        let r = wait(Duration::from_millis(120), || Err("down".into()), || None);
        assert!(r.unwrap_err().starts_with("down (still after"));
        let started = Instant::now();
        let r = wait(
            Duration::from_secs(60),
            || Err("down".into()),
            || Some("containerd.service failed".into()),
        );
        assert_eq!(r.unwrap_err(), "down: containerd.service failed");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
