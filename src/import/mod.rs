//! Directory auto-import: image archives and pull lists dropped into watched
//! directories end up, pinned, in containerd.
//!
//! - [`archive`]: the streaming archive reader (sync, containerd-free, fuzzed);
//! - [`write`]: its containerd side (Content.Write under a lease, records last);
//! - [`pull`]: `.txt` pull lists through CRI `PullImage`;
//! - [`watch`]: inotify events → signals; [`state`]: the restart-proof state
//!   file; [`pin`]: pin labels and their bookkeeping.
//!
//! [`Importer`] owns the state and runs one file at a time (archives are
//! CPU- and disk-bound; the machine is the kubelet's too). Pull lists run in
//! their own tasks so a dead registry holds up nothing.

pub mod archive;
pub mod pin;
pub mod pull;
pub mod state;
pub mod watch;
pub mod write;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::{Import, ImportDir};
use crate::containerd::Containerd;
use archive::{ArchiveError, Limits, ReadOptions};
use pull::PullEvent;
use state::{FileKind, FileState, Stamp, State};
use watch::{DirWatcher, Signal};

/// Safety net against missed inotify events: a stat-only walk this often.
pub const RESCAN_EVERY: Duration = Duration::from_secs(30);
/// Retry delay after a transient failure (containerd down), doubling.
const RETRY_BASE: Duration = Duration::from_secs(5);
const RETRY_MAX: Duration = Duration::from_secs(300);
/// Nested directory depth we follow (symlink loops end here).
const MAX_DIR_DEPTH: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error(transparent)]
    Archive(#[from] ArchiveError),
    #[error(transparent)]
    Containerd(#[from] crate::containerd::Error),
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A bug in the reader, not a hiccup: retrying the same bytes would
    /// hit it again, so the file waits until it changes.
    #[error("archive reader panicked: {0}")]
    Panic(String),
}

impl ImportError {
    /// Worth retrying unchanged: containerd or the file system hiccuped,
    /// rather than the file being bad.
    pub fn is_transient(&self) -> bool {
        match self {
            ImportError::Archive(ArchiveError::Sink { .. }) => true,
            ImportError::Archive(_) | ImportError::Panic(_) => false,
            ImportError::Containerd(_) | ImportError::Io { .. } => true,
        }
    }
}

/// Counters: an [`ImportObserver`] that only counts (the tests read it;
/// `serve` reports to `ops::Metrics` instead).
#[derive(Debug, Default)]
pub struct Stats {
    /// Archive files imported (fully or with some images failing).
    pub imported: AtomicU64,
    /// Files that could not be imported at all, plus failed images and bad list lines.
    pub failures: AtomicU64,
    /// Files found unchanged (state file) and not re-imported.
    pub skipped: AtomicU64,
    /// Image records written by archive imports.
    pub images: AtomicU64,
    /// References pulled or found present by pull lists.
    pub pulled: AtomicU64,
    pub pull_failures: AtomicU64,
    /// Images pinned (for a file) by archive imports or pull lists.
    pub pinned: AtomicU64,
    /// Images whose pin was removed or narrowed.
    pub unpinned: AtomicU64,
    /// Completed full scans (the first one ends the start-up pass).
    pub scans: AtomicU64,
}

impl ImportObserver for Stats {
    fn counted(&self, what: Count, n: u64) {
        let c = match what {
            Count::Imported => &self.imported,
            Count::Failed => &self.failures,
            Count::Skipped => &self.skipped,
            Count::Images => &self.images,
            Count::Pulled => &self.pulled,
            Count::PullFailed => &self.pull_failures,
            Count::Pinned => &self.pinned,
            Count::Unpinned => &self.unpinned,
            Count::Scans => &self.scans,
        };
        c.fetch_add(n, Ordering::SeqCst);
    }

    fn file_failed(&self, _: &Path, _: &str, _: &dyn std::fmt::Display) {}

    fn file_ok(&self, _: &Path, _: &str) {}
}

/// What [`Stats`] counts, as reported to an [`ImportObserver`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Count {
    Imported,
    Failed,
    Skipped,
    Images,
    Pulled,
    PullFailed,
    Pinned,
    Unpinned,
    Scans,
}

