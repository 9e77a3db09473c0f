//! The walk of the apply phase ([`super::apply`], [docs/design.md](../../docs/design.md#replication),
//! step 2): every blob of the tree that the source holds is made visible
//! in the target with its labels, under a lease; the blobs the source
//! lacks are noted, each with whether a pod on this node could need it,
//! for [`super::pending`] to link when they appear.
//!
//! Each blob is inspected read-only first ([`visit`]), so a tree already in
//! sync costs no write. The bookkeeping of a walk ([`Walk`]: which blobs,
//! each once, parents before their children; what is missing; the configs
//! seen) is kept apart from its I/O so it can be tested without containerd.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::OnceCell;

use super::spare::Lease;
use super::tree::{self, Child, Need};
use super::{announce, protect, Outcome, Replicator};
use crate::containerd::content::{BlobRef, Linked};
use crate::containerd::{self as ctrd, Descriptor};
use crate::labels::{CRI_NAMESPACE, DISTRIBUTION_SOURCE, EXPIRE, GC_REF_CONTENT};
use crate::lock::lock;
use crate::oci::Digest;
use containerd_client::services::v1::Info;

/// Blobs linked or checked in parallel per image.
const PARALLEL: usize = 16;

/// The distribution-source label a walk gives every blob
/// ([`super::distribution`]): `(key, repository)`.
pub(super) type Registry = (String, String);

/// What a walk found: the writes it made, the config digests seen (the
/// image ids CRI may report) and the blobs the source lacks, each with
/// whether this node could need it.
#[derive(Debug, Default)]
pub(super) struct Found {
    pub outcome: Outcome,
    pub configs: Vec<String>,
    pub missing: Vec<(Child, Need)>,
}

/// A tree made visible in a target, shared by the replications that need
/// it at once; dropping the last one releases the lease.
pub(super) struct Walked {
    _lease: Lease,
    pub found: Found,
    /// The image id CRI will report, when certain; the names are then
    /// written already marked and its id record next to them
    /// ([`super::cri_id`]).
    pub cri_id: Option<String>,
    /// The id record's writes, made once for every name of the tree.
    pub id_record: OnceCell<usize>,
}

/// A tree walked for a replication, and whether it was shared with
/// another ([`Replicator::walk_shared`]).
pub(super) type Shared = Result<(Arc<Walked>, bool), ctrd::Error>;

/// Result of looking at one blob.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Visit {
    pub children: Vec<(Child, Need)>,
    pub config: Option<String>,
    pub write: Option<Write>,
    pub pending: bool,
}

/// What a blob needs in the target.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Write {
    /// Not there: link (or copy) it with these labels; if another
    /// replication linked it since, they are checked then.
    Link {
        size: i64,
        labels: HashMap<String, String>,
    },
    /// There, but these labels are missing or differ.
    Relabel(HashMap<String, String>),
}

/// A finished unit of [`Replicator::walk`].
enum Step {
    Inspected(Child, Result<Visit, ctrd::Error>),
    Wrote(Result<usize, ctrd::Error>),
}

/// The labels of `want` that `have` lacks or holds with another value; a
/// distribution-source label `have` has for the registry is kept as it is.
fn missing_labels(want: HashMap<String, String>, have: &Info) -> HashMap<String, String> {
    want.into_iter()
        .filter(|(k, v)| match have.labels.get(k) {
            Some(_) if k.starts_with(DISTRIBUTION_SOURCE) => false,
            h => h != Some(v),
        })
        .collect()
}

