//! Pull lists: `.txt` files with one image reference per line.
//!
//! Pulls go through CRI `PullImage`, never our own registry client, so
//! containerd's registry mirrors, rewrites and credentials apply exactly as
//! for kubelet (k3s learned this the hard way). An image CRI already
//! resolves is not pulled again. Failed pulls are retried with exponential
//! backoff in a task of their own, so one unreachable registry never holds
//! up other files.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::containerd::Containerd;
use crate::reference::{self, ReferenceError};

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
/// reference) are ignored; duplicates collapse.
pub fn parse(text: &str) -> PullList {
    let mut out = PullList::default();
    for (i, line) in text.lines().enumerate() {
        let line = line.split(" #").next().unwrap_or_default().trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match reference::normalize(line) {
            Ok(r) if !out.refs.contains(&r) => out.refs.push(r),
            Ok(_) => {}
            Err(e) => out.invalid.push((i + 1, line.to_string(), e)),
        }
    }
    out
}

/// Reads and parses a list file (capped at [`MAX_LIST_BYTES`]).
pub fn read(path: &Path) -> std::io::Result<PullList> {
    let len = std::fs::metadata(path)?.len();
    if len > MAX_LIST_BYTES {
        return Err(std::io::Error::other(format!(
            "pull list is {len} bytes, over the {MAX_LIST_BYTES}-byte limit"
        )));
    }
    let b = std::fs::read(path)?;
    Ok(parse(&String::from_utf8_lossy(&b)))
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
    BACKOFF_BASE
        .saturating_mul(1u32.checked_shl(attempt.min(16)).unwrap_or(u32::MAX))
        .min(BACKOFF_MAX)
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
        retry_in: Duration,
    },
}

/// Pulls `refs` until each has succeeded once, retrying failures with
/// backoff, until `cancel` (the file changed or went away).
pub async fn run_list(
    c: Containerd,
    path: PathBuf,
    generation: u64,
    refs: Vec<String>,
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
                        let ev = PullEvent::Failed {
                            path: path.clone(),
                            generation,
                            reference: r.clone(),
                            error: e.to_string(),
                            retry_in: backoff(attempt),
                        };
                        failed.push(r);
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

    #[test]
    fn backoff_grows_and_caps() {
        assert_eq!(backoff(0), Duration::from_secs(1));
        assert_eq!(backoff(3), Duration::from_secs(8));
        assert_eq!(backoff(40), BACKOFF_MAX);
    }
}
