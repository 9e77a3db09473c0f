//! File handling: what happens to a due path — an archive imported, a
//! pull list (re)started, a removed file's pins dropped.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use super::archive::{Limits, ReadOptions};
use super::heartbeat::Heartbeat;
use super::pull::{self, PullEvent};
use super::state::{FileKind, FileState, Stamp};
use super::{esc, open, pin, write, Count, Importer, ListTask, Pending};
use crate::containerd::Image;

/// Invalid or refused lines of one list logged one by one; the rest are counted.
const MAX_LOGGED: usize = 10;

/// One version of an archive being imported: what every outcome records.
struct ArchiveRun {
    path: PathBuf,
    stamp: Stamp,
    hash: String,
    ns: String,
    /// What the state file knew of the file before this import.
    prev: Option<FileState>,
}

impl Importer {
    pub(super) async fn import_archive(&mut self, path: PathBuf, stamp: Stamp, p: Pending) {
        let ns = self.dir(p.root).namespace.clone();
        let prev = self.state.files.get(&path).cloned();
        if !p.force && self.archive_unchanged(&path, stamp, prev.as_ref()).await {
            return;
        }
        let run = ArchiveRun {
            hash: pin::path_hash(&path),
            path,
            stamp,
            ns,
            prev,
        };
        let source = self.cfg.pin.then_some(run.hash.as_str());
        if source.is_some() {
            self.record_importing(&run);
        }
        let opts = ReadOptions {
            limits: Limits {
                max_decompressed: self.cfg.max_decompressed_bytes,
                ..Limits::default()
            },
            hash_input: true,
        };
        tracing::info!(file = %esc(run.path.display()), size_mib = stamp.size >> 20, namespace = %run.ns, "importing");
        let started = Instant::now();
        let hb = Heartbeat::new();
        let res = tokio::select! {
            r = write::import_archive(&self.c, &run.ns, &run.path, opts, source, &hb) => r,
            (step, quiet) = hb.stopped(self.cfg.progress_timeout) => {
                Err(super::ImportError::Stalled { step, quiet })
            }
        };
        let secs = format!("{:.1}", started.elapsed().as_secs_f64());
        match res {
            Ok(o) => self.archive_imported(run, o, secs, p.root).await,
            Err(super::ImportError::Io { source, .. }) if open::is_not_regular(&source) => {
                self.archive_not_regular(run, &source)
            }
            Err(e) if e.is_transient() => self.archive_retry(run, p, &e),
            Err(e) => self.archive_failed(run, &e, secs),
        }
    }

    /// Whether the file is as last imported (same stamp, or only touched):
    /// then it is counted skipped, and a touch's new mtime recorded.
    async fn archive_unchanged(
        &mut self,
        path: &Path,
        stamp: Stamp,
        prev: Option<&FileState>,
    ) -> bool {
        let Some(prev) = prev else {
            return false;
        };
        if prev.stamp() == stamp {
            self.count(Count::Skipped, 1);
            return true;
        }
        if prev.size == stamp.size && prev.sha256.is_some() && self.same_bytes(path, prev).await {
            tracing::info!(file = %esc(path.display()), "touched but unchanged; not importing again");
            if let Some(f) = self.state.files.get_mut(path) {
                f.mtime_ns = stamp.mtime_ns;
            }
            self.state_dirty = true;
            self.count(Count::Skipped, 1);
            return true;
        }
        false
    }

    /// Marks the file as being imported, saved before any image is pinned
    /// to it.
    fn record_importing(&mut self, run: &ArchiveRun) {
        let begun = run.prev.clone().unwrap_or_else(|| {
            FileState::new(
                FileKind::Archive,
                run.hash.clone(),
                run.ns.clone(),
                run.stamp,
            )
        });
        self.record(run.path.clone(), begun.importing());
        self.save_state();
    }