/// What the target needs of a blob the source holds (`info`), given what
/// the target holds of it and, for an index or manifest, its parsed
/// `node`: the source's labels without `gc.expire` (a replica's blobs must
/// not expire with the source's ingest), the `gc.ref` labels of its
/// children if the source blob has none (written by a client that did not
/// label it: the children must stay alive in the target all the same), and
/// the registry's distribution-source label unless it has one.
pub(super) fn visit(
    info: Info,
    in_target: Option<Info>,
    node: Option<&tree::Node>,
    registry: Option<&Registry>,
) -> Visit {
    let mut labels: HashMap<String, String> = info
        .labels
        .into_iter()
        .filter(|(k, _)| k != EXPIRE)
        .collect();
    if let Some(n) = node {
        if !labels.keys().any(|k| k.starts_with(GC_REF_CONTENT)) {
            labels.extend(n.gc_labels());
        }
    }
    if let Some((k, repo)) = registry {
        labels.entry(k.clone()).or_insert_with(|| repo.clone());
    }
    let mut v = Visit::default();
    match in_target {
        None => {
            v.write = Some(Write::Link {
                size: info.size,
                labels,
            })
        }
        Some(t) => {
            let missing = missing_labels(labels, &t);
            if !missing.is_empty() {
                v.write = Some(Write::Relabel(missing));
            }
        }
    }
    if let Some(n) = node {
        v.config = n.doc.config.as_ref().map(|c| c.digest.to_string());
        v.children = n
            .children_needed()
            .map(|(c, need)| (c.clone(), need))
            .collect();
    }
    v
}

/// The bookkeeping of one walk from a root, without its I/O: the blobs to
/// inspect (each once, a parent before its children), and what the
/// inspections found.
pub(super) struct Walk {
    root: String,
    queue: Vec<Child>,
    seen: HashSet<String>,
    /// Parent → children of every parent read, to tell afterwards which
    /// blobs a pod here could need: a blob reached first under another
    /// platform's entry may also sit under this node's.
    edges: HashMap<String, Vec<(String, Need)>>,
    outcome: Outcome,
    configs: Vec<String>,
    missing: Vec<Child>,
}

impl Walk {
    /// A walk from a record's target (containerd validated its digest when
    /// the record was written; one it did not is refused here).
    pub fn new(root: &Descriptor) -> Result<Walk, ctrd::Error> {
        let digest = Digest::parse(&root.digest)
            .map_err(|e| ctrd::Error::Protocol(format!("image target: {e}")))?;
        Ok(Walk {
            root: root.digest.clone(),
            queue: vec![Child::new(root.media_type.clone(), digest, root.size)],
            seen: HashSet::new(),
            edges: HashMap::new(),
            outcome: Outcome::default(),
            configs: Vec::new(),
            missing: Vec::new(),
        })
    }

    /// The next blob to inspect, never one inspected before.
    pub fn next(&mut self) -> Option<Child> {
        while let Some(c) = self.queue.pop() {
            if self.seen.insert(c.digest.to_string()) {
                return Some(c);
            }
        }
        None
    }

    /// Takes in what the inspection of `child` found; returns the write it
    /// needs, if any.
    pub fn inspected(&mut self, child: &Child, v: Visit) -> Option<Write> {
        if v.pending {
            self.outcome.pending += 1;
            self.missing.push(child.clone());
        }
        self.configs.extend(v.config);
        if !v.children.is_empty() {
            let e = v.children.iter().map(|(c, n)| (c.digest.to_string(), *n));
            self.edges.insert(child.digest.to_string(), e.collect());
        }
        self.queue.extend(v.children.into_iter().map(|(c, _)| c));
        v.write
    }

    pub fn wrote(&mut self, writes: usize) {
        self.outcome.writes += writes;
    }

    /// What the walk found; each missing blob is needed here if a pod on
    /// this node could reach it from the root ([`tree::needed_here`]).
    pub fn finish(self) -> Found {
        let here = tree::needed_here(&self.root, &self.edges);
        let missing = self
            .missing
            .into_iter()
            .map(|c| {
                let n = match here.contains(c.digest.as_str()) {
                    true => Need::Node,
                    false => Need::OtherPlatform,
                };
                (c, n)
            })
            .collect();
        Found {
            outcome: self.outcome,
            configs: self.configs,
            missing,
        }
    }
}

