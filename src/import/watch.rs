//! inotify watching of the import directories, robust to what users do to
//! them (what k3s's and k0s's watchers were asked to survive):
//!
//! - the directory may not exist yet: we watch its nearest existing
//!   ancestor (and that one's parent) and arm the directory when it appears;
//! - it may be deleted and recreated: a watch dies with its inode, so events
//!   on the directory itself re-arm it;
//! - it may be a symlink, swapped atomically: the parent sees the rename and
//!   we re-watch whatever it points to now (compared by device and inode);
//! - directories created inside are rescanned, because files created before
//!   notify adds the new watch produce no event.
//!
//! This module only turns notify events into [`Signal`]s; debouncing and
//! what to do with a path belong to the importer.

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind, RenameMode};
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher as _};
use tokio::sync::mpsc;

/// Events buffered between notify's thread and the importer; on overflow
/// we fall back to a full rescan, as inotify's own queue overflow does.
const QUEUE: usize = 4096;

/// What an event means for the importer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Signal {
    /// The watched directory itself (or an ancestor) changed: re-arm, rescan.
    Rearm(usize),
    /// A directory appeared inside: scan it now.
    DirCreated(usize, PathBuf),
    /// A path inside changed (file written, renamed, removed).
    Changed(usize, PathBuf),
    /// Events were lost: rescan everything.
    Rescan,
}

struct Root {
    dir: PathBuf,
    ancestors: BTreeSet<PathBuf>,
    /// (device, inode) of the directory we watch through `dir`.
    watched: Option<(u64, u64)>,
}

pub struct DirWatcher {
    inner: RecommendedWatcher,
    roots: Vec<Root>,
    overflow: Arc<AtomicBool>,
}

impl DirWatcher {
    /// Starts notify's thread; nothing is watched until [`DirWatcher::arm`].
    pub fn new(
        dirs: &[PathBuf],
    ) -> notify::Result<(DirWatcher, mpsc::Receiver<notify::Result<Event>>)> {
        let (tx, rx) = mpsc::channel(QUEUE);
        let overflow = Arc::new(AtomicBool::new(false));
        let flag = overflow.clone();
        let inner = notify::recommended_watcher(move |ev: notify::Result<Event>| {
            if tx.try_send(ev).is_err() {
                flag.store(true, Ordering::Relaxed);
            }
        })?;
        let roots = dirs
            .iter()
            .map(|d| Root {
                dir: d.clone(),
                ancestors: BTreeSet::new(),
                watched: None,
            })
            .collect();
        Ok((
            DirWatcher {
                inner,
                roots,
                overflow,
            },
            rx,
        ))
    }

    /// Whether events were dropped since the last call.
    pub fn take_overflow(&self) -> bool {
        self.overflow.swap(false, Ordering::Relaxed)
    }

    /// (Re-)establishes the watches of root `i`. `force` re-watches the
    /// directory even if it looks unchanged (its watch may have died with a
    /// deleted inode that was then reused). Returns whether the directory's
    /// watch changed, i.e. it must be rescanned.
    pub fn arm(&mut self, i: usize, force: bool) -> bool {
        let Some(root) = self.roots.get_mut(i) else {
            return false;
        };
        let dir = root.dir.clone();
        let mut desired = BTreeSet::new();
        let mut a = dir.parent();
        while let Some(p) = a {
            if p.is_dir() {
                desired.insert(p.to_path_buf());
                if let Some(pp) = p.parent().filter(|pp| pp.is_dir()) {
                    desired.insert(pp.to_path_buf());
                }
                break;
            }
            a = p.parent();
        }
        for gone in root.ancestors.difference(&desired) {
            let _ = self.inner.unwatch(gone);
        }
        let mut now = BTreeSet::new();
        for p in &desired {
            // Re-adding an existing watch is harmless and revives a dead one.
            match self.inner.watch(p, RecursiveMode::NonRecursive) {
                Ok(()) => {
                    now.insert(p.clone());
                }
                Err(e) => {
                    tracing::debug!(dir = %crate::import::esc(p.display()), error = %crate::import::esc(&e), "cannot watch ancestor")
                }
            }
        }
        root.ancestors = now;
        let target = std::fs::metadata(&dir)
            .ok()
            .filter(|m| m.is_dir())
            .map(|m| (m.dev(), m.ino()));
        if target == root.watched && !force {
            return false;
        }
        if root.watched.is_some() || force {
            let _ = self.inner.unwatch(&dir);
        }
        root.watched = None;
        if let Some(t) = target {
            match self.inner.watch(&dir, RecursiveMode::Recursive) {
                Ok(()) => {
                    root.watched = Some(t);
                    tracing::info!(dir = %crate::import::esc(dir.display()), "watching import directory");
                }
                Err(e) => {
                    tracing::warn!(dir = %crate::import::esc(dir.display()), error = %crate::import::esc(&e), "cannot watch import directory; relying on periodic rescans")
                }
            }
        } else {
            tracing::info!(dir = %crate::import::esc(dir.display()), "import directory does not exist (yet); watching for it");
        }
        true
    }