    /// The archive was read: its images are counted and recorded, the ones
    /// an earlier version provided and this one lacks unpinned.
    async fn archive_imported(
        &mut self,
        run: ArchiveRun,
        o: write::ArchiveOutcome,
        secs: String,
        root: usize,
    ) {
        let ArchiveRun {
            path,
            stamp,
            hash,
            ns,
            prev,
        } = run;
        for w in &o.warnings {
            tracing::warn!(file = %esc(path.display()), warning = %esc(w), "archive warning");
        }
        for f in &o.failures {
            tracing::error!(file = %esc(path.display()), error = %esc(f), "image not imported");
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
            file = %esc(path.display()),
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
            if !self.unpin_names(&path, prev, &gone).await {
                self.strays = self.strays.owed(0);
            }
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

    /// The path is not a regular file (any more).
    fn archive_not_regular(&mut self, run: ArchiveRun, e: &std::io::Error) {
        // Not read, nothing pinned: what was known stands.
        match run.prev {
            Some(prev) => self.record(run.path.clone(), prev),
            None if self.state.files.remove(&run.path).is_some() => self.state_dirty = true,
            None => {}
        }
        self.refuse(&run.path, run.stamp, e);
    }

    /// A failure that may pass (containerd away): tried again after a backoff.
    fn archive_retry(&mut self, run: ArchiveRun, p: Pending, e: &super::ImportError) {
        let delay = super::RETRY.nth(p.attempt);
        tracing::warn!(file = %esc(run.path.display()), error = %esc(e), retry_in = ?delay, "import failed; will retry");
        self.count(Count::Failed, 1);
        self.file_failed(&run.path, "", &format_args!("{e} (retrying in {delay:?})"));
        self.pending.insert(
            run.path,
            Pending {
                due: Instant::now() + delay,
                stamp: Some(run.stamp),
                attempt: p.attempt + 1,
                ..p
            },
        );
    }

    /// A failure this version of the file will not get past.
    fn archive_failed(&mut self, run: ArchiveRun, e: &super::ImportError, secs: String) {
        tracing::error!(file = %esc(run.path.display()), error = %esc(e), secs, "import failed; the file is skipped until it changes");
        self.count(Count::Failed, 1);
        self.file_failed(&run.path, "", e);
        // Images an earlier version provided stay pinned until the
        // file is fixed or removed.
        let images = run.prev.map(|p| p.images).unwrap_or_default();
        self.record(
            run.path,
            FileState {
                images,
                error: Some(e.to_string()),
                ..FileState::new(FileKind::Archive, run.hash, run.ns, run.stamp)
            },
        );
    }

    /// Whether the file still has the bytes recorded (a `touch` is no change).
    pub(super) async fn same_bytes(&self, path: &Path, prev: &FileState) -> bool {
        let p = path.to_path_buf();
        let size = prev.size;
        let digest = open::in_background(move || -> std::io::Result<String> {
            use sha2::Digest as _;
            let mut h = sha2::Sha256::new();
            let f = open::open_regular(&p)?;
            std::io::copy(&mut std::io::Read::take(f, size + 1), &mut h)?;
            Ok(format!("sha256:{}", hex::encode(h.finalize())))
        })
        .await;
        matches!(digest, Some(Ok(d)) if Some(&d) == prev.sha256.as_ref())
    }

    pub(super) async fn import_list(&mut self, path: PathBuf, stamp: Stamp, p: Pending) {
        let root = p.root;
        let ns = self.dir(root).namespace.clone();
        if ns != pull::CRI_NAMESPACE && self.warned_list_ns.insert(root) {
            tracing::warn!(dir = %esc(self.dir(root).path.display()), namespace = %ns, "pull lists are pulled through CRI, which always uses k8s.io");
        }
        let prev = self.state.files.get(&path).cloned();
        if !p.force && prev.as_ref().is_some_and(|f| f.stamp() == stamp) {
            self.count(Count::Skipped, 1);
            return;
        }
        let hash = pin::path_hash(&path);
        let Some(mut list) = self.read_list(&path, stamp).await else {
            return;
        };
        self.log_invalid_lines(&path, &list);
        let refused = self.refuse_hosts(&path, &mut list);
        match (list.invalid.first(), refused.first()) {
            (Some((line, _, e)), _) => self.file_failed(
                &path,
                &format!("line {line}"),
                &format_args!("invalid reference: {}", pull::invalid_reason(e)),
            ),
            (None, Some((r, why))) => {
                self.file_failed(&path, r, &format_args!("pull refused: {why}"))
            }
            // A new version of the list: its pulls start over.
            (None, None) => self.file_ok(&path, ""),
        }
        let images = self.drop_unlisted(&path, prev.as_ref(), &list.refs).await;
        let error = (!list.invalid.is_empty() || !refused.is_empty()).then(|| {
            format!(
                "{} invalid lines, {} references refused",
                list.invalid.len(),
                refused.len()
            )
        });
        self.record(
            path.clone(),
            FileState {
                images,
                error,
                ..FileState::new(FileKind::List, hash, pull::CRI_NAMESPACE.into(), stamp)
            },
        );
        self.start_list(path, list.refs);
    }

    /// Reads and parses a list, or says why not (and returns `None`).
    async fn read_list(&mut self, path: &Path, stamp: Stamp) -> Option<pull::PullList> {
        // Reading and parsing are proportional to the file: off the async
        // runtime, so the proxy never waits for them.
        let started = Instant::now();
        let p2 = path.to_path_buf();
        let list = match open::in_background(move || pull::read(&p2)).await {
            Some(Ok(l)) => l,
            Some(Err(e)) if open::is_not_regular(&e) => {
                self.refuse(path, stamp, &e);
                return None;
            }
            Some(Err(e)) => {
                tracing::error!(file = %esc(path.display()), error = %esc(&e), "cannot read pull list");
                self.count(Count::Failed, 1);
                self.file_failed(path, "", &e);
                return None;
            }
            None => {
                tracing::error!(file = %esc(path.display()), "pull list parser failed");
                self.count(Count::Failed, 1);
                self.file_failed(path, "", &"pull list parser failed");
                return None;
            }
        };
        tracing::info!(
            file = %esc(path.display()),
            references = list.refs.len(),
            invalid = list.invalid.len(),
            ms = started.elapsed().as_millis() as u64,
            "pull list parsed"
        );
        Some(list)
    }

    /// Logs and counts the lines that are no reference.
    fn log_invalid_lines(&self, path: &Path, list: &pull::PullList) {
        // Lines are named by number and reason, never quoted: a list may be
        // a symlink to any file. A few are logged, then a count.
        for (line, _, e) in list.invalid.iter().take(MAX_LOGGED) {
            tracing::warn!(file = %esc(path.display()), line, reason = pull::invalid_reason(e), "invalid reference in pull list; not pulled");
        }
        if list.invalid.len() > MAX_LOGGED {
            tracing::warn!(file = %esc(path.display()), more = list.invalid.len() - MAX_LOGGED, "more invalid references in pull list");
        }
        self.count(Count::Failed, list.invalid.len() as u64);
    }

    /// Takes the references the host policy refuses out of `list`; logs
    /// and counts them, and returns them with the reason.
    fn refuse_hosts(&self, path: &Path, list: &mut pull::PullList) -> Vec<(String, String)> {
        let policy = pull::HostPolicy {
            allow: self.cfg.pull_hosts_allow.clone(),
            deny: self.cfg.pull_hosts_deny.clone(),
        };
        let mut refused = Vec::new();
        list.refs.retain(|r| match policy.check(r) {
            Ok(()) => true,
            Err(why) => {
                refused.push((r.clone(), why));
                false
            }
        });
        for (r, why) in refused.iter().take(MAX_LOGGED) {
            tracing::warn!(file = %esc(path.display()), image = %esc(r), reason = %esc(why), "pull refused");
        }
        if refused.len() > MAX_LOGGED {
            tracing::warn!(file = %esc(path.display()), more = refused.len() - MAX_LOGGED, "more pulls refused");
        }
        self.count(Count::Failed, refused.len() as u64);
        refused
    }

    /// Unpins the images an earlier version of the list had pulled that
    /// this one no longer names; returns the ones it still does.
    async fn drop_unlisted(
        &mut self,
        path: &Path,
        prev: Option<&FileState>,
        refs: &[String],
    ) -> BTreeMap<String, String> {
        let Some(prev) = prev else {
            return BTreeMap::new();
        };
        let wanted: HashSet<&String> = refs.iter().collect();
        let mut images = prev.images.clone();
        let gone: Vec<String> = prev
            .images
            .keys()
            .filter(|n| !wanted.contains(n))
            .cloned()
            .collect();
        if !gone.is_empty() {
            tracing::info!(file = %esc(path.display()), images = %esc(format_args!("{:?}", gone)), "left the pull list");
        }
        if !self.unpin_names(path, prev, &gone).await {
            self.strays = self.strays.owed(0);
        }
        images.retain(|n, _| wanted.contains(n));
        images
    }

    /// Cancels the pulls of the list's previous version and starts this
    /// one's, if it names any.
    fn start_list(&mut self, path: PathBuf, refs: Vec<String>) {
        if let Some(t) = self.lists.remove(&path) {
            t.cancel.cancel();
        }
        tracing::info!(file = %esc(path.display()), references = refs.len(), "processing pull list");
        if refs.is_empty() {
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
            refs,
            self.cfg.pull_attempts,
            self.pull_tx.clone(),
            cancel,
        ));
    }

    pub(super) async fn on_pull(&mut self, ev: PullEvent) {
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
                            tracing::warn!(file = %esc(path.display()), image = %esc(&reference), "CRI resolves the image but no record has that name; not pinned")
                        }
                        Err(e) => {
                            tracing::warn!(file = %esc(path.display()), image = %esc(&reference), error = %esc(&e), "pinning failed")
                        }
                    }
                }
                tracing::info!(file = %esc(path.display()), image = %esc(&reference), how = ?got, "pull list image ready");
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
                attempts,
            } => {
                if self.lists.get(&path).map(|t| t.generation) != Some(generation) {
                    return;
                }
                // Reported before it is counted: whoever sees the count
                // sees the error.
                match retry_in {
                    Some(d) => {
                        self.file_failed(
                            &path,
                            &reference,
                            &format_args!("{error} (attempt {attempts}; retrying in {d:?})"),
                        );
                        self.count(Count::PullFailed, 1);
                        tracing::warn!(file = %esc(path.display()), image = %esc(&reference), error = %esc(&error), attempts, retry_in = ?d, "pull failed; will retry");
                    }
                    None => {
                        self.file_failed(&path, &reference, &format_args!("{error} (gave up after {attempts} attempts; retried when the list changes)"));
                        self.count(Count::PullFailed, 1);
                        tracing::error!(file = %esc(path.display()), image = %esc(&reference), error = %esc(&error), attempts, "pull failed; gave up until the list changes");
                    }
                }
            }
        }
    }

    /// `path` (a file, or a directory and everything recorded below it) is
    /// gone: unpin what only it provided.
    pub(super) async fn removed(&mut self, path: &Path, p: Pending) {
        // Each namespace's images, listed once for all the files removed
        // (`None`: the listing failed; not asked again in this removal).
        let mut listed: HashMap<String, Option<Vec<Image>>> = HashMap::new();
        for k in self.state.under(path) {
            if let Some(t) = self.lists.remove(&k) {
                t.cancel.cancel();
            }
            let Some(f) = self.state.files.remove(&k) else {
                continue;
            };
            self.state_dirty = true;
            let mut names: Vec<String> = f.images.keys().cloned().collect();
            let unrecorded = self.unrecorded_pins(&mut listed, &f).await;
            let swept = unrecorded.is_some();
            names.extend(unrecorded.into_iter().flatten());
            if !(self.unpin_names(&k, &f, &names).await && swept) {
                // containerd unreachable: keep the record and try again.
                self.state.files.insert(k.clone(), f);
                let delay = super::RETRY.nth(p.attempt);
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
            tracing::info!(file = %esc(k.display()), "source removed");
            self.file_ok(&k, "");
        }
    }

    /// Unpins what a file's pin label still names but the file no longer
    /// provides: an earlier version's images whose unpin failed (the file
    /// changed while containerd was down: the hour's soak left them pinned
    /// for good, out of kubelet's GC's reach, docs/reliability.md), or a
    /// pin made just before imgbridge stopped. Runs in the importer's loop,
    /// so no import of the file is half recorded meanwhile; owed again
    /// with a back-off while containerd fails.
    pub(super) async fn sweep_strays(&mut self, attempt: u32) {
        let mut listed = HashMap::new();
        let mut ok = true;
        for (path, f) in self.state.entries() {
            let Some(stale) = self.unrecorded_pins(&mut listed, &f).await else {
                ok = false;
                continue;
            };
            if !stale.is_empty() {
                tracing::info!(file = %esc(path.display()), images = %esc(format_args!("{:?}", stale)), "pinned for a file that no longer provides them");
                ok &= self.unpin_names(&path, &f, &stale).await;
            }
        }
        if !ok {
            self.strays = self.strays.owed(attempt + 1);
        }
    }

    /// The images whose pin label names `f` but that `f` does not record:
    /// pinned just before imgbridge stopped (before the save that records
    /// them), or left by an unpin that failed. `listed` holds each
    /// namespace's images, listed once per pass (`None`: the listing
    /// failed, and is not tried again in this pass); `None` if so.
    async fn unrecorded_pins(
        &self,
        listed: &mut HashMap<String, Option<Vec<Image>>>,
        f: &FileState,
    ) -> Option<Vec<String>> {
        if !listed.contains_key(&f.namespace) {
            let images = self.c.list_images(&f.namespace, Vec::new()).await;
            if let Err(e) = &images {
                tracing::warn!(namespace = %f.namespace, error = %esc(e), "cannot list the images imported files pinned; trying again later");
            }
            listed.insert(f.namespace.clone(), images.ok());
        }
        let images = listed.get(&f.namespace)?.as_ref()?;
        Some(
            pin::pinned_by(images, &f.hash)
                .filter(|n| !f.images.contains_key(*n))
                .map(str::to_owned)
                .collect(),
        )
    }

    /// Drops `f`'s pin from `names`, keeping it where another live file
    /// still provides the image. Returns false if containerd failed.
    pub(super) async fn unpin_names(
        &mut self,
        path: &Path,
        f: &FileState,
        names: &[String],
    ) -> bool {
        let mut ok = true;
        for name in names {
            let live = self.state.providers(&f.namespace, name, path);
            match pin::unpin(&self.c, &f.namespace, name, &f.hash, &live).await {
                Ok(pin::Unpinned::Untouched) => {}
                Ok(how) => {
                    self.count(Count::Unpinned, 1);
                    tracing::info!(file = %esc(path.display()), image = %esc(name), result = ?how, "unpinned");
                }
                Err(e) => {
                    tracing::warn!(file = %esc(path.display()), image = %esc(name), error = %esc(&e), "unpinning failed");
                    ok = false;
                }
            }
        }
        ok
    }
}
