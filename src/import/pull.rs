//! Pull lists: `.txt` files with one image reference per line.
//!
//! Pulls go through CRI `PullImage`, never our own registry client, so
//! containerd's registry mirrors, rewrites and credentials apply exactly as
//! for kubelet (k3s learned this the hard way). An image CRI already
//! resolves is not pulled again. Failed pulls are retried with exponential
//! backoff in a task of their own, so one unreachable registry never holds
//! up other files.

use std::collections::HashSet;
use std::io::Read as _;
use std::net::{IpAddr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::containerd::Containerd;
use crate::oci::reference::{self, ReferenceError};

/// CRI always pulls into this namespace.
pub use crate::labels::CRI_NAMESPACE;
/// A pull list larger than this is not a pull list.
pub const MAX_LIST_BYTES: u64 = 1 << 20;
const BACKOFF_BASE: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(300);

/// A parsed list: normalised references in file order, and the bad lines.
#[derive(Debug, Default, PartialEq)]
pub struct PullList {
    pub refs: Vec<String>,
    pub invalid: Vec<(usize, String, ReferenceError)>,
}

/// Parses a list: blank lines and `#` comments (whole-line or after the
/// reference) are ignored; duplicates collapse. Linear: a 1 MiB list of
/// 145k references took 95 s with `Vec::contains`.
pub fn parse(text: &str) -> PullList {
    let mut out = PullList::default();
    let mut seen = HashSet::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split(" #").next().unwrap_or_default().trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match reference::normalize(line) {
            Ok(r) => {
                if seen.insert(r.clone()) {
                    out.refs.push(r);
                }
            }
            Err(e) => out.invalid.push((i + 1, line.to_string(), e)),
        }
    }
    out
}

/// Why a line is not a reference, without quoting the line: a pull list may
/// be a symlink to any file, and no byte of a file's content is logged.
pub fn invalid_reason(e: &ReferenceError) -> &'static str {
    match e {
        ReferenceError::Empty(_) => "empty",
        ReferenceError::Identifier(_) => "a 64-hex-digit image id, not a name",
        ReferenceError::Uppercase(_) => "repository name must be lowercase",
        ReferenceError::Domain(..) => "bad registry host",
        ReferenceError::Path(..) => "bad repository path component",
        ReferenceError::Tag(..) => "bad tag",
        ReferenceError::Digest(..) => "bad digest",
        ReferenceError::TooLong(_) => "name too long",
    }
}

/// Reads and parses a list file: regular files only (see
/// [`super::open::open_regular`]), capped at [`MAX_LIST_BYTES`] *read*
/// (a symlink to `/dev/zero` has size 0 and never ends).
pub fn read(path: &Path) -> std::io::Result<PullList> {
    let f = super::open::open_regular(path)?;
    let mut b = Vec::new();
    f.take(MAX_LIST_BYTES + 1).read_to_end(&mut b)?;
    if b.len() as u64 > MAX_LIST_BYTES {
        return Err(std::io::Error::other(format!(
            "pull list is over the {MAX_LIST_BYTES}-byte limit"
        )));
    }
    Ok(parse(&String::from_utf8_lossy(&b)))
}

/// Registry hosts a pull list may name (`import.pull_hosts_allow` /
/// `import.pull_hosts_deny`). containerd dials whatever host a reference
/// names, so a writable watched directory must not reach cloud metadata
/// services; private ranges stay allowed, internal registries live there.
#[derive(Clone, Debug, Default)]
pub struct HostPolicy {
    /// Hosts allowed even if refused by default.
    pub allow: Vec<String>,
    /// Hosts always refused.
    pub deny: Vec<String>,
}

/// Cloud metadata service names and addresses refused by default (beyond
/// link-local 169.254.0.0/16 and fe80::/10).
const METADATA_HOSTS: [&str; 8] = [
    "metadata",
    "metadata.google.internal",
    "metadata.goog",
    "metadata.azure.internal",
    "instance-data",
    "instance-data.ec2.internal",
    "fd00:ec2::254",
    "100.100.100.200",
];

/// The registry host of a normalised reference, lowercase, without port
/// or IPv6 brackets.
pub fn registry_host(r: &str) -> String {
    let domain = r.split('/').next().unwrap_or_default();
    let host = match domain.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or_default(),
        None => domain.split(':').next().unwrap_or_default(),
    };
    host.trim_end_matches('.').to_ascii_lowercase()
}

