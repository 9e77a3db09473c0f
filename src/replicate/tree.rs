//! The image tree as replication sees it: each index or manifest
//! ([`oci::Manifest`]) with, per index entry, whether a pod on this node
//! could need it, and the entry CRI resolves here.

use std::collections::HashMap;

use super::platform;
use crate::labels::media_type;
use crate::oci::{self, Entry, Manifest};

pub use crate::oci::manifest::{is_parent, Child, MAX_MANIFEST};

/// Whether a pod on this node could need a blob: only then is its absence
/// reported (a pull for this node's platform never fetches the other
/// platforms of an index, and no pod here runs them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Need {
    /// Only under index entries CRI never resolves on this node.
    OtherPlatform,
    /// A pod on this node could need it.
    Node,
}

/// An index or manifest, with what this node needs of it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Node {
    pub doc: Manifest,
    /// Of an index, per entry of `doc.manifests`: whether this node could
    /// need it ([`needs`]).
    pub needs: Vec<Need>,
    /// Of an index: the manifest CRI resolves on this host, when the index
    /// names it by platform without doubt (see [`host_manifest`]).
    pub host: Option<usize>,
}

/// The entry of an index that containerd's default platform matcher puts
/// first on this host, when that is certain from the index alone: every
/// entry carries a platform, exactly one is `linux/<this arch>`, and its
/// variant is the base one. Anything else (no platform, two variants of
/// this arch, a nested index) gives `None`, and the caller leaves the
/// choice to containerd.
fn host_manifest(index: &Manifest, arch: &str) -> Option<usize> {
    let mut found = None;
    for (i, e) in index.manifests.iter().enumerate() {
        let (d, p) = (&e.child, e.platform.as_ref()?);
        if p.os().to_string() != "linux" || p.architecture().to_string() != arch {
            continue;
        }
        if found.is_some() || !media_type::is_manifest(&d.media_type) {
            return None;
        }
        let base = matches!(
            (arch, p.variant().as_deref()),
            (_, None | Some("")) | ("arm64", Some("v8"))
        );
        if !base {
            return None;
        }
        found = Some(i);
    }
    found
}

/// Per entry of an index, whether a pod on this node could need it: the
/// entry containerd's CRI resolves here ([`platform::Matcher::select`]),
/// and every entry without a platform (containerd reads its config to
/// tell, so the index alone cannot rule it out). Everything, on a node
/// whose architecture has no GOARCH name.
fn needs(entries: &[Entry]) -> Vec<Need> {
    let platforms: Vec<_> = entries.iter().map(|e| e.platform.as_ref()).collect();
    let Some(m) = platform::Matcher::node() else {
        return vec![Need::Node; platforms.len()];
    };
    let selected = m.select(&platforms);
    platforms
        .iter()
        .enumerate()
        .map(|(i, p)| match p.is_none() || Some(i) == selected {
            true => Need::Node,
            false => Need::OtherPlatform,
        })
        .collect()
}

/// The blobs a pod on this node could need, of a tree walked from `root`
/// (`edges`: each parent read, with its children and whether this node
/// could need them): those reached from `root` through needed entries
/// only. A blob under another platform's entry that is also under this
/// node's counts as needed, whichever way the walk found it first.
pub fn needed_here(
    root: &str,
    edges: &HashMap<String, Vec<(String, Need)>>,
) -> std::collections::HashSet<String> {
    let mut here = std::collections::HashSet::from([root.to_string()]);
    let mut queue = vec![root];
    while let Some(d) = queue.pop() {
        for (c, need) in edges.get(d).into_iter().flatten() {
            if *need == Need::Node && here.insert(c.clone()) {
                queue.push(c);
            }
        }
    }
    here
}

/// Parses an index or manifest blob and reads what this node needs of it.
pub fn parse(bytes: &[u8]) -> Result<Node, oci::ManifestError> {
    let doc = Manifest::parse(bytes)?;
    Ok(Node {
        host: platform::go_arch().and_then(|arch| host_manifest(&doc, arch)),
        needs: needs(&doc.manifests),
        doc,
    })
}

impl Node {
    /// All children, configs before layers, in document order.
    pub fn children(&self) -> impl Iterator<Item = &Child> {
        self.doc.children()
    }

    /// [`Self::children`], each with whether this node could need it
    /// (given that it could need this blob).
    pub fn children_needed(&self) -> impl Iterator<Item = (&Child, Need)> {
        let entries = self
            .doc
            .manifests
            .iter()
            .map(|e| &e.child)
            .zip(self.needs.iter().copied());
        let rest = self.doc.config.iter().chain(self.doc.layers.iter());
        entries.chain(rest.map(|c| (c, Need::Node)))
    }

