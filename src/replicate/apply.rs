//! The apply phase of a replication (plan → apply → record → confirm,
//! [docs/design.md](../../docs/design.md)): the tree the plan found made
//! visible in the target by a walk ([`super::walk`]), and the blobs the
//! source lacks queued for this image ([`super::pending`]).

use std::sync::Arc;

use super::record::Plan;
use super::walk::Walked;
use super::{pending, protect, Outcome, Replicator};
use crate::containerd as ctrd;

impl Replicator {
    /// The apply phase: the tree the plan found (the hinted walk if it was
    /// the record's tree, else a new one) made visible in `target`, and
    /// the blobs the source lacks queued ([`pending`]) for this image.
    /// Returns the tree, which holds the lease until the records are in,
    /// and what this replication wrote.
    pub(super) async fn apply(
        &self,
        source: &str,
        target: &str,
        plan: &mut Plan<'_>,
    ) -> Result<(Arc<Walked>, Outcome), ctrd::Error> {
        let walk = match plan.early.take() {
            Some((h, w)) if h.digest == plan.root.digest => w,
            other => {
                // A walk of another tree is not used, but held (its lease
                // with it) until the replication ends, as it always was.
                plan.early = other;
                let open = protect::Gate::open();
                let registry = Some(&plan.replica.registry);
                self.walk_shared(source, target, registry, &plan.root, &open)
                    .await
            }
        };
        let (tree, shared) = walk?;
        for (child, need) in &tree.found.missing {
            self.pending.add(pending::Item {
                source: source.into(),
                target: target.into(),
                owner: pending::Owner {
                    image: plan.image.name.clone(),
                    root: plan.root.digest.clone(),
                    need: *need,
                },
                child: child.clone(),
            });
        }
        let outcome = match shared {
            // Another replication of the same tree wrote (and counted) it.
            true => Outcome::default(),
            false => tree.found.outcome.clone(),
        };
        Ok((tree, outcome))
    }
}