    /// Maps one notify event to signals for the roots it concerns.
    pub fn classify(&self, ev: &Event) -> Vec<Signal> {
        classify(
            &self
                .roots
                .iter()
                .map(|r| r.dir.as_path())
                .collect::<Vec<_>>(),
            ev,
        )
    }
}

/// See [`DirWatcher::classify`]; separate for unit tests.
fn classify(roots: &[&Path], ev: &Event) -> Vec<Signal> {
    if ev.need_rescan() {
        return vec![Signal::Rescan];
    }
    match ev.kind {
        // Opens and reads (ours included) change nothing; a close after
        // writing is worth a look.
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => {}
        EventKind::Access(_) => return Vec::new(),
        _ => {}
    }
    let created_dir = |p: &Path| match ev.kind {
        EventKind::Create(CreateKind::Folder) => true,
        EventKind::Modify(ModifyKind::Name(RenameMode::To | RenameMode::Both)) => p.is_dir(),
        _ => false,
    };
    let mut out = Vec::new();
    for p in &ev.paths {
        for (i, dir) in roots.iter().enumerate() {
            let s = if dir.starts_with(p) {
                Signal::Rearm(i)
            } else if p.starts_with(dir) {
                if created_dir(p) {
                    Signal::DirCreated(i, p.clone())
                } else {
                    Signal::Changed(i, p.clone())
                }
            } else {
                continue;
            };
            if !out.contains(&s) {
                out.push(s);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use notify::event::RemoveKind;

    fn ev(kind: EventKind, p: &str) -> Event {
        Event::new(kind).add_path(p.into())
    }

    #[test]
    fn classifies() {
        let roots = [Path::new("/a/images")];
        assert_eq!(
            classify(
                &roots,
                &ev(EventKind::Create(CreateKind::Folder), "/a/images")
            ),
            vec![Signal::Rearm(0)]
        );
        assert_eq!(
            classify(&roots, &ev(EventKind::Remove(RemoveKind::Folder), "/a")),
            vec![Signal::Rearm(0)]
        );
        assert_eq!(
            classify(
                &roots,
                &ev(EventKind::Create(CreateKind::Folder), "/a/images/x")
            ),
            vec![Signal::DirCreated(0, "/a/images/x".into())]
        );
        assert_eq!(
            classify(
                &roots,
                &ev(EventKind::Create(CreateKind::File), "/a/images/x.tar")
            ),
            vec![Signal::Changed(0, "/a/images/x.tar".into())]
        );
        assert!(classify(&roots, &ev(EventKind::Create(CreateKind::File), "/a/other")).is_empty());
        assert!(classify(
            &roots,
            &ev(
                EventKind::Access(AccessKind::Open(AccessMode::Any)),
                "/a/images"
            )
        )
        .is_empty());
        assert_eq!(
            classify(
                &roots,
                &ev(
                    EventKind::Access(AccessKind::Close(AccessMode::Write)),
                    "/a/images/x.tar"
                )
            ),
            vec![Signal::Changed(0, "/a/images/x.tar".into())]
        );
        let rescan = Event::new(EventKind::Other).set_flag(notify::event::Flag::Rescan);
        assert_eq!(classify(&roots, &rescan), vec![Signal::Rescan]);
    }
}
