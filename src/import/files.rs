//! File handling: what happens to a due path — an archive imported, a
//! pull list (re)started, a removed file's pins dropped.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use super::archive::{Limits, ReadOptions};
use super::pull::{self, PullEvent};
use super::state::{FileKind, FileState, Stamp};
use super::{pin, write, Count, Importer, ListTask, Pending, RETRY_BASE, RETRY_MAX};

impl Importer {
    pub(super) async fn import_archive(&mut self, path: PathBuf, stamp: Stamp, p: Pending) {
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

    /// Whether the file still has the bytes recorded (a `touch` is no change).
    pub(super) async fn same_bytes(&self, path: &Path, prev: &FileState) -> bool {
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

    pub(super) async fn import_list(&mut self, path: PathBuf, stamp: Stamp, p: Pending) {
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
    pub(super) async fn removed(&mut self, path: &Path, p: Pending) {
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
}
