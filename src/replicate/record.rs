//! The image records of a replication
//! ([docs/design.md](../../docs/design.md#replication): the protected
//! names checked before anything is written, and step 3).
//!
//! Plan: the source's record is read as it is now, not as the write's
//! reply had it (under the per-name lock, racing writers converge on what
//! containerd holds), next to the target's, and nothing is written into a
//! target whose record is protected ([`super::protect`]).
//!
//! Record: written last, once every blob is visible, named as CRI
//! normalises the name (kubelet asks for `docker.io/library/app:dev`, never
//! `app:dev`), labelled `io.imgbridge.source`, optionally pinned, and
//! marked as CRI's own when the image id is certain ([`super::cri_id`]); a
//! `name@sha256:…` record next to it for registry mirrors. The rules are
//! the pure functions here ([`replica`], [`digest_ref`], [`refusal`],
//! [`record`]); the rest is their I/O.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::distribution;
use super::locks::KeyedLocks;
use super::protect::{self, Protection};
use super::walk::{Registry, Shared, Walked};
use super::{cri_id, Error, Outcome, Replicator};
use crate::containerd::{self as ctrd, Containerd, Descriptor, Image};
use crate::labels::{
    pin_owner, PinOwner, CRI_MANAGED, CRI_MANAGED_VALUE, CRI_NAMESPACE, CRI_PREFIX, EXPIRE, IMPORT,
    PINNED, PINNED_VALUE, REPLICATE, REPLICATE_NO, SOURCE,
};
use crate::oci::{Reference, ReferenceError};

/// The image a replication is of, its name parsed once for every target
/// and phase.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Replica {
    /// The name as the source holds it.
    pub image: String,
    pub reference: Reference,
    /// The name of the record in each target, as CRI normalises it.
    pub name: String,
    /// The distribution-source label the walk gives every blob.
    pub registry: Registry,
}

/// Why an image is not replicated at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Skip {
    /// An image-id record (`sha256:…`): CRI's, written next to a name.
    ImageId,
    /// Not a reference: no name CRI could resolve.
    Invalid {
        image: String,
        error: ReferenceError,
    },
}

impl Skip {
    /// What a replication into one target reports for it (and says why).
    pub fn outcome(&self, source: &str) -> Outcome {
        if let Skip::Invalid { image, error } = self {
            tracing::warn!(image = image.as_str(), source, error = %error,
                "not replicating an image whose name is not a valid reference");
        }
        Outcome {
            skipped: true,
            ..Default::default()
        }
    }
}

/// The replica of the source image `image`, or why there is none.
pub(super) fn replica(image: &str) -> Result<Replica, Skip> {
    if image.starts_with("sha256:") {
        return Err(Skip::ImageId);
    }
    let reference = Reference::parse(image).map_err(|error| Skip::Invalid {
        image: image.into(),
        error,
    })?;
    Ok(Replica {
        image: image.into(),
        name: reference.to_string(),
        registry: distribution::label(&reference),
        reference,
    })
}

impl Replica {
    /// The error a failed containerd call of this replication becomes.
    pub fn err<'a>(
        &'a self,
        source: &'a str,
        target: &'a str,
    ) -> impl Fn(ctrd::Error) -> Error + 'a {
        move |cause| Error::Containerd {
            image: self.image.clone(),
            source_ns: source.into(),
            target: target.into(),
            cause,
        }
    }
}

/// The `name@sha256:…` record written next to a tag (`digest_refs`):
/// spegel and embedded mirrors serve a digest only from such a record, and
/// a pod may name the image that way. None for a name that is a digest
/// already.
pub(super) fn digest_ref(r: &Reference, root: &str, digest_refs: bool) -> Option<String> {
    (digest_refs && r.digest.is_none()).then(|| r.with_digest(root))
}

/// What a protection means for a replication.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// Nothing protects the name: write.
    Clear,
    /// Protected, but the target already holds what the source does:
    /// nothing to replace, nothing to refuse.
    InSync,
    /// Protected and different: nothing is written.
    Refused(Protection),
}

