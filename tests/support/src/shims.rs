//! Cleanup of what our containerds leave behind: mounts, shims, container
//! cgroups and runc state.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::util::poll;

pub(crate) fn unescape_mountinfo(s: &str) -> PathBuf {
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

pub(crate) fn mounts_under(root: &Path) -> Vec<PathBuf> {
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
pub(crate) fn unmount_under(root: &Path) -> usize {
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

pub(crate) fn proc_pids() -> Vec<i32> {
    fs::read_dir("/proc")
        .map(|rd| {
            rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

pub(crate) fn ppid_of(pid: i32) -> Option<i32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ..."; comm may contain spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

pub(crate) struct Shim {
    pid: i32,
    namespace: String,
    id: String,
}

/// containerd shims started for the containerd listening on `address`
/// (matched by `-address <address>` on the shim command line).
pub(crate) fn shims_of(address: &Path) -> Vec<Shim> {
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

pub(crate) fn is_container_id(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Cgroup directories of `pid` whose leaf is a container id (runc creates
/// them per container; they outlive a SIGKILLed shim).
pub(crate) fn container_cgroup_dirs(pid: i32) -> Vec<PathBuf> {
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
pub(crate) fn kill_shims(address: &Path) {
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
