//! Names a replica never replaces in a target
//! ([docs/protected-names.md](../../docs/protected-names.md)): replication is
//! imgbridge's own action, and it must not be the step that turns a build
//! into a node-wide change nobody asked for (a build tagged like the sandbox
//! image would break every new pod on the node).
//!
//! Protected in each target, checked before anything is written there:
//! CRI's sandbox image (in `k8s.io`), any image pinned there by someone
//! other than imgbridge, and names matching `replication.protect`.
//! `replication.overwrite` lifts them all for the names it matches.

use std::collections::HashSet;
use std::fmt;
use std::sync::Mutex;

use crate::containerd::Image;
use crate::globs::Globs;
use crate::labels::{PINNED, PINNED_VALUE, SOURCE};
use crate::lock::lock;
use crate::oci::Reference;

/// Why a name must not be replaced in a target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Protection {
    /// CRI's sandbox image: every pod on the node starts from it.
    Sandbox,
    /// Pinned there (`io.cri-containerd.pinned=pinned`) by someone other
    /// than imgbridge: an air-gap import, a k3s system image, CRI itself.
    ForeignPin,
    /// Matches this `replication.protect` glob.
    Glob(String),
}

impl Protection {
    /// The short name `/status` and logs use.
    pub fn kind(&self) -> &'static str {
        match self {
            Protection::Sandbox => "sandbox_image",
            Protection::ForeignPin => "pinned_by_others",
            Protection::Glob(_) => "protect_glob",
        }
    }
}

impl fmt::Display for Protection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Protection::Sandbox => {
                f.write_str("it is CRI's sandbox image, which every pod on this node starts from")
            }
            Protection::ForeignPin => f.write_str(
                "it is pinned there (io.cri-containerd.pinned=pinned) by someone other than imgbridge",
            ),
            Protection::Glob(p) => write!(f, "it matches replication.protect glob {p:?}"),
        }
    }
}

/// Whether `existing`, a target's record, is pinned by someone else: a
/// replica imgbridge wrote carries `io.imgbridge.source`.
pub fn pinned_by_others(existing: &Image) -> bool {
    existing.labels.get(PINNED).map(String::as_str) == Some(PINNED_VALUE)
        && !existing.labels.contains_key(SOURCE)
}

/// CRI's sandbox image, as last read from containerd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sandbox {
    /// Not read yet, or the last read failed.
    Unknown,
    /// Read: the normalised name, or none (no CRI, or it did not say).
    Known(Option<String>),
}

/// The protections in force; cheap to ask on every replication.
#[derive(Debug)]
pub struct Protections {
    protect: Globs,
    overwrite: Globs,
    sandbox: Mutex<Sandbox>,
    /// Refusals already logged as a WARN (target, name, source root): the
    /// proxy path, the events backstop and every pass meet the same one.
    told: Mutex<HashSet<String>>,
}

/// Most refusals remembered as told; past it, they are told again.
const TOLD_MAX: usize = 4096;

impl Protections {
    pub fn new(protect: &[String], overwrite: &[String]) -> Protections {
        // `Config::validate` refused bad globs before anything starts.
        let compile = |g: &[String]| Globs::new(g).unwrap_or_default();
        Protections {
            protect: compile(protect),
            overwrite: compile(overwrite),
            sandbox: Mutex::new(Sandbox::Unknown),
            told: Mutex::new(HashSet::new()),
        }
    }

    /// Whether the refusal of `key` is new (to be logged as a WARN).
    pub fn first_refusal(&self, key: String) -> bool {
        let mut told = lock(&self.told);
        if told.len() >= TOLD_MAX {
            told.clear();
        }
        told.insert(key)
    }

    /// Records CRI's sandbox image as containerd reports it now.
    pub fn set_sandbox(&self, name: Option<&str>) {
        let normalised = name.map(|n| Reference::parse(n).map_or(n.to_string(), |r| r.to_string()));
        *self.lock() = Sandbox::Known(normalised);
    }

    pub fn sandbox(&self) -> Sandbox {
        self.lock().clone()
    }

    pub fn globs(&self) -> (&Globs, &Globs) {
        (&self.protect, &self.overwrite)
    }

    /// Why `name` (normalised) may not be replaced in `target`, from the
    /// name alone. `cri_target`: the target is CRI's namespace.
    pub fn by_name(&self, cri_target: bool, name: &str) -> Option<Protection> {
        if self.lifted(name) {
            return None;
        }
        let sandbox = matches!(&*self.lock(), Sandbox::Known(Some(s)) if s == name);
        if cri_target && sandbox {
            return Some(Protection::Sandbox);
        }
        let glob = self.protect.first_match(name)?;
        Some(Protection::Glob(glob.to_string()))
    }

