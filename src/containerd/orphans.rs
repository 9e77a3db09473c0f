//! What a dead imgbridge left behind: its leases (upload sessions, blobs
//! waiting for their manifest, replications, imports) and the ingests
//! under them. They would expire on their own (`containerd.io/gc.expire`,
//! up to two hours for an upload), holding a half-written layer's bytes
//! meanwhile; this releases them as soon as their maker is known dead.
//!
//! Whether a maker lives is told by a lock: every imgbridge holds an
//! exclusive `flock` on `<dir>/<owner id>` while it runs ([`Presence`]),
//! and the kernel drops it when the process dies, SIGKILL included. A
//! lease whose owner's file can be locked is a dead one's; a live one's
//! (the instance before a socket handover, draining) is left alone, as is
//! one whose owner left no file here (another imgbridge with its own
//! directory, or a lease from before a reboot emptied `/run`): those
//! expire. The same sweep ends this process's own leases that it no
//! longer holds (a release that failed for good, an id lost to a cancelled
//! call): nothing of imgbridge's outlives what it knows of by more than a
//! sweep. See docs/design.md ("Leases").

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg};

use super::leases::{self, owner, LeaseInfo};
use super::{Containerd, Result};
use crate::labels::OWNER;

/// How often leftovers are looked for after the first sweep at start (an
/// instance killed while another already runs, as in an upgrade; a lease
/// of this one's own that it lost): a listing per namespace a minute.
pub const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// This process's claim to be alive: its owner id's file, locked.
pub struct Presence {
    path: PathBuf,
    _lock: Flock<File>,
}

impl Presence {
    /// Creates and locks `dir/<owner id>`. The file is locked before it
    /// gets its name (made under a temporary one, then renamed), so no
    /// sweep ever sees it unlocked while this process lives.
    pub fn claim(dir: &Path) -> io::Result<Presence> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(owner());
        let tmp = dir.join(format!(".{}.tmp", owner()));
        let f = File::create(&tmp)?;
        let lock =
            Flock::lock(f, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| io::Error::from(e))?;
        std::fs::rename(&tmp, &path)?;
        Ok(Presence { path, _lock: lock })
    }
}

impl Drop for Presence {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether the imgbridge `id` is known dead: its file in `dir` exists and
/// can be locked. The lock is returned, to hold while its leases go.
fn dead(dir: &Path, id: &str) -> Option<Flock<File>> {
    if id == owner() || id.contains(['/', '.']) || id.is_empty() {
        return None;
    }
    let f = File::open(dir.join(id)).ok()?;
    Flock::lock(f, FlockArg::LockExclusiveNonblock).ok()
}

/// What a sweep released.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Swept {
    pub leases: usize,
    pub ingests: usize,
    /// Of `leases`, this process's own that it no longer held: a release
    /// that failed for good, an id a cancelled call never got back.
    pub own: usize,
}

/// How old a lease of this process must be before a sweep ends it for not
/// being held: one made a moment ago may not be in the table yet.
pub const OWN_GRACE: Duration = Duration::from_secs(60);

/// Whether `l`, of namespace `ns`, is this process's and no longer held
/// ([`leases::holds`]), and at least `grace` old.
fn lost(ns: &str, l: &LeaseInfo, grace: Duration) -> bool {
    l.labels.get(OWNER).map(String::as_str) == Some(owner())
        && !leases::holds(ns, &l.id)
        && l.created
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age >= grace)
}

/// Releases, in every namespace, the leases of imgbridges known dead
/// ([`dead`]) and this process's own it no longer holds that are at least
/// `own_grace` old ([`OWN_GRACE`]), aborting the ingests under them first
/// (an ingest's bytes stay on disk until it is aborted or its lease's GC
/// runs).
pub async fn sweep(c: &Containerd, dir: &Path, own_grace: Duration) -> Result<Swept> {
    let mut swept = Swept::default();
    let mut done: Vec<String> = Vec::new();
    let mut kept: Vec<String> = Vec::new();
    for ns in c.list_namespaces().await? {
        for l in c.leases_labelled(&ns, OWNER).await? {
            let Some(id) = l.labels.get(OWNER) else {
                continue;
            };
            if lost(&ns, &l, own_grace) {
                swept.ingests += c.end_lease(&ns, &l.id).await?;
                swept.leases += 1;
                swept.own += 1;
                continue;
            }
            if kept.contains(id) {
                continue;
            }
            let Some(_lock) = dead(dir, id) else {
                kept.push(id.clone());
                continue;
            };
            swept.ingests += c.end_lease(&ns, &l.id).await?;
            swept.leases += 1;
            if !done.contains(id) {
                done.push(id.clone());
            }
        }
    }
    // Every namespace is clear of them: their files can go.
    for id in done {
        let _ = std::fs::remove_file(dir.join(id));
    }
    Ok(swept)
}

/// Sweeps now, then every [`SWEEP_EVERY`], until `stop`; off the data
/// path (its own task), and quiet unless it released something.
pub async fn sweep_forever(c: Containerd, dir: PathBuf, stop: tokio_util::sync::CancellationToken) {
    let mut delay = Duration::ZERO;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        match sweep(&c, &dir, OWN_GRACE).await {
            Ok(s) if s.leases > 0 => tracing::info!(
                leases = s.leases,
                own = s.own,
                ingests = s.ingests,
                "released leases nobody holds (a killed imgbridge's, or this one's whose release failed) and their unfinished ingests"
            ),
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = %e, "looking for a killed imgbridge's leases failed; trying again later")
            }
        }
        delay = SWEEP_EVERY;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_claim_is_not_dead_and_a_released_one_is() {
        let dir = std::env::temp_dir().join(format!(
            "imgbridge-orphans-{}",
            super::super::leases::unique()
        ));
        let p = Presence::claim(&dir).unwrap();
        // Our own id is never swept, nor is a live one's (locked).
        assert!(dead(&dir, owner()).is_none());
        let other = "0123456789abcdef";
        let f = File::create(dir.join(other)).unwrap();
        let held = Flock::lock(f, FlockArg::LockExclusiveNonblock).unwrap();
        assert!(dead(&dir, other).is_none());
        drop(held);
        assert!(dead(&dir, other).is_some());
        // No file: unknown, left alone; nor a path that leaves the dir.
        assert!(dead(&dir, "fedcba9876543210").is_none());
        assert!(dead(&dir, "../x").is_none());
        drop(p);
        assert!(!dir.join(owner()).exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