impl Replicator {
    /// [`Self::walk`] once per tree and target for every replication that
    /// needs it at the same time (a burst of names for one image): the
    /// first walks, the others wait for it and share its result. The
    /// shared [`Walked`] holds the lease, so the tree stays protected until
    /// the last of them has written its record. `true`: shared. Names of
    /// another registry walk on their own: the walk labels every blob with
    /// the name's registry ([`super::distribution`]).
    pub(super) async fn walk_shared(
        &self,
        source: &str,
        target: &str,
        registry: Option<&Registry>,
        root: &Descriptor,
        gate: &protect::Gate,
    ) -> Shared {
        let key = format!(
            "{source}\0{target}\0{}\0{}",
            root.digest,
            registry.map_or("", |(k, _)| k.as_str())
        );
        let _walking = self.walk_locks.lock(key.clone()).await;
        if let Some(w) = lock(&self.walked)
            .get(&key)
            .and_then(std::sync::Weak::upgrade)
        {
            return Ok((w, true));
        }
        let lease = Lease::new(&self.spares, target);
        let found = self
            .walk(source, target, registry, root, &lease, gate)
            .await?;
        let cri_id = match target == CRI_NAMESPACE && self.has_cri().await {
            true => self.cri_id(source, root).await,
            false => None,
        };
        let w = Arc::new(Walked {
            _lease: lease,
            found,
            cri_id,
            id_record: OnceCell::new(),
        });
        let mut walked = lock(&self.walked);
        walked.retain(|_, w| w.strong_count() > 0);
        walked.insert(key, Arc::downgrade(&w));
        Ok((w, false))
    }

    /// Walks the tree from `root`, making every present blob visible in
    /// `target`, given that this node could need `root`.
    ///
    /// Inspections (reads) and writes share one bounded set of futures: a
    /// blob's link starts as soon as it is inspected, and its children are
    /// inspected meanwhile, so a cold tree costs about one round trip per
    /// level plus containerd's commit rate.
    pub(super) async fn walk(
        &self,
        source: &str,
        target: &str,
        registry: Option<&Registry>,
        root: &Descriptor,
        lease: &Lease,
        gate: &protect::Gate,
    ) -> Result<Found, ctrd::Error> {
        let mut walk = Walk::new(root)?;
        let mut running: FuturesUnordered<BoxFuture<'_, Step>> = FuturesUnordered::new();
        loop {
            while running.len() < PARALLEL {
                let Some(c) = walk.next() else { break };
                running.push(Box::pin(async move {
                    let r = self.inspect(source, target, registry, &c).await;
                    Step::Inspected(c, r)
                }));
            }
            let Some(step) = running.next().await else {
                break;
            };
            match step {
                Step::Inspected(child, r) => {
                    if let Some(w) = walk.inspected(&child, r?) {
                        running.push(Box::pin(async move {
                            if !gate.passed().await {
                                let shut = "the target's record is protected: nothing written";
                                return Step::Wrote(Err(ctrd::Error::Protocol(shut.into())));
                            }
                            Step::Wrote(self.write_blob(source, target, &child, w, lease).await)
                        }));
                    }
                }
                Step::Wrote(r) => walk.wrote(r?),
            }
        }
        Ok(walk.finish())
    }

    /// One blob, read-only: present in source? its labels and children, and
    /// what (if anything) the target needs ([`visit`]). The reads run at
    /// once: asking the target costs no round trip, and a blob found there
    /// (the base layers of a rebuild) needs no write at all, where a link
    /// would be a bolt transaction answering ALREADY_EXISTS. Such a blob is
    /// not in our lease, but its parent is (linked with its `gc.ref` labels
    /// at the same time as this probe), so from then on the lease keeps it;
    /// only a GC finishing in between could take it, and a reconcile pass
    /// links it again.
    async fn inspect(
        &self,
        source: &str,
        target: &str,
        registry: Option<&Registry>,
        c: &Child,
    ) -> Result<Visit, ctrd::Error> {
        let parent = tree::is_parent(&c.media_type);
        let (info, in_target, node) = tokio::join!(
            self.c.content_info(source, &c.digest),
            self.c.content_info(target, &c.digest),
            async {
                if parent {
                    Some(self.node(source, &c.digest).await)
                } else {
                    None
                }
            }
        );
        let Some(info) = info? else {
            return Ok(Visit {
                pending: true,
                ..Default::default()
            });
        };
        let node = node.transpose()?;
        Ok(visit(info, in_target?, node.as_deref(), registry))
    }

