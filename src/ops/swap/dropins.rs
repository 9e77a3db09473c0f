//! The swap's three systemd drop-ins. Each starts with [`FIRST_LINE`], so
//! rollback (and a later apply) can tell its own files from an admin's.
//!
//! - `imgbridge.socket`: the default socket and its `.ttrpc` are *added* to
//!   the package's own (no `ListenStream=` reset: builders keep
//!   `/run/imgbridge/containerd.sock`), bound before containerd and kubelet
//!   start.
//! - `imgbridge.service`: needs containerd (its upstream, moved to the real
//!   socket through `IMGBRIDGE_UPSTREAM`) and may write in `/run/containerd`.
//! - `kubelet.service`: kubelet's runtime endpoint is now imgbridge's socket,
//!   so kubelet waits for it.

use std::collections::BTreeSet;
use std::io;
use std::path::Path;

/// First line of every drop-in the swap writes.
pub(super) const FIRST_LINE: &str =
    "# Written by `imgbridge swap`; `imgbridge swap rollback` removes it.";

/// The drop-ins, as host paths.
pub(super) const SOCKET: &str = "/etc/systemd/system/imgbridge.socket.d/50-swap.conf";
pub(super) const SERVICE: &str = "/etc/systemd/system/imgbridge.service.d/50-swap.conf";
pub(super) const KUBELET: &str = "/etc/systemd/system/kubelet.service.d/50-imgbridge.conf";

/// The files of the manual procedure (docs/socket-swap.md before `imgbridge
/// swap`): with them in place the two would fight over the socket list.
pub(super) const MANUAL: [&str; 3] = [
    "/etc/systemd/system/imgbridge.socket.d/swap.conf",
    "/etc/systemd/system/imgbridge.service.d/swap.conf",
    "/etc/systemd/system/kubelet.service.d/imgbridge.conf",
];

/// One drop-in: where it goes (host path) and what it says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct DropIn {
    pub path: &'static str,
    pub text: String,
}

/// What is at a drop-in's path now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Found {
    Absent,
    /// Ours, with the wanted content.
    Current,
    /// Ours, with other content (other sockets, an older imgbridge).
    Outdated,
    /// Not written by `imgbridge swap`.
    Foreign,
}

/// The three drop-ins for containerd moved to `real_socket` and imgbridge
/// on `default_socket`.
pub(super) fn all(default_socket: &Path, real_socket: &Path) -> [DropIn; 3] {
    let default = default_socket.display();
    let real = real_socket.display();
    let dirs: BTreeSet<String> = [default_socket, real_socket]
        .iter()
        .filter_map(|p| p.parent())
        .map(|d| format!("ReadWritePaths=-{}\n", d.display()))
        .collect();
    let rw: String = dirs.into_iter().collect();
    [
        DropIn {
            path: SOCKET,
            text: format!(
                "{FIRST_LINE}\n\
                 # Socket swap: imgbridge takes containerd's default socket, containerd\n\
                 # listens on {real} (docs/socket-swap.md).\n\
                 [Unit]\n\
                 # Bound before containerd and kubelet start, and across their restarts.\n\
                 Before=containerd.service kubelet.service\n\
                 \n\
                 [Socket]\n\
                 # Added to the package's sockets, not replacing them: builders keep\n\
                 # /run/imgbridge/containerd.sock.\n\
                 ListenStream={default}\n\
                 ListenStream={default}.ttrpc\n\
                 # As containerd creates its directory; it leaves an existing one as is.\n\
                 DirectoryMode=0711\n"
            ),
        },
        DropIn {
            path: SERVICE,
            text: format!(
                "{FIRST_LINE}\n\
                 # Socket swap: imgbridge's upstream is containerd's moved socket.\n\
                 [Unit]\n\
                 Requires=containerd.service\n\
                 After=containerd.service\n\
                 \n\
                 [Service]\n\
                 {rw}\
                 Environment=IMGBRIDGE_UPSTREAM={real}\n"
            ),
        },
        DropIn {
            path: KUBELET,
            text: format!(
                "{FIRST_LINE}\n\
                 # Socket swap: kubelet's runtime endpoint ({default}) is imgbridge's\n\
                 # socket; have it bound before kubelet starts.\n\
                 [Unit]\n\
                 Wants=imgbridge.socket\n\
                 After=imgbridge.socket\n"
            ),
        },
    ]
}

