//! Scheduling: the importer's loop, watcher signals, rescans and the
//! debounce table decide *when* a path is looked at; [`super::files`]
//! decides what happens to it.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::state::{FileKind, FileState, Stamp, State};
use super::watch::{DirWatcher, Signal};
use super::{
    esc, supported, Count, ImportObserver, Importer, Pending, Strays, MAX_DIR_DEPTH, RESCAN_EVERY,
    STRAYS_AFTER_START,
};
use crate::config::{Import, ImportDir};
use crate::containerd::Containerd;

impl Importer {
    pub fn new(c: Containerd, cfg: Import, observers: Vec<Arc<dyn ImportObserver>>) -> Importer {
        let state = State::load(&cfg.state_file);
        let (pull_tx, pull_rx) = mpsc::channel(256);
        Importer {
            c,
            cfg,
            observers,
            state,
            state_dirty: false,
            pending: HashMap::new(),
            lists: HashMap::new(),
            generation: 0,
            pull_tx,
            pull_rx,
            warned_list_ns: HashSet::new(),
            refused: HashMap::new(),
            strays: Strays::Due {
                at: Instant::now() + STRAYS_AFTER_START,
                attempt: 0,
            },
        }
    }

    pub(super) fn count(&self, what: Count, n: u64) {
        for o in &self.observers {
            o.counted(what, n);
        }
    }

    pub(super) fn file_failed(&self, path: &Path, context: &str, error: &dyn std::fmt::Display) {
        for o in &self.observers {
            o.file_failed(path, context, error);
        }
    }

    pub(super) fn file_ok(&self, path: &Path, context: &str) {
        for o in &self.observers {
            o.file_ok(path, context);
        }
    }

    pub(super) fn dirs(&self) -> Vec<PathBuf> {
        self.cfg.dirs.iter().map(|d| d.path.clone()).collect()
    }

    pub(super) fn dir(&self, root: usize) -> &ImportDir {
        &self.cfg.dirs[root]
    }

    pub(super) fn root_of(&self, path: &Path) -> Option<usize> {
        self.cfg.dirs.iter().position(|d| path.starts_with(&d.path))
    }

    pub async fn run(&mut self, shutdown: CancellationToken) {
        let dirs = self.dirs();
        let (mut watcher, mut events) = match DirWatcher::new(&dirs) {
            Ok((w, rx)) => (Some(w), Some(rx)),
            Err(e) => {
                tracing::error!(error = %esc(&e), "cannot start the file watcher; relying on periodic rescans");
                (None, None)
            }
        };
        self.startup().await;
        self.rescan_all(watcher.as_mut(), true);
        self.save_state();
        let mut tick = tokio::time::interval(RESCAN_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            let due = self
                .pending
                .values()
                .map(|p| p.due)
                .chain(self.strays.due())
                .min()
                .unwrap_or_else(|| Instant::now() + RESCAN_EVERY);
            tokio::select! {
                _ = shutdown.cancelled() => break,
                ev = recv(&mut events) => {
                    let mut batch = vec![ev];
                    if let Some(rx) = &mut events {
                        while let Ok(e) = rx.try_recv() {
                            batch.push(e);
                        }
                    }
                    for ev in batch {
                        self.on_event(watcher.as_mut(), ev);
                    }
                }
                Some(ev) = self.pull_rx.recv() => self.on_pull(ev).await,
                _ = tick.tick() => self.rescan_all(watcher.as_mut(), false),
                _ = tokio::time::sleep_until(due.into()) => self.process_due(&shutdown).await,
            }
            if watcher.as_ref().is_some_and(|w| w.take_overflow()) {
                tracing::warn!("file events were lost; rescanning");
                self.rescan_all(watcher.as_mut(), false);
            }
            self.save_state();
        }
        for (_, t) in self.lists.drain() {
            t.cancel.cancel();
        }
        self.save_state();
    }