    /// Performs what [`Self::inspect`] found missing; returns writes made.
    async fn write_blob(
        &self,
        source: &str,
        target: &str,
        c: &Child,
        w: Write,
        lease: &Lease,
    ) -> Result<usize, ctrd::Error> {
        let (size, labels) = match w {
            Write::Relabel(missing) => {
                self.c
                    .update_content_labels(target, &c.digest, &missing)
                    .await?;
                if missing.keys().any(|k| k.starts_with(DISTRIBUTION_SOURCE)) {
                    announce::content_created(&self.c, target, &c.digest, c.size).await;
                }
                return Ok(1);
            }
            Write::Link { size, labels } => (size, labels),
        };
        let id = lease.id().await?;
        let blob = BlobRef {
            digest: &c.digest,
            size,
            labels: &labels,
        };
        let shared = if self.shared_content().await {
            self.c.link_shared(target, Some(id), blob.clone()).await?
        } else {
            None
        };
        let linked = match shared {
            Some(l) => l,
            None => self.c.link_or_copy(source, target, Some(id), blob).await?,
        };
        if linked == Linked::Present {
            // Linked unseen (or another replication linked it since the
            // probe, with its own labels): its labels were not checked.
            if let Some(t) = self.c.content_info(target, &c.digest).await? {
                let missing = missing_labels(labels, &t);
                if !missing.is_empty() {
                    self.c
                        .update_content_labels(target, &c.digest, &missing)
                        .await?;
                }
            }
        } else if linked != Linked::Present && !self.content_events().await {
            announce::content_created(&self.c, target, &c.digest, size).await;
        }
        Ok(1)
    }

    /// Whether containerd publishes `/content/create` itself (asked once,
    /// when known; see [`announce`]).
    async fn content_events(&self) -> bool {
        let r = self
            .content_events
            .get_or_try_init(|| async {
                self.c
                    .version()
                    .await
                    .map(|v| announce::publishes_content_events(&v))
            })
            .await;
        // Unknown (containerd restarting): announcing is harmless either way.
        matches!(r, Ok(true))
    }

    /// Whether containerd shares content across namespaces (asked once):
    /// then a blob is linked with a single COMMIT message.
    async fn shared_content(&self) -> bool {
        let r = self
            .shared
            .get_or_try_init(|| async { self.c.sharing_policy().await.map(|p| p == "shared") })
            .await;
        matches!(r, Ok(true))
    }

    /// Parsed index/manifest, cached by digest (content is immutable).
    async fn node(&self, source: &str, digest: &str) -> Result<Arc<tree::Node>, ctrd::Error> {
        if let Some(n) = lock(&self.nodes).get(digest) {
            return Ok(n.clone());
        }
        let bytes = self
            .c
            .read_small(source, digest, tree::MAX_MANIFEST)
            .await?;
        let node = Arc::new(tree::parse(&bytes).map_err(|e| {
            ctrd::Error::Protocol(format!(
                "blob {digest} is not a valid manifest or index: {e}"
            ))
        })?);
        let mut cache = lock(&self.nodes);
        if cache.len() > 8192 {
            cache.clear();
        }
        cache.insert(digest.into(), node.clone());
        Ok(node)
    }

    /// The image id CRI will give the tree at `root` on this host, if that
    /// is certain without asking it: the config of the root manifest, or of
    /// the index entry for this platform ([`tree::Node::host`]).
    pub(super) async fn cri_id(&self, source: &str, root: &Descriptor) -> Option<String> {
        let node = self.node(source, &root.digest).await.ok()?;
        let manifest = match (&node.doc.config, node.host) {
            (Some(_), _) => node,
            (None, Some(i)) => self
                .node(source, &node.doc.manifests[i].child.digest)
                .await
                .ok()?,
            (None, None) => return None,
        };
        manifest.doc.config.as_ref().map(|c| c.digest.to_string())
    }
}