/// Receives what the importer does as it happens: `ops::Metrics` counts it
/// and shows each file's last error in `/status`. The importer itself knows
/// nothing of metrics.
pub trait ImportObserver: Send + Sync + 'static {
    /// `n` more of `what` (the same numbers [`Stats`] keeps).
    fn counted(&self, what: Count, n: u64);
    /// The latest attempt on `path` failed; `context` names the part (a
    /// pull-list line or reference), empty for the file as a whole.
    fn file_failed(&self, path: &Path, context: &str, error: &dyn std::fmt::Display);
    /// The part `context` of `path` went fine (empty: the whole file, or
    /// the file is gone): an error about it no longer applies.
    fn file_ok(&self, path: &Path, context: &str);
}

/// One file's result in a [`Report`].
#[derive(Debug, Clone)]
pub struct FileReport {
    pub path: PathBuf,
    pub images: Vec<String>,
    pub failures: Vec<String>,
    pub bytes: u64,
    pub duration: Duration,
}

/// Result of [`import_files_with`].
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub files: Vec<FileReport>,
}

impl Report {
    /// Every failure, as `file: cause`.
    pub fn failures(&self) -> Vec<String> {
        self.files
            .iter()
            .flat_map(|f| {
                f.failures
                    .iter()
                    .map(move |e| format!("{}: {e}", f.path.display()))
            })
            .collect()
    }
}

/// Whether a file name is something we import (dotfiles never are, so
/// `.x.tar.partial`-style temp files and our state file stay out).
pub fn supported(path: &Path) -> Option<FileKind> {
    let name = path.file_name()?.to_str()?.to_ascii_lowercase();
    if name.starts_with('.') {
        return None;
    }
    if name.ends_with(".txt") {
        return Some(FileKind::List);
    }
    [".tar", ".tar.gz", ".tgz", ".tar.zst", ".tzst"]
        .iter()
        .any(|e| name.ends_with(e))
        .then_some(FileKind::Archive)
}

/// One-shot import for `imgbridge import`: archives (any name; compression
/// from the bytes) and `.txt` pull lists, each file independent, within
/// `import.max_decompressed_bytes`.
pub async fn import_files_with(
    containerd: Containerd,
    ns: &str,
    files: &[PathBuf],
    pin: bool,
    limits: Limits,
) -> Report {
    let mut report = Report::default();
    for f in files {
        let started = Instant::now();
        let abs = std::path::absolute(f).unwrap_or_else(|_| f.clone());
        let source = pin.then(|| pin::path_hash(&abs));
        let mut r = FileReport {
            path: f.clone(),
            images: Vec::new(),
            failures: Vec::new(),
            bytes: std::fs::metadata(f).map(|m| m.len()).unwrap_or(0),
            duration: Duration::ZERO,
        };
        let is_list = supported(f) == Some(FileKind::List);
        if is_list && ns != pull::CRI_NAMESPACE {
            tracing::warn!(file = %f.display(), "pull lists are pulled through CRI, which always uses k8s.io");
        }
        if is_list {
            list_once(&containerd, f, source.as_deref(), &mut r).await;
        } else {
            let opts = ReadOptions {
                limits: limits.clone(),
                hash_input: false,
            };
            match write::import_archive(&containerd, ns, f, opts, source.as_deref()).await {
                Ok(o) => {
                    for w in &o.warnings {
                        tracing::warn!(file = %f.display(), "{w}");
                    }
                    r.images = o.images.into_iter().map(|(n, _)| n).collect();
                    r.failures = o.failures;
                }
                Err(e) => r.failures.push(e.to_string()),
            }
        }
        r.duration = started.elapsed();
        for e in &r.failures {
            tracing::error!(file = %f.display(), "{e}");
        }
        tracing::info!(
            file = %f.display(),
            size_mib = r.bytes >> 20,
            images = r.images.len(),
            failures = r.failures.len(),
            secs = format!("{:.1}", r.duration.as_secs_f64()),
            "{}", if is_list { "pull list done" } else { "archive done" }
        );
        report.files.push(r);
    }
    report
}