/// Whether `text` is a drop-in the swap wrote.
pub(super) fn is_ours(text: &str) -> bool {
    text.lines().next() == Some(FIRST_LINE)
}

/// What is at `file` (the drop-in's path under the root) against `want`.
pub(super) fn inspect(file: &Path, want: &str) -> io::Result<Found> {
    match std::fs::read_to_string(file) {
        Ok(t) if t == want => Ok(Found::Current),
        Ok(t) if is_ours(&t) => Ok(Found::Outdated),
        Ok(_) => Ok(Found::Foreign),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Found::Absent),
        // Not UTF-8: not ours.
        Err(e) if e.kind() == io::ErrorKind::InvalidData => Ok(Found::Foreign),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dropins() -> [DropIn; 3] {
        all(
            Path::new("/run/containerd/containerd.sock"),
            Path::new("/run/containerd/containerd-real.sock"),
        )
    }

    #[test]
    fn socket_drop_in_adds_the_default_path() {
        let [socket, _, _] = dropins();
        assert_eq!(socket.path, SOCKET);
        assert_eq!(
            socket.text,
            "# Written by `imgbridge swap`; `imgbridge swap rollback` removes it.
# Socket swap: imgbridge takes containerd's default socket, containerd
# listens on /run/containerd/containerd-real.sock (docs/socket-swap.md).
[Unit]
# Bound before containerd and kubelet start, and across their restarts.
Before=containerd.service kubelet.service

[Socket]
# Added to the package's sockets, not replacing them: builders keep
# /run/imgbridge/containerd.sock.
ListenStream=/run/containerd/containerd.sock
ListenStream=/run/containerd/containerd.sock.ttrpc
# As containerd creates its directory; it leaves an existing one as is.
DirectoryMode=0711
"
        );
        // Never a reset of the list: the package's socket stays live.
        assert!(!socket.text.lines().any(|l| l.trim() == "ListenStream="));
    }

    #[test]
    fn service_and_kubelet_drop_ins() {
        let [_, service, kubelet] = dropins();
        assert_eq!(service.path, SERVICE);
        assert_eq!(
            service.text,
            "# Written by `imgbridge swap`; `imgbridge swap rollback` removes it.
# Socket swap: imgbridge's upstream is containerd's moved socket.
[Unit]
Requires=containerd.service
After=containerd.service

[Service]
ReadWritePaths=-/run/containerd
Environment=IMGBRIDGE_UPSTREAM=/run/containerd/containerd-real.sock
"
        );
        assert_eq!(kubelet.path, KUBELET);
        assert_eq!(
            kubelet.text,
            "# Written by `imgbridge swap`; `imgbridge swap rollback` removes it.
# Socket swap: kubelet's runtime endpoint (/run/containerd/containerd.sock) is imgbridge's
# socket; have it bound before kubelet starts.
[Unit]
Wants=imgbridge.socket
After=imgbridge.socket
"
        );
        // Sockets in two directories: both writable.
        let [_, service, _] = all(
            Path::new("/run/containerd/containerd.sock"),
            Path::new("/run/real/c.sock"),
        );
        assert!(service
            .text
            .contains("ReadWritePaths=-/run/containerd\nReadWritePaths=-/run/real\n"));
    }

    #[test]
    fn tells_its_own_files_from_others() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("50-swap.conf");
        let want = &dropins()[0].text;
        assert_eq!(inspect(&f, want).unwrap(), Found::Absent);
        std::fs::write(&f, want).unwrap();
        assert_eq!(inspect(&f, want).unwrap(), Found::Current);
        std::fs::write(&f, format!("{FIRST_LINE}\n[Socket]\n")).unwrap();
        assert_eq!(inspect(&f, want).unwrap(), Found::Outdated);
        std::fs::write(&f, "[Socket]\nListenStream=/x\n").unwrap();
        assert_eq!(inspect(&f, want).unwrap(), Found::Foreign);
    }
}
