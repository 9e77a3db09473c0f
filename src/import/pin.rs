//! Pin bookkeeping on image records.
//!
//! An image imported or pulled from a watched file gets
//! `io.cri-containerd.pinned=pinned` (kubelet's image GC skips it) and
//! `io.imgbridge.import=<h1>,<h2>…`, the sorted short hashes of the files that
//! provide it. Short hashes, not paths, because containerd refuses a label
//! whose key and value exceed 4096 bytes; the hash → path mapping lives in
//! the state file. At 13 bytes a source, more than 300 files fit; beyond
//! that the label keeps the first ones in sorted order and the state file
//! stays the authority.
//!
//! Rules: an image pinned by someone else (pinned, but no import label) is
//! never touched; unpinning removes only our labels; nothing is deleted.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use sha2::{Digest as _, Sha256};

use crate::containerd::{Containerd, Descriptor, Image, Result};

use crate::labels::{pin_owner, PinOwner};
pub use crate::labels::{CRI_MANAGED, IMPORT, PINNED, PINNED_VALUE};
/// containerd's limit on a label's key plus value.
const LABEL_MAX: usize = 4096;

/// A short, stable id for a source file (48 bits of sha256 of its path).
pub fn path_hash(path: &Path) -> String {
    let d = Sha256::digest(path.as_os_str().as_encoded_bytes());
    hex::encode(&d[..6])
}

/// The sources listed in an image's import label.
pub fn sources(img: &Image) -> Option<BTreeSet<String>> {
    img.labels.get(IMPORT).map(|v| {
        v.split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    })
}

/// Joins sources into a label value within containerd's size limit.
pub fn format_sources(set: &BTreeSet<String>) -> String {
    let mut out = String::new();
    for s in set {
        if IMPORT.len() + out.len() + 1 + s.len() > LABEL_MAX {
            break;
        }
        if !out.is_empty() {
            out.push(',');
        }
        out.push_str(s);
    }
    out
}

/// Writes (or moves) the record `name` → `target` in `ns`, keeping every
/// label already there, and pins it for `source` when given. A moved
/// target also drops CRI's `managed` mark so CRI re-reads the image.
/// The flag says whether this call set the pin (for `source`).
pub async fn record(
    c: &Containerd,
    ns: &str,
    name: &str,
    target: &Descriptor,
    source: Option<&str>,
) -> Result<(Image, bool)> {
    for _ in 0..5 {
        match c.get_image(ns, name).await? {
            None => {
                let mut labels = HashMap::new();
                if let Some(s) = source {
                    labels.insert(PINNED.to_string(), PINNED_VALUE.to_string());
                    labels.insert(IMPORT.to_string(), s.to_string());
                }
                let img = Image {
                    name: name.into(),
                    labels,
                    target: Some(target.clone()),
                    ..Default::default()
                };
                match c.create_image(ns, img).await {
                    Err(e) if e.is(tonic::Code::AlreadyExists) => continue,
                    other => return other.map(|img| (img, source.is_some())),
                }
            }
            Some(existing) => {
                let same = existing.target.as_ref().is_some_and(|t| {
                    t.digest == target.digest && t.media_type == target.media_type
                });
                let mut img = Image {
                    name: name.into(),
                    target: Some(target.clone()),
                    ..Default::default()
                };
                let mut mask = Vec::new();
                if !same {
                    mask.push("target".to_string());
                    mask.push(format!("labels.{CRI_MANAGED}"));
                    img.labels.insert(CRI_MANAGED.into(), String::new());
                }
                let mut pins = false;
                if let Some(s) = source {
                    if let Some(labels) = pin_labels(&existing, s) {
                        mask.extend(labels.keys().map(|k| format!("labels.{k}")));
                        img.labels.extend(labels);
                        pins = true;
                    }
                }
                if mask.is_empty() {
                    return Ok((existing, false));
                }
                match c.update_image(ns, img, mask).await {
                    Err(e) if e.is(tonic::Code::NotFound) => continue,
                    other => return other.map(|img| (img, pins)),
                }
            }
        }
    }
    Err(crate::containerd::Error::Protocol(format!(
        "image {name} in {ns} kept changing while being recorded"
    )))
}

/// The label changes that pin `img` for `source`, or `None` if there is
/// nothing to do (already pinned by it, or pinned by someone else).
fn pin_labels(img: &Image, source: &str) -> Option<HashMap<String, String>> {
    // A pin of the replicator's is taken over (it then stays while files
    // need it); anyone else's is left alone.
    if pin_owner(&img.labels) == PinOwner::Other {
        return None;
    }
    let mut set = sources(img).unwrap_or_default();
    let had =
        set.contains(source) && img.labels.get(PINNED).map(String::as_str) == Some(PINNED_VALUE);
    if had {
        return None;
    }
    set.insert(source.into());
    Some(HashMap::from([
        (PINNED.to_string(), PINNED_VALUE.to_string()),
        (IMPORT.to_string(), format_sources(&set)),
    ]))
}