/// A pull list for the one-shot command: a few quick retries, then give up.
async fn list_once(c: &Containerd, path: &Path, source: Option<&str>, r: &mut FileReport) {
    let list = match pull::read(path) {
        Ok(l) => l,
        Err(e) => {
            r.failures.push(format!("reading pull list: {e}"));
            return;
        }
    };
    for (line, text, e) in &list.invalid {
        r.failures.push(format!("line {line} {text:?}: {e}"));
    }
    for reference in &list.refs {
        let mut attempt = 0;
        loop {
            match pull::ensure(c, reference).await {
                Ok(_) => {
                    if let Some(s) = source {
                        if let Err(e) = pin::pin(c, pull::CRI_NAMESPACE, reference, s).await {
                            r.failures.push(format!("pinning {reference}: {e}"));
                        }
                    }
                    r.images.push(reference.clone());
                    break;
                }
                Err(e) if attempt < 2 => {
                    tracing::warn!(file = %path.display(), image = %reference, error = %e, "pull failed; retrying");
                    tokio::time::sleep(pull::backoff(attempt)).await;
                    attempt += 1;
                }
                Err(e) => {
                    r.failures.push(format!("pulling {reference}: {e}"));
                    break;
                }
            }
        }
    }
}

/// Runs the directory importer until `shutdown` (the `serve` command),
/// reporting what it does to `observers`.
pub async fn run(
    containerd: Containerd,
    cfg: Import,
    shutdown: CancellationToken,
    observers: Vec<Arc<dyn ImportObserver>>,
) {
    if cfg.dirs.is_empty() {
        return;
    }
    Importer::new(containerd, cfg, observers)
        .run(shutdown)
        .await;
}

#[derive(Clone, Copy)]
struct Pending {
    root: usize,
    due: Instant,
    stamp: Option<Stamp>,
    /// Import even if the state says unchanged (an image vanished).
    force: bool,
    attempt: u32,
}

struct ListTask {
    generation: u64,
    cancel: CancellationToken,
}