    /// Checks recorded images still exist as recorded; files whose images
    /// vanished (kubelet GC, `ctr rm`) are imported again even if unchanged.
    pub(super) async fn startup(&mut self) {
        let files = self.state.entries();
        for (path, f) in files {
            let Some(root) = self.root_of(&path) else {
                continue;
            };
            let Ok(m) = std::fs::metadata(&path) else {
                continue; // the rescan notices it is gone
            };
            if Stamp::of(&m) != f.stamp() {
                continue; // the rescan notices it changed
            }
            let mut missing = Vec::new();
            for (name, digest) in &f.images {
                match self.c.get_image(&f.namespace, name).await {
                    Ok(Some(img))
                        if img
                            .target
                            .as_ref()
                            .is_some_and(|t| &t.digest == digest || digest.is_empty()) => {}
                    Ok(_) => missing.push(name.clone()),
                    Err(e) => {
                        tracing::warn!(error = %esc(&e), "cannot check recorded images; will import again");
                        missing.push(name.clone());
                    }
                }
            }
            if f.kind == FileKind::Archive && missing.is_empty() {
                self.count(Count::Skipped, 1);
            }
            if f.kind == FileKind::List || !missing.is_empty() {
                if !missing.is_empty() {
                    tracing::info!(file = %esc(path.display()), images = %esc(format_args!("{:?}", missing)), "recorded images are gone or changed; importing again");
                }
                self.pend(root, path, Some(Stamp::of(&m)), true, Duration::ZERO);
            }
        }
    }

    pub(super) fn pend(
        &mut self,
        root: usize,
        path: PathBuf,
        stamp: Option<Stamp>,
        force: bool,
        delay: Duration,
    ) {
        let due = Instant::now() + delay;
        match self.pending.get_mut(&path) {
            Some(p) => {
                p.due = due;
                p.stamp = stamp;
                p.force |= force;
            }
            None => {
                self.pending.insert(
                    path,
                    Pending {
                        root,
                        due,
                        stamp,
                        force,
                        attempt: 0,
                    },
                );
            }
        }
    }