impl HostPolicy {
    /// `Err(why)` when `r` must not be pulled.
    pub fn check(&self, r: &str) -> Result<(), String> {
        let host = registry_host(r);
        let listed = |l: &[String]| {
            l.iter()
                .any(|h| registry_host(&format!("{}/x", h.trim())) == host)
        };
        if listed(&self.deny) {
            return Err(format!(
                "registry host {host:?} is in import.pull_hosts_deny"
            ));
        }
        if listed(&self.allow) {
            return Ok(());
        }
        let link_local = match host.parse::<IpAddr>() {
            Ok(IpAddr::V4(a)) => a.is_link_local(),
            Ok(IpAddr::V6(a)) => {
                (a.segments()[0] & 0xffc0) == 0xfe80
                    || a.to_ipv4_mapped().is_some_and(|v4| v4.is_link_local())
            }
            Err(_) => false,
        };
        let metadata = METADATA_HOSTS.iter().any(|m| {
            *m == host
                || (m.parse::<Ipv6Addr>().ok())
                    .is_some_and(|a| host.parse::<Ipv6Addr>().ok() == Some(a))
        });
        if link_local || metadata {
            return Err(format!(
                "registry host {host:?} is {} and refused by default (add it to import.pull_hosts_allow to pull from it)",
                if metadata { "a cloud metadata service" } else { "link-local" }
            ));
        }
        Ok(())
    }
}

/// How [`ensure`] got the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Got {
    AlreadyPresent,
    Pulled,
}

/// Makes `r` present through CRI; returns the target digest of its record
/// in `k8s.io` (empty if CRI resolved it under another record).
pub async fn ensure(c: &Containerd, r: &str) -> Result<(Got, String), crate::containerd::Error> {
    let got = if c.cri_image_id(r).await?.is_some() {
        Got::AlreadyPresent
    } else {
        c.cri_pull(r).await?;
        Got::Pulled
    };
    let target = c
        .get_image(CRI_NAMESPACE, r)
        .await?
        .and_then(|i| i.target)
        .map(|t| t.digest)
        .unwrap_or_default();
    Ok((got, target))
}

/// Delay before retry number `attempt` (0-based): 1 s, 2 s, 4 s … 5 min.
pub fn backoff(attempt: u32) -> Duration {
    const BACKOFF: Backoff = Backoff::new(BACKOFF_BASE, BACKOFF_MAX);
    BACKOFF.nth(attempt)
}

/// Reported by a list task to the importer, which owns pins and state.
#[derive(Debug)]
pub enum PullEvent {
    Done {
        path: PathBuf,
        generation: u64,
        reference: String,
        got: Got,
        target: String,
    },
    Failed {
        path: PathBuf,
        generation: u64,
        reference: String,
        error: String,
        /// `None`: given up (invalid reference, or attempts used up).
        retry_in: Option<Duration>,
        /// Attempts made so far for this reference.
        attempts: u32,
    },
}

/// A pull that can never succeed as written: retrying it only loads
/// containerd (`[fd00::1]:5000/x:y` was retried forever).
/// containerd 1.6 answers an unparsable reference with code Unknown and
/// its parser's message, so the message is the only signal there.
fn permanent(e: &crate::containerd::Error) -> bool {
    matches!(e.code(), Some(tonic::Code::InvalidArgument))
        || e.to_string().contains("invalid reference format")
}

