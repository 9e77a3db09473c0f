//! Directory auto-import: image archives and pull lists dropped into watched
//! directories end up, pinned, in containerd.
//!
//! - [`archive`]: the streaming archive reader (sync, containerd-free, fuzzed);
//! - [`write`]: its containerd side (Content.Write under a lease, records last);
//! - [`pull`]: `.txt` pull lists through CRI `PullImage`;
//! - [`watch`]: inotify events → signals; [`state`]: the restart-proof state
//!   file; [`pin`]: pin labels and their bookkeeping.
//!
//! [`Importer`] (struct here; [`schedule`]: when a path is looked at, [`files`]: what is done with it) owns the state and runs one file at a time (archives are
//! CPU- and disk-bound; the machine is the kubelet's too). Pull lists run in
//! their own tasks so a dead registry holds up nothing.

pub mod archive;
mod files;
pub mod heartbeat;
pub mod open;
pub mod pin;
pub mod pull;
mod schedule;
pub mod state;
pub mod watch;
pub mod write;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::config::Import;
use crate::containerd::Containerd;
use archive::{ArchiveError, Limits, ReadOptions};
use pull::PullEvent;
use state::{FileKind, Stamp, State};

/// Safety net against missed inotify events: a stat-only walk this often.
pub const RESCAN_EVERY: Duration = Duration::from_secs(30);
/// Retry delay after a transient failure (containerd down), doubling.
const RETRY_BASE: Duration = Duration::from_secs(5);
const RETRY_MAX: Duration = Duration::from_secs(300);
/// A file whose import failed for a passing reason is retried after this.
const RETRY: Backoff = Backoff::new(RETRY_BASE, RETRY_MAX);
/// Long enough for the files' first look after start to have recorded
/// every image they still provide (present ones are found at once).
const STRAYS_AFTER_START: Duration = Duration::from_secs(60);
/// Nested directory depth we follow (symlink loops end here).
const MAX_DIR_DEPTH: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error(transparent)]
    Archive(#[from] ArchiveError),
    #[error(transparent)]
    Containerd(#[from] crate::containerd::Error),
    #[error("reading {}: {source}", esc(path.display()))]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A bug in the reader, not a hiccup: retrying the same bytes would
    /// hit it again, so the file waits until it changes.
    #[error("archive reader panicked: {0}")]
    Panic(String),
    /// No step for `import.progress_timeout`: a call that never answered.
    #[error("no progress for {}s after {step}; cancelled", quiet.as_secs())]
    Stalled {
        step: &'static str,
        quiet: std::time::Duration,
    },
}

impl ImportError {
    /// Worth retrying unchanged: containerd or the file system hiccuped,
    /// rather than the file being bad.
    pub fn is_transient(&self) -> bool {
        match self {
            ImportError::Archive(ArchiveError::Sink { .. }) => true,
            ImportError::Archive(_) | ImportError::Panic(_) => false,
            ImportError::Io { source, .. } => !open::is_not_regular(source),
            ImportError::Containerd(_) | ImportError::Stalled { .. } => true,
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

/// User-controlled text (file names, references, image names, messages
/// quoting them) for a log line: control characters — newlines, ANSI
/// escapes — are escaped so nobody can forge or colour log lines.
pub fn esc(s: impl std::fmt::Display) -> String {
    let s = s.to_string();
    if !s.chars().any(char::is_control) {
        return s;
    }
    s.chars()
        .flat_map(|c| {
            let v: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            v
        })
        .collect()
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

/// How `imgbridge import` treats its files: the same limits and pull host
/// policy as the watched directories, so a one-shot import is no way round
/// them.
#[derive(Clone, Debug, Default)]
pub struct OneShot {
    pub pin: bool,
    pub limits: Limits,
    pub hosts: pull::HostPolicy,
}

/// One-shot import for `imgbridge import`: archives (any name; compression
/// from the bytes) and `.txt` pull lists, each file independent, within
/// `import.max_decompressed_bytes`.
pub async fn import_files_with(
    containerd: Containerd,
    ns: &str,
    files: &[PathBuf],
    how: OneShot,
) -> Report {
    let OneShot { pin, limits, hosts } = how;
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
            tracing::warn!(file = %esc(f.display()), "pull lists are pulled through CRI, which always uses k8s.io");
        }
        if is_list {
            list_once(&containerd, f, source.as_deref(), &hosts, &mut r).await;
        } else {
            let opts = ReadOptions {
                limits: limits.clone(),
                hash_input: false,
            };
            let hb = heartbeat::Heartbeat::new();
            match write::import_archive(&containerd, ns, f, opts, source.as_deref(), &hb).await {
                Ok(o) => {
                    for w in &o.warnings {
                        tracing::warn!(file = %esc(f.display()), warning = %esc(w), "archive warning");
                    }
                    r.images = o.images.into_iter().map(|(n, _)| n).collect();
                    r.failures = o.failures;
                }
                Err(e) => r.failures.push(e.to_string()),
            }
        }
        r.duration = started.elapsed();
        for e in &r.failures {
            tracing::error!(file = %esc(f.display()), error = %esc(e), "import failure");
        }
        tracing::info!(
            file = %esc(f.display()),
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
async fn list_once(
    c: &Containerd,
    path: &Path,
    source: Option<&str>,
    hosts: &pull::HostPolicy,
    r: &mut FileReport,
) {
    let list = match pull::read(path) {
        Ok(l) => l,
        Err(e) => {
            r.failures.push(format!("reading pull list: {e}"));
            return;
        }
    };
    for (line, _, e) in &list.invalid {
        r.failures.push(format!(
            "line {line}: invalid reference: {}",
            pull::invalid_reason(e)
        ));
    }
    for reference in &list.refs {
        if let Err(why) = hosts.check(reference) {
            r.failures
                .push(format!("{}: pull refused: {why}", esc(reference)));
            continue;
        }
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
                    tracing::warn!(file = %esc(path.display()), image = %esc(reference), error = %esc(&e), "pull failed; retrying");
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

/// When the pins no file provides any more are looked for
/// ([`Importer::sweep_strays`]): once [`STRAYS_AFTER_START`] after start
/// (an unpin owed by the previous run is not in the state file), and after
/// an unpin that failed, again with [`RETRY`]'s back-off until one goes
/// through.
#[derive(Clone, Copy, Debug)]
enum Strays {
    /// Nothing owed.
    Clear,
    Due {
        at: Instant,
        attempt: u32,
    },
}

impl Strays {
    fn due(self) -> Option<Instant> {
        match self {
            Strays::Clear => None,
            Strays::Due { at, .. } => Some(at),
        }
    }

    /// Owed after attempt `attempt` failed (or an unpin elsewhere did):
    /// an earlier due time stands.
    fn owed(self, attempt: u32) -> Strays {
        let at = Instant::now() + RETRY.nth(attempt);
        match self {
            Strays::Due { at: sooner, .. } if sooner <= at => self,
            _ => Strays::Due { at, attempt },
        }
    }
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
    /// Paths refused as not regular files, by the stamp they had: warned
    /// once, looked at again only when they change.
    refused: HashMap<PathBuf, Stamp>,
    strays: Strays,
}
