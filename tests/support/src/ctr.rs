//! `ctr` against our containerds, with the snapshotter that works here.

use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::OnceLock;

use crate::flavor::flavor;
use crate::grpc::sha256_digest;
use crate::util::{logs_near, output_with_timeout, run_ok, tempdir, unique_name, TOOL_TIMEOUT};

pub(crate) fn overlay_works() -> bool {
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

pub fn ctr_command<I, S>(sock: &Path, ns: &str, args: I) -> Command
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

/// Like [`ctr`] but panics (with stdout, stderr and the logs next to `sock`)
/// unless it succeeds; returns stdout.
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
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(&sh).env("PATH", flavor().path_env());
    run_ok(cmd);
}

/// Writes `data` as a blob into `ns` with [`ctr_ingest`]; returns its digest.
pub fn ingest_bytes(sock: &Path, ns: &str, data: &[u8]) -> String {
    let digest = sha256_digest(data);
    let dir = tempdir("blob-");
    let f = dir.path().join("blob");
    fs::write(&f, data).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
    ctr_ingest(sock, ns, &digest, &f);
    digest
}