    pub(super) fn on_event(
        &mut self,
        watcher: Option<&mut DirWatcher>,
        ev: notify::Result<notify::Event>,
    ) {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                tracing::warn!(error = %esc(&e), "file watcher error; rescanning");
                self.rescan_all(watcher, false);
                return;
            }
        };
        let Some(w) = watcher else { return };
        for s in w.classify(&ev) {
            match s {
                Signal::Rescan => self.rescan_all(Some(w), false),
                Signal::Rearm(i) => {
                    w.arm(i, true);
                    let dir = self.dir(i).path.clone();
                    self.rescan(i, &dir);
                }
                Signal::DirCreated(i, p) => self.rescan(i, &p),
                Signal::Changed(i, p) => {
                    let meta = std::fs::metadata(&p).ok();
                    let dir = meta.as_ref().is_some_and(|m| m.is_dir());
                    // Temp files and other names we never import: ignore,
                    // unless something we recorded lived there.
                    if supported(&p).is_none() && !dir && self.state.under(&p).is_empty() {
                        continue;
                    }
                    let stamp = meta.map(|m| Stamp::of(&m));
                    let debounce = self.cfg.debounce;
                    self.pend(i, p, stamp, false, debounce);
                }
            }
        }
    }

    pub(super) fn rescan_all(&mut self, mut watcher: Option<&mut DirWatcher>, first: bool) {
        for i in 0..self.cfg.dirs.len() {
            if let Some(w) = watcher.as_deref_mut() {
                w.arm(i, first);
            }
            let dir = self.dir(i).path.clone();
            self.rescan(i, &dir);
        }
        self.count(Count::Scans, 1);
    }

    /// Stat-only walk of `dir`: new or changed files and vanished entries
    /// get a debounced look.
    pub(super) fn rescan(&mut self, root: usize, dir: &Path) {
        let mut seen = HashSet::new();
        let mut visited = HashSet::new();
        let mut stack = vec![(dir.to_path_buf(), 0usize)];
        while let Some((d, depth)) = stack.pop() {
            // Symlinked directories are followed, but each only once.
            let id = std::fs::metadata(&d).map(|m| (m.dev(), m.ino()));
            if id.is_ok_and(|id| !visited.insert(id)) {
                continue;
            }
            let Ok(rd) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in rd.flatten() {
                let p = e.path();
                let Ok(m) = std::fs::metadata(&p) else {
                    continue;
                };
                if m.is_dir() {
                    let hidden = p
                        .file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with('.'));
                    if depth < MAX_DIR_DEPTH && !hidden {
                        stack.push((p, depth + 1));
                    }
                    continue;
                }
                if supported(&p).is_none() {
                    continue;
                }
                if !m.is_file() {
                    if self.refused.get(&p) != Some(&Stamp::of(&m))
                        && !self.pending.contains_key(&p)
                    {
                        let debounce = self.cfg.debounce;
                        self.pend(root, p, Some(Stamp::of(&m)), false, debounce);
                    }
                    continue;
                }
                seen.insert(p.clone());
                let stamp = Stamp::of(&m);
                let unchanged = self.state.files.get(&p).is_some_and(|f| f.stamp() == stamp);
                if !unchanged && !self.pending.contains_key(&p) {
                    let debounce = self.cfg.debounce;
                    self.pend(root, p, Some(stamp), false, debounce);
                }
            }
        }
        for p in self.state.under(dir) {
            if !seen.contains(&p) && !self.pending.contains_key(&p) {
                let debounce = self.cfg.debounce;
                self.pend(root, p, None, false, debounce);
            }
        }
    }

    pub(super) async fn process_due(&mut self, shutdown: &CancellationToken) {
        let now = Instant::now();
        if let Strays::Due { at, attempt } = self.strays {
            if at <= now {
                self.strays = Strays::Clear;
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = self.sweep_strays(attempt) => {}
                }
            }
        }
        let mut due: Vec<PathBuf> = self
            .pending
            .iter()
            .filter(|(_, p)| p.due <= now)
            .map(|(k, _)| k.clone())
            .collect();
        due.sort();
        for path in due {
            if shutdown.is_cancelled() {
                return;
            }
            let Some(p) = self.pending.remove(&path) else {
                continue;
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.handle(path, p) => {}
            }
            self.save_state();
        }
    }

    /// A debounced path is due: it is gone, a directory, or a file that is
    /// either still changing or ready.
    pub(super) async fn handle(&mut self, path: PathBuf, p: Pending) {
        let m = match std::fs::metadata(&path) {
            Ok(m) => m,
            Err(_) => {
                self.refused.remove(&path);
                return self.removed(&path, p).await;
            }
        };
        if m.is_dir() {
            // Whatever was recorded as a file here is gone.
            if self.state.files.contains_key(&path) {
                self.removed(&path, p).await;
            }
            self.rescan(p.root, &path);
            return;
        }
        let stamp = Stamp::of(&m);
        if !m.is_file() {
            // FIFOs, sockets, devices (or symlinks to them): never opened
            // here; the open itself re-checks the descriptor.
            if supported(&path).is_some() {
                let e = std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    super::open::NotRegular(super::open::describe(m.file_type())),
                );
                self.refuse(&path, stamp, &e);
            }
            return;
        }
        self.refused.remove(&path);
        if p.stamp != Some(stamp) {
            // Still being written: wait until it is quiet for a full period.
            let debounce = self.cfg.debounce;
            self.pending.insert(
                path,
                Pending {
                    due: Instant::now() + debounce,
                    stamp: Some(stamp),
                    ..p
                },
            );
            return;
        }
        let Some(kind) = supported(&path) else { return };
        match kind {
            FileKind::Archive => self.import_archive(path, stamp, p).await,
            FileKind::List => self.import_list(path, stamp, p).await,
        }
    }

    /// `path` is not a regular file: one WARN per version of it (its
    /// stamp), never read, looked at again only when it changes.
    pub(super) fn refuse(&mut self, path: &Path, stamp: Stamp, e: &std::io::Error) {
        if self.refused.insert(path.to_path_buf(), stamp) == Some(stamp) {
            return;
        }
        tracing::warn!(file = %esc(path.display()), error = %esc(e), "refused: not a regular file; not read until it changes");
        self.count(Count::Failed, 1);
        self.file_failed(path, "", e);
    }

    /// Records what is known of `path` now; the state file is written later.
    pub(super) fn record(&mut self, path: PathBuf, file: FileState) {
        self.state.files.insert(path, file);
        self.state_dirty = true;
    }

    pub(super) fn save_state(&mut self) {
        if !self.state_dirty {
            return;
        }
        match self.state.save(&self.cfg.state_file) {
            Ok(()) => self.state_dirty = false,
            Err(e) => tracing::warn!(error = %esc(&e), "cannot save import state"),
        }
    }
}

async fn recv(
    rx: &mut Option<mpsc::Receiver<notify::Result<notify::Event>>>,
) -> notify::Result<notify::Event> {
    match rx {
        Some(r) => match r.recv().await {
            Some(ev) => ev,
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}
