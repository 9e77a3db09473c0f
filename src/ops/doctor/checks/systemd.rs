//! Who owns imgbridge's sockets: systemd (`imgbridge.socket`, socket
//! activation) or imgbridge itself. Under socket activation `listen`,
//! `socket_mode` and `socket_group` are systemd's to set, so a value that
//! differs is flagged rather than silently ignored; and the service's
//! `IMGBRIDGE_UPSTREAM` (set by the socket swap's drop-in) is the upstream
//! the other checks must use, not the file's.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::config::Config;
use crate::ops::doctor::report::Report;

/// What `systemctl show` says about the two units.
#[derive(Debug, Default, PartialEq, Eq)]
pub(in crate::ops::doctor) struct Units {
    /// `LoadState` of imgbridge.socket (`loaded`, `not-found`, …).
    pub load: String,
    pub socket_active: String,
    pub service_active: String,
    /// Paths of its `ListenStream=`s.
    pub listen: Vec<PathBuf>,
    /// `SocketMode=` (octal).
    pub mode: Option<u32>,
    /// `SocketGroup=` (empty = root).
    pub group: String,
    /// The service's `IMGBRIDGE_UPSTREAM`, if its environment sets one.
    pub upstream: Option<PathBuf>,
}

impl Units {
    /// Reads systemd's view, `None` when systemd is not PID 1 or
    /// `systemctl` cannot answer.
    fn read() -> Option<Units> {
        if !Path::new("/run/systemd/system").is_dir() {
            return None;
        }
        let out = Command::new("systemctl")
            .args(["show", "imgbridge.socket", "imgbridge.service"])
            .args([
                "-p",
                "Id,LoadState,ActiveState,Listen,SocketMode,SocketGroup,Environment",
            ])
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| Units::parse(&String::from_utf8_lossy(&out.stdout)))
    }

    /// Parses `systemctl show` output for both units (blocks separated by
    /// an empty line, each starting with `Id=`).
    fn parse(s: &str) -> Units {
        let mut u = Units::default();
        let mut socket = false;
        for line in s.lines() {
            let Some((k, v)) = line.split_once('=') else {
                continue;
            };
            match k {
                "Id" => socket = v == "imgbridge.socket",
                "LoadState" if socket => u.load = v.into(),
                "ActiveState" if socket => u.socket_active = v.into(),
                "ActiveState" => u.service_active = v.into(),
                // "/run/imgbridge/containerd.sock (Stream)"
                "Listen" if socket => {
                    if let Some(p) = v.strip_suffix(" (Stream)") {
                        u.listen.push(p.into());
                    }
                }
                "SocketMode" if socket => u.mode = u32::from_str_radix(v, 8).ok(),
                "SocketGroup" if socket => u.group = v.into(),
                "Environment" if !socket => {
                    u.upstream = v
                        .split_whitespace()
                        .find_map(|kv| kv.strip_prefix("IMGBRIDGE_UPSTREAM="))
                        .map(PathBuf::from)
                }
                _ => {}
            }
        }
        u
    }
}

/// Reports who owns the sockets and flags settings socket activation
/// ignores. Returns the upstream the running service uses when its unit
/// sets one (the socket swap) and doctor's own environment does not.
pub(in crate::ops::doctor) fn sockets(config: &Config, r: &mut Report) -> Option<PathBuf> {
    let what = "socket activation";
    let Some(u) = Units::read().filter(|u| u.load == "loaded") else {
        r.pass(
            what,
            "no imgbridge.socket unit loaded: imgbridge binds its own socket (listen, socket_mode, socket_group apply)",
        );
        return None;
    };
    check(config, &u, r);
    u.upstream
        .filter(|up| std::env::var_os("IMGBRIDGE_UPSTREAM").is_none() && *up != config.upstream)
}