    /// The GC labels containerd's own clients put on this blob.
    pub fn gc_labels(&self) -> HashMap<String, String> {
        self.doc.gc_labels()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(c: char) -> String {
        format!("sha256:{}", c.to_string().repeat(64))
    }

    /// Which index entry CRI runs here is told only when no other entry
    /// could come first under containerd's matcher.
    #[test]
    fn host_manifest_only_when_certain() {
        let m = media_type::DOCKER_MANIFEST;
        let entry = |c: char, platform: &str| {
            format!(
                r#"{{"mediaType":"{m}","digest":"{}","size":1{platform}}}"#,
                d(c)
            )
        };
        let p = |arch: &str, variant: &str| {
            let v = if variant.is_empty() {
                String::new()
            } else {
                format!(r#","variant":"{variant}""#)
            };
            format!(r#","platform":{{"os":"linux","architecture":"{arch}"{v}}}"#)
        };
        let index = |entries: &[String]| {
            let doc = format!(
                r#"{{"schemaVersion":2,"manifests":[{}]}}"#,
                entries.join(",")
            );
            host_manifest(&Manifest::parse(doc.as_bytes()).unwrap(), "amd64")
        };
        let att = entry(
            'b',
            r#","platform":{"os":"unknown","architecture":"unknown"}"#,
        );
        // buildkit's index: the image and its attestation.
        assert_eq!(index(&[att.clone(), entry('a', &p("amd64", ""))]), Some(1));
        assert_eq!(
            index(&[entry('a', &p("arm64", "v8")), entry('c', &p("amd64", ""))]),
            Some(1)
        );
        // An entry without a platform may match anything.
        assert_eq!(index(&[entry('a', &p("amd64", "")), entry('c', "")]), None);
        // Two variants of this arch, or only a higher one.
        assert_eq!(
            index(&[entry('a', &p("amd64", "")), entry('c', &p("amd64", "v3"))]),
            None
        );
        assert_eq!(index(&[entry('a', &p("amd64", "v3"))]), None);
        assert_eq!(index(&[att]), None);
        assert_eq!(
            host_manifest(
                &Manifest::parse(
                    format!(
                        r#"{{"schemaVersion":2,"manifests":[{}]}}"#,
                        entry('e', &p("arm64", "v8"))
                    )
                    .as_bytes()
                )
                .unwrap(),
                "arm64"
            ),
            Some(0)
        );
        // A nested index is not resolved here.
        let nested = format!(
            r#"{{"mediaType":"{}","digest":"{}","size":1{}}}"#,
            media_type::DOCKER_MANIFEST_LIST,
            d('f'),
            p("amd64", "")
        );
        assert_eq!(index(&[nested]), None);
    }

    /// An index's entries: the one CRI resolves here and those without a
    /// platform are needed; other platforms and attestations are not.
    /// What lies under a foreign entry is foreign unless this node's entry
    /// reaches it too.
    #[test]
    fn index_entries_needed_on_this_node() {
        let Some(arch) = platform::go_arch() else {
            return;
        };
        let other = |n| {
            ["arm64", "s390x", "ppc64le"]
                .into_iter()
                .filter(|a| *a != arch)
                .nth(n)
        };
        let entry = |c: char, platform: &str| {
            format!(
                r#"{{"mediaType":"{}","digest":"{}","size":1{platform}}}"#,
                media_type::DOCKER_MANIFEST,
                d(c)
            )
        };
        let p = |a: &str| format!(r#","platform":{{"os":"linux","architecture":"{a}"}}"#);
        let doc = format!(
            r#"{{"schemaVersion":2,"manifests":[{}]}}"#,
            [
                entry('a', &p(other(0).unwrap())),
                entry('b', &p(arch)),
                entry('c', &p(other(1).unwrap())),
                entry(
                    'e',
                    r#","platform":{"os":"unknown","architecture":"unknown"}"#
                ),
                entry('f', ""),
            ]
            .join(",")
        );
        let n = parse(doc.as_bytes()).unwrap();
        use Need::*;
        assert_eq!(
            n.needs,
            [OtherPlatform, Node, OtherPlatform, OtherPlatform, Node]
        );
        let needs: Vec<_> = n.children_needed().map(|(_, need)| need).collect();
        assert_eq!(needs, n.needs);

        // idx → {a: foreign manifest, b: this node's}; both name layer l.
        let edges = HashMap::from([
            (
                "idx".to_string(),
                vec![("a".to_string(), OtherPlatform), ("b".to_string(), Node)],
            ),
            (
                "a".to_string(),
                vec![("l".to_string(), Node), ("x".to_string(), Node)],
            ),
            ("b".to_string(), vec![("l".to_string(), Node)]),
        ]);
        let here = needed_here("idx", &edges);
        assert!(here.contains("l") && here.contains("b"));
        assert!(!here.contains("a") && !here.contains("x"));
    }
}
