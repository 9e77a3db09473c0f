//! imgbridge's own setup on the node: the namespaces it replicates, its
//! proxy socket, the watched directories and its state directory.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use crate::config::Config;
use crate::containerd::Containerd;
use crate::ops::doctor::report::Report;
use crate::ops::doctor::timed;

pub(in crate::ops::doctor) async fn namespaces(config: &Config, r: &mut Report) {
    let c = Containerd::new(&config.upstream);
    let list = timed(c.list_namespaces()).await;
    let present: Vec<String> = match list {
        Ok(l) => l,
        Err(e) => {
            r.warn(
                "namespaces",
                format!("could not list: {e}"),
                "check containerd's logs",
            );
            return;
        }
    };
    let rep = &config.replication;
    let missing = |want: &[String]| -> Vec<String> {
        want.iter()
            .filter(|n| !present.contains(n))
            .cloned()
            .collect()
    };
    let kinds = [
        (
            "source namespaces",
            &rep.source_namespaces,
            " (nothing was built there)",
            "point buildkit at imgbridge with [worker.containerd] namespace set to a source namespace; it is created on the first build",
        ),
        (
            "target namespaces",
            &rep.target_namespaces,
            "",
            "k8s.io appears once the CRI plugin (kubelet) uses it; imgbridge creates targets on the first replication",
        ),
    ];
    for (what, names, why, hint) in kinds {
        let m = missing(names);
        if m.is_empty() {
            r.pass(what, names.join(", "));
        } else {
            r.warn(what, format!("{} not present yet{why}", m.join(", ")), hint);
        }
    }
    crate::ops::doctor::protected::check(config, &c, r).await;
}

pub(in crate::ops::doctor) async fn proxy_socket(config: &Config, r: &mut Report) {
    let path = &config.listen;
    let what = "proxy socket";
    let m = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            r.warn(
                what,
                format!("{} does not exist: imgbridge is not running", path.display()),
                "systemctl enable --now imgbridge.socket imgbridge.service (or run imgbridge serve)",
            );
            return;
        }
        Err(e) => {
            r.fail(
                what,
                format!("{}: {e}", path.display()),
                "check the path and its directory's permissions",
            );
            return;
        }
    };
    if !m.file_type().is_socket() {
        r.fail(
            what,
            format!("{} exists but is not a socket", path.display()),
            "remove it, or choose another listen path",
        );
        return;
    }
    let mode = m.mode() & 0o777;
    let owner = format!("owner {}:{} mode {mode:04o}", m.uid(), m.gid());
    if mode & 0o006 != 0 {
        r.warn(
            what,
            format!("{} is world-accessible ({owner}): any local user can drive containerd as root", path.display()),
            "set socket_mode = \"0660\" (SocketMode=0660 in imgbridge.socket) and grant access through socket_group",
        );
    } else {
        r.pass(what, format!("{} ({owner})", path.display()));
    }
    let c = Containerd::new(path);
    match timed(c.version()).await {
        Ok(v) => r.pass(
            "proxy",
            format!("answers on {} and relays to containerd {v}", path.display()),
        ),
        Err(e) => r.fail(
            "proxy",
            format!("{} does not answer: {e}", path.display()),
            "start imgbridge (it replaces a stale socket file), or see journalctl -u imgbridge",
        ),
    }
}

pub(in crate::ops::doctor) fn watched_dirs(config: &Config, r: &mut Report) {
    for d in &config.import.dirs {
        let p = &d.path;
        let what = "watched directory";
        match std::fs::metadata(p) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => r.warn(
                what,
                format!(
                    "{} does not exist yet (it is picked up once created)",
                    p.display()
                ),
                format!("mkdir -p {}", p.display()),
            ),
            Err(e) => r.fail(
                what,
                format!("{}: {e}", p.display()),
                "fix the path's permissions",
            ),
            Ok(m) if !m.is_dir() => r.fail(
                what,
                format!("{} is not a directory", p.display()),
                "point import.dirs at a directory",
            ),
            Ok(_) => match std::fs::read_dir(p) {
                Ok(entries) => r.pass(
                    what,
                    format!(
                        "{} readable, {} entries → {}",
                        p.display(),
                        entries.count(),
                        d.namespace
                    ),
                ),
                Err(e) => r.fail(
                    what,
                    format!("{} is not readable: {e}", p.display()),
                    "let imgbridge (root) read it, e.g. chmod o+rx or fix the ACL",
                ),
            },
        }
    }
    if !config.import.dirs.is_empty() {
        state_dir(&config.import.state_file, r);
    }
}

pub(in crate::ops::doctor) fn state_dir(state_file: &Path, r: &mut Report) {
    let Some(dir) = state_file.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return;
    };
    let what = "import state";
    match nix::unistd::access(dir, nix::unistd::AccessFlags::W_OK) {
        Ok(()) => r.pass(what, format!("{} writable", dir.display())),
        Err(nix::errno::Errno::ENOENT) => r.warn(
            what,
            format!("{} does not exist", dir.display()),
            format!(
                "mkdir -p {} (the packaged unit has StateDirectory=imgbridge)",
                dir.display()
            ),
        ),
        Err(e) => r.fail(
            what,
            format!("{} is not writable: {e}", dir.display()),
            "make it writable for imgbridge (ReadWritePaths= in the unit)",
        ),
    }
}