    /// Why the record `existing` may not be replaced under `name`.
    pub fn by_record(&self, name: &str, existing: Option<&Image>) -> Option<Protection> {
        let foreign = existing.is_some_and(pinned_by_others);
        (foreign && !self.lifted(name)).then_some(Protection::ForeignPin)
    }

    fn lifted(&self, name: &str) -> bool {
        self.overwrite.first_match(name).is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Sandbox> {
        lock(&self.sandbox)
    }
}

/// Lets a walk started before the target's record was read (to overlap
/// their round trips) write only once that record is known not to be
/// protected: nothing is written into a target before the check.
#[derive(Clone, Debug)]
pub struct Gate(tokio::sync::watch::Receiver<Option<bool>>);

impl Gate {
    /// A gate that is open from the start.
    pub fn open() -> Gate {
        Gate(tokio::sync::watch::channel(Some(true)).1)
    }

    /// A closed gate and what decides it: `true` opens it; `false`, or
    /// dropping the sender, keeps it shut.
    pub fn pending() -> (tokio::sync::watch::Sender<Option<bool>>, Gate) {
        let (tx, rx) = tokio::sync::watch::channel(None);
        (tx, Gate(rx))
    }

    /// Waits for the verdict: whether writes may go ahead.
    pub async fn passed(&self) -> bool {
        if let Some(v) = *self.0.borrow() {
            return v;
        }
        let mut rx = self.0.clone();
        let verdict = rx.wait_for(Option::is_some).await.map(|v| *v);
        matches!(verdict, Ok(Some(true)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn globs(p: &[&str]) -> Vec<String> {
        p.iter().map(|s| s.to_string()).collect()
    }

    fn record(labels: &[(&str, &str)]) -> Image {
        Image {
            name: "x".into(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<HashMap<_, _>>(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_gate_opens_only_on_a_clear_verdict() {
        assert!(Gate::open().passed().await);
        let (tx, gate) = Gate::pending();
        let waiting = tokio::spawn({
            let gate = gate.clone();
            async move { gate.passed().await }
        });
        tx.send(Some(true)).unwrap();
        assert!(waiting.await.unwrap());
        let (tx, gate) = Gate::pending();
        tx.send(Some(false)).unwrap();
        assert!(!gate.passed().await);
        let (tx, gate) = Gate::pending();
        drop(tx);
        assert!(!gate.passed().await, "no verdict is no");
    }

    #[test]
    fn the_sandbox_is_protected_in_cri_s_namespace_only() {
        let p = Protections::new(&[], &[]);
        assert_eq!(p.sandbox(), Sandbox::Unknown);
        p.set_sandbox(Some("registry.k8s.io/pause:3.6"));
        let pause = "registry.k8s.io/pause:3.6";
        assert_eq!(p.by_name(true, pause), Some(Protection::Sandbox));
        assert_eq!(p.by_name(false, pause), None);
        assert_eq!(p.by_name(true, "registry.k8s.io/pause:3.7"), None);
        // A short name is compared as CRI normalises it.
        p.set_sandbox(Some("pause:3.6"));
        assert_eq!(
            p.by_name(true, "docker.io/library/pause:3.6"),
            Some(Protection::Sandbox)
        );
    }

    #[test]
    fn pins_of_others_protect_and_imgbridge_s_own_do_not() {
        let p = Protections::new(&[], &[]);
        let n = "docker.io/library/app:1";
        let foreign = record(&[(PINNED, PINNED_VALUE)]);
        let ours = record(&[(PINNED, PINNED_VALUE), (SOURCE, "buildkit")]);
        let unpinned = record(&[]);
        assert_eq!(p.by_record(n, Some(&foreign)), Some(Protection::ForeignPin));
        assert_eq!(p.by_record(n, Some(&ours)), None);
        assert_eq!(p.by_record(n, Some(&unpinned)), None);
        assert_eq!(p.by_record(n, None), None);
    }

    #[test]
    fn overwrite_lifts_every_protection() {
        let p = Protections::new(
            &globs(&["registry.k8s.io/**"]),
            &globs(&["registry.k8s.io/pause:*"]),
        );
        p.set_sandbox(Some("registry.k8s.io/pause:3.6"));
        let pause = "registry.k8s.io/pause:3.6";
        assert_eq!(p.by_name(true, pause), None);
        let pinned = record(&[(PINNED, PINNED_VALUE)]);
        assert_eq!(p.by_record(pause, Some(&pinned)), None);
        assert_eq!(
            p.by_name(true, "registry.k8s.io/coredns:1"),
            Some(Protection::Glob("registry.k8s.io/**".into()))
        );
    }
}