/// Pins an existing record for `source` (pull lists: CRI wrote the record).
/// Returns the record and whether this call set the pin, or `None` if the
/// record does not exist.
pub async fn pin(
    c: &Containerd,
    ns: &str,
    name: &str,
    source: &str,
) -> Result<Option<(Image, bool)>> {
    let Some(img) = c.get_image(ns, name).await? else {
        return Ok(None);
    };
    Ok(match pin_labels(&img, source) {
        Some(labels) => (c.update_image_labels(ns, name, labels).await?).map(|img| (img, true)),
        None => Some((img, false)),
    })
}

/// What [`unpin`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Unpinned {
    /// Image gone, or not pinned by us: left alone.
    Untouched,
    /// Other sources still provide it; only `source` left the label.
    Narrowed,
    /// Both labels removed.
    Unpinned,
}

/// Drops `source` from the image's pin. `live` are the other sources known
/// to still provide it: while any remain, the image stays pinned.
pub async fn unpin(
    c: &Containerd,
    ns: &str,
    name: &str,
    source: &str,
    live: &BTreeSet<String>,
) -> Result<Unpinned> {
    let Some(img) = c.get_image(ns, name).await? else {
        return Ok(Unpinned::Untouched);
    };
    let Some(mut set) = sources(&img) else {
        return Ok(Unpinned::Untouched);
    };
    set.remove(source);
    set.extend(live.iter().cloned());
    let (labels, result) = if set.is_empty() {
        (
            HashMap::from([
                (PINNED.to_string(), String::new()),
                (IMPORT.to_string(), String::new()),
            ]),
            Unpinned::Unpinned,
        )
    } else {
        if sources(&img).as_ref() == Some(&set) {
            return Ok(Unpinned::Narrowed);
        }
        (
            HashMap::from([(IMPORT.to_string(), format_sources(&set))]),
            Unpinned::Narrowed,
        )
    };
    Ok(match c.update_image_labels(ns, name, labels).await? {
        Some(_) => result,
        None => Unpinned::Untouched,
    })
}

/// The names among `images` whose import label lists `source`.
pub fn pinned_by<'a>(images: &'a [Image], source: &'a str) -> impl Iterator<Item = &'a str> {
    images
        .iter()
        .filter(move |img| sources(img).is_some_and(|s| s.contains(source)))
        .map(|img| img.name.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_by_finds_the_source_in_any_position() {
        let named = |name: &str, labels: &[(&str, &str)]| Image {
            name: name.into(),
            ..img(labels)
        };
        let images = [
            named("a", &[(IMPORT, "aaa")]),
            named("b", &[(IMPORT, "bbb,ccc")]),
            named("c", &[(IMPORT, "ccc")]),
            named("d", &[]),
            named("e", &[(IMPORT, "cccc")]),
        ];
        assert_eq!(pinned_by(&images, "ccc").collect::<Vec<_>>(), ["b", "c"]);
        assert_eq!(pinned_by(&images, "zzz").count(), 0);
    }

    fn img(labels: &[(&str, &str)]) -> Image {
        Image {
            name: "x".into(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn hash_is_short_and_stable() {
        let h = path_hash(Path::new("/var/lib/images/a.tar"));
        assert_eq!(h.len(), 12);
        assert_eq!(h, path_hash(Path::new("/var/lib/images/a.tar")));
        assert_ne!(h, path_hash(Path::new("/var/lib/images/b.tar")));
    }

    #[test]
    fn label_stays_under_limit() {
        let set: BTreeSet<String> = (0..1000).map(|i| format!("{i:012x}")).collect();
        let v = format_sources(&set);
        assert!(IMPORT.len() + v.len() <= LABEL_MAX);
        assert!(v.split(',').count() > 300);
    }

    #[test]
    fn others_pins_are_left_alone() {
        assert!(pin_labels(&img(&[(PINNED, "pinned")]), "aa").is_none());
        let l = pin_labels(&img(&[]), "aa").unwrap();
        assert_eq!(l[IMPORT], "aa");
        let l = pin_labels(&img(&[(PINNED, "pinned"), (IMPORT, "bb")]), "aa").unwrap();
        assert_eq!(l[IMPORT], "aa,bb");
        assert!(pin_labels(&img(&[(PINNED, "pinned"), (IMPORT, "aa,bb")]), "aa").is_none());
    }

    #[test]
    fn a_replica_pinned_by_the_replicator_is_taken_over() {
        // Without the import label the replicator's unpin would drop the
        // pin while the watched file still needs the image.
        let replica = img(&[(PINNED, "pinned"), (crate::labels::SOURCE, "buildkit")]);
        let l = pin_labels(&replica, "aa").expect("the file records its pin");
        assert_eq!(l[IMPORT], "aa");
    }
}
