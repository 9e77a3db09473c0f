//! The delete policy: what happens to replicas when their source image is
//! deleted through imgbridge, or was deleted while nobody watched.

use std::collections::HashMap;

use super::{Error, Replicator};
use crate::config::DeletePolicy;
use crate::containerd::{self as ctrd, Image};
use crate::labels::{pin_owner, PinOwner, CRI_NAMESPACE, PINNED, SOURCE};
use crate::oci::Reference;

impl Replicator {
    /// Applies `delete_policy` to the replicas of `name` deleted in `source`.
    pub async fn on_delete(&self, source: &str, name: &str) -> Result<(), Error> {
        let Ok(parsed) = Reference::parse(name) else {
            return Ok(());
        };
        let target_name = parsed.to_string();
        for target in &self.s.targets {
            let _g = self.locks.lock(format!("{target}\0{target_name}")).await;
            let err = |cause| Error::Containerd {
                image: name.into(),
                source_ns: source.into(),
                target: target.clone(),
                cause,
            };
            // nerdctl tag is Delete then Create: a late event must not undo
            // the re-created image.
            if self.c.get_image(source, name).await.map_err(err)?.is_some() {
                continue;
            }
            let Some(img) = self.c.get_image(target, &target_name).await.map_err(err)? else {
                continue;
            };
            let mut records = vec![img.clone()];
            if let (true, Some(t)) = (self.s.digest_refs, &img.target) {
                // The digest record goes with the last tag of its repository.
                let same_digest = self
                    .c
                    .list_images(source, vec![format!("target.digest=={}", t.digest)])
                    .await
                    .map_err(err)?;
                let shared = same_digest
                    .iter()
                    .any(|i| Reference::parse(&i.name).is_ok_and(|r| r.name() == parsed.name()));
                let dref = parsed.with_digest(&t.digest);
                if !shared {
                    records.extend(self.c.get_image(target, &dref).await.map_err(err)?);
                }
            }
            for rec in records {
                self.apply_delete_policy(source, target, rec)
                    .await
                    .map_err(err)?;
            }
        }
        Ok(())
    }

    /// The tag `reference` moved in `source` from root `old` to another:
    /// the digest record of `old` (`digest_refs`) names what no source tag
    /// of the repository points at any more, so it gets `delete_policy` now,
    /// as if its source were deleted. Without this every rebuild of one tag
    /// (a dev loop's `app:dev`) left a pinned image that kubelet's image GC
    /// can never remove, until the next catch-up pass (found by the soak,
    /// docs/reliability.md).
    pub(super) async fn on_moved(
        &self,
        source: &str,
        target: &str,
        reference: &Reference,
        old: &str,
    ) -> Result<(), ctrd::Error> {
        if !self.s.digest_refs || reference.digest.is_some() {
            return Ok(());
        }
        let dref = reference.with_digest(old);
        let _g = self.locks.lock(format!("{target}\0{dref}")).await;
        let still = self
            .c
            .list_images(source, vec![format!("target.digest=={old}")])
            .await?;
        if still
            .iter()
            .any(|i| Reference::parse(&i.name).is_ok_and(|r| r.name() == reference.name()))
        {
            return Ok(());
        }
        if let Some(rec) = self.c.get_image(target, &dref).await? {
            self.apply_delete_policy(source, target, rec).await?;
        }
        Ok(())
    }

    /// Applies `delete_policy` to every replica of `source` whose source
    /// image is gone: deletes that happened while imgbridge or containerd
    /// was down, or whose policy write failed (a crash in between), still
    /// end as the policy says. Idempotent: an already unpinned replica costs
    /// no write. Returns the replicas the policy was applied to.
    pub async fn converge_deletes(&self, source: &str) -> Result<usize, Error> {
        let err = |target: &str, cause| Error::Containerd {
            image: "*".into(),
            source_ns: source.into(),
            target: target.into(),
            cause,
        };
        let live = self.replica_names(source).await.map_err(|e| err("*", e))?;
        let mut applied = 0;
        for target in &self.s.targets {
            let filter = format!("labels.\"{SOURCE}\"==\"{source}\"");
            let replicas = self
                .c
                .list_images(target, vec![filter])
                .await
                .map_err(|e| err(target, e))?;
            for r in replicas {
                if live.contains(&r.name) || !self.owes_policy(&r) {
                    continue;
                }
                let _g = self.locks.lock(format!("{target}\0{}", r.name)).await;
                // A write may have brought the source back meanwhile.
                if self
                    .replica_names(source)
                    .await
                    .map_err(|e| err(target, e))?
                    .contains(&r.name)
                {
                    continue;
                }
                let Some(current) = self
                    .c
                    .get_image(target, &r.name)
                    .await
                    .map_err(|e| err(target, e))?
                else {
                    continue;
                };
                tracing::info!(image = %r.name, source, target, "source image is gone; applying delete_policy in the catch-up pass");
                self.apply_delete_policy(source, target, current)
                    .await
                    .map_err(|e| err(target, e))?;
                applied += 1;
            }
        }
        Ok(applied)
    }

    /// Whether `delete_policy` would still change replica `r`.
    fn owes_policy(&self, r: &Image) -> bool {
        match self.s.delete_policy {
            DeletePolicy::Keep => false,
            DeletePolicy::Delete => true,
            DeletePolicy::Unpin => pin_owner(&r.labels) == PinOwner::Replication,
        }
    }

    /// The replica names (tags and, with `digest_refs`, digest records) the
    /// images now in `source` map to.
    async fn replica_names(
        &self,
        source: &str,
    ) -> Result<std::collections::HashSet<String>, ctrd::Error> {
        let mut names = std::collections::HashSet::new();
        for img in self.c.list_images(source, Vec::new()).await? {
            let Ok(parsed) = Reference::parse(&img.name) else {
                continue;
            };
            names.insert(parsed.to_string());
            if let (true, None, Some(t)) = (self.s.digest_refs, &parsed.digest, &img.target) {
                names.insert(parsed.with_digest(&t.digest));
            }
        }
        Ok(names)
    }

    /// Unpins, deletes or keeps one replica record, never one we did not write.
    async fn apply_delete_policy(
        &self,
        source: &str,
        target: &str,
        img: Image,
    ) -> Result<(), ctrd::Error> {
        if img.labels.get(SOURCE).map(String::as_str) != Some(source) {
            return Ok(()); // not ours: never touched
        }
        match self.s.delete_policy {
            DeletePolicy::Keep => {}
            DeletePolicy::Delete => {
                if let Some(p) = self.protect.by_name(target == CRI_NAMESPACE, &img.name) {
                    // What the node depends on is never removed by a build's delete.
                    tracing::info!(image = %img.name, source, target, protection = %p,
                        "kept a protected replica although its source was deleted (delete_policy = delete)");
                    return Ok(());
                }
                self.c.delete_image(target, &img.name, false).await?;
                tracing::info!(image = %img.name, source, target, "deleted replica (delete_policy = delete)");
            }
            DeletePolicy::Unpin => {
                if pin_owner(&img.labels) == PinOwner::Replication {
                    let unpin = HashMap::from([(PINNED.to_string(), String::new())]);
                    self.c.update_image_labels(target, &img.name, unpin).await?;
                    tracing::info!(image = %img.name, source, target, "unpinned replica (delete_policy = unpin)");
                }
            }
        }
        Ok(())
    }
}