/// Pulls `refs` until each has succeeded once, retrying failures with
/// backoff up to `max_attempts` attempts each (invalid references: one),
/// until `cancel` (the file changed or went away).
pub async fn run_list(
    c: Containerd,
    path: PathBuf,
    generation: u64,
    refs: Vec<String>,
    max_attempts: u32,
    events: mpsc::Sender<PullEvent>,
    cancel: CancellationToken,
) {
    let mut pending = refs;
    let mut attempt = 0u32;
    while !pending.is_empty() {
        let mut failed = Vec::new();
        for r in pending {
            if cancel.is_cancelled() {
                return;
            }
            let ev = tokio::select! {
                _ = cancel.cancelled() => return,
                res = ensure(&c, &r) => match res {
                    Ok((got, target)) => PullEvent::Done {
                        path: path.clone(),
                        generation,
                        reference: r,
                        got,
                        target,
                    },
                    Err(e) => {
                        let give_up = permanent(&e) || attempt + 1 >= max_attempts.max(1);
                        let ev = PullEvent::Failed {
                            path: path.clone(),
                            generation,
                            reference: r.clone(),
                            error: e.to_string(),
                            retry_in: (!give_up).then(|| backoff(attempt)),
                            attempts: attempt + 1,
                        };
                        if !give_up {
                            failed.push(r);
                        }
                        ev
                    }
                },
            };
            if events.send(ev).await.is_err() {
                return;
            }
        }
        pending = failed;
        if pending.is_empty() {
            break;
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(backoff(attempt)) => {}
        }
        attempt += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lists() {
        let l = parse(
            "# base images\n\nbusybox\n  docker.io/library/busybox:latest  \nreg:5000/x:y # pinned for CI\nBad:Ref\nfoo@sha256:abc\n",
        );
        assert_eq!(
            l.refs,
            vec!["docker.io/library/busybox:latest", "reg:5000/x:y"]
        );
        assert_eq!(l.invalid.len(), 2);
        assert_eq!(l.invalid[0].0, 6);
        assert_eq!(l.invalid[1].1, "foo@sha256:abc");
    }

    /// Duplicates go, the first of each stays, in order, over a list as
    /// long as real ones. How long that takes is measured by
    /// `examples/bench_pull_list.rs` (docs/performance.md), not asserted
    /// here: a timing assertion fails on a loaded machine.
    #[test]
    fn dedupe_keeps_the_first_of_each() {
        let n = 40_000;
        let text: String = (0..n)
            .flat_map(|i| [format!("r{i}\n"), format!("r{}\n", i / 2)])
            .collect();
        let refs = parse(&text).refs;
        assert_eq!(refs.len(), n);
        assert!(refs.windows(2).all(|w| w[0] != w[1]));
        assert_eq!(
            refs[..3],
            [
                "docker.io/library/r0:latest",
                "docker.io/library/r1:latest",
                "docker.io/library/r2:latest"
            ]
        );
    }

    #[test]
    fn host_policy() {
        let p = HostPolicy::default();
        for r in [
            "169.254.169.254/x/y:1",
            "metadata.google.internal/x:1",
            "METADATA/x:1",
            "[fe80::1]:5000/x:1",
            "[fd00:ec2::254]/x:1",
            "100.100.100.200/x:1",
        ] {
            let e = p.check(r).unwrap_err();
            assert!(e.contains("refused by default"), "{r}: {e}");
        }
        for r in [
            "10.1.2.3:5000/x:1",
            "192.168.1.1/x:1",
            "[fd00::1]:5000/x:1",
            "docker.io/library/busybox:latest",
            "127.0.0.1:5000/x:1",
        ] {
            assert_eq!(p.check(r), Ok(()), "{r}");
        }
        let p = HostPolicy {
            allow: vec!["169.254.169.254".into(), "metadata".into()],
            deny: vec!["reg.internal:5000".into(), "10.1.2.3".into()],
        };
        assert_eq!(p.check("169.254.169.254/x:1"), Ok(()));
        assert_eq!(p.check("metadata/x:1"), Ok(()));
        assert!(p.check("metadata.google.internal/x:1").is_err());
        assert!(p.check("reg.internal/x:1").unwrap_err().contains("deny"));
        assert!(p.check("10.1.2.3:5000/x:1").unwrap_err().contains("deny"));
    }

    #[test]
    fn reads_only_what_it_may() {
        let d = tempfile::tempdir().unwrap();
        let zero = d.path().join("z.txt");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        assert!(super::super::open::is_not_regular(
            &read(&zero).unwrap_err()
        ));
        let big = d.path().join("big.txt");
        std::fs::write(&big, vec![b'\n'; (MAX_LIST_BYTES + 1) as usize]).unwrap();
        assert!(read(&big).is_err());
    }

    #[test]
    fn backoff_grows_and_caps() {
        assert_eq!(backoff(0), Duration::from_secs(1));
        assert_eq!(backoff(3), Duration::from_secs(8));
        assert_eq!(backoff(40), BACKOFF_MAX);
    }
}