#[cfg(test)]
mod tests {
    //! The walk without containerd: [`Walk`] driven by hand over a source
    //! and a target held in maps, each blob judged by [`visit`] as the real
    //! walk judges what containerd answers. The documents are real ones,
    //! parsed by [`tree::parse`]; no containerd is faked.

    use super::*;
    use crate::labels::media_type::{DOCKER_CONFIG, DOCKER_LAYER_GZIP, DOCKER_MANIFEST};
    use crate::labels::DISTRIBUTION_SOURCE;

    const INDEX: &str = "application/vnd.oci.image.index.v1+json";

    fn d(c: char) -> String {
        format!("sha256:{}", c.to_string().repeat(64))
    }

    fn labels(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn info(kv: &[(&str, &str)]) -> Info {
        Info {
            size: 7,
            labels: labels(kv),
            ..Default::default()
        }
    }

    fn registry() -> Registry {
        (
            format!("{DISTRIBUTION_SOURCE}.docker.io"),
            "library/app".into(),
        )
    }

    /// A manifest naming `config` and `layers`.
    fn manifest(config: char, layers: &[char]) -> Vec<u8> {
        let desc =
            |m: &str, c: char| format!(r#"{{"mediaType":"{m}","digest":"{}","size":1}}"#, d(c));
        let layers: Vec<_> = layers.iter().map(|c| desc(DOCKER_LAYER_GZIP, *c)).collect();
        format!(
            r#"{{"schemaVersion":2,"mediaType":"{DOCKER_MANIFEST}","config":{},"layers":[{}]}}"#,
            desc(DOCKER_CONFIG, config),
            layers.join(",")
        )
        .into_bytes()
    }

    /// An index of manifests, each with its platform (`os/arch`) if any.
    fn index(entries: &[(char, Option<&str>)]) -> Vec<u8> {
        let entry = |(c, p): &(char, Option<&str>)| {
            let platform = p.map_or(String::new(), |p| {
                let (os, arch) = p.split_once('/').unwrap();
                format!(r#","platform":{{"os":"{os}","architecture":"{arch}"}}"#)
            });
            format!(
                r#"{{"mediaType":"{DOCKER_MANIFEST}","digest":"{}","size":1{platform}}}"#,
                d(*c)
            )
        };
        let entries: Vec<_> = entries.iter().map(entry).collect();
        format!(
            r#"{{"schemaVersion":2,"mediaType":"{INDEX}","manifests":[{}]}}"#,
            entries.join(",")
        )
        .into_bytes()
    }

    /// A namespace's content: digest → labels, and the document of a parent.
    #[derive(Default)]
    struct Store(HashMap<String, (Info, Option<tree::Node>)>);

    impl Store {
        fn blob(mut self, c: char) -> Self {
            self.0.insert(d(c), (info(&[]), None));
            self
        }

        fn doc(mut self, c: char, bytes: &[u8]) -> Self {
            let node = tree::parse(bytes).unwrap();
            self.0.insert(d(c), (info(&[]), Some(node)));
            self
        }
    }

    fn root(c: char, media_type: &str) -> Descriptor {
        Descriptor {
            media_type: media_type.into(),
            digest: d(c),
            size: 1,
            ..Default::default()
        }
    }

    /// What a walk of `root` did: the blobs in the order inspected, the
    /// writes, and what it found.
    struct Run {
        order: Vec<String>,
        writes: Vec<(String, Write)>,
        found: Found,
    }

    /// Walks as [`Replicator::walk`] does, one blob at a time, every write
    /// succeeding.
    fn walk(root: &Descriptor, source: &Store, target: &Store) -> Run {
        let mut w = Walk::new(root).unwrap();
        let (mut order, mut writes) = (Vec::new(), Vec::new());
        while let Some(c) = w.next() {
            order.push(c.digest.to_string());
            let v = match source.0.get(c.digest.as_str()) {
                None => Visit {
                    pending: true,
                    ..Default::default()
                },
                Some((info, node)) => {
                    let there = target.0.get(c.digest.as_str()).map(|(i, _)| i.clone());
                    visit(info.clone(), there, node.as_ref(), Some(&registry()))
                }
            };
            if let Some(write) = w.inspected(&c, v) {
                writes.push((c.digest.to_string(), write));
                w.wrote(1);
            }
        }
        Run {
            order,
            writes,
            found: w.finish(),
        }
    }

    /// Every blob of an index (manifests of every platform, configs,
    /// layers) is inspected once, a parent before its children, even a
    /// layer two manifests share; each one the target lacks is linked.
    #[test]
    fn every_blob_once_and_parents_first() {
        let source = Store::default()
            .doc(
                '0',
                &index(&[('1', Some("linux/amd64")), ('2', Some("linux/arm64"))]),
            )
            .doc('1', &manifest('a', &['d', 'e']))
            .doc('2', &manifest('b', &['d', '6']))
            .blob('a')
            .blob('b')
            .blob('d')
            .blob('e')
            .blob('6');
        let r = walk(&root('0', INDEX), &source, &Store::default());
        assert_eq!(r.order[0], d('0'), "the root first");
        let mut seen = r.order.clone();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), r.order.len(), "each once: {:?}", r.order);
        assert_eq!(r.order.len(), 8);
        let at = |c| r.order.iter().position(|x| *x == d(c)).unwrap();
        for (parent, child) in [('0', '1'), ('0', '2'), ('1', 'a'), ('1', 'e'), ('2', '6')] {
            assert!(at(parent) < at(child), "{parent} before {child}");
        }
        assert!(
            at('d') > at('1').min(at('2')),
            "a shared layer after one of its parents"
        );
        assert_eq!(r.writes.len(), 8);
        assert_eq!(r.found.outcome.writes, 8);
        assert!(r
            .writes
            .iter()
            .all(|(_, w)| matches!(w, Write::Link { .. })));
        let mut configs = r.found.configs.clone();
        configs.sort();
        assert_eq!(configs, [d('a'), d('b')], "every manifest's config");
        assert!(r.found.missing.is_empty());
        assert_eq!(r.found.outcome.pending, 0);
    }

    /// A tree the target holds with the same labels costs no write: the
    /// reconcile pass over an image in sync writes nothing.
    #[test]
    fn a_tree_in_sync_writes_nothing() {
        let m = manifest('a', &['e']);
        let source = Store::default().doc('8', &m).blob('a').blob('e');
        let first = walk(&root('8', DOCKER_MANIFEST), &source, &Store::default());
        let mut target = Store::default();
        for (digest, w) in first.writes {
            let Write::Link { labels, .. } = w else {
                panic!("{digest} relabelled in an empty target")
            };
            let node = source.0[&digest].1.clone();
            let info = Info {
                labels,
                ..info(&[])
            };
            target.0.insert(digest, (info, node));
        }
        let again = walk(&root('8', DOCKER_MANIFEST), &source, &target);
        assert_eq!(again.order.len(), 3);
        assert!(again.writes.is_empty(), "{:?}", again.writes);
        assert_eq!(again.found.outcome, Outcome::default());
    }

    /// Blobs the source lacks are pending, not an error, and each says
    /// whether a pod on this node could need it: everything under a plain
    /// manifest; of an index, what lies under the entry CRI resolves here
    /// (also when another platform's entry reaches it first) and under
    /// entries without a platform, but not what only other platforms'
    /// entries or an attestation name.
    #[test]
    fn missing_blobs_are_pending_with_whether_this_node_needs_them() {
        let Some(arch) = super::super::platform::go_arch() else {
            return;
        };
        let other = if arch == "s390x" { "ppc64le" } else { "s390x" };
        let (here, there) = (format!("linux/{arch}"), format!("linux/{other}"));
        let source = Store::default()
            .doc(
                '0',
                &index(&[
                    ('2', Some(&there)),
                    ('1', Some(&here)),
                    ('3', Some(&there)),
                    ('4', Some("unknown/unknown")),
                    ('5', None),
                ]),
            )
            .doc('1', &manifest('a', &['d', 'e']))
            .doc('2', &manifest('b', &['d', '6']))
            .doc('4', &manifest('c', &['7']))
            .blob('a')
            .blob('b')
            .blob('c');
        let r = walk(&root('0', INDEX), &source, &Store::default());
        let mut missing: Vec<_> = r
            .found
            .missing
            .iter()
            .map(|(c, n)| (c.digest.to_string(), *n))
            .collect();
        missing.sort();
        use Need::*;
        let mut want = [
            (d('3'), OtherPlatform), // another platform's manifest
            (d('5'), Node),          // no platform: CRI may resolve it
            (d('d'), Node),          // under this node's entry and another's
            (d('e'), Node),
            (d('6'), OtherPlatform),
            (d('7'), OtherPlatform), // the attestation's
        ];
        want.sort();
        assert_eq!(missing, want);
        assert_eq!(r.found.outcome.pending, 6);
        assert_eq!(r.found.outcome.writes, 7, "the blobs the source holds");
    }

    /// Of a plain manifest, every blob is needed here.
    #[test]
    fn a_missing_blob_of_a_manifest_is_needed_here() {
        let source = Store::default()
            .doc('8', &manifest('a', &['e', '6']))
            .blob('e');
        let r = walk(&root('8', DOCKER_MANIFEST), &source, &Store::default());
        let mut missing: Vec<_> = r
            .found
            .missing
            .iter()
            .map(|(c, n)| (c.digest.to_string(), *n))
            .collect();
        missing.sort();
        let mut want = [(d('a'), Need::Node), (d('6'), Need::Node)];
        want.sort();
        assert_eq!(missing, want);
        assert_eq!(r.found.configs, [d('a')], "a config named is a config seen");
    }

    /// A blob the target lacks is linked with the source's labels, without
    /// `gc.expire`, and with the registry's distribution-source label.
    #[test]
    fn a_link_carries_the_source_labels_but_gc_expire() {
        let src = info(&[
            (EXPIRE, "2026-01-01T00:00:00Z"),
            ("containerd.io/uncompressed", "sha256:u"),
        ]);
        let v = visit(src, None, None, Some(&registry()));
        let want = labels(&[
            ("containerd.io/uncompressed", "sha256:u"),
            (&registry().0, "library/app"),
        ]);
        assert_eq!(
            v.write,
            Some(Write::Link {
                size: 7,
                labels: want
            })
        );
        assert!(!v.pending && v.children.is_empty() && v.config.is_none());
    }

    /// A parent whose source blob has no `gc.ref` labels (its client did
    /// not label it) is linked with its children's, so the target's GC
    /// keeps them; one that has them keeps its own.
    #[test]
    fn an_unlabelled_parent_gets_its_children_gc_labels() {
        let node = tree::parse(&manifest('a', &['e'])).unwrap();
        let v = visit(info(&[]), None, Some(&node), None);
        let Some(Write::Link { labels: l, .. }) = v.write else {
            panic!("not linked")
        };
        assert_eq!(l, node.gc_labels());
        assert_eq!(v.config, Some(d('a')));
        assert_eq!(v.children.len(), 2);
        let own = info(&[(&format!("{GC_REF_CONTENT}.config"), &d('a'))]);
        let v = visit(own, None, Some(&node), None);
        let Some(Write::Link { labels: l, .. }) = v.write else {
            panic!("not linked")
        };
        assert!(!l.contains_key(&format!("{GC_REF_CONTENT}.l.0")), "{l:?}");
    }

    /// A blob the target has is relabelled with only what differs; a
    /// distribution-source label there (a pull's, another replica's) is
    /// kept, never replaced ([`super::super::distribution`]).
    #[test]
    fn a_blob_there_is_relabelled_with_only_what_differs() {
        let key = registry().0;
        let src = info(&[("a", "1"), ("b", "2")]);
        let there = info(&[("a", "1"), ("b", "old"), (&key, "team/other")]);
        let v = visit(src.clone(), Some(there), None, Some(&registry()));
        assert_eq!(v.write, Some(Write::Relabel(labels(&[("b", "2")]))));
        let there = info(&[("a", "1"), ("b", "2"), (&key, "team/other")]);
        let v = visit(src, Some(there), None, Some(&registry()));
        assert_eq!(v.write, None);
    }
}