/// The directory import service: owns the state file, the watcher, the
/// debounce table and the pull-list tasks.
pub struct Importer {
    c: Containerd,
    cfg: Import,
    observers: Vec<Arc<dyn ImportObserver>>,
    state: State,
    state_dirty: bool,
    pending: HashMap<PathBuf, Pending>,
    lists: HashMap<PathBuf, ListTask>,
    generation: u64,
    pull_tx: mpsc::Sender<PullEvent>,
    pull_rx: mpsc::Receiver<PullEvent>,
    warned_list_ns: HashSet<usize>,
}

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
        }
    }

    fn count(&self, what: Count, n: u64) {
        for o in &self.observers {
            o.counted(what, n);
        }
    }

    fn file_failed(&self, path: &Path, context: &str, error: &dyn std::fmt::Display) {
        for o in &self.observers {
            o.file_failed(path, context, error);
        }
    }

    fn file_ok(&self, path: &Path, context: &str) {
        for o in &self.observers {
            o.file_ok(path, context);
        }
    }

    fn dirs(&self) -> Vec<PathBuf> {
        self.cfg.dirs.iter().map(|d| d.path.clone()).collect()
    }

    fn dir(&self, root: usize) -> &ImportDir {
        &self.cfg.dirs[root]
    }

    fn root_of(&self, path: &Path) -> Option<usize> {
        self.cfg.dirs.iter().position(|d| path.starts_with(&d.path))
    }

    pub async fn run(&mut self, shutdown: CancellationToken) {
        let dirs = self.dirs();
        let (mut watcher, mut events) = match DirWatcher::new(&dirs) {
            Ok((w, rx)) => (Some(w), Some(rx)),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the file watcher; relying on periodic rescans");
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
    async fn startup(&mut self) {
        let files: Vec<(PathBuf, FileState)> = self
            .state
            .files
            .iter()
            .map(|(p, f)| (p.clone(), f.clone()))
            .collect();
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
                        tracing::warn!(error = %e, "cannot check recorded images; will import again");
                        missing.push(name.clone());
                    }
                }
            }
            if f.kind == FileKind::Archive && missing.is_empty() {
                self.count(Count::Skipped, 1);
            }
            if f.kind == FileKind::List || !missing.is_empty() {
                if !missing.is_empty() {
                    tracing::info!(file = %path.display(), images = ?missing, "recorded images are gone or changed; importing again");
                }
                self.pend(root, path, Some(Stamp::of(&m)), true, Duration::ZERO);
            }
        }
    }

    fn pend(
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

    fn on_event(&mut self, watcher: Option<&mut DirWatcher>, ev: notify::Result<notify::Event>) {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                tracing::warn!(error = %e, "file watcher error; rescanning");
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

    fn rescan_all(&mut self, mut watcher: Option<&mut DirWatcher>, first: bool) {
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
    fn rescan(&mut self, root: usize, dir: &Path) {
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
                if !m.is_file() || supported(&p).is_none() {
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

    async fn process_due(&mut self, shutdown: &CancellationToken) {
        let now = Instant::now();
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
    async fn handle(&mut self, path: PathBuf, p: Pending) {
        let m = match std::fs::metadata(&path) {
            Ok(m) => m,
            Err(_) => return self.removed(&path, p).await,
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

    async fn import_archive(&mut self, path: PathBuf, stamp: Stamp, p: Pending) {
        let root = p.root;
        let ns = self.dir(root).namespace.clone();
        let prev = self.state.files.get(&path).cloned();
        if !p.force {
            if let Some(prev) = &prev {
                if prev.stamp() == stamp {
                    self.count(Count::Skipped, 1);
                    return;
                }
                if prev.size == stamp.size
                    && prev.sha256.is_some()
                    && self.same_bytes(&path, prev).await
                {
                    tracing::info!(file = %path.display(), "touched but unchanged; not importing again");
                    if let Some(f) = self.state.files.get_mut(&path) {
                        f.mtime_ns = stamp.mtime_ns;
                    }
                    self.state_dirty = true;
                    self.count(Count::Skipped, 1);
                    return;
                }
            }
        }
        let hash = pin::path_hash(&path);
        let source = self.cfg.pin.then_some(hash.as_str());
        let opts = ReadOptions {
            limits: Limits {
                max_decompressed: self.cfg.max_decompressed_bytes,
                ..Limits::default()
            },
            hash_input: true,
        };
        tracing::info!(file = %path.display(), size_mib = stamp.size >> 20, namespace = %ns, "importing");
        let started = Instant::now();
        let res = write::import_archive(&self.c, &ns, &path, opts, source).await;
        let secs = format!("{:.1}", started.elapsed().as_secs_f64());
        match res {
            Ok(o) => {
                for w in &o.warnings {
                    tracing::warn!(file = %path.display(), "{w}");
                }
                for f in &o.failures {
                    tracing::error!(file = %path.display(), "{f}");
                }
                self.count(Count::Images, o.images.len() as u64);
                self.count(Count::Pinned, o.pinned);
                self.count(Count::Failed, o.failures.len() as u64);
                match o.failures.as_slice() {
                    [] => self.file_ok(&path, ""),
                    [one] => self.file_failed(&path, "", one),
                    [first, rest @ ..] => {
                        let more = format!("{first} (and {} more)", rest.len());
                        self.file_failed(&path, "", &more)
                    }
                }
                // Last: a reader that sees the file counted sees its images.
                self.count(Count::Imported, 1);
                let images: BTreeMap<String, String> = o.images.iter().cloned().collect();
                tracing::info!(
                    file = %path.display(),
                    size_mib = stamp.size >> 20,
                    images = ?images.keys().collect::<Vec<_>>(),
                    failures = o.failures.len(),
                    secs,
                    "imported"
                );
                if let Some(prev) = &prev {
                    let gone: Vec<String> = prev
                        .images
                        .keys()
                        .filter(|n| !images.contains_key(*n))
                        .cloned()
                        .collect();
                    self.unpin_names(&path, prev, &gone).await;
                }
                let error = (!o.failures.is_empty()).then(|| o.failures.join("; "));
                self.record(
                    path.clone(),
                    FileState {
                        sha256: o.raw_sha256,
                        images,
                        error,
                        ..FileState::new(FileKind::Archive, hash, ns, stamp)
                    },
                );
                // Changed while we read it: look again once it settles.
                if std::fs::metadata(&path).ok().map(|m| Stamp::of(&m)) != Some(stamp) {
                    let debounce = self.cfg.debounce;
                    self.pend(root, path, None, false, debounce);
                }
            }
            Err(e) if e.is_transient() => {
                let delay = RETRY_BASE
                    .saturating_mul(1 << p.attempt.min(6))
                    .min(RETRY_MAX);
                tracing::warn!(file = %path.display(), error = %e, retry_in = ?delay, "import failed; will retry");
                self.count(Count::Failed, 1);
                self.file_failed(&path, "", &format_args!("{e} (retrying in {delay:?})"));
                self.pending.insert(
                    path,
                    Pending {
                        due: Instant::now() + delay,
                        stamp: Some(stamp),
                        attempt: p.attempt + 1,
                        ..p
                    },
                );
            }
            Err(e) => {
                tracing::error!(file = %path.display(), error = %e, secs, "import failed; the file is skipped until it changes");
                self.count(Count::Failed, 1);
                self.file_failed(&path, "", &e);
                // Images an earlier version provided stay pinned until the
                // file is fixed or removed.
                let images = prev.map(|p| p.images).unwrap_or_default();
                self.record(
                    path,
                    FileState {
                        images,
                        error: Some(e.to_string()),
                        ..FileState::new(FileKind::Archive, hash, ns, stamp)
                    },
                );
            }
        }
    }

    /// Records what is known of `path` now; the state file is written later.
    fn record(&mut self, path: PathBuf, file: FileState) {
        self.state.files.insert(path, file);
        self.state_dirty = true;
    }

    /// Whether the file still has the bytes recorded (a `touch` is no change).
    async fn same_bytes(&self, path: &Path, prev: &FileState) -> bool {
        let p = path.to_path_buf();
        let digest = tokio::task::spawn_blocking(move || -> std::io::Result<String> {
            use sha2::Digest as _;
            let mut h = sha2::Sha256::new();
            let mut f = std::fs::File::open(&p)?;
            std::io::copy(&mut f, &mut h)?;
            Ok(format!("sha256:{}", hex::encode(h.finalize())))
        })
        .await;
        matches!(digest, Ok(Ok(d)) if Some(&d) == prev.sha256.as_ref())
    }

    async fn import_list(&mut self, path: PathBuf, stamp: Stamp, p: Pending) {
        let root = p.root;
        let ns = self.dir(root).namespace.clone();
        if ns != pull::CRI_NAMESPACE && self.warned_list_ns.insert(root) {
            tracing::warn!(dir = %self.dir(root).path.display(), namespace = %ns, "pull lists are pulled through CRI, which always uses k8s.io");
        }
        let prev = self.state.files.get(&path).cloned();
        if !p.force && prev.as_ref().is_some_and(|f| f.stamp() == stamp) {
            self.count(Count::Skipped, 1);
            return;
        }
        let hash = pin::path_hash(&path);
        let list = match pull::read(&path) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(file = %path.display(), error = %e, "cannot read pull list");
                self.count(Count::Failed, 1);
                self.file_failed(&path, "", &e);
                return;
            }
        };
        for (line, text, e) in &list.invalid {
            tracing::warn!(file = %path.display(), line, entry = %text, "invalid reference in pull list: {e}");
        }
        self.count(Count::Failed, list.invalid.len() as u64);
        match list.invalid.first() {
            Some((line, text, e)) => self.file_failed(
                &path,
                &format!("line {line}"),
                &format_args!("invalid reference {text:?}: {e}"),
            ),
            // A new version of the list: its pulls start over.
            None => self.file_ok(&path, ""),
        }
        let wanted: HashSet<&String> = list.refs.iter().collect();
        let mut images = prev.as_ref().map(|f| f.images.clone()).unwrap_or_default();
        if let Some(prev) = &prev {
            let gone: Vec<String> = prev
                .images
                .keys()
                .filter(|n| !wanted.contains(n))
                .cloned()
                .collect();
            if !gone.is_empty() {
                tracing::info!(file = %path.display(), images = ?gone, "left the pull list");
            }
            self.unpin_names(&path, prev, &gone).await;
            images.retain(|n, _| wanted.contains(n));
        }
        let error =
            (!list.invalid.is_empty()).then(|| format!("{} invalid lines", list.invalid.len()));
        self.record(
            path.clone(),
            FileState {
                images,
                error,
                ..FileState::new(FileKind::List, hash, pull::CRI_NAMESPACE.into(), stamp)
            },
        );
        if let Some(t) = self.lists.remove(&path) {
            t.cancel.cancel();
        }
        tracing::info!(file = %path.display(), references = list.refs.len(), "processing pull list");
        if list.refs.is_empty() {
            return;
        }
        self.generation += 1;
        let cancel = CancellationToken::new();
        self.lists.insert(
            path.clone(),
            ListTask {
                generation: self.generation,
                cancel: cancel.clone(),
            },
        );
        tokio::spawn(pull::run_list(
            self.c.clone(),
            path,
            self.generation,
            list.refs,
            self.pull_tx.clone(),
            cancel,
        ));
    }

    async fn on_pull(&mut self, ev: PullEvent) {
        match ev {
            PullEvent::Done {
                path,
                generation,
                reference,
                got,
                target,
            } => {
                if self.lists.get(&path).map(|t| t.generation) != Some(generation) {
                    return;
                }
                let hash = pin::path_hash(&path);
                let mut target = target;
                if self.cfg.pin {
                    match pin::pin(&self.c, pull::CRI_NAMESPACE, &reference, &hash).await {
                        Ok(Some((img, pinned))) => {
                            self.count(Count::Pinned, u64::from(pinned));
                            target = img.target.map(|t| t.digest).unwrap_or(target);
                        }
                        Ok(None) => {
                            tracing::warn!(file = %path.display(), image = %reference, "CRI resolves the image but no record has that name; not pinned")
                        }
                        Err(e) => {
                            tracing::warn!(file = %path.display(), image = %reference, error = %e, "pinning failed")
                        }
                    }
                }
                tracing::info!(file = %path.display(), image = %reference, how = ?got, "pull list image ready");
                self.count(Count::Pulled, 1);
                self.file_ok(&path, &reference);
                if let Some(f) = self.state.files.get_mut(&path) {
                    f.images.insert(reference, target);
                    self.state_dirty = true;
                }
            }
            PullEvent::Failed {
                path,
                generation,
                reference,
                error,
                retry_in,
            } => {
                if self.lists.get(&path).map(|t| t.generation) != Some(generation) {
                    return;
                }
                // Reported before it is counted: whoever sees the count
                // sees the error.
                self.file_failed(&path, &reference, &error);
                self.count(Count::PullFailed, 1);
                tracing::warn!(file = %path.display(), image = %reference, error = %error, retry_in = ?retry_in, "pull failed; will retry");
            }
        }
    }

    /// `path` (a file, or a directory and everything recorded below it) is
    /// gone: unpin what only it provided.
    async fn removed(&mut self, path: &Path, p: Pending) {
        for k in self.state.under(path) {
            if let Some(t) = self.lists.remove(&k) {
                t.cancel.cancel();
            }
            let Some(f) = self.state.files.remove(&k) else {
                continue;
            };
            self.state_dirty = true;
            let names: Vec<String> = f.images.keys().cloned().collect();
            if !self.unpin_names(&k, &f, &names).await {
                // containerd unreachable: keep the record and try again.
                self.state.files.insert(k.clone(), f);
                let delay = RETRY_BASE
                    .saturating_mul(1 << p.attempt.min(6))
                    .min(RETRY_MAX);
                self.pending.insert(
                    k,
                    Pending {
                        root: p.root,
                        due: Instant::now() + delay,
                        stamp: None,
                        force: false,
                        attempt: p.attempt + 1,
                    },
                );
                continue;
            }
            tracing::info!(file = %k.display(), "source removed");
            self.file_ok(&k, "");
        }
    }

    /// Drops `f`'s pin from `names`, keeping it where another live file
    /// still provides the image. Returns false if containerd failed.
    async fn unpin_names(&mut self, path: &Path, f: &FileState, names: &[String]) -> bool {
        let mut ok = true;
        for name in names {
            let live = self.state.providers(&f.namespace, name, path);
            match pin::unpin(&self.c, &f.namespace, name, &f.hash, &live).await {
                Ok(pin::Unpinned::Untouched) => {}
                Ok(how) => {
                    self.count(Count::Unpinned, 1);
                    tracing::info!(file = %path.display(), image = %name, result = ?how, "unpinned");
                }
                Err(e) => {
                    tracing::warn!(file = %path.display(), image = %name, error = %e, "unpinning failed");
                    ok = false;
                }
            }
        }
        ok
    }

    fn save_state(&mut self) {
        if !self.state_dirty {
            return;
        }
        match self.state.save(&self.cfg.state_file) {
            Ok(()) => self.state_dirty = false,
            Err(e) => tracing::warn!(error = %e, "cannot save import state"),
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