/// Whether the record `existing` of a target may be replaced by one
/// pointing at `root`, given the protection on its name or record.
pub(super) fn refusal(
    protection: Option<Protection>,
    existing: Option<&Image>,
    root: &Descriptor,
) -> Refusal {
    let Some(protection) = protection else {
        return Refusal::Clear;
    };
    let held = existing.and_then(|e| e.target.as_ref());
    match held.is_some_and(|t| t.digest == root.digest) {
        true => Refusal::InSync,
        false => Refusal::Refused(protection),
    }
}

/// The record `name` a target gets for the source record `image` at
/// `root`, written from `source`; `None` if `existing` is that already. It
/// carries the source's labels but `gc.expire` and CRI's own, the source
/// namespace, the pin (`pin`) and CRI's management mark (`managed`). Of
/// the existing record it keeps what others own: the importer's label, a
/// pin the importer or someone else set, and CRI's mark while the digest
/// is unchanged (a changed digest clears it: CRI then does its own part).
pub(super) fn record(
    source: &str,
    name: &str,
    image: &Image,
    root: &Descriptor,
    existing: Option<&Image>,
    pin: bool,
    managed: bool,
) -> Option<Image> {
    let mut labels: HashMap<String, String> = image
        .labels
        .iter()
        .filter(|(k, _)| k.as_str() != EXPIRE && !k.starts_with(CRI_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    labels.insert(SOURCE.into(), source.into());
    if pin {
        labels.insert(PINNED.into(), PINNED_VALUE.into());
    }
    if managed {
        labels.insert(CRI_MANAGED.into(), CRI_MANAGED_VALUE.into());
    }
    if let Some(e) = existing {
        let same_target = e.target.as_ref().map(|t| &t.digest) == Some(&root.digest);
        for (k, v) in &e.labels {
            let keep = k == IMPORT
                || (k == PINNED
                    && matches!(pin_owner(&e.labels), PinOwner::Import | PinOwner::Other))
                || (k == CRI_MANAGED && same_target);
            if keep {
                labels.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        if same_target && e.target.as_ref() == Some(root) && e.labels == labels {
            return None;
        }
    }
    Some(Image {
        name: name.into(),
        labels,
        target: Some(root.clone()),
        ..Default::default()
    })
}

/// What the plan decided.
pub(super) enum Planned<'a> {
    /// Go on to write, with what the plan found (boxed: it is most of the
    /// size).
    Write(Box<Plan<'a>>),
    /// Nothing to write: the replication ends with this outcome.
    Done(Outcome),
}

/// What the plan found, for the phases after it.
pub(super) struct Plan<'a> {
    pub replica: &'a Replica,
    /// The source's record as it is now.
    pub image: Image,
    /// Where it points.
    pub root: Descriptor,
    /// The target's record of the name, until the tag is written.
    pub existing: Option<Image>,
    pub digest_ref: Option<String>,
    /// The walk of the tree the write's reply named, started with the
    /// reads ([`super::walk`]); used if it is the record's tree.
    pub early: Option<(&'a Descriptor, Shared)>,
}

impl Replicator {
    /// The plan: the source's record as it is now, the target's, and
    /// whether the name may be written there. The tree the reply named (`hint`) is walked meanwhile (almost
    /// always the record's; if not, that walk is not used): all reads but
    /// the links, and the caller's lock keeps our own writers out. The walk
    /// writes only once the target's record is known not to be protected
    /// ([`protect::Gate`]); a name protected as such is not walked at all.
    pub(super) async fn plan<'a>(
        &self,
        source: &str,
        target: &str,
        replica: &'a Replica,
        hint: Option<&'a Descriptor>,
    ) -> Result<Planned<'a>, Error> {
        let by_name = self.protection_by_name(target, &replica.name).await;
        let (verdict, gate) = protect::Gate::pending();
        let hint = hint.filter(|_| by_name.is_none());
        let (image, existing, early) = tokio::join!(
            self.c.get_image(source, &replica.image),
            async {
                let existing = self.c.get_image(target, &replica.name).await;
                let clear = by_name.is_none()
                    && matches!(&existing, Ok(e) if self.protect.by_record(&replica.name, e.as_ref()).is_none());
                let _ = verdict.send(Some(clear));
                existing
            },
            async {
                let h = hint?;
                let registry = Some(&replica.registry);
                Some((
                    h,
                    self.walk_shared(source, target, registry, h, &gate).await,
                ))
            }
        );
        let err = replica.err(source, target);
        let Some(image) = image.map_err(&err)? else {
            tracing::debug!(
                image = replica.image.as_str(),
                source,
                "source image gone before replication; nothing to do"
            );
            return Ok(Planned::Done(Outcome::default()));
        };
        if image.labels.get(REPLICATE).map(String::as_str) == Some(REPLICATE_NO) {
            // Not an image for CRI (a registry artefact or digest-only
            // manifest, see crate::registry).
            return Ok(Planned::Done(Outcome {
                skipped: true,
                ..Default::default()
            }));
        }
        let existing = existing.map_err(&err)?;
        let root = image.target.clone().ok_or_else(|| Error::NoTarget {
            image: replica.image.clone(),
            source_ns: source.into(),
        })?;
        let protection =
            by_name.or_else(|| self.protect.by_record(&replica.name, existing.as_ref()));
        match refusal(protection, existing.as_ref(), &root) {
            Refusal::Clear => {}
            Refusal::InSync => return Ok(Planned::Done(Outcome::default())),
            Refusal::Refused(protection) => {
                return Err(Error::Protected {
                    image: replica.image.clone(),
                    source_ns: source.into(),
                    target: target.into(),
                    replica: replica.name.clone(),
                    protection,
                })
            }
        }
        let digest_ref = digest_ref(&replica.reference, &root.digest, self.s.digest_refs);
        Ok(Planned::Write(Box::new(Plan {
            replica,
            image,
            root,
            existing,
            digest_ref,
            early,
        })))
    }

    /// Why `name` may not be replaced in `target`, from the name alone;
    /// CRI's sandbox image is read first if it is not known yet.
    async fn protection_by_name(&self, target: &str, name: &str) -> Option<Protection> {
        let cri_target = target == CRI_NAMESPACE;
        if cri_target && self.protect.sandbox() == protect::Sandbox::Unknown {
            self.refresh_sandbox().await;
        }
        self.protect.by_name(cri_target, name)
    }

    /// Reads CRI's sandbox image from containerd again: at start and after
    /// every reconnect (each catch-up pass), as containerd may have come
    /// back with another config. A read that fails leaves it unknown, to
    /// be asked again by the next replication into `k8s.io`.
    pub async fn refresh_sandbox(&self) {
        if !self.has_cri().await {
            self.protect.set_sandbox(None);
            return;
        }
        let file = ctrd::node_config::locate_for(self.c.socket());
        let read = self.c.cri_sandbox_image(file.as_deref());
        match tokio::time::timeout(Duration::from_secs(5), read).await {
            Ok(Ok(name)) => {
                let before = self.protect.sandbox();
                self.protect.set_sandbox(name.as_deref());
                if self.protect.sandbox() != before {
                    tracing::info!(sandbox_image = ?name, "CRI's sandbox image is protected: replicas never replace it");
                }
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "could not read CRI's sandbox image; asking again on the next replication")
            }
            Err(_) => tracing::debug!(
                "CRI's sandbox image not read within 5 s; asking again on the next replication"
            ),
        }
    }

    /// The tag record, written once every blob is visible, first of the
    /// records so that CRI handles its event first; the blobs noted
    /// missing that arrived meanwhile are linked at the same time
    /// ([`super::pending`]). Returns writes.
    pub(super) async fn record_tag(
        &self,
        source: &str,
        target: &str,
        plan: &mut Plan<'_>,
        tree: &Walked,
    ) -> Result<usize, ctrd::Error> {
        let managed = tree.cri_id.is_some();
        let existing = plan.existing.take();
        let (tag, ()) = tokio::join!(
            self.put_record(
                source,
                target,
                &plan.replica.name,
                &plan.image,
                existing,
                managed
            ),
            self.arrived_meanwhile(source, &tree.found.missing)
        );
        tag
    }

    /// The digest ref ([`digest_ref`]), if any. It is one record for every
    /// name of the tree: a burst of names for one image would otherwise
    /// write it once per name (each a bolt transaction with an fsync, one
    /// at a time), so its writers take turns and each reads it again under
    /// the lock. Returns writes.
    pub(super) async fn record_digest_ref(
        &self,
        source: &str,
        target: &str,
        plan: &Plan<'_>,
        managed: bool,
    ) -> Result<usize, ctrd::Error> {
        let Some(n) = &plan.digest_ref else {
            return Ok(0);
        };
        let _guard = self.locks.lock(format!("{target}\0{n}")).await;
        let existing = self.c.get_image(target, n).await?;
        self.put_record(source, target, n, &plan.image, existing, managed)
            .await
    }

    /// The id record of a tree whose names are written marked, after the
    /// names: CRI does not need it to resolve them (and handles events in
    /// order). `detached` (a client's write waits): written in the
    /// background, returning 0; the tree, and with it the lease (once the
    /// last replication sharing it is done), is held until it is in.
    pub(super) async fn record_id(
        &self,
        target: &str,
        tree: Arc<Walked>,
        root: &Descriptor,
        detached: bool,
    ) -> Result<usize, ctrd::Error> {
        if !detached {
            return id_record(&self.c, &self.locks, target, &tree, root).await;
        }
        let (c, locks, target, root) = (
            self.c.clone(),
            self.locks.clone(),
            target.to_string(),
            root.clone(),
        );
        tokio::spawn(async move {
            if let Err(e) = id_record(&c, &locks, &target, &tree, &root).await {
                tracing::warn!(target, id = ?tree.cri_id, error = %e,
                    "could not write the image id record CRI keeps; the next pass over the image writes it");
            }
        });
        Ok(0)
    }

    /// Writes the record `name` in `target`, pointing where the source
    /// record `image` points, if it differs ([`record`]); returns writes.
    /// `managed`: written marked as CRI's, its id record written next to it.
    async fn put_record(
        &self,
        source: &str,
        target: &str,
        name: &str,
        image: &Image,
        existing: Option<Image>,
        managed: bool,
    ) -> Result<usize, ctrd::Error> {
        let Some(root) = image.target.as_ref() else {
            return Err(ctrd::Error::Protocol(format!("image {name} has no target")));
        };
        let pin = self.s.pin;
        let Some(record) = record(source, name, image, root, existing.as_ref(), pin, managed)
        else {
            return Ok(0);
        };
        match existing {
            Some(_) => match self
                .c
                .update_image(target, record.clone(), Vec::new())
                .await
            {
                Err(e) if e.is(tonic::Code::NotFound) => {
                    self.c.put_image(target, record).await?;
                }
                r => {
                    r?;
                }
            },
            None => {
                self.c.put_image(target, record).await?;
            }
        }
        Ok(1)
    }
}

/// Makes sure the id record of a tree whose names are written marked
/// exists ([`cri_id`]), once for all of them; returns the writes this
/// caller made. CRI does not write it for a marked name, and does not need
/// it to resolve one: it keeps the tree alive by its id once the names move
/// on, so it is written after the names, off a client's path.
async fn id_record(
    c: &Containerd,
    locks: &KeyedLocks,
    target: &str,
    tree: &Walked,
    root: &Descriptor,
) -> Result<usize, ctrd::Error> {
    let Some(id) = &tree.cri_id else {
        return Ok(0);
    };
    let mut mine = false;
    let writes = tree
        .id_record
        .get_or_try_init(|| {
            mine = true;
            async {
                let _guard = locks.lock(format!("{target}\0{id}")).await;
                cri_id::ensure(c, target, id, root).await
            }
        })
        .await?;
    Ok(if mine { *writes } else { 0 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::labels::DISTRIBUTION_SOURCE;
    use crate::replicate::protect::Protections;

    fn d(c: char) -> String {
        format!("sha256:{}", c.to_string().repeat(64))
    }

    fn root(c: char) -> Descriptor {
        Descriptor {
            media_type: "application/vnd.oci.image.index.v1+json".into(),
            digest: d(c),
            size: 1,
            ..Default::default()
        }
    }

    fn image(name: &str, at: Option<char>, labels: &[(&str, &str)]) -> Image {
        Image {
            name: name.into(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            target: at.map(root),
            ..Default::default()
        }
    }

    /// The label set of a record, sorted, to compare.
    fn labels(i: &Image) -> Vec<(&str, &str)> {
        let mut l: Vec<_> = i
            .labels
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        l.sort();
        l
    }

    const APP: &str = "docker.io/library/app:dev";

    /// The replica is named as CRI normalises the name (kubelet never asks
    /// for `app:dev`), the name parsed once with its registry; image-id
    /// records and names that are no reference are not replicated.
    #[test]
    fn the_replica_is_named_as_cri_resolves_it() {
        let r = replica("app:dev").unwrap();
        assert_eq!(r.image, "app:dev");
        assert_eq!(r.name, APP);
        assert_eq!(
            r.registry,
            (
                format!("{DISTRIBUTION_SOURCE}.docker.io"),
                "library/app".to_string()
            )
        );
        let pinned = format!("127.0.0.1:5000/team/app:1@{}", d('a'));
        let r = replica(&pinned).unwrap();
        assert_eq!(r.name, format!("127.0.0.1:5000/team/app@{}", d('a')));
        assert_eq!(replica(&d('c')), Err(Skip::ImageId));
        assert!(matches!(
            replica("Not A Name"),
            Err(Skip::Invalid { image, .. }) if image == "Not A Name"
        ));
        assert!(Skip::ImageId.outcome("buildkit").skipped);
    }

    /// A `name@sha256:…` record goes next to a tag with `digest_refs`,
    /// named after the tree it points at; a name that is a digest has none.
    #[test]
    fn a_digest_ref_goes_next_to_a_tag() {
        let tag = Reference::parse("app:dev").unwrap();
        assert_eq!(
            digest_ref(&tag, &d('a'), true),
            Some(format!("docker.io/library/app@{}", d('a')))
        );
        assert_eq!(digest_ref(&tag, &d('a'), false), None);
        let by_digest = Reference::parse(&format!("app@{}", d('b'))).unwrap();
        assert_eq!(digest_ref(&by_digest, &d('a'), true), None);
    }

    /// A new record: the source's labels but `gc.expire` and CRI's own,
    /// `io.imgbridge.source`, the pin with `pin`, CRI's mark with
    /// `managed`; named as given, pointing at the source's root.
    #[test]
    fn a_new_record_carries_source_pin_and_mark() {
        let src = image(
            "app:dev",
            Some('a'),
            &[
                ("org.opencontainers.image.title", "app"),
                (EXPIRE, "2026-01-01T00:00:00Z"),
                (CRI_MANAGED, CRI_MANAGED_VALUE),
                (PINNED, PINNED_VALUE),
            ],
        );
        let r = record("buildkit", APP, &src, &root('a'), None, false, false).unwrap();
        assert_eq!(r.name, APP);
        assert_eq!(r.target, Some(root('a')));
        assert_eq!(
            labels(&r),
            [
                (SOURCE, "buildkit"),
                ("org.opencontainers.image.title", "app")
            ]
        );
        let r = record("buildkit", APP, &src, &root('a'), None, true, true).unwrap();
        assert_eq!(r.labels[PINNED], PINNED_VALUE);
        assert_eq!(r.labels[CRI_MANAGED], CRI_MANAGED_VALUE);
    }

    /// Of a record there, what others own stays: the importer's label, a
    /// pin the importer or someone else set. A pin imgbridge set goes when
    /// `pin` is off.
    #[test]
    fn an_existing_record_keeps_what_others_own() {
        let src = image("app:dev", Some('b'), &[]);
        let rec = |existing: &Image, pin| {
            record(
                "buildkit",
                APP,
                &src,
                &root('b'),
                Some(existing),
                pin,
                false,
            )
            .unwrap()
        };
        let imported = image(
            APP,
            Some('a'),
            &[(IMPORT, "app.tar"), (PINNED, PINNED_VALUE)],
        );
        let r = rec(&imported, false);
        assert_eq!(r.labels[IMPORT], "app.tar");
        assert_eq!(r.labels[PINNED], PINNED_VALUE);
        let operator = image(APP, Some('a'), &[(PINNED, PINNED_VALUE)]);
        assert_eq!(rec(&operator, false).labels[PINNED], PINNED_VALUE);
        let ours = image(
            APP,
            Some('a'),
            &[(SOURCE, "buildkit"), (PINNED, PINNED_VALUE)],
        );
        assert!(!rec(&ours, false).labels.contains_key(PINNED));
        assert_eq!(rec(&ours, true).labels[PINNED], PINNED_VALUE);
    }

    /// CRI's mark stays while the record points at the same tree (CRI set
    /// it, and has the id record), and goes with a changed digest: unless
    /// the id is certain (`managed`), CRI then does its own part.
    #[test]
    fn cri_s_mark_is_cleared_by_a_changed_digest_only() {
        let src = image("app:dev", Some('a'), &[]);
        let marked = |at| {
            image(
                APP,
                Some(at),
                &[(SOURCE, "buildkit"), (CRI_MANAGED, CRI_MANAGED_VALUE)],
            )
        };
        // Same tree: the mark kept, so the record is as it should be.
        assert_eq!(
            record(
                "buildkit",
                APP,
                &src,
                &root('a'),
                Some(&marked('a')),
                false,
                false
            ),
            None
        );
        let moved = record(
            "buildkit",
            APP,
            &src,
            &root('a'),
            Some(&marked('b')),
            false,
            false,
        );
        assert!(!moved.unwrap().labels.contains_key(CRI_MANAGED));
        let certain = record(
            "buildkit",
            APP,
            &src,
            &root('a'),
            Some(&marked('b')),
            false,
            true,
        );
        assert_eq!(certain.unwrap().labels[CRI_MANAGED], CRI_MANAGED_VALUE);
    }

    /// A record already as it should be is not written again; any
    /// difference (labels, the descriptor) is.
    #[test]
    fn a_record_in_sync_is_not_written() {
        let src = image("app:dev", Some('a'), &[("x", "1")]);
        let want = record("buildkit", APP, &src, &root('a'), None, true, false).unwrap();
        let again = record("buildkit", APP, &src, &root('a'), Some(&want), true, false);
        assert_eq!(again, None);
        let mut stale = want.clone();
        stale.labels.insert("x".into(), "0".into());
        assert!(record("buildkit", APP, &src, &root('a'), Some(&stale), true, false).is_some());
        let mut resized = want;
        resized.target.as_mut().unwrap().size = 2;
        assert!(record(
            "buildkit",
            APP,
            &src,
            &root('a'),
            Some(&resized),
            true,
            false
        )
        .is_some());
    }

    /// A protected name ([`protect`]) is refused unless the target already
    /// holds the source's tree; `replication.overwrite` lifts it.
    #[test]
    fn protected_names_are_refused_unless_already_in_sync() {
        let p = Protections::new(&["registry.k8s.io/**".to_string()], &[]);
        p.set_sandbox(Some("registry.k8s.io/pause:3.10"));
        let pause = "registry.k8s.io/pause:3.10";
        let held = image(pause, Some('a'), &[]);
        let by_name = p.by_name(true, pause);
        assert_eq!(by_name, Some(Protection::Sandbox));
        assert_eq!(
            refusal(by_name.clone(), Some(&held), &root('b')),
            Refusal::Refused(Protection::Sandbox)
        );
        assert_eq!(
            refusal(by_name.clone(), Some(&held), &root('a')),
            Refusal::InSync
        );
        assert_eq!(
            refusal(by_name, None, &root('a')),
            Refusal::Refused(Protection::Sandbox)
        );
        let glob = p.by_name(false, "registry.k8s.io/coredns:1");
        assert!(matches!(
            refusal(glob, None, &root('a')),
            Refusal::Refused(Protection::Glob(_))
        ));
        let foreign = image(APP, Some('a'), &[(PINNED, PINNED_VALUE)]);
        let by_record = p.by_record(APP, Some(&foreign));
        assert_eq!(
            refusal(by_record, Some(&foreign), &root('b')),
            Refusal::Refused(Protection::ForeignPin)
        );
        let ours = image(
            APP,
            Some('a'),
            &[(PINNED, PINNED_VALUE), (SOURCE, "buildkit")],
        );
        assert_eq!(
            refusal(p.by_record(APP, Some(&ours)), Some(&ours), &root('b')),
            Refusal::Clear
        );
        let lifted = Protections::new(&[], &[APP.to_string()]);
        assert_eq!(lifted.by_record(APP, Some(&foreign)), None);
    }
}
