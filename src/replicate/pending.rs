//! Blobs that were missing in the source when their image was replicated
//! (buildkit names images before fetching lazy base layers; an index pulled
//! for one platform). They never block a reply: they are linked into the
//! target as soon as they appear, or given up after `pending_give_up`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::observe::PendingBlob as Item;
use super::Replicator;

/// Poll interval: well under the 1 s promise, cheap (one Info per blob).
const TICK: Duration = Duration::from_millis(200);

#[derive(Default)]
pub struct Pending {
    items: Mutex<HashMap<(String, String, String), Item>>,
}

impl Pending {
    pub fn add(&self, item: Item) {
        let key = (
            item.source.clone(),
            item.target.clone(),
            item.child.digest.clone(),
        );
        let mut m = self.items.lock().unwrap();
        if !m.contains_key(&key) {
            tracing::info!(image = %item.image, digest = %item.child.digest, source = %item.source, target = %item.target, "blob not yet in source; will link it when it appears");
        }
        m.entry(key).or_insert(item);
    }

    pub fn count(&self) -> usize {
        self.items.lock().unwrap().len()
    }

    fn snapshot(&self) -> Vec<Item> {
        self.items.lock().unwrap().values().cloned().collect()
    }

    fn remove(&self, it: &Item) {
        self.items.lock().unwrap().remove(&(
            it.source.clone(),
            it.target.clone(),
            it.child.digest.clone(),
        ));
    }
}

pub async fn run(r: Arc<Replicator>, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(TICK) => {}
        }
        let items = r.pending.snapshot();
        if let Some(o) = r.observer() {
            o.blobs_pending(&items);
        }
        for it in items {
            if it.since.elapsed() > r.s.pending_give_up {
                tracing::warn!(image = %it.image, digest = %it.child.digest, source = %it.source, target = %it.target,
                    "gave up waiting for blob to appear in the source; pull or rebuild the image, then run `imgbridge sync`");
                r.pending.remove(&it);
                continue;
            }
            match r.c.content_info(&it.source, &it.child.digest).await {
                Ok(Some(_)) => {}
                Ok(None) => continue,
                Err(e) => {
                    tracing::debug!(error = %e, "pending check failed; retrying");
                    continue;
                }
            }
            // The parent in the target already carries a gc.ref label for
            // this blob, so the link is GC-safe by itself; the walk's lease
            // (created only if it writes) covers its children until they are
            // referenced. Children still missing are queued again.
            r.pending.remove(&it);
            let root = crate::containerd::Descriptor {
                media_type: it.child.media_type.clone(),
                digest: it.child.digest.clone(),
                size: it.child.size,
                ..Default::default()
            };
            let lease = super::Lease::new(&r.c, &it.target);
            match r
                .walk(&it.source, &it.target, &it.image, &root, &lease.id)
                .await
            {
                Ok((o, _)) => {
                    tracing::info!(image = %it.image, digest = %it.child.digest, target = %it.target, writes = o.writes, still_pending = o.pending, "linked blob that appeared late")
                }
                Err(e) => {
                    tracing::warn!(image = %it.image, digest = %it.child.digest, error = %e, "linking late blob failed; will retry");
                    r.pending.add(it.clone());
                }
            }
            lease.release().await;
        }
    }
}