fn check(config: &Config, u: &Units, r: &mut Report) {
    let what = "socket activation";
    let paths: Vec<String> = u.listen.iter().map(|p| p.display().to_string()).collect();
    r.pass(
        what,
        format!(
            "systemd owns the sockets (imgbridge.socket {}, imgbridge.service {}): {}",
            u.socket_active,
            u.service_active,
            paths.join(", ")
        ),
    );
    if !u.listen.contains(&config.listen) {
        r.warn(
            "listen",
            format!(
                "listen = {} is not applied under socket activation; systemd's sockets are {}",
                config.listen.display(),
                paths.join(", ")
            ),
            "set ListenStream= in a drop-in (systemctl edit imgbridge.socket), or listen to one of those paths",
        );
    }
    let want_mode = config.socket_mode().ok();
    if u.mode.is_some() && want_mode.is_some() && u.mode != want_mode {
        r.warn(
            "socket_mode",
            format!(
                "socket_mode = \"{}\" is not applied under socket activation: imgbridge.socket has SocketMode={:04o}",
                config.socket_mode,
                u.mode.unwrap_or_default()
            ),
            "set SocketMode= in a drop-in (systemctl edit imgbridge.socket)",
        );
    }
    // Compared as gids, the way both sides resolve names (/etc/group):
    // "", "root" and "0" are one group.
    let group = config.socket_group.trim();
    let unit_group = u.group.trim();
    let gid = |g: &str| match g {
        "" => Some(0),
        g => g
            .parse()
            .ok()
            .or_else(|| crate::etc_group::gid_of(g).ok().flatten()),
    };
    if gid(group) != gid(unit_group) {
        r.warn(
            "socket_group",
            format!(
                "socket_group = \"{group}\" is not applied under socket activation: imgbridge.socket has SocketGroup={}",
                if unit_group.is_empty() { "root" } else { unit_group }
            ),
            "set SocketGroup= in a drop-in (systemctl edit imgbridge.socket)",
        );
    }
    if let Some(up) = &u.upstream {
        r.pass(
            "upstream (service)",
            format!(
                "imgbridge.service sets IMGBRIDGE_UPSTREAM={} (the drop-in socket swap); checked below",
                up.display()
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHOW: &str = "Id=imgbridge.socket\nLoadState=loaded\nActiveState=active\n\
Listen=/run/imgbridge/containerd.sock (Stream)\nListen=/run/imgbridge/containerd.sock.ttrpc (Stream)\n\
Listen=/run/containerd/containerd.sock (Stream)\nSocketMode=0660\nSocketGroup=root\nEnvironment=\n\n\
Id=imgbridge.service\nLoadState=loaded\nActiveState=active\nListen=\nSocketMode=\nSocketGroup=\n\
Environment=RUST_LOG=info IMGBRIDGE_UPSTREAM=/run/containerd/containerd-real.sock\n";

    #[test]
    fn reads_both_units() {
        let u = Units::parse(SHOW);
        assert_eq!(u.load, "loaded");
        assert_eq!(
            (u.socket_active.as_str(), u.service_active.as_str()),
            ("active", "active")
        );
        assert_eq!(u.listen.len(), 3);
        assert_eq!(u.mode, Some(0o660));
        assert_eq!(u.group, "root");
        assert_eq!(
            u.upstream.as_deref(),
            Some(Path::new("/run/containerd/containerd-real.sock"))
        );
    }

    #[test]
    fn flags_what_socket_activation_ignores() {
        let u = Units::parse(SHOW);
        let mut r = Report::default();
        check(&Config::default(), &u, &mut r);
        let s = r.to_string();
        assert!(!s.contains("! "), "defaults match the unit: {s}");
        let c = Config {
            listen: "/run/elsewhere.sock".into(),
            socket_mode: "0600".into(),
            socket_group: "adm".into(),
            ..Config::default()
        };
        let mut r = Report::default();
        check(&c, &u, &mut r);
        let s = r.to_string();
        for w in ["! listen:", "! socket_mode:", "! socket_group:"] {
            assert!(s.contains(w), "{w} in {s}");
        }
    }
}
